"""Real architectures from five libraries and two fields' own code, each as a
``hookbench.Workload`` configured the way its users train it, built from config on the CPU (no
weights are downloaded), tiny enough for a 2-core CI machine.

``ARCHITECTURES`` lists them; ``FAMILY`` says each one's library and family; ``NAME`` (the
attribute, upper case with underscores) is what ``--workload sweep.architectures:NAME`` loads.
What each keeps of its recipe (dropout, LayerDrop, stochastic depth, SpecAugment masking, tied
or shared weights, its optimizer and schedule) is said where it is built.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload

SEQ, VOCAB, BATCH = 16, 256, 4
SCHEDULE = (torch.optim.lr_scheduler.LinearLR, {"start_factor": 0.1, "total_iters": 2})


# -- batches and losses ----------------------------------------------------------------------

def tokens(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :3] = 0  # one padded row, so the mask is not a no-op
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]


def labelled_tokens(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x, _ = tokens(g)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def seq2seq(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    source = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)
    start = torch.zeros(BATCH, 1, dtype=torch.long)
    return ({"input_ids": source, "attention_mask": torch.ones_like(source),
             "decoder_input_ids": torch.cat([start, labels[:, :-1]], 1)}, labels)


def images(g: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(BATCH, 3, size, size, generator=g),
            torch.randint(0, 10, (BATCH,), generator=g))


def pixel_values(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x, y = images(g)
    return {"pixel_values": x}, y


def waveforms(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return ({"input_values": torch.randn(BATCH, 3200, generator=g)},
            torch.randint(1, 30, (BATCH, 4), generator=g))


def log_mels(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    labels = torch.randint(3, VOCAB, (BATCH, 6), generator=g)
    start = torch.zeros(BATCH, 1, dtype=torch.long)
    return ({"input_features": torch.randn(BATCH, 16, 32, generator=g),
             "decoder_input_ids": torch.cat([start, labels[:, :-1]], 1)}, labels)


def captioned_images(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    x, _ = tokens(g)
    return ({"input_ids": x["input_ids"], "attention_mask": x["attention_mask"],
             "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g)},
            torch.zeros(BATCH, dtype=torch.long))  # the pairs themselves are the labels


def caption_targets(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    labels = torch.randint(3, VOCAB, (BATCH, 8), generator=g)
    start = torch.zeros(BATCH, 1, dtype=torch.long)
    return ({"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=g),
             "decoder_input_ids": torch.cat([start, labels[:, :-1]], 1)}, labels)


def logits_of(output):
    for key in ("logits", "sample", "last_hidden_state"):
        if hasattr(output, key):
            return getattr(output, key)
    return output[0] if isinstance(output, tuple) else output


def cross_entropy(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token, token-level or sequence-level cross entropy, in float32 as HF computes it."""
    logits = logits_of(output).float()
    if logits.dim() == 3:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return F.cross_entropy(logits, target)


def ctc(output, target: torch.Tensor) -> torch.Tensor:
    """CTC over the frames, as wav2vec2's and HuBERT's model cards fine-tune them."""
    log_probs = logits_of(output).float().log_softmax(-1).transpose(0, 1)
    frames, rows = log_probs.shape[:2]
    return F.ctc_loss(log_probs, target, torch.full((rows,), frames, dtype=torch.long),
                      torch.full((rows,), target.shape[1], dtype=torch.long), blank=0,
                      zero_infinity=True)


def contrastive(output, target: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric loss: each image's own caption among the batch's."""
    logits = output.logits_per_image.float()
    labels = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def noise_prediction(output, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits_of(output).float(), target)


# -- optimizers as the recipes set them --------------------------------------------------------

def decay_matrices(model: nn.Module, weight_decay: float = 0.01) -> list[dict]:
    """HF Trainer's and nanoGPT's split: weight decay on matrices, none on biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


ADAMW = (torch.optim.AdamW, {"lr": 5e-4, "betas": (0.9, 0.999)})
SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4})


def _transformers(model_class: str, config_class: str, **config) -> nn.Module:
    import transformers

    config = getattr(transformers, config_class)(**config)
    return getattr(transformers, model_class)(config)


