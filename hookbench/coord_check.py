"""The coordinate check of Tensor Programs V, built on activation capture.

Train one model family at widths w to 16w for a few Adam steps on fixed data, over several
seeds; capture the mean |x| (and RMS) of every layer's output at every step with
``ActivationCapture(stats=True)``; and decide. Under muP the coordinates of every layer stay the
same size as width grows; under the standard parametrization at the same learning rate they grow
with width after the first update. The band: no layer's mean |x|, averaged over seeds, may grow
more than ``band`` (2x, OLMo-core's threshold) from the narrowest to any wider width. mean |x| or
RMS, never the raw L2 norm, which grows as sqrt(width) even when muP is right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hookbench import mup
from hookbench.activation_capture import ActivationCapture

__all__ = ["CoordCheck", "coord_check"]

MODELS = {"mlp": mup.MLP, "transformer": mup.Transformer}


def _LAYERS(name: str, module: nn.Module) -> bool:  # noqa: N802 - a selector, used as a constant
    return isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm))


@dataclass
class CoordCheck:
    model: str
    parametrization: str
    widths: list[int]
    steps: int
    seeds: int
    lr: float
    band: float
    # layer -> stat ("mean_abs", "rms") -> [step][width index], averaged over seeds
    coords: dict[str, dict[str, list[list[float]]]] = field(repr=False)

    def growth(self, layer: str, step: int) -> float:
        """The largest mean |x| at any width over that at the narrowest."""
        row = self.coords[layer]["mean_abs"][step]
        return max(row) / row[0]

    @property
    def failures(self) -> list[tuple[str, int, float]]:
        """(layer, step, growth) for every coordinate that left the band."""
        return [(layer, t, self.growth(layer, t)) for layer in self.coords
                for t in range(self.steps + 1) if self.growth(layer, t) > self.band]

    @property
    def passed(self) -> bool:
        return not self.failures

    def verdict(self) -> str:
        worst = max(((layer, t, self.growth(layer, t)) for layer in self.coords
                     for t in range(self.steps + 1)), key=lambda f: f[2])
        head = "PASS" if self.passed else f"FAIL ({len(self.failures)} layer-steps out of band)"
        return (f"{head}: {self.model} in {self.parametrization}, widths {self.widths[0]}.."
                f"{self.widths[-1]}, {self.seeds} seeds, lr {self.lr:g}; largest growth of "
                f"mean |x| {worst[2]:.2f}x ({worst[0]}, step {worst[1]}), band {self.band:g}x")


def _data(model: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)  # the same data at every width
    if model == "mlp":
        return torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
    tokens = torch.randint(0, 64, (8, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def coord_check(
    model: str = "mlp",
    parametrization: str = "mup",
    *,
    widths: tuple[int, ...] = (32, 64, 128, 256, 512),
    steps: int = 3,
    seeds: int = 3,
    lr: float = 1e-2,
    band: float = 2.0,
) -> CoordCheck:
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if len(widths) < 2 or list(widths) != sorted(set(widths)):
        raise ValueError(f"widths must be at least two increasing values, got {widths}")
    if steps < 1 or seeds < 1:
        raise ValueError("steps and seeds must be >= 1")
    sums: dict[str, dict[str, list[list[float]]]] = {}
    for wi, width in enumerate(widths):
        for seed in range(seeds):
            torch.manual_seed(seed)
            net = MODELS[model](width, parametrization, base_width=widths[0])
            opt = torch.optim.Adam(mup.param_groups(net, lr), foreach=False)
            x, y = _data(model, seed)
            with ActivationCapture(net, include=_LAYERS, stats=("mean_abs", "rms")) as cap:
                for t in range(steps + 1):
                    cap.clear()
                    out = net(x)
                    for row in cap.table():  # every layer's statistics, read at once
                        per = sums.setdefault(row["name"], {s: [[0.0] * len(widths)
                                                               for _ in range(steps + 1)]
                                                            for s in ("mean_abs", "rms")})
                        for stat in per:
                            per[stat][t][wi] += row[stat] / seeds
                    if t < steps:
                        loss = (F.mse_loss(out, y) if model == "mlp" else
                                F.cross_entropy(out.flatten(0, 1), y.flatten()))
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
    return CoordCheck(model, parametrization, list(widths), steps, seeds, lr, band, sums)
