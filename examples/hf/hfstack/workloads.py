"""Seven models from real libraries, configured the way their own recipes train them, and two
recipes of how teams train them, as ``hookbench.Workload``s. Built from config (no weights are
downloaded), small enough for CI.

    gpt2        transformers' GPT2LMHeadModel as shipped: dropout 0.1 everywhere, tied
                embeddings, AdamW with weight decay 0.1 on the matrices only (biases and
                LayerNorms excluded, as nanoGPT and HF's Trainer do), a linear warmup,
                keyword inputs (input_ids, attention_mask)
    llama-bf16  transformers' LlamaForCausalLM under bf16 autocast, each decoder layer
                checkpointed (non-reentrant), gradient clipping at 1.0 and a cosine schedule
                (HF Trainer's defaults); the optimizer in backward refuses the clipping, in words
    vit         timm's VisionTransformer with its default qkv bias, AdamW with timm's own
                weight-decay split (``param_groups_weight_decay``), each block checkpointed

Four more, one of each class of model hookbench once could not measure one way or another:

    resnet          timm's resnet10t (BatchNorm after every conv) with SGD, Nesterov momentum
                    0.9 and timm's weight decay 1e-4 (none on norms and biases), 4 images per
                    rank: the single process drifts from DDP by far more than rounding, so
                    ZeRO-2 is held to DDP bit for bit and to the single process within the
                    measured noise floor
    opt-layerdrop   transformers' OPTForCausalLM with LayerDrop 0.3 (a layer skipped when
                    ``torch.rand([]) < 0.3``, decided in Python): fake tensors cannot run it, so
                    memory is measured on real CPU tensors; layers go unused at random per step
                    and rank, so DDP runs with ``find_unused_parameters=True``
    mixtral         transformers' MixtralForCausalLM, whose experts run as ``torch._grouped_mm``:
                    its meta kernel rejects float32 and its CPU kernel float64, so memory falls
                    back to real tensors and the rounding-level reference to the noise floor
    t5-adafactor    transformers' T5 with transformers' Adafactor (relative step, no lr), HF's
                    documented T5 recipe: an optimizer outside torch.optim, with no foreach
                    option and a factored (not elementwise) update, which ZeRO-2 refuses in words

Two recipes, as their communities write them:

    llama-pure-bf16      torchtune's full fine-tune (its Llama configs' ``dtype: bf16``): the
                         model, its gradients and AdamW's state all bf16, no autocast and no
                         fp32 masters, AdamW with ``fused: True`` as torchtune's configs set it
    gpt2-accelerate-ddp  GPT-2 under DDP as Accelerate users configure it
                         (``DistributedDataParallelKwargs``): ``gradient_as_bucket_view=True``
                         (no second copy of the gradients), ``find_unused_parameters=False``
                         (every parameter is used), 25 MB buckets, and the bf16 gradient
                         compression hook (``comm_hook=DDPCommunicationHookType.BF16``,
                         which registers torch's ``bf16_compress_hook``); each held to what
                         DDP reports running, and DDP with the hook bit for bit to the hook
                         applied by hand
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hookbench import Workload

SEQ, VOCAB, BATCH = 32, 512, 4


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # GPT2Config's dropout defaults (resid, embd, attn: 0.1) are kept on purpose.
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2,
                                      n_head=4, bos_token_id=0, eos_token_id=1))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=SEQ,
                                        bos_token_id=0, eos_token_id=1,
                                        # a cache that a recomputed layer appends to twice
                                        # (HF turns it off for checkpointing, too)
                                        use_cache=False))


def vit():
    import timm

    # vit_tiny's width and heads, 2 blocks, 32x32 images in 8x8 patches: 0.9M parameters.
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, depth=2, num_classes=10)


def tokens(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, :4] = 0  # one left-padded row, so the mask is not a no-op
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:]


def images(g: torch.Generator, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)


def image_batches(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """8 images: BatchNorm normalises over 4 per data-parallel rank (2 ranks), a per-GPU
    batch as small as a large model leaves room for."""
    return images(g, 8)


def lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def no_decay_on_biases_and_norms(model: torch.nn.Module) -> list[dict]:
    """nanoGPT's and HF Trainer's split: weight decay on matrices, none on vectors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def timm_weight_decay(model: torch.nn.Module, weight_decay: float = 0.05) -> list[dict]:
    from timm.optim import param_groups_weight_decay

    return param_groups_weight_decay(model, weight_decay=weight_decay,
                                     no_weight_decay_list=model.no_weight_decay())


