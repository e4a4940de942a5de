"""A second sweep: architectures from fields the first sweep (transformers, timm, torchvision
classifiers, diffusers, peft) did not visit, each a ``hookbench.Workload`` configured the way
its users train it, built from config on the CPU (nothing is downloaded), small enough that a
step takes well under a second on a loaded 2-core machine.

Fields: segmentation and detection (segmentation_models_pytorch, torchvision detectors),
medical imaging (MONAI), graphs (PyTorch Geometric), recommenders (TorchRec), reinforcement
learning (Stable-Baselines3), scientific ML (neuraloperator, torchdiffeq, e3nn), generative
models (GAN steps, a VAE, normalizing flows), RNNs, embeddings (open_clip,
sentence-transformers) and Lightning modules.

Every batch is 4 rows (2 data-parallel ranks get 2 each). Structures that are not tensors
(PyG's ``Batch``, TorchRec's ``KeyedJaggedTensor``, flat EmbeddingBag ids with offsets) are
built inside the model from per-sample tensors, so that a rank's share is a set of samples.
Every function here is module-level (workloads are pickled into spawned ranks).
"""

from __future__ import annotations

import functools
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload

BATCH = 4
COSINE = (torch.optim.lr_scheduler.CosineAnnealingLR, {"T_max": 3})


def built_on_cpu(factory, *args, **kwargs) -> nn.Module:
    """``factory`` built as usual, except under ``torch.device("meta")`` (where hookbench reads
    parameter counts and dtypes): some libraries read values at construction (``.item()`` on a
    ``linspace`` of drop-path rates, ``.to(device)``, ``from_pretrained``) and cannot build on
    meta, so there the model is built on the CPU and moved to meta."""
    device = torch.get_default_device()
    if device.type != "meta":
        return factory(*args, **kwargs)
    with torch.device("cpu"):
        model = factory(*args, **kwargs)
    return model.to(device)


def output_is_loss(output, target):
    """For models whose forward is the training step and returns the loss itself."""
    return output


def cross_entropy(output, target):
    return F.cross_entropy(output, target)


# == segmentation and detection: segmentation_models_pytorch, torchvision =====================


def masks(g: torch.Generator, classes: int = 3, size: int = 64):
    return (torch.randn(BATCH, 3, size, size, generator=g),
            torch.randint(0, classes, (BATCH, size, size), generator=g))


def binary_masks(g: torch.Generator):
    return (torch.randn(BATCH, 3, 64, 64, generator=g),
            torch.randint(0, 2, (BATCH, 1, 64, 64), generator=g).float())


def _smp(arch: str, **options) -> nn.Module:
    import segmentation_models_pytorch as smp

    return getattr(smp, arch)(encoder_weights=None, in_channels=3, **options)


def smp_model(arch: str, **options):
    return functools.partial(built_on_cpu, _smp, arch, **options)


def dice_ce(output, target):
    """smp's multiclass Dice loss beside cross entropy, as its examples combine them."""
    from segmentation_models_pytorch.losses import DiceLoss

    return DiceLoss("multiclass", from_logits=True)(output, target) + F.cross_entropy(output,
                                                                                      target)


def dice_focal_binary(output, target):
    from segmentation_models_pytorch.losses import DiceLoss, FocalLoss

    return (DiceLoss("binary", from_logits=True)(output, target)
            + FocalLoss("binary")(output, target))


def lovasz(output, target):
    from segmentation_models_pytorch.losses import LovaszLoss

    return LovaszLoss("multiclass", per_image=True)(output, target) + F.cross_entropy(output,
                                                                                      target)


# smp's examples: Adam lr 2e-4 (1e-4 for transformers), cosine annealing
SMP_UNET = Workload("smp-unet-resnet10t", model=smp_model(
    "Unet", encoder_name="tu-resnet10t", encoder_depth=3, decoder_channels=(32, 16, 8), classes=3),
    batch=masks, loss=dice_ce, optimizer=(torch.optim.Adam, {"lr": 2e-4}), lr_scheduler=COSINE)
SMP_FPN = Workload("smp-fpn-binary", model=smp_model(
    "FPN", encoder_name="tu-mobilenetv3_small_050", decoder_pyramid_channels=32,
    decoder_segmentation_channels=32,
    decoder_dropout=0.2, classes=1), batch=binary_masks, loss=dice_focal_binary,
    optimizer=(torch.optim.Adam, {"lr": 2e-4}), lr_scheduler=COSINE)
SMP_DEEPLAB = Workload("smp-deeplabv3plus", model=smp_model(
    "DeepLabV3Plus", encoder_name="tu-resnet10t", decoder_channels=32, classes=3),
    batch=masks, loss=lovasz,
    optimizer=(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}),
    lr_scheduler=(torch.optim.lr_scheduler.PolynomialLR, {"total_iters": 3, "power": 0.9}))
SMP_SEGFORMER = Workload("smp-segformer-mit-b0", model=smp_model(
    "Segformer", encoder_name="mit_b0", decoder_segmentation_channels=32, classes=3),
    batch=masks, loss=dice_ce, optimizer=(torch.optim.AdamW, {"lr": 6e-5, "weight_decay": 0.01}),
    clip_grad_norm=1.0)


