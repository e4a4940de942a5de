"""torchvision's resnet18, vit_b_16 and vit_l_16, rebuilt from ``torch.nn`` alone.

A new PyTorch release usually ships before a torchvision built against it, and the zoo
(``hookbench.models.zoo.ZOO``) and the upgrade gate's memory rows must not wait for it. These builders
give the same models without importing torchvision, identical to torchvision 0.29's: the same
parameters and buffers (names, shapes, dtypes, order), the same submodule names and ``torch.nn``
layers with the same settings, the same forward op for op with the same tensor lifetimes (so a
memory measurement is the same allocation by allocation), and, from the same seed, the same
initial values (layers are created and initialised in torchvision's order, with its
distributions). tests/models/test_vision.py proves it where torchvision imports: layouts, module calls,
outputs and gradients bit for bit with torchvision's state dict loaded (strict), and the
fake-backend memory of every strategy the gate records.

The builders take torchvision's defaults: 1000 classes, 3x224x224 input, dropout 0.0, no
pretrained weights (a torchvision state dict loads as it is). The classes also take dropout.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import nn

__all__ = ["BasicBlock", "Encoder", "EncoderBlock", "ResNet", "VisionTransformer", "resnet18",
           "vit_b_16", "vit_l_16"]


# -- ResNet ---------------------------------------------------------------------------------------


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return conv, nn.BatchNorm2d(cout)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a residual; a strided 1x1 convolution and batch
    norm (``downsample``) on the residual where the shape changes. One ReLU module, applied
    twice."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        # torchvision creates the downsample branch before the block, and registers it last:
        # creation order fixes the random initial values, registration order the layout.
        downsample = (nn.Sequential(*_conv_bn(cin, cout, 1, stride))
                      if stride != 1 or cin != cout else None)
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3, 1)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One step per statement, as torchvision: a tensor is released when its name is rebound,
        # so this order of statements is the order of allocations and frees.
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        # The residual is computed after bn2 and held until the block returns.
        residual = x if self.downsample is None else self.downsample(x)
        out += residual  # in place
        return self.relu(out)


class ResNet(nn.Module):
    """A ResNet of ``BasicBlock`` stages (widths 64, 128, 256, 512)."""

    def __init__(self, blocks: tuple[int, int, int, int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), blocks)):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1))
                cin = width
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)  # keeps nn.Linear's own initialisation
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)  # statement by statement, as in BasicBlock.forward
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def resnet18() -> ResNet:
    """torchvision's ``resnet18()``: 11,689,512 parameters, 1000 classes."""
    return ResNet((2, 2, 2, 2))


# -- Vision Transformer ---------------------------------------------------------------------------


def _layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=1e-6)


class EncoderBlock(nn.Module):
    """A pre-norm transformer layer: self-attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, dropout: float = 0.0,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = heads
        self.ln_1 = _layer_norm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=attention_dropout,
                                                    batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = _layer_norm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(mlp_dim, dim), nn.Dropout(dropout))
        for m in self.mlp:
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Statement by statement, as in BasicBlock.forward (with dropout > 0, the attention
        # output is released before the residual sum is allocated).
        x = self.ln_1(input)
        x = self.self_attention(x, x, x, need_weights=False)[0]
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class Encoder(nn.Module):
    """Learned position embedding, dropout, the layers and a final layer norm."""

    def __init__(self, seq_length: int, layers: int, heads: int, dim: int, mlp_dim: int,
                 dropout: float = 0.0, attention_dropout: float = 0.0) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(OrderedDict(
            (f"encoder_layer_{i}", EncoderBlock(dim, heads, mlp_dim, dropout, attention_dropout))
            for i in range(layers)))
        self.ln = _layer_norm(dim)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = input + self.pos_embedding  # named: alive through the layers, as torchvision's
        return self.ln(self.layers(self.dropout(input)))


class VisionTransformer(nn.Module):
    """ViT: patches projected by a strided convolution, a class token, the encoder, and a linear
    head on the class token's output."""

    def __init__(self, patch_size: int, layers: int, heads: int, dim: int, mlp_dim: int,
                 image_size: int = 224, num_classes: int = 1000, dropout: float = 0.0,
                 attention_dropout: float = 0.0) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image size {image_size} is not a multiple of patch {patch_size}")
        self.image_size, self.patch_size, self.hidden_dim = image_size, patch_size, dim
        self.conv_proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.seq_length = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(self.seq_length, layers, heads, dim, mlp_dim, dropout,
                               attention_dropout)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(dim, num_classes)))
        fan_in = 3 * patch_size * patch_size
        nn.init.trunc_normal_(self.conv_proj.weight, std=math.sqrt(1 / fan_in))
        nn.init.zeros_(self.conv_proj.bias)
        nn.init.zeros_(self.heads.head.weight)
        nn.init.zeros_(self.heads.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        if h != self.image_size or w != self.image_size:
            raise ValueError(f"expected {self.image_size}x{self.image_size} images, got {h}x{w}")
        patches = (h // self.patch_size) * (w // self.patch_size)
        # (n, dim, h/p, w/p) -> (n, dim, patches) -> (n, patches, dim)
        x = self.conv_proj(x).reshape(n, self.hidden_dim, patches).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        # Rebinding x releases the concatenation before the head runs, as in torchvision;
        # ``self.heads(self.encoder(x)[:, 0])`` would hold it and change the timeline.
        x = self.encoder(x)
        x = x[:, 0]
        return self.heads(x)


def vit_b_16() -> VisionTransformer:
    """torchvision's ``vit_b_16()``: 86,567,656 parameters, 1000 classes, 224x224 input."""
    return VisionTransformer(patch_size=16, layers=12, heads=12, dim=768, mlp_dim=3072)


def vit_l_16() -> VisionTransformer:
    """torchvision's ``vit_l_16()``: 304,326,632 parameters, 1000 classes, 224x224 input."""
    return VisionTransformer(patch_size=16, layers=24, heads=16, dim=1024, mlp_dim=4096)