def transformers_model(model_class: str, config_class: str, **config):
    return functools.partial(_transformers, model_class, config_class, **config)


def text(name: str, model_class: str, config_class: str, batch=tokens, loss=cross_entropy,
         **config) -> Workload:
    return Workload(name, model=transformers_model(model_class, config_class, **config),
                    batch=batch, loss=loss, optimizer=ADAMW, param_groups=decay_matrices,
                    lr_scheduler=SCHEDULE)


SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=64)
DECODER = dict(SMALL, num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
               use_cache=False)

# -- encoders (masked LM, dropout 0.1 as shipped) ---------------------------------------------
BERT = text("bert", "BertForMaskedLM", "BertConfig", **SMALL)
ROBERTA = text("roberta", "RobertaForMaskedLM", "RobertaConfig", **SMALL, pad_token_id=1)
DISTILBERT = text("distilbert", "DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB,
                  dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)
# ALBERT: one layer group shared across the whole depth, embeddings factorised
ALBERT = text("albert", "AlbertForMaskedLM", "AlbertConfig", **SMALL, embedding_size=16,
              num_hidden_groups=1)
ELECTRA = text("electra", "ElectraForMaskedLM", "ElectraConfig", **SMALL, embedding_size=32)
DEBERTA = text("deberta-v2", "DebertaV2ForMaskedLM", "DebertaV2Config", **SMALL,
               relative_attention=True, position_buckets=8, max_relative_positions=16)
BERT_CLASSIFIER = text("bert-classifier", "BertForSequenceClassification", "BertConfig",
                       batch=labelled_tokens, **SMALL, num_labels=3)

# -- decoders (causal LM) ---------------------------------------------------------------------
GPT2 = text("gpt2", "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_positions=64,
            n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)
GPT_NEOX = text("gpt-neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", **SMALL, use_cache=False)
# Llama as its recipes pre-train it: bf16 autocast, every decoder layer checkpointed
# (non-reentrant, as gradient_checkpointing_enable does), clipping at 1.0, a cosine schedule
LLAMA = text("llama-bf16", "LlamaForCausalLM", "LlamaConfig", **DECODER).replace(
    precision="bf16", checkpointing="repeated", clip_grad_norm=1.0,
    lr_scheduler=(torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 3}))
MISTRAL = text("mistral", "MistralForCausalLM", "MistralConfig", **DECODER, sliding_window=8)
QWEN2 = text("qwen2", "Qwen2ForCausalLM", "Qwen2Config", **DECODER)
PHI = text("phi", "PhiForCausalLM", "PhiConfig", **DECODER, resid_pdrop=0.1)
GEMMA = text("gemma", "GemmaForCausalLM", "GemmaConfig", **DECODER, head_dim=8)
# OPT as fairseq trains it: LayerDrop 0.2, dropout 0.1
OPT = text("opt-layerdrop", "OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32,
           ffn_dim=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64,
           word_embed_proj_dim=32, layerdrop=0.2, dropout=0.1, bos_token_id=0, eos_token_id=1,
           pad_token_id=2)
BLOOM = text("bloom", "BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=32,
             n_layer=2, n_head=4, hidden_dropout=0.1, attention_dropout=0.1)
FALCON = text("falcon", "FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32,
              num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False)

# -- encoder-decoders -------------------------------------------------------------------------
def adafactor():
    from transformers.optimization import Adafactor

    return Adafactor