class Detector(nn.Module):
    """A torchvision detector in training mode: a list of images (of different sizes) and a
    list of target dicts in, the dict of losses out."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        import torchvision
        from torchvision.models.detection import FasterRCNN, RetinaNet
        from torchvision.models.detection.anchor_utils import AnchorGenerator

        backbone = nn.Sequential(torchvision.models.mobilenet_v3_small(weights=None).features,
                                 nn.Conv2d(576, 32, 1))
        backbone.out_channels = 32
        sizes = ((16, 32),)
        if kind == "faster-rcnn":
            anchors = AnchorGenerator(sizes=sizes, aspect_ratios=((0.5, 1.0, 2.0),))
            pool = torchvision.ops.MultiScaleRoIAlign(["0"], output_size=7, sampling_ratio=2)
            self.net = FasterRCNN(backbone, num_classes=3, rpn_anchor_generator=anchors,
                                  box_roi_pool=pool, min_size=64, max_size=96,
                                  rpn_batch_size_per_image=32, box_batch_size_per_image=32,
                                  representation_size=64)
        else:
            anchors = AnchorGenerator(sizes=sizes, aspect_ratios=((0.5, 1.0, 2.0),))
            self.net = RetinaNet(backbone, num_classes=3, anchor_generator=anchors, min_size=64,
                                 max_size=96)

    def forward(self, images, targets):
        return self.net(images, targets)


def detection_batch(g: torch.Generator):
    images, targets = [], []
    for i in range(BATCH):
        h, w = 64 + 8 * i, 80 - 8 * i  # different sizes: why a detector takes a list
        images.append(torch.rand(3, h, w, generator=g))
        n = 2 + i % 2
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w / 2, h / 2])
        wh = 10 + torch.rand(n, 2, generator=g) * 20
        targets.append({"boxes": torch.cat([xy, xy + wh], 1),
                        "labels": torch.randint(1, 3, (n,), generator=g)})
    return (images, targets), torch.zeros(BATCH)


def detection_losses(output, target):
    return sum(output.values())


# torchvision's detection reference: SGD 0.02 momentum 0.9 decay 1e-4, warmup
FASTER_RCNN = Workload("tv-faster-rcnn", model=functools.partial(Detector, "faster-rcnn"),
                       batch=detection_batch, loss=detection_losses,
                       optimizer=(torch.optim.SGD, {"lr": 0.02, "momentum": 0.9,
                                                    "weight_decay": 1e-4}),
                       lr_scheduler=(torch.optim.lr_scheduler.LinearLR,
                                     {"start_factor": 0.001, "total_iters": 3}))
RETINANET = Workload("tv-retinanet", model=functools.partial(Detector, "retinanet"),
                     batch=detection_batch, loss=detection_losses,
                     optimizer=(torch.optim.SGD, {"lr": 0.01, "momentum": 0.9,
                                                  "weight_decay": 1e-4}))

# == medical imaging: MONAI ===================================================================


def volumes(g: torch.Generator, channels: int = 1, size: int = 32):
    """Volumes and their label maps (one channel of class indices)."""
    return (torch.randn(BATCH, channels, size, size, size, generator=g),
            torch.randint(0, 2, (BATCH, 1, size, size, size), generator=g))


def slices(g: torch.Generator):
    """64x64 slices: SwinUNETR downsamples 32 times, and instance norm needs more than one
    pixel at the bottom."""
    return (torch.randn(BATCH, 1, 64, 64, generator=g),
            torch.randint(0, 2, (BATCH, 1, 64, 64), generator=g))


def brats_volumes(g: torch.Generator):
    """BraTS-style: 4 modalities in, 3 overlapping region channels (TC, WT, ET) out."""
    return (torch.randn(BATCH, 4, 32, 32, 32, generator=g),
            torch.randint(0, 2, (BATCH, 3, 32, 32, 32), generator=g).float())


def dice_ce_3d(output, target):
    from monai.losses import DiceCELoss

    return DiceCELoss(to_onehot_y=True, softmax=True)(output, target)


def dice_sigmoid(output, target):
    from monai.losses import DiceLoss

    return DiceLoss(smooth_nr=0, smooth_dr=1e-5, squared_pred=True, sigmoid=True)(output, target)


def _monai_unet() -> nn.Module:
    from monai.networks.layers import Norm
    from monai.networks.nets import UNet

    # the spleen segmentation tutorial's UNet, 4x narrower and two levels shallower
    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(8, 16, 32),
                strides=(2, 2), num_res_units=2, norm=Norm.BATCH)


def _swin_unetr() -> nn.Module:
    from monai.networks.nets import SwinUNETR

    # the BTCV recipe's SwinUNETR with its gradient checkpointing inside (use_checkpoint), on
    # 2D slices (spatial_dims=2) so that a step stays short on a CPU
    return SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1),
                     num_heads=(3, 3, 3, 3), use_checkpoint=True, spatial_dims=2)


def _segresnet() -> nn.Module:
    from monai.networks.nets import SegResNet

    return SegResNet(blocks_down=(1, 2, 2), blocks_up=(1, 1), init_filters=8, in_channels=4,
                     out_channels=3, dropout_prob=0.2)


def _unetr() -> nn.Module:
    from monai.networks.nets import UNETR

    return UNETR(in_channels=1, out_channels=2, img_size=(32, 32, 32), feature_size=8,
                 hidden_size=48, mlp_dim=96, num_heads=4, proj_type="perceptron",
                 norm_name="instance", res_block=True, dropout_rate=0.1)


def _densenet3d() -> nn.Module:
    from monai.networks.nets import DenseNet

    return DenseNet(spatial_dims=3, in_channels=1, out_channels=2, init_features=8,
                    growth_rate=8, block_config=(2, 2), dropout_prob=0.1)


def volume_labels(g: torch.Generator):
    return (torch.randn(BATCH, 1, 32, 32, 32, generator=g),
            torch.randint(0, 2, (BATCH,), generator=g))


def _monai_vae() -> nn.Module:
    from monai.networks.nets import VarAutoEncoder

    return VarAutoEncoder(spatial_dims=2, in_shape=(1, 32, 32), out_channels=1, latent_size=8,
                          channels=(8, 16), strides=(2, 2))


def unit_images(g: torch.Generator):
    x = torch.rand(BATCH, 1, 32, 32, generator=g)
    return x, x


def vae_loss(output, target):
    """MONAI's VAE tutorial: BCE reconstruction plus beta times the KL divergence."""
    recon, mu, logvar, _ = output
    bce = F.binary_cross_entropy(torch.sigmoid(recon), target, reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + 100 * kld


# MONAI's tutorials: Adam 1e-4, weight decay 1e-5 (spleen, BraTS: cosine), AdamW for Swin
MONAI_UNET = Workload("monai-unet3d", model=_monai_unet, batch=volumes, loss=dice_ce_3d,
                      optimizer=(torch.optim.Adam, {"lr": 1e-4}))
SWIN_UNETR = Workload("monai-swinunetr", model=functools.partial(built_on_cpu, _swin_unetr),
                      batch=slices, loss=dice_ce_3d,
                      optimizer=(torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 1e-5}))
SEGRESNET = Workload("monai-segresnet-brats", model=_segresnet, batch=brats_volumes,
                     loss=dice_sigmoid,
                     optimizer=(torch.optim.Adam, {"lr": 1e-4, "weight_decay": 1e-5}),
                     lr_scheduler=COSINE)
UNETR = Workload("monai-unetr", model=_unetr, batch=volumes, loss=dice_ce_3d,
                 optimizer=(torch.optim.AdamW, {"lr": 1e-4, "weight_decay": 1e-5}))
DENSENET3D = Workload("monai-densenet3d", model=_densenet3d, batch=volume_labels,
                      loss=cross_entropy, optimizer=(torch.optim.Adam, {"lr": 1e-5}))
MONAI_VAE = Workload("monai-vae", model=_monai_vae, batch=unit_images, loss=vae_loss,
                     optimizer=(torch.optim.Adam, {"lr": 1e-4}))

# == graphs: PyTorch Geometric ================================================================
# A batch is a set of fixed-size graphs: node features (graphs, nodes, features) and each
# graph's edges (graphs, 2, edges) with node indices local to it; the model offsets them into
# one disjoint graph and a batch vector, what PyG's Batch.from_data_list builds.

NODES, EDGES, FEATURES = 10, 24, 8


def disjoint(x: torch.Tensor, edges: torch.Tensor):
    graphs, nodes, _ = x.shape
    offset = (torch.arange(graphs, device=x.device) * nodes).view(-1, 1, 1)
    edge_index = (edges + offset).transpose(0, 1).reshape(2, -1)
    batch = torch.arange(graphs, device=x.device).repeat_interleave(nodes)
    return x.reshape(graphs * nodes, -1), edge_index, batch


def graph_batch(g: torch.Generator, classes: int = 2):
    x = torch.randn(BATCH, NODES, FEATURES, generator=g)
    edges = torch.randint(0, NODES, (BATCH, 2, EDGES), generator=g)
    return (x, edges), torch.randint(0, classes, (BATCH,), generator=g)


def node_labelled_graphs(g: torch.Generator):
    (x, edges), _ = graph_batch(g)
    return (x, edges), torch.randint(0, 3, (BATCH, NODES), generator=g)


class GraphClassifier(nn.Module):
    """GIN (Xu et al. 2019) as PyG's models.GIN builds it, summed per graph, an MLP head."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import MLP
        from torch_geometric.nn.models import GIN

        self.gin = GIN(FEATURES, hidden_channels=32, num_layers=3, dropout=0.5, norm="batch_norm",
                       jk="cat")
        self.head = MLP([32, 32, 2], dropout=0.5, norm=None)

    def forward(self, x, edges):
        from torch_geometric.nn import global_add_pool

        x, edge_index, batch = disjoint(x, edges)
        return self.head(global_add_pool(self.gin(x, edge_index), batch))


class NodeGAT(nn.Module):
    """GAT (Velickovic et al. 2018) with PyG's GATConv: 4 heads concatenated, then a 1-head
    output layer; dropout 0.6 on features and on attention coefficients."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv

        self.conv1 = GATConv(FEATURES, 8, heads=4, dropout=0.6)
        self.conv2 = GATConv(32, 3, heads=1, concat=False, dropout=0.6)

    def forward(self, x, edges):
        graphs = x.shape[0]
        x, edge_index, _ = disjoint(x, edges)
        x = F.dropout(x, 0.6, self.training)
        x = F.dropout(F.elu(self.conv1(x, edge_index)), 0.6, self.training)
        return self.conv2(x, edge_index).view(graphs, NODES, -1)


