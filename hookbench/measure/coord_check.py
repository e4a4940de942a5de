"""The coordinate check of Tensor Programs V, built on activation capture.

Train one model family at widths w to 16w for a few Adam steps on fixed data, over several
seeds; capture every layer's output at every step with ``ActivationCapture``; and decide whether
muP's promise holds: every coordinate stays Theta(1) as width grows, in both directions. Two
quantities per layer and step, each the mean |.| of the output's entries (mup's "l1"; never the
raw L2 norm, which grows as sqrt(width) even when muP is right), averaged over seeds:

    coordinate  mean |x_t|          every step (t = 0 is initialisation)
    change      mean |x_t - x_0|    every step after the first update: the "maximal update"

For each, the growth (largest value at any width over the narrowest width's) and the shrinkage
(the narrowest's over the smallest at any width) must both stay within ``band`` (2x, OLMo-core's
threshold). A quantity that is exactly 0 at every width (the zero-initialised readout at t = 0)
is flat; 0 at some widths only is an infinite change. The change catches what the coordinate
hides: a hidden layer whose learning rate is too small for its width moves too little, but its
output is still its Theta(1) initial value.

The readout is zero-initialised here (``readout_zero_init=True``), as in microsoft/mup's own
coordinate-check test and examples. With ``MuReadout``'s default random init the logits at
initialisation are Theta(width^-1/2) by design (Tensor Programs V, Table 3) and the first
updates add a term of the same order, so a Theta(1) band would measure that finite-width
term (at 16x width the logits shrink 4x at init and 2x after three steps), not the
parametrization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hookbench.mechanisms.activation_capture import ActivationCapture, statistics
from hookbench.models import mup

__all__ = ["QUANTITIES", "CoordCheck", "coord_check", "data", "loss"]

MODELS = {"mlp": mup.MLP, "transformer": mup.Transformer}
QUANTITIES = ("coordinate", "change")


def LAYERS(name: str, module: nn.Module) -> bool:  # noqa: N802 - a selector, used as a constant
    """The layers whose outputs are checked."""
    return isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm))


def ratios(row: list[float]) -> tuple[float, float]:
    """(growth, shrinkage) of one quantity across widths, relative to the narrowest width."""
    if any(math.isnan(v) for v in row):
        return math.inf, math.inf
    if not any(row):
        return 1.0, 1.0  # 0 at every width: flat
    first, low, high = row[0], min(row), max(row)
    return (high / first if first else math.inf), (first / low if low else
                                                    math.inf if first else 1.0)


@dataclass
class CoordCheck:
    model: str
    parametrization: str
    widths: list[int]
    steps: int
    seeds: int
    lr: float
    band: float
    readout_zero_init: bool
    # layer -> quantity ("coordinate", "change") -> [step][width index], averaged over seeds
    coords: dict[str, dict[str, list[list[float]]]] = field(repr=False)

    def growth(self, layer: str, step: int, quantity: str = "coordinate") -> float:
        """The largest value at any width over the narrowest width's."""
        return ratios(self.coords[layer][quantity][step])[0]

    def shrink(self, layer: str, step: int, quantity: str = "coordinate") -> float:
        """The narrowest width's value over the smallest at any width."""
        return ratios(self.coords[layer][quantity][step])[1]

    def cells(self) -> list[tuple[str, str, int, float, float]]:
        """(layer, quantity, step, growth, shrinkage) for every checked cell."""
        return [(layer, q, t, *ratios(self.coords[layer][q][t])) for layer in self.coords
                for q in QUANTITIES for t in range(1 if q == "change" else 0, self.steps + 1)]

    @property
    def failures(self) -> list[tuple[str, str, int, str, float]]:
        """(layer, quantity, step, "grows" or "shrinks", ratio) for every cell out of band."""
        return [(layer, q, t, way, r) for layer, q, t, up, down in self.cells()
                for way, r in (("grows", up), ("shrinks", down)) if r > self.band]

    @property
    def passed(self) -> bool:
        return not self.failures

    def worst(self, direction: str) -> tuple[str, str, int, float]:
        """The cell with the largest growth ("grows") or shrinkage ("shrinks")."""
        i = 3 if direction == "grows" else 4
        cell = max(self.cells(), key=lambda c: c[i])
        return cell[0], cell[1], cell[2], cell[i]

    def verdict(self) -> str:
        head = "PASS" if self.passed else f"FAIL ({len(self.failures)} cells out of band)"
        worst = "; ".join(f"largest {what} {r:.2f}x ({layer} {q}, step {t})" for what, (
            layer, q, t, r) in (("growth", self.worst("grows")),
                                ("shrinkage", self.worst("shrinks"))))
        return (f"{head}: {self.model} in {self.parametrization}, widths {self.widths[0]}.."
                f"{self.widths[-1]}, {self.seeds} seeds, lr {self.lr:g}; {worst}; "
                f"band {self.band:g}x both ways")


def data(model: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed batch of one seed (the same at every width): inputs and class targets."""
    g = torch.Generator().manual_seed(10_000 + seed)
    if model == "mlp":
        return torch.randn(32, 16, generator=g), torch.randint(0, 8, (32,), generator=g)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:].flatten()


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension (mup's get_coord_data "xent", flattened)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target)


def coord_check(
    model: str = "mlp",
    parametrization: str = "mup",
    *,
    widths: tuple[int, ...] = (32, 64, 128, 256, 512),
    steps: int = 3,
    seeds: int = 3,
    lr: float = 1e-2,
    band: float = 2.0,
    readout_zero_init: bool = True,
) -> CoordCheck:
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if len(widths) < 2 or list(widths) != sorted(set(widths)):
        raise ValueError(f"widths must be at least two increasing values, got {widths}")
    if steps < 1 or seeds < 1:
        raise ValueError("steps and seeds must be >= 1")
    if not band > 1:
        raise ValueError(f"band must be > 1, got {band}")
    sums: dict[str, dict[str, list[list[float]]]] = {}
    for wi, width in enumerate(widths):
        for seed in range(seeds):
            torch.manual_seed(seed)
            net = MODELS[model](width, parametrization, base_width=widths[0],
                                readout_zero_init=readout_zero_init)
            opt = torch.optim.Adam(mup.param_groups(net, lr), foreach=False)
            x, y = data(model, seed)
            first: dict[str, torch.Tensor] = {}
            with ActivationCapture(net, include=LAYERS, dtype=torch.float64) as cap:
                for t in range(steps + 1):
                    cap.clear()
                    out = net(x)
                    for r in cap.records:
                        v = r.value
                        first.setdefault(r.name, v)
                        per = sums.setdefault(r.name, {q: [[0.0] * len(widths)
                                                          for _ in range(steps + 1)]
                                                       for q in QUANTITIES})
                        per["coordinate"][t][wi] += statistics(v, ("mean_abs",))[
                            "mean_abs"] / seeds
                        per["change"][t][wi] += statistics(v - first[r.name], ("mean_abs",))[
                            "mean_abs"] / seeds
                    if t < steps:
                        loss(out, y).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
    return CoordCheck(model, parametrization, list(widths), steps, seeds, lr, band,
                      readout_zero_init, sums)