# T5 as its documentation fine-tunes it: transformers' Adafactor with its relative step (no lr)
T5 = Workload("t5-adafactor", model=transformers_model(
    "T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
    num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
    batch=seq2seq, loss=cross_entropy,
    optimizer=(adafactor(), {"lr": None, "scale_parameter": True, "relative_step": True,
                             "warmup_init": True}))
BART = text("bart", "BartForConditionalGeneration", "BartConfig", batch=seq2seq,
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
            decoder_ffn_dim=64, max_position_embeddings=64, encoder_layerdrop=0.0,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
MARIAN = text("marian", "MarianMTModel", "MarianConfig", batch=seq2seq, vocab_size=VOCAB,
              d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
              max_position_embeddings=64, pad_token_id=VOCAB - 1,
              decoder_start_token_id=VOCAB - 1)

MBART = text("mbart", "MBartForConditionalGeneration", "MBartConfig", batch=seq2seq,
             vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
             decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1,
             pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)

# -- MoE and state-space ----------------------------------------------------------------------
MIXTRAL = text("mixtral", "MixtralForCausalLM", "MixtralConfig", **DECODER,
               num_local_experts=4, num_experts_per_tok=2)
QWEN2_MOE = text("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", **DECODER,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32)
SWITCH = text("switch", "SwitchTransformersForConditionalGeneration",
              "SwitchTransformersConfig", batch=seq2seq, vocab_size=VOCAB, d_model=32, d_kv=8,
              d_ff=64, num_layers=2, num_sparse_encoder_layers=1, num_decoder_layers=2,
              num_sparse_decoder_layers=1, num_heads=4, num_experts=4, decoder_start_token_id=0,
              pad_token_id=0, eos_token_id=1)
MAMBA = text("mamba", "MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=32,
             state_size=8, num_hidden_layers=2, use_cache=False, bos_token_id=0,
             eos_token_id=1, pad_token_id=2)

# -- audio ------------------------------------------------------------------------------------
_AUDIO = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4),
              num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
              # SpecAugment as the model cards fine-tune with it: time masks, drawn from numpy
              mask_time_prob=0.2, mask_time_length=2, layerdrop=0.0, pad_token_id=0,
              ctc_zero_infinity=True)
WAV2VEC2 = text("wav2vec2-ctc", "Wav2Vec2ForCTC", "Wav2Vec2Config", batch=waveforms, loss=ctc,
                **_AUDIO)
HUBERT = text("hubert-ctc", "HubertForCTC", "HubertConfig", batch=waveforms, loss=ctc, **_AUDIO)
WHISPER = text("whisper", "WhisperForConditionalGeneration", "WhisperConfig", batch=log_mels,
               vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=1,
               decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
               max_target_positions=32, pad_token_id=2, bos_token_id=0, eos_token_id=1,
               decoder_start_token_id=0)

# -- multimodal -------------------------------------------------------------------------------


def _clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, image_size=32, patch_size=8),
        projection_dim=16))


def _vision_encoder_decoder() -> nn.Module:
    from transformers import (GPT2Config, ViTConfig, VisionEncoderDecoderConfig,
                              VisionEncoderDecoderModel)

    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                  intermediate_size=64, image_size=32, patch_size=8),
        GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=1, n_head=4,
                   bos_token_id=0, eos_token_id=1))
    config.decoder_start_token_id, config.pad_token_id = 0, 2
    return VisionEncoderDecoderModel(config)


# CLIP's learned temperature is a 0-dim parameter (fully_shard refuses it)
CLIP = Workload("clip", model=_clip, batch=captioned_images, loss=contrastive,
                optimizer=ADAMW, param_groups=decay_matrices, lr_scheduler=SCHEDULE)
VISION_ENCODER_DECODER = Workload("vit-gpt2-captioning", model=_vision_encoder_decoder,
                                  batch=caption_targets, loss=cross_entropy, optimizer=ADAMW,
                                  param_groups=decay_matrices)
VIT_HF = Workload("vit-hf", model=transformers_model(
    "ViTForImageClassification", "ViTConfig", hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8, num_labels=10,
    hidden_dropout_prob=0.1), batch=pixel_values, loss=cross_entropy, optimizer=ADAMW,
    param_groups=decay_matrices)

# -- vision: timm, with its own recipes' optimizers -------------------------------------------


def _timm(name: str, **options) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=10, **options)


def timm_model(name: str, **options):
    return functools.partial(_timm, name, **options)


def timm_decay(model: nn.Module) -> list[dict]:
    from timm.optim import param_groups_weight_decay

    return param_groups_weight_decay(model, weight_decay=0.05)