def node_cross_entropy(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def dense_graphs(g: torch.Generator):
    """Dense batches, as PyG's DiffPool example: (graphs, nodes, nodes) adjacency and a node
    mask, the last graphs smaller than the padding."""
    x = torch.randn(BATCH, NODES, FEATURES, generator=g)
    adj = (torch.rand(BATCH, NODES, NODES, generator=g) < 0.3).float()
    adj = ((adj + adj.transpose(1, 2)) > 0).float()
    mask = torch.ones(BATCH, NODES, dtype=torch.bool)
    mask[2:, 7:] = False
    return {"x": x, "adj": adj, "mask": mask}, torch.randint(0, 2, (BATCH,), generator=g)


class DiffPool(nn.Module):
    """DiffPool (Ying et al. 2018) with PyG's DenseSAGEConv and dense_diff_pool: returns the
    logits and the auxiliary link-prediction and entropy losses."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn import DenseSAGEConv

        self.pool1 = DenseSAGEConv(FEATURES, 4)
        self.embed1 = DenseSAGEConv(FEATURES, 16)
        self.embed2 = DenseSAGEConv(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x, adj, mask):
        from torch_geometric.nn import dense_diff_pool

        s = self.pool1(x, adj, mask)
        x = F.relu(self.embed1(x, adj, mask))
        x, adj, link, entropy = dense_diff_pool(x, adj, s, mask)
        x = F.relu(self.embed2(x, adj))
        return self.head(x.mean(1)), link, entropy


def diffpool_loss(output, target):
    logits, link, entropy = output
    return F.cross_entropy(logits, target) + link + entropy


class Molecules(nn.Module):
    """SchNet (Schuett et al. 2017) from PyG on small molecules, its interaction graph every
    pair of atoms in a molecule within the cutoff (built here from the batch vector, so that
    torch-cluster is not needed); energy regression."""

    def __init__(self) -> None:
        super().__init__()
        from torch_geometric.nn.models import SchNet

        self.net = SchNet(hidden_channels=32, num_filters=32, num_interactions=2,
                          num_gaussians=16, cutoff=5.0, interaction_graph=self.pairs)

    @staticmethod
    def pairs(pos, batch):
        same = batch.view(-1, 1) == batch.view(1, -1)
        same.fill_diagonal_(False)
        edge_index = same.nonzero().t()
        weight = (pos[edge_index[0]] - pos[edge_index[1]]).norm(dim=-1)
        keep = weight < 5.0
        return edge_index[:, keep], weight[keep]

    def forward(self, z, pos):
        graphs, atoms = z.shape
        batch = torch.arange(graphs, device=z.device).repeat_interleave(atoms)
        return self.net(z.flatten(), pos.reshape(-1, 3), batch).view(-1)


def molecules(g: torch.Generator):
    return ((torch.randint(1, 10, (BATCH, 6), generator=g),
             torch.randn(BATCH, 6, 3, generator=g) * 1.5), torch.randn(BATCH, generator=g))


def mse(output, target):
    return F.mse_loss(output, target)


# PyG's examples: Adam 0.01 (GIN: StepLR halving), GAT lr 0.005 decay 5e-4
GIN = Workload("pyg-gin", model=GraphClassifier, batch=graph_batch, loss=cross_entropy,
               optimizer=(torch.optim.Adam, {"lr": 0.01}),
               lr_scheduler=(torch.optim.lr_scheduler.StepLR, {"step_size": 2, "gamma": 0.5}))
GAT = Workload("pyg-gat", model=NodeGAT, batch=node_labelled_graphs, loss=node_cross_entropy,
               optimizer=(torch.optim.Adam, {"lr": 0.005, "weight_decay": 5e-4}))
DIFFPOOL = Workload("pyg-diffpool", model=DiffPool, batch=dense_graphs, loss=diffpool_loss,
                    optimizer=(torch.optim.Adam, {"lr": 0.001}))
SCHNET = Workload("pyg-schnet", model=functools.partial(built_on_cpu, Molecules), batch=molecules, loss=mse,
                  optimizer=(torch.optim.Adam, {"lr": 5e-4}),
                  lr_scheduler=(torch.optim.lr_scheduler.ExponentialLR, {"gamma": 0.96}))

# == recommenders: TorchRec ===================================================================
# Each sample: dense features, and for each sparse feature up to 3 ids (padded) and how many
# are real; the model builds the KeyedJaggedTensor from them.

TABLES, ROWS, DIM, MAX_IDS = 3, 100, 8, 3


def _collection():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS,
                           feature_names=[f"f{i}"]) for i in range(TABLES)],
        device=torch.get_default_device())


def jagged(ids: torch.Tensor, lengths: torch.Tensor):
    """A KeyedJaggedTensor, key-major as TorchRec lays it out, from padded ids
    (samples, keys, MAX_IDS) and their lengths (samples, keys)."""
    from torchrec import KeyedJaggedTensor

    keep = torch.arange(ids.shape[2], device=ids.device) < lengths.unsqueeze(-1)
    values = ids.transpose(0, 1)[keep.transpose(0, 1)]
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)],
                                               values=values,
                                               lengths=lengths.t().reshape(-1))


class TorchRecDLRM(nn.Module):
    def __init__(self, dcn: bool = False) -> None:
        super().__init__()
        from torchrec.models.dlrm import DLRM, DLRM_DCN

        if dcn:
            self.dlrm = DLRM_DCN(_collection(), dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                                 over_arch_layer_sizes=[16, 1], dcn_num_layers=2,
                                 dcn_low_rank_dim=4)
        else:
            self.dlrm = DLRM(_collection(), dense_in_features=4, dense_arch_layer_sizes=[16, DIM],
                             over_arch_layer_sizes=[16, 1])

    def forward(self, dense, ids, lengths):
        return self.dlrm(dense, jagged(ids, lengths)).squeeze(1)


def sessions(g: torch.Generator):
    dense = torch.randn(BATCH, 4, generator=g)
    ids = torch.randint(0, ROWS, (BATCH, TABLES, MAX_IDS), generator=g)
    lengths = torch.randint(0, MAX_IDS + 1, (BATCH, TABLES), generator=g)
    return (dense, ids, lengths), torch.randint(0, 2, (BATCH,), generator=g).float()


def bce_logits(output, target):
    return F.binary_cross_entropy_with_logits(output, target)


# TorchRec's DLRM example: Adagrad on the tables and the dense part (lr 0.015 on Criteo)
DLRM = Workload("torchrec-dlrm", model=functools.partial(built_on_cpu, TorchRecDLRM), batch=sessions, loss=bce_logits,
                optimizer=(torch.optim.Adagrad, {"lr": 0.015}))
DLRM_DCN = Workload("torchrec-dlrm-dcn", model=functools.partial(built_on_cpu,
                                                                 TorchRecDLRM, dcn=True),
                    batch=sessions, loss=bce_logits, optimizer=(torch.optim.Adam, {"lr": 1e-3}))

# == reinforcement learning: Stable-Baselines3 policies on fixed rollouts =====================


def constant_schedule(progress: float) -> float:
    return 3e-4


def _policy(kind: str) -> nn.Module:
    import gymnasium as gym
    import numpy as np

    if kind == "ppo-discrete":
        from stable_baselines3.common.policies import ActorCriticPolicy

        return ActorCriticPolicy(gym.spaces.Box(-1, 1, (8,), np.float32), gym.spaces.Discrete(4),
                                 constant_schedule, net_arch=dict(pi=[64, 64], vf=[64, 64]))
    if kind == "ppo-continuous":
        from stable_baselines3.common.policies import ActorCriticPolicy

        # the rl-zoo's MuJoCo settings: tanh, separate networks, log std -0.5... at init 0
        return ActorCriticPolicy(gym.spaces.Box(-1, 1, (11,), np.float32),
                                 gym.spaces.Box(-1, 1, (3,), np.float32), constant_schedule,
                                 net_arch=dict(pi=[64, 64], vf=[64, 64]),
                                 activation_fn=nn.Tanh)
    if kind == "a2c-cnn":
        from stable_baselines3.common.policies import ActorCriticCnnPolicy

        return ActorCriticCnnPolicy(gym.spaces.Box(0, 255, (4, 36, 36), np.uint8),
                                    gym.spaces.Discrete(6), constant_schedule,
                                    features_extractor_kwargs=dict(features_dim=64),
                                    optimizer_class=torch.optim.RMSprop,
                                    optimizer_kwargs=dict(alpha=0.99, eps=1e-5,
                                                          weight_decay=0))
    if kind == "dqn":
        from stable_baselines3.dqn.policies import DQNPolicy

        return DQNPolicy(gym.spaces.Box(-1, 1, (8,), np.float32), gym.spaces.Discrete(4),
                         constant_schedule, net_arch=[64, 64])
    raise ValueError(kind)


class ActorCriticStep(nn.Module):
    """PPO's or A2C's loss on a fixed rollout, as stable_baselines3's train() computes it:
    evaluate_actions, the clipped ratio (PPO) or the plain policy gradient (A2C), the value
    loss and the entropy bonus; returns the loss."""

    def __init__(self, kind: str, algo: str) -> None:
        super().__init__()
        self.policy = built_on_cpu(_policy, kind)
        self.algo = algo

    def forward(self, obs, actions, old_log_prob, advantages, returns):
        values, log_prob, entropy = self.policy.evaluate_actions(obs, actions)
        values = values.flatten()
        if self.algo == "ppo":
            # per-minibatch advantage normalisation (normalize_advantage=True)
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
            ratio = torch.exp(log_prob - old_log_prob)
            policy_loss = -torch.min(advantages * ratio,
                                     advantages * ratio.clamp(0.8, 1.2)).mean()
            entropy_coef = 0.0
        else:
            policy_loss = -(advantages * log_prob).mean()
            entropy_coef = 0.01
        value_loss = F.mse_loss(returns, values)
        entropy_loss = -torch.mean(entropy)
        return policy_loss + entropy_coef * entropy_loss + 0.5 * value_loss


def rollout(g: torch.Generator, obs_shape, actions):
    obs = torch.rand(BATCH, *obs_shape, generator=g) * 2 - 1
    return obs, actions, (torch.randn(BATCH, generator=g) - 1.5,
                          torch.randn(BATCH, generator=g), torch.randn(BATCH, generator=g))


def discrete_rollout(g: torch.Generator):
    obs, act, (old, adv, ret) = rollout(g, (8,), None)
    act = torch.randint(0, 4, (BATCH,), generator=g)
    return (obs, act, old, adv, ret), ret


def continuous_rollout(g: torch.Generator):
    obs, act, (old, adv, ret) = rollout(g, (11,), None)
    act = torch.rand(BATCH, 3, generator=g) * 2 - 1
    return (obs, act, old - 2, adv, ret), ret


def atari_rollout(g: torch.Generator):
    obs = torch.randint(0, 256, (BATCH, 4, 36, 36), generator=g, dtype=torch.uint8)
    act = torch.randint(0, 6, (BATCH,), generator=g)
    adv, ret = torch.randn(BATCH, generator=g), torch.randn(BATCH, generator=g)
    return (obs, act, torch.zeros(BATCH), adv, ret), ret


class DQNStep(nn.Module):
    """DQN's TD loss as stable_baselines3's DQN.train: Huber between Q(s, a) and
    r + gamma (1 - done) max_a' Q_target(s', a'); the target network (a frozen copy, synced
    every target_update_interval steps) gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = built_on_cpu(_policy, "dqn")

    def forward(self, obs, actions, rewards, next_obs, dones):
        with torch.no_grad():
            next_q = self.policy.q_net_target(next_obs).max(dim=1).values
            target = rewards + (1 - dones) * 0.99 * next_q
        q = self.policy.q_net(obs).gather(1, actions.long().view(-1, 1)).flatten()
        return F.smooth_l1_loss(q, target)


