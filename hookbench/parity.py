"""Numerical parity: does a training strategy follow the standard ``optimizer.step()``?

``trajectory`` trains a workload (``hookbench.Workload``, or a ``TinySpec``) for a few steps
with one strategy and snapshots the parameters and optimizer state after every step;
``compare`` says whether two trajectories are bit-exact or how far apart they are against a
stated tolerance. The property tests, the report and the fault-injection tests all use these
two functions, so a check that passes in one place passes for the same reason in the others.

Strategies:
    forloop, foreach, fused      a standard optimizer with that implementation
    in_backward                  OptimizerInBackward, one optimizer per parameter, for-loop
    in_backward_grouped          OptimizerInBackward(grouped=True), for-loop
    in_backward_grouped_foreach  the grouped mode with the foreach kernels inside each module
    in_backward_bucketed         OptimizerInBackward(bucket_cap_mb=25), foreach in each bucket
                                 (or the kwargs' foreach=False / fused=True)
    peer                         torch.distributed.optim._apply_optimizer_in_backward (k=1 only)
    zero2                        hookbench.zero2.Zero2 (needs an initialized process group)
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch

from hookbench.optimizer_in_backward import OptimizerInBackward
from hookbench.zero2 import Zero2
from hookbench.workload import Workload, of, to_device
from hookbench.zoo import TinySpec

__all__ = [
    "FAMILIES",
    "STRATEGIES",
    "Comparison",
    "Tolerance",
    "compare",
    "live_gradients",
    "parameters_only",
    "start",
    "tolerance",
    "training",
    "trajectory",
]

# The optimizer families hookbench verifies, with settings that exercise their less common
# branches (nesterov, amsgrad, centered, lr decay, weight decay).
FAMILIES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "adagrad": (torch.optim.Adagrad, dict(lr=5e-2, lr_decay=1e-3)),
}

STRATEGIES = (
    "forloop",
    "foreach",
    "fused",
    "in_backward",
    "in_backward_grouped",
    "in_backward_grouped_foreach",
    "in_backward_bucketed",
    "peer",
    "zero2",
)


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# Tolerances for paths whose arithmetic is not identical to the for-loop's. Identical arithmetic
# (every in-backward mode with foreach=False, and the peer) is compared bit for bit instead.
# PyTorch's own tests (test/test_optim.py) compare foreach with the for-loop in float64 at
# rtol=atol=1e-7 and fused in low precision at 5e-3. Here a few steps of a tiny model: fp32 eps
# is 1.2e-7, fused Adam was seen 2e-7 off per step (../shared/NOTES.md), and the gap can grow a
# little over steps through the model's own sensitivity, hence about 100 ulps in fp32. float64
# keeps the PyTorch test's 1e-7, which is still ~1e9 ulps of float64 headroom.
_TOLERANCES = {
    ("foreach", torch.float32): Tolerance(rtol=1e-5, atol=1e-6),
    ("foreach", torch.float64): Tolerance(rtol=1e-7, atol=1e-7),
    ("fused", torch.float32): Tolerance(rtol=1e-5, atol=1e-6),
    ("fused", torch.float64): Tolerance(rtol=1e-7, atol=1e-7),
}


def tolerance(strategy: str, dtype: torch.dtype) -> Tolerance | None:
    """The tolerance against the for-loop for ``strategy`` in ``dtype``; None means bit-exact."""
    if strategy in ("in_backward_grouped_foreach", "in_backward_bucketed"):
        strategy = "foreach"
    return _TOLERANCES.get((strategy, dtype))


# in_backward_bucketed's buckets: DDP's default bucket_cap_mb
BUCKET_CAP_MB = 25

Snapshot = dict[str, torch.Tensor]  # "name" and "name/state_key" -> value after a step


@contextlib.contextmanager
def training(
    spec: Workload | TinySpec,
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    strategy: str,
    *,
    accumulation: int = 1,
    device: str | torch.device = "cpu",
) -> Iterator[Training]:
    """A model of ``spec`` (a Workload or a TinySpec) on ``device`` set up to train with
    ``strategy``, in the workload's precision (fp16: with a GradScaler); hooks are removed on
    exit."""
    workload = of(spec)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    if strategy == "peer" and workload.precision == "fp16":
        raise ValueError("the peer _apply_optimizer_in_backward has no loss scaling: it would "
                         "step on fp16 gradients still scaled by the GradScaler")
    if strategy == "peer" and accumulation != 1:
        raise ValueError("the peer _apply_optimizer_in_backward has no gradient accumulation")
    model = workload.build().to(device)
    scaler = workload.grad_scaler(device)
    started = start(strategy, model, optimizer_class, kwargs, accumulation, scaler)
    try:
        yield Training(workload, model, accumulation, started.step, started.state_of, device,
                       started.scale or (scaler and scaler.scale))
    finally:
        started.close()


@dataclass
class Training:
    workload: Workload
    model: torch.nn.Module
    accumulation: int
    _step: Callable[[], None]
    state_of: Callable[[torch.Tensor], dict]
    device: str | torch.device = "cpu"
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None  # the loss's, before backward

    def step(self, index: int) -> None:
        """One optimizer step: ``accumulation`` forward/backward passes on batches of ``index``."""
        k = self.accumulation
        self.step_on([self.workload.data(index * k + micro) for micro in range(k)])

    def step_on(self, batches: list[tuple[Any, torch.Tensor]]) -> None:
        """One optimizer step on these micro-batches, each loss divided by their number (what
        data-parallel ranks compute together when each holds one of them)."""
        for x, y in batches:
            loss = self.workload.compute_loss(self.model, to_device(x, self.device),
                                              y.to(self.device)) / len(batches)
            (loss if self.scale is None else self.scale(loss)).backward()
        self._step()

    def snapshot(self) -> Snapshot:
        snap = {}
        for name, p in self.model.named_parameters():
            snap[name] = p.detach().clone()
            if not p.requires_grad:
                continue  # never stepped; the peer keeps no state for it, Adagrad does
            for key, value in self.state_of(p).items():
                snap[f"{name}/{key}"] = torch.as_tensor(value).detach().clone()
        return snap


def parameters_only(snapshots: list[Snapshot]) -> list[Snapshot]:
    """The parameters of each snapshot, without the optimizer state."""
    return [{k: v for k, v in snap.items() if "/" not in k} for snap in snapshots]


def trajectory(
    spec: Workload | TinySpec,
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    strategy: str,
    *,
    steps: int = 3,
    accumulation: int = 1,
) -> list[Snapshot]:
    """Train ``spec`` for ``steps`` optimizer steps of ``accumulation`` micro-batches each and
    snapshot parameters and optimizer state after every step."""
    with training(spec, optimizer_class, kwargs, strategy, accumulation=accumulation) as run:
        snapshots = []
        for i in range(steps):
            run.step(i)
            snapshots.append(run.snapshot())
        return snapshots


class Started(NamedTuple):
    step: Callable[[], None]  # after the micro-batches of one optimizer step
    state_of: Callable[[torch.Tensor], dict]  # the optimizer state of a tensor in `optimized`
    close: Callable[[], None]  # remove hooks
    optimized: list[torch.Tensor]  # the tensors the optimizer steps (ZeRO-2: shard pieces)
    # gradients the strategy holds outside any .grad (ZeRO-2: the shard's gradient buffers)
    held: Callable[[], list[torch.Tensor]] = lambda: []
    # its own loss scaling (ZeRO-2 in fp16), in place of the workload's GradScaler
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None


def start(strategy: str, model: torch.nn.Module, cls: type, kwargs: dict,
          accumulation: int, scaler: torch.amp.GradScaler | None = None) -> Started:
    """Set ``model`` up to train with ``strategy``; with ``scaler`` (fp16) the step goes
    through ``scaler.step`` and ``scaler.update``, as in torch's AMP recipe."""
    nothing = lambda: None  # noqa: E731

    def stepped(opt: Any) -> None:
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()  # set_to_none, torch's default and Zero2's only behaviour

    params = [p for p in model.parameters()]
    if strategy in ("forloop", "foreach", "fused"):
        impl = {"forloop": {"foreach": False}, "foreach": {"foreach": True},
                "fused": {"fused": True}}[strategy]
        opt = cls(model.parameters(), **{**kwargs, **impl})
        return Started(lambda: stepped(opt), lambda p: opt.state.get(p, {}), nothing, params)
    if strategy.startswith("in_backward"):
        bucketed = strategy == "in_backward_bucketed"
        cap = kwargs.get("bucket_cap_mb", BUCKET_CAP_MB) if bucketed else None  # kwargs may
        options = {k: v for k, v in kwargs.items() if k != "bucket_cap_mb"}  # carry the cap
        implementation = ({} if bucketed and {"foreach", "fused"} & set(options)
                          else {"foreach": bucketed or strategy.endswith("foreach")})
        opt = OptimizerInBackward(
            model, cls, accumulation_steps=accumulation,
            grouped=strategy.startswith("in_backward_grouped"), bucket_cap_mb=cap,
            **{**options, **implementation},
        )
        return Started(nothing, lambda p: opt.state.get(p, {}), opt.remove, params)
    if strategy == "zero2":  # kwargs may carry bucket_numel
        zero = Zero2(model, cls, **{"foreach": False, **kwargs})
        own = zero.loss_scale is not None  # fp16: its own loss scaling, not a GradScaler's
        return Started((lambda: (zero.step(), zero.zero_grad())) if own else
                       (lambda: stepped(zero)), lambda p: zero.optimizer.state.get(p, {}),
                       zero.remove,
                       [piece for f in zero.flats for _, piece, _, _ in f.owned],
                       lambda: [f.grad for f in zero.flats if f.grad is not None],
                       zero.scale if own else None)
    # The peer keeps its optimizers and hook handles in module-level maps and attributes.
    from torch.distributed.optim import apply_optimizer_in_backward as peer

    trainable = [p for p in params if p.requires_grad]
    peer._apply_optimizer_in_backward(cls, trainable, {**kwargs, "foreach": False})

    def close() -> None:
        for p in trainable:
            for handle in peer.param_to_optim_hook_handle_map.pop(p, []):
                handle.remove()
            peer.param_to_acc_grad_map.pop(p, None)

    def state_of(p: torch.Tensor) -> dict:
        inner = getattr(p, "_in_backward_optimizers", None)  # frozen parameters have none
        return inner[0].state.get(p, {}) if inner else {}

    return Started(nothing, state_of, close, params)


