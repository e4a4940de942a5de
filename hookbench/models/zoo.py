"""The models hookbench trains, each with deterministic data and its loss.

``TinySpec`` describes a random small MLP or convnet (depth, width, activation, tied and frozen
layers, dtype); hypothesis draws them in the property tests and ``hookbench report`` uses fixed
ones. ``workload(name)`` builds a real model (torchvision's resnet18, vit_b_16 and vit_l_16, rebuilt
from torch.nn by ``hookbench.models.vision`` so that they need no torchvision, and a small GPT-style
transformer) for memory measurement and benchmarks. Both are ``hookbench.Workload``s
(``TinySpec.workload()``, ``workload(name, batch_size)``), the same description a user's own
model gets, so two strategies trained on the same one see the same batches and differ only in
how the optimizer is stepped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hookbench.core import names
from hookbench.core.workload import Workload
from hookbench.models import vision

__all__ = ["ACTIVATIONS", "BENCHMARK_MLP", "ZOO", "TinySpec", "TinyTransformer", "workload"]

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


@dataclass(frozen=True)
class TinySpec:
    """A small model and its data.

    kind: "mlp" (regression, MSE) or "convnet" (classification, cross-entropy).
    tied: the first and last hidden layers share one weight (needs depth >= 3: two hidden
        layers), so a parameter is used twice per forward and belongs to two modules.
    frozen: the first layer does not require grad.
    """

    kind: str = "mlp"
    depth: int = 2
    width: int = 8
    activation: str = "relu"
    tied: bool = False
    frozen: bool = False
    dtype: torch.dtype = torch.float32
    batch_size: int = 4
    in_features: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("mlp", "convnet"):
            raise ValueError(f"kind must be 'mlp' or 'convnet', got {self.kind!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}")
        if self.depth < 1 or (self.tied and self.depth < 3):
            raise ValueError("depth must be >= 1, and >= 3 for tied hidden layers")

    def workload(self) -> Workload:
        """This spec as a Workload (fp32, eager; the optimizer is chosen per test)."""
        return Workload(name=f"tiny-{self.kind}", model=functools.partial(_tiny_model, self),
                        batch=functools.partial(_tiny_batch, self), loss=self.loss,
                        seed=self.seed)

    def build(self) -> nn.Module:
        return self.workload().build()

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The index-th (input, target) batch, the same on every call."""
        return self.workload().data(index)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            # In float32 at least (float64 stays): a bf16 model's output against an fp32 target
            # (mixed-precision ZeRO-2), or a pure-bf16 model's against a bf16 one, which
            # torch < 2.5's mse_loss refuses ("mse_cpu" not implemented for 'BFloat16'); a
            # no-op for fp32 and fp64.
            dtype = torch.promote_types(torch.promote_types(output.dtype, target.dtype),
                                        torch.float32)
            return F.mse_loss(output.to(dtype), target.to(dtype))
        return F.cross_entropy(output, target)


def _tiny_model(spec: TinySpec) -> nn.Module:
    model = _mlp(spec) if spec.kind == "mlp" else _convnet(spec)
    if spec.frozen:
        model[0].requires_grad_(False)
    return model.to(spec.dtype)


def _tiny_batch(spec: TinySpec, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.kind == "mlp":
        x = torch.randn(spec.batch_size, spec.in_features, generator=g, dtype=spec.dtype)
        y = torch.randn(spec.batch_size, 3, generator=g, dtype=spec.dtype)
    else:
        x = torch.randn(spec.batch_size, 3, 8, 8, generator=g, dtype=spec.dtype)
        y = torch.randint(0, 5, (spec.batch_size,), generator=g)
    return x, y


# The step benchmarks' workload, also timed by the upgrade gate: a 12-layer MLP of width 256
# (~0.8M parameters), batch 32; one Adam step takes about 10 ms on 2 CPU cores.
BENCHMARK_MLP = TinySpec(depth=12, width=256, in_features=256, batch_size=32)


def _hidden(spec: TinySpec, make) -> list[nn.Module]:
    layers = [make() for _ in range(spec.depth - 1)]
    if spec.tied:
        # Tie the first and last hidden layers, not adjacent ones, so that the shared weight is
        # used at two distant points of the graph and its gradient has two contributions.
        layers[-1].weight = layers[0].weight
    act = ACTIVATIONS[spec.activation]
    return [m for layer in layers for m in (layer, act())]


def _mlp(spec: TinySpec) -> nn.Sequential:
    w = spec.width
    return nn.Sequential(
        nn.Linear(spec.in_features, w),
        ACTIVATIONS[spec.activation](),
        *_hidden(spec, lambda: nn.Linear(w, w)),
        nn.Linear(w, 3),
    )


def _convnet(spec: TinySpec) -> nn.Sequential:
    w = spec.width
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        ACTIVATIONS[spec.activation](),
        *_hidden(spec, lambda: nn.Conv2d(w, w, 3, padding=1)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(w, 5),
    )


class TinyTransformer(nn.Module):
    """A small decoder-style language model: embedding, pre-norm causal layers without biases,
    and a head tied to the embedding."""

    def __init__(self, vocab: int = 1000, dim: int = 256, layers: int = 4, heads: int = 4,
                 seq_len: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        # No biases, as in current LLMs; also, the key projection's bias has an exactly zero
        # gradient (softmax ignores a shift shared by all keys), which Adam would turn from
        # rounding noise into full-size steps, so no two summation orders could agree.
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True, bias=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device)
        h = self.embed(tokens) + self.pos[:n]
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


# name -> (builder, input kind); images are 3x224x224 with 1000 classes. The image models are
# torchvision's, rebuilt without it (hookbench/models/vision.py; tests/models/test_vision.py proves them
# equal).
ZOO = {
    "resnet18": (vision.resnet18, "image"),
    "vit_b_16": (vision.vit_b_16, "image"),
    "vit_l_16": (vision.vit_l_16, "image"),
    "transformer": (TinyTransformer, "tokens"),
}
assert tuple(sorted(ZOO)) == names.ZOO, "hookbench.core.names.ZOO lists the zoo's models"


def workload(name: str, batch_size: int = 1, seed: int = 0) -> Workload:
    """The zoo's model ``name`` at ``batch_size`` as a Workload: Adam, fp32, eager."""
    if name not in ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has {sorted(ZOO)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return Workload(name=name, model=ZOO[name][0],
                    batch=functools.partial(_zoo_batch, ZOO[name][1], batch_size),
                    loss=_cross_entropy, seed=seed)


def _zoo_batch(kind: str, batch_size: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "image":
        x = torch.randn(batch_size, 3, 224, 224, generator=g)
        return x, torch.randint(0, 1000, (batch_size,), generator=g)
    tokens = torch.randint(0, 1000, (batch_size, 129), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2), target.flatten())