def transitions(g: torch.Generator):
    obs = torch.rand(BATCH, 8, generator=g) * 2 - 1
    next_obs = torch.rand(BATCH, 8, generator=g) * 2 - 1
    rewards = torch.randn(BATCH, generator=g)
    dones = (torch.rand(BATCH, generator=g) < 0.25).float()
    return (obs, torch.randint(0, 4, (BATCH,), generator=g), rewards, next_obs, dones), rewards


# PPO's defaults: Adam lr 3e-4 eps 1e-5, max_grad_norm 0.5; A2C's: RMSprop lr 7e-4 alpha 0.99
# eps 1e-5, max_grad_norm 0.5; DQN's: Adam lr 1e-4, max_grad_norm 10
PPO = Workload("sb3-ppo-mlp", model=functools.partial(ActorCriticStep, "ppo-discrete", "ppo"),
               batch=discrete_rollout, loss=output_is_loss,
               optimizer=(torch.optim.Adam, {"lr": 3e-4, "eps": 1e-5}), clip_grad_norm=0.5)
PPO_CONTINUOUS = Workload("sb3-ppo-gaussian", model=functools.partial(
    ActorCriticStep, "ppo-continuous", "ppo"), batch=continuous_rollout, loss=output_is_loss,
    optimizer=(torch.optim.Adam, {"lr": 3e-4, "eps": 1e-5}), clip_grad_norm=0.5,
    lr_scheduler=(torch.optim.lr_scheduler.LinearLR,
                  {"start_factor": 1.0, "end_factor": 0.0, "total_iters": 10}))
A2C = Workload("sb3-a2c-cnn", model=functools.partial(ActorCriticStep, "a2c-cnn", "a2c"),
               batch=atari_rollout, loss=output_is_loss,
               optimizer=(torch.optim.RMSprop, {"lr": 7e-4, "alpha": 0.99, "eps": 1e-5}),
               clip_grad_norm=0.5)
DQN = Workload("sb3-dqn", model=DQNStep, batch=transitions, loss=output_is_loss,
               optimizer=(torch.optim.Adam, {"lr": 1e-4}), clip_grad_norm=10.0)

# == scientific ML: neuraloperator, torchdiffeq, e3nn =========================================


def _fno(**options) -> nn.Module:
    from neuralop.models import FNO

    return FNO(**options)


def darcy(g: torch.Generator):
    a = (torch.rand(BATCH, 1, 32, 32, generator=g) > 0.5).float() * 9 + 3
    return a, torch.randn(BATCH, 1, 32, 32, generator=g)


def burgers(g: torch.Generator):
    return torch.randn(BATCH, 1, 64, generator=g), torch.randn(BATCH, 1, 64, generator=g)


def lp_2d(output, target):
    from neuralop.losses import LpLoss

    return LpLoss(d=2, p=2)(output, target)


def h1_1d(output, target):
    from neuralop.losses import H1Loss

    return H1Loss(d=1)(output, target)


# neuraloperator's Darcy example: AdamW lr 8e-3 decay 1e-4, cosine; FNO's spectral weights are
# complex64
FNO2D = Workload("neuralop-fno2d", model=functools.partial(
    _fno, n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=16, n_layers=2,
    projection_channel_ratio=2), batch=darcy, loss=lp_2d,
    optimizer=(torch.optim.AdamW, {"lr": 8e-3, "weight_decay": 1e-4}), lr_scheduler=COSINE)