@dataclass(frozen=True)
class Comparison:
    """How two trajectories differ. ``ratio`` <= 1 means within tolerance."""

    bit_exact: bool
    max_abs: float
    ratio: float  # the largest |a - b| / (atol + rtol * |b|); inf for a mismatch when exact
    where: str  # "step N, name" of the largest ratio, or of the first mismatch
    tolerance: Tolerance | None

    @property
    def ok(self) -> bool:
        return self.bit_exact if self.tolerance is None else self.ratio <= 1.0

    def verdict(self) -> str:
        if self.bit_exact:
            return "bit-exact"
        if self.tolerance is None:
            return f"MISMATCH (bit-exact expected) max |diff| {self.max_abs:.3g} at {self.where}"
        t = self.tolerance
        head = "ok" if self.ok else "FAIL"
        return (f"{head}: max |diff| {self.max_abs:.3g}, {self.ratio:.3g}x of tolerance "
                f"(rtol {t.rtol:g}, atol {t.atol:g}) at {self.where}")


def compare(
    actual: list[Snapshot], expected: list[Snapshot], tol: Tolerance | None = None
) -> Comparison:
    """Compare two trajectories entry by entry, every step. ``tol=None``: bit-exact."""
    if len(actual) != len(expected):
        raise ValueError(f"trajectories have {len(actual)} and {len(expected)} steps")
    exact, max_abs, ratio, where = True, 0.0, 0.0, ""
    for step, (a, b) in enumerate(zip(actual, expected)):
        if a.keys() != b.keys():
            missing = sorted(set(a.keys()) ^ set(b.keys()))
            return Comparison(False, float("inf"), float("inf"),
                              f"step {step}, entries only on one side: {missing}", tol)
        for key in a:
            x, y = a[key], b[key]
            if x.shape != y.shape:
                return Comparison(False, float("inf"), float("inf"),
                                  f"step {step}, {key}: shape {tuple(x.shape)} vs "
                                  f"{tuple(y.shape)}", tol)
            if torch.equal(x, y):
                continue
            exact = False
            diff = (x.double() - y.double()).abs().nan_to_num(nan=float("inf"))
            r = float("inf")
            if tol is not None:
                r = float((diff / (tol.atol + tol.rtol * y.double().abs())).max())
            if r > ratio or not where:
                ratio, where = r, f"step {step}, {key}"
            max_abs = max(max_abs, float(diff.max()))
    return Comparison(exact, max_abs, ratio, where, tol)