def vision(name: str, model, optimizer=ADAMW, param_groups=timm_decay, **kwargs) -> Workload:
    return Workload(name, model=model, batch=images, loss=cross_entropy, optimizer=optimizer,
                    param_groups=param_groups, **kwargs)


def timm_resnet_decay(model: nn.Module) -> list[dict]:
    """timm's train.py for a ResNet: weight decay 1e-4, none on BatchNorm and biases."""
    from timm.optim import param_groups_weight_decay

    return param_groups_weight_decay(model, weight_decay=1e-4)


def _regnetx() -> nn.Module:
    from timm.models.regnet import RegNet, RegNetCfg

    # a point of the RegNetX design space (linear widths quantised, grouped 3x3 convs, no SE)
    # narrower than regnetx_002: depth 6, w0 16, wa 16, wm 2, groups of 8
    return RegNet(RegNetCfg(depth=6, w0=16, wa=16.0, wm=2.0, group_size=8), num_classes=10)


# timm's train.py default optimizer: SGD, Nesterov momentum 0.9, decay off norms and biases;
# timm's ResNet-10T at CIFAR widths (16, 32, 64, 128)
TIMM_SGD = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True})
COSINE = (torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 3})
RESNET = vision("timm-resnet10t", timm_model("resnet10t", channels=(16, 32, 64, 128)),
                optimizer=TIMM_SGD, param_groups=timm_resnet_decay, lr_scheduler=COSINE)
# ConvNeXt with stochastic depth (drop_path), as timm's recipes train it: AdamW, decay 0.05
CONVNEXT = vision("timm-convnext-atto", timm_model("convnext_atto", dims=(16, 32, 64, 128),
                                                   depths=(1, 1, 2, 1), drop_path_rate=0.1),
                  lr_scheduler=COSINE)
# EfficientNet scaled down by TinyNet's rules (tinynet_e), with the EfficientNet recipe's
# dropout 0.2, drop path 0.2 and RMSprop (TF-style: alpha 0.9, eps 1e-3, momentum 0.9)
EFFICIENTNET = vision("timm-tinynet-e", timm_model("tinynet_e", drop_rate=0.2,
                                                   drop_path_rate=0.2),
                      optimizer=(torch.optim.RMSprop, {"lr": 1e-3, "alpha": 0.9, "eps": 1e-3,
                                                       "momentum": 0.9}),
                      param_groups=timm_resnet_decay)
TIMM_VIT = vision("timm-vit", timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8,
                                         depth=2, drop_path_rate=0.1), lr_scheduler=COSINE)
DEIT = vision("timm-deit", timm_model("deit_tiny_patch16_224", img_size=32, patch_size=8,
                                      depth=2, drop_path_rate=0.1), lr_scheduler=COSINE)
SWIN = vision("timm-swin", timm_model("swin_tiny_patch4_window7_224", img_size=32,
                                      patch_size=2, window_size=4, embed_dim=16,
                                      depths=(1, 1), num_heads=(2, 4), drop_path_rate=0.1))
MOBILENETV3 = vision("timm-mobilenetv3", timm_model("mobilenetv3_small_050"),
                     optimizer=TIMM_SGD, param_groups=timm_resnet_decay)
REGNET = vision("timm-regnetx", _regnetx, optimizer=TIMM_SGD, param_groups=timm_resnet_decay)

# -- vision: torchvision, its reference recipe (SGD momentum 0.9, decay 1e-4 on everything,
# a step schedule) --------------------------------------------------------------------------


def _torchvision(name: str, **options) -> nn.Module:
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=10, **options)


def torchvision_model(name: str, **options):
    return functools.partial(_torchvision, name, **options)


TV_SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4})
TV_STEP = (torch.optim.lr_scheduler.StepLR, {"step_size": 2, "gamma": 0.1})


def torchvision_recipe(name: str, model) -> Workload:
    return vision(name, model, optimizer=TV_SGD, param_groups=None, lr_scheduler=TV_STEP)