TFNO2D = Workload("neuralop-tfno2d", model=functools.partial(
    _fno, n_modes=(8, 8), in_channels=1, out_channels=1, hidden_channels=16, n_layers=2,
    factorization="tucker", rank=0.42), batch=darcy, loss=lp_2d,
    optimizer=(torch.optim.AdamW, {"lr": 8e-3, "weight_decay": 1e-4}), lr_scheduler=COSINE)
FNO1D = Workload("neuralop-fno1d-burgers", model=functools.partial(
    _fno, n_modes=(16,), in_channels=1, out_channels=1, hidden_channels=16, n_layers=3,
    domain_padding=0.125), batch=burgers, loss=h1_1d,
    optimizer=(torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-4}),
    lr_scheduler=(torch.optim.lr_scheduler.StepLR, {"step_size": 2, "gamma": 0.5}))


class ODEFunc(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(4, dim), nn.GroupNorm(4, dim)
        self.conv1 = nn.Conv2d(dim + 1, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim + 1, dim, 3, padding=1)

    def conv(self, conv, t, x):
        return conv(torch.cat([x, torch.ones_like(x[:, :1]) * t], 1))

    def forward(self, t, x):
        x = self.conv(self.conv1, t, F.relu(self.norm1(x)))
        return self.norm2(self.conv(self.conv2, t, F.relu(x)))


class ODENet(nn.Module):
    """torchdiffeq's odenet_mnist: a downsampling stem, one ODE block (conv dynamics with
    time as a channel) integrated by odeint from t=0 to 1, a pooled head."""

    def __init__(self, method: str = "rk4", adjoint: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3), nn.GroupNorm(4, 16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 4, 2, 1))
        self.func = ODEFunc(16)
        self.head = nn.Sequential(nn.GroupNorm(4, 16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(16, 10))
        self.method, self.adjoint = method, adjoint

    def forward(self, x):
        from torchdiffeq import odeint, odeint_adjoint

        t = torch.tensor([0.0, 1.0], device=x.device)
        options = dict(method=self.method)
        if self.method == "rk4":
            options["options"] = dict(step_size=0.25)
        else:
            options.update(rtol=1e-3, atol=1e-3)
        solve = odeint_adjoint if self.adjoint else odeint
        return self.head(solve(self.func, self.stem(x), t, **options)[-1])


def digits(g: torch.Generator):
    return (torch.randn(BATCH, 1, 16, 16, generator=g),
            torch.randint(0, 10, (BATCH,), generator=g))


class CNF(nn.Module):
    """A continuous normalizing flow (FFJORD, Grathwohl et al. 2019) with torchdiffeq: the
    log-density change is the trace of the dynamics' Jacobian, estimated with Hutchinson's
    estimator through torch.autograd.grad(create_graph=True) inside the forward."""

    def __init__(self, dim: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim + 1, hidden), nn.Tanh(),
                                 nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, dim))
        self.noise = None

    def dynamics(self, t, state):
        z, _ = state
        with torch.enable_grad():
            z = z.requires_grad_(True)
            dz = self.net(torch.cat([z, torch.ones_like(z[:, :1]) * t], 1))
            e_dz = torch.autograd.grad(dz, z, self.noise, create_graph=True)[0]
        return dz, -(e_dz * self.noise).sum(1)

    def forward(self, x, noise):
        from torchdiffeq import odeint

        self.noise = noise
        t = torch.tensor([0.0, 1.0], device=x.device)
        z, delta_logp = odeint(self.dynamics, (x, x.new_zeros(len(x))), t,
                               method="rk4", options=dict(step_size=0.25))
        self.noise = None
        return z[-1], delta_logp[-1]


def two_moons(g: torch.Generator):
    angle = torch.rand(BATCH, generator=g) * math.pi
    upper = torch.arange(BATCH) % 2 == 0
    x = torch.stack([torch.cos(angle), torch.sin(angle)], 1)
    x = torch.where(upper.view(-1, 1), x, torch.stack([1 - x[:, 0], 0.5 - x[:, 1]], 1))
    x = x + 0.05 * torch.randn(BATCH, 2, generator=g)
    return (x, torch.randn(BATCH, 2, generator=g)), torch.zeros(BATCH)


def flow_nll(output, target):
    """The negative log-likelihood under a standard normal base: -(log N(z) - delta_logp)."""
    z, delta_logp = output
    logp_z = -0.5 * (z.pow(2) + math.log(2 * math.pi)).sum(1)
    return -(logp_z + delta_logp).mean()


ODENET = Workload("torchdiffeq-odenet-rk4", model=ODENet, batch=digits, loss=cross_entropy,
                  optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}))
ODENET_ADJOINT = Workload("torchdiffeq-odenet-adjoint", model=functools.partial(
    ODENet, method="dopri5", adjoint=True), batch=digits, loss=cross_entropy,
    optimizer=(torch.optim.Adam, {"lr": 1e-3}))
CNF_FLOW = Workload("torchdiffeq-cnf", model=CNF, batch=two_moons, loss=flow_nll,
                    optimizer=(torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-5}))


class Potential(nn.Module):
    """An equivariant interatomic potential with e3nn (NequIP-style, one interaction): edge
    spherical harmonics, a radial MLP giving the tensor product's weights, a gated nonlinearity,
    summed per-atom energies; forces are minus the energy's gradient in the atoms' positions,
    torch.autograd.grad(create_graph=True) in the forward, trained on energies and forces."""

    def __init__(self) -> None:
        super().__init__()
        from e3nn import o3
        from e3nn.nn import FullyConnectedNet, Gate

        self.irreps_sh = o3.Irreps.spherical_harmonics(2)
        self.embed = nn.Embedding(5, 8)
        gate = Gate("8x0e", [torch.tanh], "4x0e", [torch.sigmoid], "4x1o")
        self.tp = o3.FullyConnectedTensorProduct("8x0e", self.irreps_sh, gate.irreps_in,
                                                 shared_weights=False)
        self.radial = FullyConnectedNet([8, 16, self.tp.weight_numel], torch.nn.functional.silu)
        self.gate = gate
        self.tp2 = o3.FullyConnectedTensorProduct(gate.irreps_out, self.irreps_sh, "8x0e",
                                                  shared_weights=False)
        self.radial2 = FullyConnectedNet([8, 16, self.tp2.weight_numel], torch.nn.functional.silu)
        self.readout = o3.Linear("8x0e", "0e")

    def forward(self, species, pos):
        from e3nn import o3
        from e3nn.math import soft_one_hot_linspace

        with torch.enable_grad():
            if not pos.requires_grad:
                pos = pos.requires_grad_(True)
            graphs, atoms = species.shape
            flat = pos.reshape(-1, 3)
            batch = torch.arange(graphs, device=pos.device).repeat_interleave(atoms)
            same = batch.view(-1, 1) == batch.view(1, -1)
            same.fill_diagonal_(False)
            src, dst = same.nonzero().t()
            vec = flat[dst] - flat[src]
            sh = o3.spherical_harmonics(self.irreps_sh, vec, True, normalization="component")
            length = vec.norm(dim=1)
            basis = soft_one_hot_linspace(length, 0.0, 4.0, 8, basis="smooth_finite",
                                          cutoff=True) * 8 ** 0.5
            h = self.embed(species.flatten())
            msg = self.tp(h[src], sh, self.radial(basis))
            h1 = self.gate(msg.new_zeros(len(flat), msg.shape[1]).index_add(0, dst, msg)
                           / atoms ** 0.5)
            msg2 = self.tp2(h1[src], sh, self.radial2(basis))
            h2 = msg2.new_zeros(len(flat), 8).index_add(0, dst, msg2)
            energy = self.readout(h2).view(graphs, atoms).sum(1)
            forces = -torch.autograd.grad(energy.sum(), pos, create_graph=True)[0]
        return energy, forces