def live_gradients(
    spec: Workload | TinySpec,
    optimizer_class: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    strategy: str,
) -> tuple[int, int]:
    """(most gradients alive at once during one training step's backward, alive after it).

    Counted by a tensor hook on every trainable parameter, which runs just before that
    parameter's gradient is accumulated. A gradient counts as alive while ``p.grad`` is set or
    while the storage that arrived for it still exists (so a reference kept elsewhere counts).
    The optimizer in backward frees each gradient as soon as it is stepped, so it should never
    hold more than one parameter's (per-parameter), one module's (grouped) or one bucket's
    (bucketed) at a time, besides the one arriving.
    """
    counts: list[int] = []
    with training(spec, optimizer_class, kwargs, strategy) as run:
        params = [p for p in run.model.parameters() if p.requires_grad]
        arrived: dict[int, weakref.ref] = {}

        def alive() -> int:
            return sum(p.grad is not None or (i in arrived and arrived[i]() is not None)
                       for i, p in enumerate(params))

        def count(i: int, grad: torch.Tensor) -> None:
            arrived[i] = weakref.ref(grad.untyped_storage())
            counts.append(alive())

        handles = [p.register_hook(functools.partial(count, i)) for i, p in enumerate(params)]
        try:
            run.step(0)
        finally:
            for h in handles:
                h.remove()
        return max(counts), alive()