# resnet18 as shipped (its widths are fixed by the constructor): 11M parameters, 32x32 images
TV_RESNET18 = torchvision_recipe("torchvision-resnet18", torchvision_model("resnet18"))
TV_MOBILENET = torchvision_recipe("torchvision-mobilenet-v3",
                                  torchvision_model("mobilenet_v3_small", width_mult=0.5))
TV_SQUEEZENET = torchvision_recipe("torchvision-squeezenet", torchvision_model("squeezenet1_1"))
TV_SHUFFLENET = torchvision_recipe("torchvision-shufflenet",
                                   torchvision_model("shufflenet_v2_x0_5"))


def _torchvision_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    # convnext_tiny's layout (4 stages, 7x7 depthwise, LayerNorm, layer scale) at a 16th of
    # its widths, with its stochastic depth
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1),
                     CNBlockConfig(64, 128, 2), CNBlockConfig(128, None, 1)],
                    stochastic_depth_prob=0.1, num_classes=10)


# torchvision's ConvNeXt recipe: AdamW, lr 1e-3, decay 0.05 (none on norms), cosine
TV_CONVNEXT = vision("torchvision-convnext", _torchvision_convnext, param_groups=decay_matrices,
                     lr_scheduler=COSINE)


def _torchvision_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                             hidden_dim=32, mlp_dim=64, dropout=0.1, num_classes=10)


TV_VIT = vision("torchvision-vit", _torchvision_vit, param_groups=decay_matrices)

# -- diffusion (diffusers): noise prediction, the noise drawn in the batch ---------------------


def _noised(g: torch.Generator, channels: int, size: int) -> tuple[torch.Tensor, ...]:
    from diffusers import DDPMScheduler

    latents = torch.randn(BATCH, channels, size, size, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    steps = torch.randint(0, 1000, (BATCH,), generator=g)
    return DDPMScheduler(num_train_timesteps=1000).add_noise(latents, noise, steps), steps, noise


def latents_and_text(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    noisy, steps, noise = _noised(g, 4, 8)
    return ({"sample": noisy, "timestep": steps,
             "encoder_hidden_states": torch.randn(BATCH, 6, 32, generator=g)}, noise)


def pixels(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    noisy, steps, noise = _noised(g, 3, 16)
    return {"sample": noisy, "timestep": steps}, noise


def _unet_conditional() -> nn.Module:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4,
                                layers_per_block=1, block_out_channels=(32, 64),
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                cross_attention_dim=32, norm_num_groups=8,
                                attention_head_dim=8)


def _unet() -> nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(16, 32), norm_num_groups=8,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"))


def _dit() -> nn.Module:
    from diffusers import DiTTransformer2DModel

    # DiT (Peebles and Xie 2023): adaLN-zero blocks over 2x2 patches of a 4-channel latent,
    # class-conditional, predicting the noise and a variance (8 output channels); its label
    # embedding drops the class 10% of the time (classifier-free guidance), drawn from torch
    return DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                 out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                 num_embeds_ada_norm=10, norm_num_groups=8)


def latents_and_classes(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    noisy, steps, noise = _noised(g, 4, 8)
    return ({"hidden_states": noisy, "timestep": steps,
             "class_labels": torch.randint(0, 10, (BATCH,), generator=g)}, noise)


def dit_noise_prediction(output, target: torch.Tensor) -> torch.Tensor:
    """The simple loss on DiT's noise half (its variance half is trained by a VLB term in the
    paper, left out here)."""
    return F.mse_loss(output.sample[:, :target.shape[1]].float(), target)


# diffusers' train_text_to_image.py defaults: AdamW lr 1e-4, decay 1e-2, clipping at 1.0,
# constant schedule
UNET_CONDITIONAL = Workload("sd-unet", model=_unet_conditional, batch=latents_and_text,
                            loss=noise_prediction,
                            optimizer=(torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 1e-2}),
                            clip_grad_norm=1.0)
# diffusers' train_unconditional.py defaults: AdamW lr 1e-4, betas (0.95, 0.999), decay 1e-6,
# clipping at 1.0, cosine schedule
UNET = Workload("ddpm-unet", model=_unet, batch=pixels, loss=noise_prediction,
                optimizer=(torch.optim.AdamW, {"lr": 1e-4, "betas": (0.95, 0.999),
                                               "weight_decay": 1e-6}),
                clip_grad_norm=1.0, lr_scheduler=COSINE)
# DiT's recipe: AdamW lr 1e-4, no weight decay, constant
DIT = Workload("dit", model=_dit, batch=latents_and_classes, loss=dit_noise_prediction,
               optimizer=(torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 0.0}))