def atoms(g: torch.Generator):
    species = torch.randint(0, 5, (BATCH, 5), generator=g)
    pos = torch.randn(BATCH, 5, 3, generator=g)
    return (species, pos), (torch.randn(BATCH, generator=g), torch.randn(BATCH, 5, 3,
                                                                         generator=g))


def energy_forces(output, target):
    """NequIP's loss: per-atom energy MSE plus force MSE, forces weighted as much."""
    (energy, forces), (e_ref, f_ref) = output, target
    return F.mse_loss(energy / 5, e_ref / 5) + F.mse_loss(forces, f_ref)


E3NN_POTENTIAL = Workload("e3nn-potential-forces", model=functools.partial(built_on_cpu, Potential), batch=atoms,
                          loss=energy_forces,
                          optimizer=(torch.optim.Adam, {"lr": 5e-3, "amsgrad": True}))

# == generative: GAN steps, a flow (the VAE and the CNF are above) ============================


class DCGANGenerator(nn.Module):
    def __init__(self, z: int = 16, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(z, width * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(width * 2),
            nn.ReLU(True), nn.ConvTranspose2d(width * 2, width, 4, 2, 1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU(True), nn.ConvTranspose2d(width, 1, 4, 2, 1,
                                                                     bias=False), nn.Tanh())

    def forward(self, z):
        return self.net(z.view(len(z), -1, 1, 1))


class DCGANDiscriminator(nn.Module):
    def __init__(self, width: int = 16, norm: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True),
            nn.Conv2d(width, width * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(width * 2) if norm else nn.LayerNorm([width * 2, 4, 4]),
            nn.LeakyReLU(0.2, True), nn.Conv2d(width * 2, 1, 4, 1, 0, bias=False))

    def forward(self, x):
        return self.net(x).flatten()


class CriticStep(nn.Module):
    """WGAN-GP's critic step (Gulrajani et al. 2017): the generator frozen (requires_grad off,
    as the training loop sets it during critic iterations), the gradient penalty at random
    interpolates through torch.autograd.grad(create_graph=True); the critic has no BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = DCGANGenerator()
        self.generator.requires_grad_(False)
        self.critic = DCGANDiscriminator(norm=False)

    def forward(self, real, z, alpha):
        with torch.no_grad():
            fake = self.generator(z)
        mixed = (alpha.view(-1, 1, 1, 1) * real + (1 - alpha.view(-1, 1, 1, 1)) * fake)
        mixed.requires_grad_(True)
        grad = torch.autograd.grad(self.critic(mixed).sum(), mixed, create_graph=True)[0]
        penalty = ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()
        return self.critic(fake).mean() - self.critic(real).mean() + 10 * penalty


class GeneratorStep(nn.Module):
    """DCGAN's generator step (Radford et al. 2016): the discriminator frozen, the
    non-saturating loss on the generator's samples labelled real."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = DCGANGenerator()
        self.discriminator = DCGANDiscriminator()
        self.discriminator.requires_grad_(False)

    def forward(self, z):
        logits = self.discriminator(self.generator(z))
        return F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits))


def critic_batch(g: torch.Generator):
    return ((torch.rand(BATCH, 1, 16, 16, generator=g) * 2 - 1, torch.randn(BATCH, 16, generator=g),
             torch.rand(BATCH, generator=g)), torch.zeros(BATCH))


def latent_batch(g: torch.Generator):
    return torch.randn(BATCH, 16, generator=g), torch.zeros(BATCH)


class RealNVP(nn.Module):
    """RealNVP (Dinh et al. 2017) on 8-dimensional data: affine couplings with alternating
    masks, tanh-bounded scales; returns z and log|det J|."""

    def __init__(self, dim: int = 8, layers: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.register_buffer("masks", torch.stack([
            (torch.arange(dim) + i) % 2 == 0 for i in range(layers)]).float())
        self.nets = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(),
                                                nn.Linear(hidden, hidden), nn.ReLU(),
                                                nn.Linear(hidden, 2 * dim))
                                  for _ in range(layers))

    def forward(self, x):
        logdet = x.new_zeros(len(x))
        for mask, net in zip(self.masks, self.nets):
            s, t = net(x * mask).chunk(2, dim=1)
            s = torch.tanh(s) * (1 - mask)
            x = x * mask + (1 - mask) * (x * torch.exp(s) + t)
            logdet = logdet + s.sum(1)
        return x, logdet


def flow_data(g: torch.Generator):
    return torch.randn(BATCH, 8, generator=g) @ torch.randn(8, 8, generator=g), torch.zeros(BATCH)


# WGAN-GP: Adam lr 1e-4 betas (0, 0.9); DCGAN: Adam lr 2e-4 betas (0.5, 0.999)
WGAN_CRITIC = Workload("wgan-gp-critic", model=CriticStep, batch=critic_batch,
                       loss=output_is_loss,
                       optimizer=(torch.optim.Adam, {"lr": 1e-4, "betas": (0.0, 0.9)}))
DCGAN_GENERATOR = Workload("dcgan-generator", model=GeneratorStep, batch=latent_batch,
                           loss=output_is_loss,
                           optimizer=(torch.optim.Adam, {"lr": 2e-4, "betas": (0.5, 0.999)}))
REALNVP = Workload("realnvp", model=RealNVP, batch=flow_data, loss=flow_nll,
                   optimizer=(torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-5}),
                   clip_grad_norm=100.0)

# == RNNs =====================================================================================

VOCAB, SEQ = 64, 12


