"""microsoft/mup as a peer of hookbench's muP: the same graphs built from the library's parts.

The library's way to muP a model: ``MuReadout`` as the output layer, ``set_base_shapes`` against
a base-width model (which rescales the readout's SP-initialised weight by sqrt(m)), ``MuAdam``,
and ``1/d_head`` attention written by the user (here explicitly, as in the library's
Transformer example: ``q.k * attn_mult / d_head``, attn_mult = sqrt(base d_head)). Each model
here is loaded with hookbench's raw SP initialisation at the same seed before the library
rescales it, and ``mup.coord_check.get_coord_data`` trains it on hookbench's batch, so any
difference between the two coordinate tables comes from the parametrization or the arithmetic.

Needs the ``mup`` extra (``pip install -e '.[mup]'``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import mup as mup_library
from mup.coord_check import get_coord_data

from hookbench.measure import coord_check as hb_coord

__all__ = ["coordinates", "difference", "library_model"]


class _MLP(nn.Module):
    def __init__(self, width: int, depth: int = 3, in_features: int = 16,
                 out_features: int = 8, readout_zero_init: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.out = mup_library.MuReadout(width, out_features, readout_zero_init=readout_zero_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.out(h)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, attn_mult: float) -> None:
        super().__init__()
        self.heads, self.attn_mult = heads, attn_mult
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, n, d = h.shape
        d_head = d // self.heads
        q, k, v = self.qkv(self.ln1(h)).view(b, n, 3, self.heads, d_head).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) * self.attn_mult / d_head
        causal = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        a = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        h = h + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return h + self.fc2(F.gelu(self.fc(self.ln2(h))))


class _Transformer(nn.Module):
    def __init__(self, width: int, base_width: int, depth: int = 2, heads: int = 4,
                 vocab: int = 64, seq_len: int = 16, readout_zero_init: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq_len, width))
        attn_mult = math.sqrt(base_width // heads)
        self.blocks = nn.ModuleList(_Block(width, heads, attn_mult) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.out = mup_library.MuReadout(width, vocab, readout_zero_init=readout_zero_init)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.out(self.ln(h))


def _build(model: str, width: int, base_width: int, readout_zero_init: bool) -> nn.Module:
    if model == "mlp":
        return _MLP(width, readout_zero_init=readout_zero_init)
    return _Transformer(width, base_width, readout_zero_init=readout_zero_init)


def library_model(model: str, width: int, base_width: int, seed: int,
                  readout_zero_init: bool = False) -> nn.Module:
    """The library's muP ``model`` at ``width``, from hookbench's SP initialisation at ``seed``
    (what ``coord_check`` draws for that seed), rescaled by ``set_base_shapes``."""
    torch.manual_seed(seed)
    raw = hb_coord.MODELS[model](width, "sp", base_width=base_width,
                                 readout_zero_init=readout_zero_init)
    net = _build(model, width, base_width, readout_zero_init)
    net.load_state_dict(raw.state_dict())
    # The delta model marks which dimensions are widths (mup's recommended use).
    return mup_library.set_base_shapes(
        net, _build(model, base_width, base_width, readout_zero_init),
        delta=_build(model, 2 * base_width, base_width, readout_zero_init))


def coordinates(model: str = "mlp", *, widths: tuple[int, ...] = (32, 64, 128, 256, 512),
                steps: int = 3, seeds: int = 3, lr: float = 1e-2,
                readout_zero_init: bool = True) -> dict[str, list[list[float]]]:
    """The library's coordinate table, laid out as hookbench's ``coords[layer]["coordinate"]``:
    layer -> [step][width index] of mean |x| (in float64), averaged over seeds."""
    sums: dict[str, list[list[float]]] = {}
    for seed in range(seeds):
        models = {w: (lambda w=w: library_model(model, w, widths[0], seed, readout_zero_init))
                  for w in widths}
        checked = {n for n, m in models[widths[0]]().named_modules() if hb_coord.LAYERS(n, m)}
        x, y = hb_coord.data(model, seed)
        # nsteps + 1: the library records the forward before each of its nsteps updates.
        df = get_coord_data(models, [(x, y)], optimizer="adam", lr=lr, mup=True,
                            nsteps=steps + 1, lossfn="xent", flatten_output=model != "mlp",
                            cuda=False, show_progress=False, filter_module_by_name=checked.__contains__,
                            output_fdict={"l1": lambda t: t.double().abs().mean()})
        for row in df.itertuples():
            per = sums.setdefault(row.module, [[0.0] * len(widths) for _ in range(steps + 1)])
            per[row.t - 1][widths.index(row.width)] += row.l1 / seeds
    return sums


def difference(ours: hb_coord.CoordCheck, theirs: dict[str, list[list[float]]]) -> float:
    """The largest relative difference between hookbench's coordinates and the library's over
    every layer, step and width (0.0 where they are the same numbers)."""
    if set(theirs) != set(ours.coords):
        raise ValueError(f"the two record different layers: {sorted(set(theirs) ^ set(ours.coords))}")
    return max(abs(a - b) / abs(b) if b else abs(a) for layer in theirs
               for row, peer_row in zip(ours.coords[layer]["coordinate"], theirs[layer])
               for a, b in zip(row, peer_row))
