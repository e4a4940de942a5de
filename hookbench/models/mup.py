"""Width-parametrized models in muP and in standard parametrization (SP), for the coordinate check.

muP (Tensor Programs V, Table 3, Adam) as microsoft/mup implements it (``MuReadout``,
``set_base_shapes``, ``MuAdam``), with ``m = width / base_width``:
    input weights and all biases   init var 1/fan_in          Adam lr  eta
    hidden (width x width) weights init var 1/fan_in          Adam lr  eta / m
    output (readout) weights       init var 1/base_fan_in     Adam lr  eta, input divided by m
    attention logits               q.k sqrt(d_base) / d_head  (SP: q.k / sqrt(d_head))
The readout is ``MuReadout``: its weight is drawn like SP's and multiplied by sqrt(m) (the same
operation as mup's rescale, so the numbers are bit-identical to the library's), and its *input*
is divided by m. The effective readout variance is then 1/(base_fan_in m^2), i.e. ~ fan_in^-2 as
Table 3 asks, and the bias, outside the multiplier, learns at eta at every width. So the logits
at initialisation are Theta(m^-1/2) (they vanish as width grows, by design) and their change
after an update is Theta(1).
At the base width (m = 1) every factor above is exactly 1: muP and SP are the same model, bit
for bit (mup's convention). SP is PyTorch's default: the same init, no readout multiplier, every
lr eta, 1/sqrt(d_head). ``param_groups(model, lr)`` gives the Adam groups for either.
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

    def readout(self, width: int, out_features: int, zero_init: bool) -> Readout:
        return Readout(width, out_features, self.m if self.parametrization == "mup" else 1.0,
                       zero_init=zero_init)


class Readout(nn.Linear):
    """The output layer: ``MuReadout`` in muP (``width_mult`` = m), a plain Linear in SP (1).
    The multiplier is inside the module, so a forward hook on it sees the logits the loss sees."""

    def __init__(self, in_features: int, out_features: int, width_mult: float, *,
                 zero_init: bool = False) -> None:
        super().__init__(in_features, out_features)
        _init(self)
        with torch.no_grad():
            if zero_init:  # MuReadout(readout_zero_init=True); the bias is zero already
                self.weight.zero_()
            else:  # mup's _rescale_parameters: SP's draw times sqrt(m)
                self.weight *= width_mult ** 0.5
        self.width_mult = width_mult

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On the input, as MuReadout does: a multiplier on the output would also scale the bias
        # and so its Adam learning rate, to eta / m.
        return super().forward(x / self.width_mult)


class MLP(_Width):
    """in_features -> width -> ... -> width -> out_features, ReLU."""

    def __init__(self, width: int, parametrization: str = "mup", *, base_width: int = 32,
                 depth: int = 3, in_features: int = 16, out_features: int = 8,
                 readout_zero_init: bool = False) -> None:
        super().__init__(parametrization, width, base_width)
        self.inp = _init(nn.Linear(in_features, width))
        self.layers = nn.ModuleList(_init(nn.Linear(width, width)) for _ in range(depth - 1))
        self.out = self.readout(width, out_features, readout_zero_init)
        self.hidden = list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.out(h)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, scale: float) -> None:
        super().__init__()
        self.heads, self.scale = heads, scale
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = _init(nn.Linear(width, 3 * width))
        self.proj = _init(nn.Linear(width, width))
        self.fc = _init(nn.Linear(width, 4 * width))
        self.fc2 = _init(nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return h + self.fc2(F.gelu(self.fc(self.ln2(h))))


def attention_scale(parametrization: str, d_head: int, base_d_head: int) -> float:
    """muP: 1/d_head with the constant chosen so that the base width gets SP's 1/sqrt(d_head)
    (mup's attn_mult); written so that at the base width the two are the same float."""
    if parametrization == "sp":
        return 1 / math.sqrt(d_head)
    return 1 / math.sqrt(base_d_head) * (base_d_head / d_head)


class Transformer(_Width):
    """A small pre-norm causal transformer on token ids; width is d_model, heads fixed."""

    def __init__(self, width: int, parametrization: str = "mup", *, base_width: int = 32,
                 depth: int = 2, heads: int = 4, vocab: int = 64, seq_len: int = 16,
                 readout_zero_init: bool = False) -> None:
        super().__init__(parametrization, width, base_width)
        if width % heads or base_width % heads:
            raise ValueError(f"width {width} and base_width {base_width} must be divisible by "
                             f"heads {heads}")
        self.embed = nn.Embedding(vocab, width)
        nn.init.normal_(self.embed.weight, std=1.0)  # input layer: coordinates Theta(1)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        scale = attention_scale(parametrization, width // heads, base_width // heads)
        self.blocks = nn.ModuleList(_Block(width, heads, scale) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.out = self.readout(width, vocab, readout_zero_init)
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