class LSTMLanguageModel(nn.Module):
    """PyTorch's word_language_model example: embedding, 2-layer LSTM with dropout, decoder
    weights tied to the embedding."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.2)
        self.encoder = nn.Embedding(VOCAB, dim)
        self.rnn = nn.LSTM(dim, dim, 2, dropout=0.2, batch_first=True)
        self.decoder = nn.Linear(dim, VOCAB)
        self.decoder.weight = self.encoder.weight

    def forward(self, ids):
        out, _ = self.rnn(self.drop(self.encoder(ids)))
        return self.decoder(self.drop(out))


def text_stream(g: torch.Generator):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def next_token(output, target):
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


class PackedGRUClassifier(nn.Module):
    """A bidirectional GRU over variable-length sequences packed with pack_padded_sequence
    (enforce_sorted=False), its last hidden states classified."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim, padding_idx=0)
        self.rnn = nn.GRU(dim, dim, num_layers=2, bidirectional=True, batch_first=True,
                          dropout=0.1)
        self.head = nn.Linear(2 * dim, 5)

    def forward(self, ids, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence

        packed = pack_padded_sequence(self.embed(ids), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        _, h = self.rnn(packed)
        return self.head(torch.cat([h[-2], h[-1]], 1))


def padded_sentences(g: torch.Generator):
    lengths = torch.randint(3, SEQ + 1, (BATCH,), generator=g)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    ids = ids * (torch.arange(SEQ) < lengths.view(-1, 1))
    return (ids, lengths), torch.randint(0, 5, (BATCH,), generator=g)


class LSTMCTC(nn.Module):
    """A speech-style acoustic model: 2-layer bidirectional LSTM with projections
    (proj_size), CTC over the frames."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, bidirectional=True, proj_size=16,
                           batch_first=True)
        self.head = nn.Linear(32, 20)

    def forward(self, features):
        out, _ = self.rnn(features)
        return self.head(out).log_softmax(-1)


def speech_frames(g: torch.Generator):
    return torch.randn(BATCH, 24, 16, generator=g), torch.randint(1, 20, (BATCH, 5), generator=g)


def ctc(output, target):
    log_probs = output.transpose(0, 1)
    frames, rows = log_probs.shape[:2]
    return F.ctc_loss(log_probs, target, torch.full((rows,), frames, dtype=torch.long),
                      torch.full((rows,), target.shape[1], dtype=torch.long), zero_infinity=True)


# word_language_model: SGD lr 20, clipping 0.25 (here lr 5 on a tiny model)
LSTM_LM = Workload("lstm-lm-tied", model=LSTMLanguageModel, batch=text_stream, loss=next_token,
                   optimizer=(torch.optim.SGD, {"lr": 5.0}), clip_grad_norm=0.25)
GRU_PACKED = Workload("gru-packed-bidirectional", model=PackedGRUClassifier,
                      batch=padded_sentences, loss=cross_entropy,
                      optimizer=(torch.optim.Adam, {"lr": 1e-3}), clip_grad_norm=5.0)
LSTM_CTC = Workload("lstm-proj-ctc", model=LSTMCTC, batch=speech_frames, loss=ctc,
                    optimizer=(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}),
                    clip_grad_norm=1.0,
                    lr_scheduler=(torch.optim.lr_scheduler.OneCycleLR,
                                  {"max_lr": 1e-3, "total_steps": 10}))

# == embeddings: open_clip, sentence-transformers =============================================

CONTEXT = 16


def _open_clip(kind: str) -> nn.Module:
    import open_clip

    vision = dict(layers=2, width=32, head_width=16, patch_size=8, image_size=32)
    text = dict(context_length=CONTEXT, vocab_size=VOCAB, width=32, heads=2, layers=2)
    if kind == "coca":
        model = open_clip.CoCa(embed_dim=32, multimodal_cfg=dict(
            context_length=CONTEXT, vocab_size=VOCAB, width=32, heads=2, layers=1),
            text_cfg=dict(text, embed_cls=True, pad_id=0, output_tokens=True), vision_cfg=dict(
                vision, attentional_pool=True, attn_pooler_heads=2, attn_pooler_queries=4,
                output_tokens=True))
        # open_clip 3.3.0 never initialises the multimodal decoder's text_projection (a
        # torch.empty; its init_parameters is not called, and would fail on self.transformer):
        # pretrained checkpoints overwrite it, a run from scratch must set it
        nn.init.normal_(model.text_decoder.text_projection, std=32 ** -0.5)
        return model
    if kind == "siglip":
        return open_clip.CustomTextCLIP(
            embed_dim=16, vision_cfg=dict(vision, pool_type="avg", final_ln_after_pool=True),
            text_cfg=dict(text, pool_type="last", no_causal_mask=True, proj_bias=True),
            init_logit_scale=math.log(10), init_logit_bias=-10, output_dict=True)
    return open_clip.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text, output_dict=True)


def image_text(g: torch.Generator):
    text = torch.randint(3, VOCAB, (BATCH, CONTEXT), generator=g)
    text[:, -1] = VOCAB - 1  # an end token, the highest id (CLIP pools its argmax)
    return (torch.randn(BATCH, 3, 32, 32, generator=g), text), torch.zeros(BATCH)


def clip_loss(output, target):
    from open_clip.loss import ClipLoss

    return ClipLoss()(output["image_features"], output["text_features"], output["logit_scale"])


def siglip_loss(output, target):
    from open_clip.loss import SigLipLoss

    return SigLipLoss()(output["image_features"], output["text_features"], output["logit_scale"],
                        output["logit_bias"])


def coca_loss(output, target):
    from open_clip.loss import CoCaLoss

    loss = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0, pad_id=0)
    return sum(loss(output["image_features"], output["text_features"], output["logits"],
                    output["labels"], output["logit_scale"]))


def open_clip_decay(model: nn.Module) -> list[dict]:
    """open_clip's main.py: no weight decay on gains, biases, embeddings and logit_scale."""
    exclude = lambda n, p: (p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n  # noqa: E731
                            or "logit_scale" in n)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if exclude(n, p)], "weight_decay": 0.0},
            {"params": [p for n, p in named if not exclude(n, p)], "weight_decay": 0.2}]


OPEN_CLIP_ADAMW = (torch.optim.AdamW, {"lr": 5e-4, "betas": (0.9, 0.98), "eps": 1e-6})
OPEN_CLIP = Workload("open-clip-vit", model=functools.partial(_open_clip, "clip"),
                     batch=image_text, loss=clip_loss, optimizer=OPEN_CLIP_ADAMW,
                     param_groups=open_clip_decay, lr_scheduler=COSINE)
# open_clip's training wraps DDP with torch's defaults (ddp_args = {}, static_graph by flag):
# hookbench's own choice, find_unused_parameters=True, fails in torch on SigLIP, whose forward
# returns its logit_bias parameter itself ("Expected to mark a variable ready only once")
SIGLIP = Workload("open-clip-siglip", model=functools.partial(_open_clip, "siglip"),
                  batch=image_text, loss=siglip_loss, optimizer=OPEN_CLIP_ADAMW,
                  param_groups=open_clip_decay, lr_scheduler=COSINE,
                  ddp={"find_unused_parameters": False})
COCA = Workload("open-clip-coca", model=functools.partial(_open_clip, "coca"),
                batch=image_text, loss=coca_loss, optimizer=OPEN_CLIP_ADAMW,
                param_groups=open_clip_decay, clip_grad_norm=1.0)

ST_DIR = os.path.join(tempfile.gettempdir(), "hookbench-fields-st-tiny-bert")


def _tiny_bert_dir() -> str:
    """A tiny BERT and its WordPiece tokenizer saved once (seeded) where SentenceTransformer
    loads a model from: what a user's local checkpoint is. Written atomically, as ranks may
    import this at once."""
    if os.path.isdir(ST_DIR):
        return ST_DIR
    import tempfile

    from transformers import BertConfig, BertModel, BertTokenizerFast

    staging = tempfile.mkdtemp(prefix="st-tiny-bert.", dir=os.path.dirname(ST_DIR))
    with open(os.path.join(staging, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                          + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    BertTokenizerFast(os.path.join(staging, "vocab.txt")).save_pretrained(staging)
    with torch.device("cpu"), torch.random.fork_rng():
        torch.manual_seed(0)
        BertModel(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=64,
                             max_position_embeddings=64)).save_pretrained(staging)
    try:
        os.rename(staging, ST_DIR)
    except OSError:  # another rank was first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return ST_DIR


class SentenceEmbedder(nn.Module):
    """A SentenceTransformer (BERT, mean pooling) trained with MultipleNegativesRankingLoss on
    (anchor, positive) pairs, in-batch negatives; the loss module holds the model, as in
    SentenceTransformerTrainer, and returns the loss."""

    def __init__(self) -> None:
        super().__init__()
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.losses import (
            MultipleNegativesRankingLoss)

        path = _tiny_bert_dir()
        self.model = SentenceTransformer(path, device=str(torch.get_default_device()))
        self.loss = MultipleNegativesRankingLoss(self.model)

    def forward(self, anchor, positive):
        return self.loss([anchor, positive], None)


def sentence_pairs(g: torch.Generator):
    def sentences():
        ids = torch.randint(5, VOCAB, (BATCH, 10), generator=g)
        ids[:, 0], ids[:, -1] = 2, 3
        mask = torch.ones(BATCH, 10, dtype=torch.long)
        mask[1, 6:] = 0
        return {"input_ids": ids * mask, "attention_mask": mask,
                "token_type_ids": torch.zeros(BATCH, 10, dtype=torch.long)}

    return {"anchor": sentences(), "positive": sentences()}, torch.zeros(BATCH)


def _word_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))