# -- peft: LoRA adapters on frozen bases ------------------------------------------------------


def _lora(model_factory, target_modules: tuple[str, ...]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model_factory(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                      target_modules=list(target_modules)))


LORA_GPT2 = Workload("lora-gpt2", model=functools.partial(
    _lora, transformers_model("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB,
                              n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                              eos_token_id=1), ("c_attn",)),
    batch=tokens, loss=cross_entropy, optimizer=(torch.optim.AdamW, {"lr": 2e-4}))


def _lora_checkpointed(model_factory, target_modules: tuple[str, ...]) -> nn.Module:
    """What QLoRA-style recipes do before get_peft_model (peft's
    prepare_model_for_kbit_training without the quantisation): gradient checkpointing on
    (non-reentrant), and a forward hook on the input embeddings that makes their output
    require grad, so that checkpointed blocks over a frozen embedding still backpropagate."""
    base = model_factory()
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    return _lora(lambda: base, target_modules)


LORA_LLAMA = Workload("lora-llama", model=functools.partial(
    _lora_checkpointed, transformers_model("LlamaForCausalLM", "LlamaConfig", **DECODER),
    ("q_proj", "k_proj", "v_proj", "o_proj")), batch=tokens, loss=cross_entropy,
    optimizer=(torch.optim.AdamW, {"lr": 2e-4, "weight_decay": 0.0}),
    lr_scheduler=(torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 3}))

# -- written the way their fields write them -------------------------------------------------