def timm_resnet_weight_decay(model: torch.nn.Module) -> list[dict]:
    """timm's train.py for a ResNet: weight decay 1e-4, none on BatchNorm and biases."""
    from timm.optim import param_groups_weight_decay

    return param_groups_weight_decay(model, weight_decay=1e-4)


def llama_decoder_layer():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


GPT2 = Workload("gpt2", model=gpt2, batch=tokens, loss=lm_loss,
                optimizer=(torch.optim.AdamW, {"lr": 6e-4, "betas": (0.9, 0.95)}),
                param_groups=no_decay_on_biases_and_norms,
                lr_scheduler=(torch.optim.lr_scheduler.LinearLR,
                              {"start_factor": 0.1, "total_iters": 2}))

LLAMA_BF16 = Workload("llama-bf16", model=llama, batch=tokens, loss=lm_loss,
                      optimizer=(torch.optim.AdamW, {"lr": 3e-4, "weight_decay": 0.0}),
                      precision="bf16", checkpointing=llama_decoder_layer(),
                      clip_grad_norm=1.0,
                      lr_scheduler=(torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 3}))

VIT = Workload("vit", model=vit, batch=images, loss=classification_loss,
               optimizer=(torch.optim.AdamW, {"lr": 1e-3}), param_groups=timm_weight_decay,
               checkpointing=re.compile(r"blocks\.\d+"))


# -- four more, each a class of model that hookbench once refused (issue 33) ---------------------

def resnet():
    import timm

    # timm's smallest ResNet (BatchNorm after every conv), 10 classes at 32x32.
    return timm.create_model("resnet10t", pretrained=False, num_classes=10)


def opt_layerdrop():
    from transformers import OPTConfig, OPTForCausalLM

    # LayerDrop (Fan et al. 2019), as fairseq's recipes train it: each decoder layer skipped
    # with probability 0.3 per forward, decided by `torch.rand([]) < layerdrop` in Python.
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128,
                                    num_hidden_layers=4, num_attention_heads=4,
                                    max_position_embeddings=SEQ, word_embed_proj_dim=64,
                                    layerdrop=0.3, dropout=0.1, bos_token_id=0,
                                    eos_token_id=1, pad_token_id=1))


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    # transformers 5's MoE experts run as one torch._grouped_mm per projection (its default
    # experts_implementation); 4 experts, 2 per token.
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=64,
                                            intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            max_position_embeddings=SEQ, use_cache=False,
                                            bos_token_id=0, eos_token_id=1))


def t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                                               num_layers=2, num_heads=4, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def seq2seq(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    source = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(2, VOCAB, (BATCH, SEQ // 2), generator=g)
    start = torch.zeros(BATCH, 1, dtype=torch.long)  # T5's decoder starts from the pad token
    return ({"input_ids": source, "attention_mask": torch.ones_like(source),
             "decoder_input_ids": torch.cat([start, labels[:, :-1]], dim=1)}, labels)


def adafactor():
    from transformers.optimization import Adafactor

    return Adafactor


RESNET = Workload("resnet", model=resnet, batch=image_batches, loss=classification_loss,
                  optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
                  param_groups=timm_resnet_weight_decay)

OPT_LAYERDROP = Workload("opt-layerdrop", model=opt_layerdrop, batch=tokens, loss=lm_loss,
                         optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}))

MIXTRAL = Workload("mixtral", model=mixtral, batch=tokens, loss=lm_loss,
                   optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.0}))

# HF's documented T5 recipe: Adafactor with its own relative step size, no lr.
T5_ADAFACTOR = Workload("t5-adafactor", model=t5, batch=seq2seq, loss=lm_loss,
                        optimizer=(adafactor(), {"lr": None, "scale_parameter": True,
                                                 "relative_step": True, "warmup_init": True}))

# torchtune's lr is 2e-5; here 1e-3, so that 3 steps move bf16 parameters (a bf16 rounding is
# 1/256 of the value: smaller updates leave most of them where they were)
LLAMA_PURE_BF16 = Workload("llama-pure-bf16", model=llama, batch=tokens, loss=lm_loss,
                           optimizer=(torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
                           precision="bf16-true")

GPT2_ACCELERATE_DDP = GPT2.replace(
    name="gpt2-accelerate-ddp",
    ddp={"find_unused_parameters": False, "gradient_as_bucket_view": True, "bucket_cap_mb": 25,
         "comm_hook": default_hooks.bf16_compress_hook})

WORKLOADS = [GPT2, LLAMA_BF16, VIT, RESNET, OPT_LAYERDROP, MIXTRAL, T5_ADAFACTOR,
             LLAMA_PURE_BF16, GPT2_ACCELERATE_DDP]