class StaticEmbedder(nn.Module):
    """sentence-transformers' StaticEmbedding (an EmbeddingBag over token ids, the model2vec
    architecture) trained with CoSENTLoss on scored pairs; the flat ids and offsets it takes
    are built here from padded ids and lengths."""

    def __init__(self) -> None:
        super().__init__()
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.losses import CoSENTLoss
        from sentence_transformers.sentence_transformer.modules import StaticEmbedding

        self.model = SentenceTransformer(modules=[StaticEmbedding(_word_tokenizer(),
                                                                  embedding_dim=32)],
                                         device=str(torch.get_default_device()))
        self.loss = CoSENTLoss(self.model)

    @staticmethod
    def flat(ids, lengths):
        keep = torch.arange(ids.shape[1], device=ids.device) < lengths.view(-1, 1)
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        return {"input_ids": ids[keep], "offsets": offsets}

    def forward(self, ids_a, lengths_a, ids_b, lengths_b, scores):
        return self.loss([self.flat(ids_a, lengths_a), self.flat(ids_b, lengths_b)], scores)


def scored_pairs(g: torch.Generator):
    def side():
        return (torch.randint(0, VOCAB, (BATCH, 8), generator=g),
                torch.randint(1, 9, (BATCH,), generator=g))

    return (*side(), *side(), torch.rand(BATCH, generator=g)), torch.zeros(BATCH)


# SentenceTransformerTrainer's defaults: AdamW lr 5e-5, linear warmup and decay, clipping 1.0;
# StaticEmbedding's recipe: lr 2e-1
ST_MNRL = Workload("st-bert-mnrl", model=functools.partial(built_on_cpu, SentenceEmbedder), batch=sentence_pairs,
                   loss=output_is_loss,
                   optimizer=(torch.optim.AdamW, {"lr": 5e-5, "weight_decay": 0.01}),
                   clip_grad_norm=1.0, lr_scheduler=(torch.optim.lr_scheduler.LinearLR, {
                       "start_factor": 1.0, "end_factor": 0.0, "total_iters": 10}))
ST_STATIC = Workload("st-static-cosent", model=StaticEmbedder, batch=scored_pairs,
                     loss=output_is_loss, optimizer=(torch.optim.AdamW, {"lr": 0.2}),
                     clip_grad_norm=1.0)

# == Lightning modules: the LightningModule's training_step is the loss =======================


def _lit(kind: str):
    import lightning as L

    class LitAutoEncoder(L.LightningModule):
        """Lightning's README autoencoder, as written there (self.log inside)."""

        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
            self.decoder = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64))

        def training_step(self, batch, batch_idx):
            x, _ = batch
            x = x.view(x.size(0), -1)
            loss = F.mse_loss(self.decoder(self.encoder(x)), x)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class LitClassifier(L.LightningModule):
        """A LightningModule classifier with torchmetrics accuracy logged in training_step,
        label smoothing, and its dict return ({"loss": ...})."""

        def __init__(self):
            super().__init__()
            import torchmetrics

            self.save_hyperparameters()
            self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8),
                                     nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1),
                                     nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                     nn.Flatten(), nn.Dropout(0.25), nn.Linear(16, 10))
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            logits = self(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.1)
            self.accuracy(logits.argmax(1), y)
            self.log_dict({"train_loss": loss, "train_acc": self.accuracy}, prog_bar=True)
            return {"loss": loss}

    return LitAutoEncoder() if kind == "autoencoder" else LitClassifier()


class TrainingStep(nn.Module):
    """What Lightning's automatic optimisation runs as the closure: training_step on the batch,
    its loss (a tensor or a dict's "loss")."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.module = _lit(kind)

    def forward(self, x, y):
        out = self.module.training_step((x, y), 0)
        return out["loss"] if isinstance(out, dict) else out


def small_digits(g: torch.Generator):
    return (torch.randn(BATCH, 1, 8, 8, generator=g),
            torch.randint(0, 10, (BATCH,), generator=g)), torch.zeros(BATCH)


LIT_AUTOENCODER = Workload("lightning-autoencoder",
                           model=functools.partial(TrainingStep, "autoencoder"),
                           batch=small_digits, loss=output_is_loss,
                           optimizer=(torch.optim.Adam, {"lr": 1e-3}))
LIT_CLASSIFIER = Workload("lightning-classifier",
                          model=functools.partial(TrainingStep, "classifier"),
                          batch=small_digits, loss=output_is_loss,
                          optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9,
                                                       "weight_decay": 5e-4}),
                          lr_scheduler=(torch.optim.lr_scheduler.OneCycleLR,
                                        {"max_lr": 0.1, "total_steps": 10}),
                          clip_grad_norm=1.0)

# == the list, and each one's library and field ===============================================

FAMILY = {
    "smp-unet-resnet10t": ("segmentation-models-pytorch", "segmentation"),
    "smp-fpn-binary": ("segmentation-models-pytorch", "segmentation"),
    "smp-deeplabv3plus": ("segmentation-models-pytorch", "segmentation"),
    "smp-segformer-mit-b0": ("segmentation-models-pytorch", "segmentation"),
    "tv-faster-rcnn": ("torchvision", "detection"),
    "tv-retinanet": ("torchvision", "detection"),
    "monai-unet3d": ("monai", "medical imaging"),
    "monai-swinunetr": ("monai", "medical imaging"),
    "monai-segresnet-brats": ("monai", "medical imaging"),
    "monai-unetr": ("monai", "medical imaging"),
    "monai-densenet3d": ("monai", "medical imaging"),
    "monai-vae": ("monai", "generative (VAE)"),
    "pyg-gin": ("torch-geometric", "graphs"),
    "pyg-gat": ("torch-geometric", "graphs"),
    "pyg-diffpool": ("torch-geometric", "graphs"),
    "pyg-schnet": ("torch-geometric", "graphs (molecules)"),
    "torchrec-dlrm": ("torchrec", "recommenders"),
    "torchrec-dlrm-dcn": ("torchrec", "recommenders"),
    "sb3-ppo-mlp": ("stable-baselines3", "reinforcement learning"),
    "sb3-ppo-gaussian": ("stable-baselines3", "reinforcement learning"),
    "sb3-a2c-cnn": ("stable-baselines3", "reinforcement learning"),
    "sb3-dqn": ("stable-baselines3", "reinforcement learning"),
    "neuralop-fno2d": ("neuraloperator", "scientific ML"),
    "neuralop-tfno2d": ("neuraloperator", "scientific ML"),
    "neuralop-fno1d-burgers": ("neuraloperator", "scientific ML"),
    "torchdiffeq-odenet-rk4": ("torchdiffeq", "scientific ML"),
    "torchdiffeq-odenet-adjoint": ("torchdiffeq", "scientific ML"),
    "torchdiffeq-cnf": ("torchdiffeq", "generative (flow)"),
    "e3nn-potential-forces": ("e3nn", "scientific ML"),
    "wgan-gp-critic": ("hand-written", "generative (GAN)"),
    "dcgan-generator": ("hand-written", "generative (GAN)"),
    "realnvp": ("hand-written", "generative (flow)"),
    "lstm-lm-tied": ("torch.nn", "RNN"),
    "gru-packed-bidirectional": ("torch.nn", "RNN"),
    "lstm-proj-ctc": ("torch.nn", "RNN"),
    "open-clip-vit": ("open-clip-torch", "embeddings"),
    "open-clip-siglip": ("open-clip-torch", "embeddings"),
    "open-clip-coca": ("open-clip-torch", "embeddings"),
    "st-bert-mnrl": ("sentence-transformers", "embeddings"),
    "st-static-cosent": ("sentence-transformers", "embeddings"),
    "lightning-autoencoder": ("lightning", "Lightning module"),
    "lightning-classifier": ("lightning", "Lightning module"),
}
ARCHITECTURES = [w for w in globals().values() if isinstance(w, Workload)]
NAME = {w.name: attr for attr, w in globals().items() if isinstance(w, Workload)}
assert set(FAMILY) == {w.name for w in ARCHITECTURES}, "every architecture has its family"