class Recommender(nn.Module):
    """DLRM (Naumov et al. 2019): embedding bags with sparse gradients (sum pooling), a dense
    bottom MLP, pairwise dot interactions, a top MLP; trained with Adagrad."""

    def __init__(self, tables: int = 3, rows: int = 100, dim: int = 8) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
                                    for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, dim), nn.ReLU())
        pairs = (tables + 1) * tables // 2
        self.top = nn.Sequential(nn.Linear(dim + pairs, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.stack([x, *(t(ids[:, i]) for i, t in enumerate(self.tables))], 1)
        upper = torch.triu_indices(z.shape[1], z.shape[1], 1)
        pairs = torch.bmm(z, z.transpose(1, 2))[:, upper[0], upper[1]]
        return self.top(torch.cat([x, pairs], 1)).squeeze(1)


def clicks(g: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return ((torch.randn(8, 4, generator=g), torch.randint(0, 100, (8, 3, 2), generator=g)),
            torch.randint(0, 2, (8,), generator=g).float())


class GraphSAGE(nn.Module):
    """GraphSAGE (Hamilton et al. 2017) with mean aggregation over an edge list, written with
    ``index_add_`` as graph code without a graph library does; dropout between layers. The
    batch is a set of small graphs, one per row, so that data parallelism splits graphs."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2 * features, hidden), nn.Linear(2 * hidden,
                                                                                  hidden)])
        self.head = nn.Linear(hidden, classes)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        # x: (graphs, nodes, features); edges: (graphs, 2, edges) within each graph
        graphs, nodes, _ = x.shape
        offset = (torch.arange(graphs, device=x.device) * nodes).view(-1, 1, 1)
        src, dst = (edges + offset).transpose(0, 1).reshape(2, -1)
        h = x.reshape(graphs * nodes, -1)
        degree = torch.zeros(graphs * nodes, device=x.device).index_add_(
            0, dst, torch.ones_like(dst, dtype=x.dtype)).clamp(min=1).unsqueeze(1)
        for layer in self.layers:
            neighbours = torch.zeros_like(h).index_add_(0, dst, h[src]) / degree
            h = self.dropout(F.relu(layer(torch.cat([h, neighbours], 1))))
        return self.head(h).view(graphs, nodes, -1)


def graphs(g: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    x = torch.randn(BATCH, 10, 8, generator=g)
    edges = torch.randint(0, 10, (BATCH, 2, 24), generator=g)
    return (x, edges), torch.randint(0, 3, (BATCH, 10), generator=g)


RECOMMENDER = Workload("dlrm", model=Recommender, batch=clicks,
                       loss=F.binary_cross_entropy_with_logits,
                       optimizer=(torch.optim.Adagrad, {"lr": 0.05}))
GRAPHSAGE = Workload("graphsage", model=GraphSAGE, batch=graphs, loss=cross_entropy,
                     optimizer=(torch.optim.Adam, {"lr": 1e-2, "weight_decay": 5e-4}))

# -- the list, and each one's library and family ---------------------------------------------

FAMILY = {
    "bert": ("transformers", "encoder"), "roberta": ("transformers", "encoder"),
    "distilbert": ("transformers", "encoder"), "albert": ("transformers", "encoder"),
    "electra": ("transformers", "encoder"), "deberta-v2": ("transformers", "encoder"),
    "bert-classifier": ("transformers", "encoder"),
    "gpt2": ("transformers", "decoder"), "gpt-neox": ("transformers", "decoder"),
    "llama-bf16": ("transformers", "decoder"), "mistral": ("transformers", "decoder"),
    "qwen2": ("transformers", "decoder"), "phi": ("transformers", "decoder"),
    "gemma": ("transformers", "decoder"), "opt-layerdrop": ("transformers", "decoder"),
    "bloom": ("transformers", "decoder"), "falcon": ("transformers", "decoder"),
    "t5-adafactor": ("transformers", "encoder-decoder"),
    "bart": ("transformers", "encoder-decoder"), "marian": ("transformers", "encoder-decoder"),
    "mbart": ("transformers", "encoder-decoder"),
    "mixtral": ("transformers", "MoE"), "qwen2-moe": ("transformers", "MoE"),
    "switch": ("transformers", "MoE encoder-decoder"),
    "mamba": ("transformers", "state-space"),
    "wav2vec2-ctc": ("transformers", "audio"), "hubert-ctc": ("transformers", "audio"),
    "whisper": ("transformers", "audio encoder-decoder"),
    "clip": ("transformers", "multimodal"), "vit-gpt2-captioning": ("transformers", "multimodal"),
    "vit-hf": ("transformers", "vision"),
    "timm-resnet10t": ("timm", "vision"), "timm-convnext-atto": ("timm", "vision"),
    "timm-tinynet-e": ("timm", "vision"), "timm-vit": ("timm", "vision"),
    "timm-deit": ("timm", "vision"), "timm-swin": ("timm", "vision"),
    "timm-mobilenetv3": ("timm", "vision"), "timm-regnetx": ("timm", "vision"),
    "torchvision-resnet18": ("torchvision", "vision"),
    "torchvision-mobilenet-v3": ("torchvision", "vision"),
    "torchvision-squeezenet": ("torchvision", "vision"),
    "torchvision-shufflenet": ("torchvision", "vision"),
    "torchvision-vit": ("torchvision", "vision"),
    "torchvision-convnext": ("torchvision", "vision"),
    "sd-unet": ("diffusers", "diffusion"), "ddpm-unet": ("diffusers", "diffusion"),
    "dit": ("diffusers", "diffusion transformer"),
    "lora-gpt2": ("peft", "decoder, adapters"), "lora-llama": ("peft", "decoder, adapters"),
    "dlrm": ("hand-written", "recommender (sparse)"), "graphsage": ("hand-written", "graph"),
}
ARCHITECTURES = [w for w in globals().values() if isinstance(w, Workload)]
NAME = {w.name: attr for attr, w in globals().items() if isinstance(w, Workload)}
assert set(FAMILY) == {w.name for w in ARCHITECTURES}, "every architecture has its family"
