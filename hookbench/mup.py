"""Width-parametrized models in muP and in standard parametrization (SP), for the coordinate check.

muP (Tensor Programs V, Table 3, Adam): with ``m = width / base_width``,
    input weights and all biases   init var 1/fan_in     Adam lr  eta
    hidden (width x width) weights init var 1/fan_in     Adam lr  eta / m
    output (readout) weights       init var 1/fan_in     Adam lr  eta, output multiplied by 1/m
    attention logits               q.k / d_head          (SP: q.k / sqrt(d_head))
SP is PyTorch's default: the same init, no readout multiplier, every lr eta, 1/sqrt(d_head).
``param_groups(model, lr)`` gives the Adam groups for either.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "Transformer", "param_groups"]

PARAMETRIZATIONS = ("mup", "sp")


def _check(parametrization: str, width: int, base_width: int) -> None:
    if parametrization not in PARAMETRIZATIONS:
        raise ValueError(f"parametrization must be one of {PARAMETRIZATIONS}")
    if width < 1 or base_width < 1:
        raise ValueError("width and base_width must be >= 1")


def _init(linear: nn.Linear) -> nn.Linear:
    nn.init.normal_(linear.weight, std=linear.in_features ** -0.5)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    return linear


class _Width(nn.Module):
    """What the parametrizations share: the width multiplier and the readout."""

    hidden: list[nn.Linear]  # the width x width matrices, whose Adam lr scales as 1/m

    def __init__(self, parametrization: str, width: int, base_width: int) -> None:
        super().__init__()
        _check(parametrization, width, base_width)
        self.parametrization, self.width, self.base_width = parametrization, width, base_width
        self.m = width / base_width

    def readout(self, width: int, out_features: int) -> _Readout:
        return _Readout(width, out_features, 1 / self.m if self.parametrization == "mup" else 1.0)


class _Readout(nn.Linear):
    """The output layer, with muP's output multiplier inside it so that a forward hook on it
    sees the logits the loss sees."""

    def __init__(self, in_features: int, out_features: int, multiplier: float) -> None:
        super().__init__(in_features, out_features)
        _init(self)
        self.multiplier = multiplier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.multiplier


class MLP(_Width):
    """in_features -> width -> ... -> width -> out_features, ReLU."""

    def __init__(self, width: int, parametrization: str = "mup", *, base_width: int = 32,
                 depth: int = 3, in_features: int = 16, out_features: int = 8) -> None:
        super().__init__(parametrization, width, base_width)
        self.inp = _init(nn.Linear(in_features, width))
        self.layers = nn.ModuleList(_init(nn.Linear(width, width)) for _ in range(depth - 1))
        self.out = self.readout(width, out_features)
        self.hidden = list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.out(h)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mup: bool) -> None:
        super().__init__()
        self.heads, self.mup = heads, mup
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = _init(nn.Linear(width, 3 * width))
        self.proj = _init(nn.Linear(width, width))
        self.fc = _init(nn.Linear(width, 4 * width))
        self.fc2 = _init(nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        d_head = d // self.heads
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1 / d_head if self.mup else 1 / math.sqrt(d_head))
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return h + self.fc2(F.gelu(self.fc(self.ln2(h))))


class Transformer(_Width):
    """A small pre-norm causal transformer on token ids; width is d_model, heads fixed."""

    def __init__(self, width: int, parametrization: str = "mup", *, base_width: int = 32,
                 depth: int = 2, heads: int = 4, vocab: int = 64, seq_len: int = 16) -> None:
        super().__init__(parametrization, width, base_width)
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=1.0)  # input layer: coordinates Theta(1)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(_Block(width, heads, parametrization == "mup")
                                    for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.out = self.readout(width, vocab)
        self.hidden = [lin for blk in self.blocks for lin in (blk.qkv, blk.proj, blk.fc, blk.fc2)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.out(self.ln(h))


def param_groups(model: _Width, lr: float) -> list[dict]:
    """Adam param groups: in muP the hidden matrices get lr / m, everything else lr."""
    hidden = {id(lin.weight) for lin in model.hidden}
    scaled = [p for p in model.parameters() if id(p) in hidden]
    rest = [p for p in model.parameters() if id(p) not in hidden]
    hidden_lr = lr / model.m if model.parametrization == "mup" else lr
    return [{"params": scaled, "lr": hidden_lr}, {"params": rest, "lr": lr}]
