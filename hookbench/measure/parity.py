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
    zero2                        hookbench.mechanisms.zero2.Zero2 (needs an initialized process group)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from hookbench.core.workload import Workload, of, to_device
from hookbench.measure.bounds import Tolerance, tolerance
from hookbench.mechanisms.optimizer_in_backward import OptimizerInBackward
from hookbench.mechanisms.zero2 import Zero2
from hookbench.models.zoo import TinySpec

__all__ = [
    "AGAINST_FORLOOP",
    "DEVICE_FLAGS",
    "FAMILIES",
    "IMPLEMENTATION_FLAGS",
    "IMPLEMENTATION_CASES",
    "OPTION_VARIANTS",
    "STRATEGIES",
    "Comparison",
    "NoiseBounds",
    "Tolerance",
    "accepts",
    "against_forloop",
    "compare",
    "implementation_ran",
    "largest_step_per_lr",
    "live_gradients",
    "missing_implementation",
    "parameters_only",
    "refused_here",
    "rounding_level",
    "start",
    "stepwise",
    "tolerance",
    "training",
    "trajectory",
    "wide",
    "without_implementation",
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
    "capturable",  # the user's options as given, capturable=True among them
    "in_backward",
    "in_backward_grouped",
    "in_backward_grouped_foreach",
    "in_backward_bucketed",
    "peer",
    "zero2",
)


# The options that choose how a torch optimizer's step is computed, not what it computes.
IMPLEMENTATION_FLAGS = ("foreach", "fused")
# Options torch takes only on some devices. capturable=True keeps the step count on the
# parameter's device, so that the step reads nothing back to the host and a CUDA graph can
# capture it; on the CPU torch refuses it at the first step (an AssertionError naming the
# devices it supports). Its own "capturable" row runs it as given (``refused_here`` where torch
# refuses it); every other row runs without it.
DEVICE_FLAGS = ("capturable",)


def without_implementation(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The optimizer options less an implementation flag (``IMPLEMENTATION_FLAGS``) and an
    option torch takes only on some devices (``DEVICE_FLAGS``)."""
    return {k: v for k, v in kwargs.items() if k not in IMPLEMENTATION_FLAGS + DEVICE_FLAGS}


def refused_here(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                 device: str | torch.device = "cpu") -> str | None:
    """torch's words where it refuses ``kwargs``' device-bound options (``DEVICE_FLAGS``) on
    ``device``, measured: one step of ``cls`` with ``kwargs`` as given on a one-element
    parameter there. None where it takes them; what it raises about anything else propagates."""
    p = torch.nn.Parameter(torch.zeros(1, device=device))
    p.grad = torch.ones(1, device=device)
    try:
        cls([p], **kwargs).step()
    except (AssertionError, RuntimeError, ValueError) as e:
        if any(flag in str(e) for flag in DEVICE_FLAGS if kwargs.get(flag)):
            return f"{type(e).__name__}: {e}"
        raise
    return None


def _captured(names: set[str]) -> None:
    """Raise unless a capturable step, which dispatched the aten operators ``names``, read
    nothing back to the host: capturable's promise, and what a torch that ignored it breaks
    (the step count read with ``.item()`` for the bias corrections)."""
    if "_local_scalar_dense" in names:
        raise RuntimeError("the capturable step read a value back to the host "
                           "(aten._local_scalar_dense): torch did not run the capturable step "
                           "it was asked for")


# What each implementation's step dispatches: torch's kernels for it are named so
# (aten._fused_adam_, aten._foreach_mul_, ...); the for-loop dispatches neither.
_KERNEL_PREFIX = {"fused": "_fused_", "foreach": "_foreach_"}


class _Kernels(TorchDispatchMode):
    """Records the name of every aten operator dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def implementation_ran(implementation: str | None) -> Iterator[None]:
    """Raise ``RuntimeError`` after the block unless the optimizer step in it ran
    ``implementation`` ("forloop", "foreach", "fused"; None: check nothing): a flag torch
    quietly ignored would otherwise pass, the for-loop being its own reference."""
    if implementation is None:
        yield
        return
    with _Kernels() as kernels:
        yield
    _ran(implementation, kernels.names)


def _ran(implementation: str, names: set[str]) -> None:
    """Raise unless the aten operators ``names`` are ``implementation``'s step's."""
    kinds = {kind for kind, prefix in _KERNEL_PREFIX.items()
             if any(name.startswith(prefix) for name in names)}
    # A fused step also counts its steps with a foreach kernel (torch._foreach_add_): fused
    # where a fused kernel ran, foreach where only foreach ones did.
    if implementation != ("fused" if "fused" in kinds else "foreach" if kinds else "forloop"):
        found = ", ".join(sorted(n for n in names
                                 if n.startswith(tuple(_KERNEL_PREFIX.values()))))
        raise RuntimeError(f"the {implementation} step ran "
                           f"{found or 'no fused or foreach kernel'}: torch did not run the "
                           f"implementation it was asked for")


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
    started = start(strategy, model, optimizer_class, kwargs, accumulation, scaler,
                    params=workload.optimizer_params(model), clip=workload.clip_grad_norm)
    try:
        if workload.lr_scheduler is not None and started.scheduled is None:
            raise ValueError(f"the {strategy} strategy has no optimizer an LR scheduler can "
                             f"drive")
        scheduler = workload.scheduler(started.scheduled)
        step = started.step if scheduler is None else lambda: (started.step(), scheduler.step())
        yield Training(workload, model, accumulation, step, started.state_of, device,
                       started.scale or (scaler and scaler.scale), started.scheduled)
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
    optimizer: Any = None  # whose param groups hold the lr of the next step

    def step(self, index: int) -> None:
        """One optimizer step: ``accumulation`` forward/backward passes on batches of ``index``."""
        k = self.accumulation
        micro = range(index * k, (index + 1) * k)
        self.step_on([self.workload.data(i) for i in micro], [(i, 0) for i in micro])

    def step_on(self, batches: list[tuple[Any, torch.Tensor]],
                keys: list[tuple[int, int]]) -> None:
        """One optimizer step on these micro-batches, each loss divided by their number (what
        data-parallel ranks compute together when each holds one of them); ``keys``: each
        one's (batch index, share), which seeds the random numbers its forward draws
        (``Workload.forward_rng``)."""
        for (x, y), key in zip(batches, keys, strict=True):
            loss = self.workload.compute_loss(self.model, to_device(x, self.device),
                                              to_device(y, self.device), key) / len(batches)
            (loss if self.scale is None else self.scale(loss)).backward()
        self._step()

    def optimizer_step(self) -> None:
        """The optimizer step alone, after a backward made outside ``step_on`` (a trace)."""
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
    # what an LR scheduler drives (None: the strategy has nothing it could drive)
    scheduled: Any = None


def start(strategy: str, model: torch.nn.Module, cls: type, kwargs: dict,
          accumulation: int, scaler: torch.amp.GradScaler | None = None, *,
          params: list[Any] | None = None, clip: float | None = None) -> Started:
    """Set ``model`` up to train with ``strategy`` on ``params`` (param groups; default every
    parameter); with ``scaler`` (fp16) the step goes through ``scaler.step`` and
    ``scaler.update``, as in torch's AMP recipe; with ``clip`` the global gradient norm is
    clipped to it before each step, where the strategy can (the optimizer in backward
    refuses, in its own words, before training starts). ``kwargs`` are the user's options as
    given, less an implementation flag (``IMPLEMENTATION_FLAGS``): each strategy sets its own,
    so that ``fused=True`` is run as given by the "fused" strategy and every other one runs
    beside it instead of raising on two flags; the bucketed mode alone takes the user's."""
    nothing = lambda: None  # noqa: E731
    first = [True]

    def stepped(opt: Any, clip_norm: Callable[[], Any] | None = None,
                implementation: str | None = None, capturable: bool = False) -> None:
        if clip is not None:
            if scaler is not None:
                scaler.unscale_(opt)  # clip the true gradients, as torch's AMP recipe does
            clip_norm()
        # The first step that runs only: the implementation is chosen per step() call, and a
        # dispatch mode on every step would be timed with it (``step_time`` times later
        # steps). Not a step the GradScaler skipped (an inf in the scaled gradients: no
        # optimizer step, no kernel), and not sparse gradients, which torch steps with the
        # for-loop whatever the flag (Adagrad's and SGD's foreach paths hand them on).
        kernels = (_Kernels() if first[0] and (implementation or capturable) and not any(
            p.grad is not None and p.grad.is_sparse for p in every) else None)
        scale = None if scaler is None else scaler.get_scale()
        with kernels or contextlib.nullcontext():
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
        if scaler is not None:
            scaler.update()
        if kernels is not None and (scaler is None or scaler.get_scale() >= scale):
            first[0] = False
            if implementation:
                _ran(implementation, kernels.names)
            if capturable and scaler is None:  # a GradScaler reads its inf check back itself
                _captured(kernels.names)
        opt.zero_grad()  # set_to_none, torch's default and Zero2's only behaviour

    every = [p for p in model.parameters()]
    # A class without a foreach option (transformers' Adafactor, ...) has one implementation,
    # its for-loop: it is given no flag. foreach and fused there raise its own TypeError.
    loop = {"foreach": False} if accepts(cls, "foreach") else {}
    options = without_implementation(kwargs)
    if strategy in ("forloop", "foreach", "fused", "capturable"):
        # capturable: the user's flags as given, the implementation torch then runs checked
        # where they name one
        given = {k: v for k, v in kwargs.items() if k in IMPLEMENTATION_FLAGS + DEVICE_FLAGS}
        impl = {"forloop": loop, "foreach": {"foreach": True}, "fused": {"fused": True},
                "capturable": {**given, "capturable": True}}[strategy]
        ran = ("fused" if impl.get("fused") else "foreach" if impl.get("foreach")
               else "forloop" if "foreach" in impl else None)
        opt = cls(every if params is None else params, **{**options, **impl})
        clip_norm = lambda: torch.nn.utils.clip_grad_norm_(  # noqa: E731
            every, clip, foreach=ran in ("foreach", "fused"))
        return Started(lambda: stepped(opt, clip_norm, ran, strategy == "capturable"),
                       lambda p: opt.state.get(p, {}), nothing, every, scheduled=opt)
    if strategy.startswith("in_backward"):
        bucketed = strategy == "in_backward_bucketed"
        cap = kwargs.get("bucket_cap_mb", BUCKET_CAP_MB) if bucketed else None  # kwargs may
        options.pop("bucket_cap_mb", None)  # carry the cap
        if bucketed:  # the user's implementation flag, if any, steps each bucket
            options = {k: v for k, v in kwargs.items()
                       if k != "bucket_cap_mb" and k not in DEVICE_FLAGS}
        implementation = ({} if bucketed and set(IMPLEMENTATION_FLAGS) & set(options)
                          else {"foreach": True} if strategy.endswith("foreach")
                          or (bucketed and loop) else loop)
        opt = OptimizerInBackward(
            model, cls, params, accumulation_steps=accumulation,
            grouped=strategy.startswith("in_backward_grouped"), bucket_cap_mb=cap,
            **{**options, **implementation},
        )
        if clip is not None:
            try:
                opt.clip_grad_norm_(clip)  # it refuses, saying why, before any step
            finally:  # refused, or (a regression) accepted: either way nothing to train
                opt.remove()
            raise AssertionError("OptimizerInBackward accepted global gradient clipping")
        return Started(nothing, lambda p: opt.state.get(p, {}), opt.remove, every,
                       scheduled=opt)
    if strategy == "zero2":  # kwargs may carry bucket_numel
        zero = Zero2(model, cls, params, **{**loop, **options})
        own = zero.loss_scale is not None  # fp16: its own loss scaling, not a GradScaler's

        def own_step() -> None:
            if clip is not None:
                zero.clip_grad_norm_(clip)  # the unscaled gradient's norm (its own scaling)
            zero.step()
            zero.zero_grad()

        return Started(own_step if own else lambda: stepped(zero, lambda: zero.clip_grad_norm_(
                           clip)), lambda p: zero.optimizer.state.get(p, {}), zero.remove,
                       [piece for f in zero.flats for _, piece, _, _ in f.owned],
                       lambda: [f.grad for f in zero.flats if f.grad is not None],
                       zero.scale if own else None, scheduled=zero.optimizer)
    if clip is not None or params is not None:
        raise ValueError("the peer _apply_optimizer_in_backward takes neither param groups "
                         "nor gradient clipping")
    # The peer keeps its optimizers and hook handles in module-level maps and attributes.
    from torch.distributed.optim import apply_optimizer_in_backward as peer

    trainable = [p for p in every if p.requires_grad]
    peer._apply_optimizer_in_backward(cls, trainable, {**options, "foreach": False})

    def close() -> None:
        for p in trainable:
            for handle in peer.param_to_optim_hook_handle_map.pop(p, []):
                handle.remove()
            peer.param_to_acc_grad_map.pop(p, None)

    def state_of(p: torch.Tensor) -> dict:
        inner = getattr(p, "_in_backward_optimizers", None)  # frozen parameters have none
        return inner[0].state.get(p, {}) if inner else {}

    return Started(nothing, state_of, close, every)


@dataclass(frozen=True)
class Comparison:
    """How two trajectories differ. ``ratio`` <= 1 means within tolerance."""

    bit_exact: bool
    max_abs: float
    ratio: float  # the largest |a - b| / (atol + rtol * |b|); inf for a mismatch when exact
    where: str  # "step N, name" of the largest ratio, or of the first mismatch
    tolerance: Tolerance | None
    # elements whose gradient was at rounding level, each within its own bound (``compare``)
    rounding_level: int = 0
    bound: str = ""  # the bound in words where it is not ``tolerance``'s (``stepwise``)

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
        if self.bound:
            return (f"{head}: max |diff| {self.max_abs:.3g}, {self.ratio:.3g}x of the bound "
                    f"({self.bound}) at {self.where}")
        noise = (f"; {self.rounding_level} elements with a gradient at rounding level each "
                 f"within 2 x the optimizer's largest step per lr x the lr summed over steps"
                 if self.rounding_level else "")
        return (f"{head}: max |diff| {self.max_abs:.3g}, {self.ratio:.3g}x of tolerance "
                f"(rtol {t.rtol:g}, atol {t.atol:g}) at {self.where}{noise}")


def compare(
    actual: list[Snapshot], expected: list[Snapshot], tol: Tolerance | None = None,
    noise: list[Snapshot] | None = None,
) -> Comparison:
    """Compare two trajectories entry by entry, every step. ``tol=None``: bit-exact.
    ``noise``: per step, for some entries, a bound per element (``NoiseBounds``): where it is
    nonzero the element's gradient was at rounding level and ``|a - b|`` may reach it (plus
    the tolerance); every other element is held to the tolerance alone."""
    if len(actual) != len(expected):
        raise ValueError(f"trajectories have {len(actual)} and {len(expected)} steps")
    if noise is not None and tol is None:
        raise ValueError("rounding-level bounds need a tolerance: bit-exact allows no bound")
    exact, max_abs, ratio, where = True, 0.0, 0.0, ""
    counted = 0
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
            diff = (wide(x) - wide(y)).abs().nan_to_num(nan=float("inf"))
            r = float("inf")
            if tol is not None:
                allowed = tol.atol + tol.rtol * wide(y).abs()
                bound = None if noise is None else noise[step].get(key)
                if bound is not None:
                    allowed = allowed + bound
                    if step == len(actual) - 1:
                        counted += int((bound > 0).sum())
                r = float((diff / allowed).max())
            if r > ratio or not where:
                ratio, where = r, f"step {step}, {key}"
            max_abs = max(max_abs, float(diff.max()))
    return Comparison(exact, max_abs, ratio, where, tol, counted)


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


# -- gradients at rounding level ----------------------------------------------------------------

# An element is at rounding level when its float32 gradient is off its float64 value by more
# than 1/16 of that value: its sign and size come from the order of the float32 additions, not
# from the model (the key third of an attention qkv bias: zero in exact arithmetic, as softmax
# ignores a per-query constant, and about 1e-10 in float32). A real gradient is off by about
# 1e-7 of itself (float32's eps over a few thousand additions), so it is 5 orders of magnitude
# from the cut; 1/16 leaves room for another summation order being 16x worse than ours.
ROUNDING_LEVEL = 1 / 16


def largest_step_per_lr(group: dict[str, Any]) -> float | None:
    """The largest |change| of one element per unit lr that the optimizer of this param group
    takes from a gradient of any size, for the sign-sensitive families (their update divides
    by a running magnitude of the gradient, so a gradient of 1e-10 still moves an element by
    about lr); None for the others, whose step scales with the gradient (SGD), so that a
    rounding-level gradient moves an element by a rounding-level amount.

    Adam, AdamW: |m_hat / sqrt(v_hat)| <= 1 at the first step and <= (1 - beta1) /
    sqrt(1 - beta2) after a lone large gradient (Kingma & Ba 2015, section 2.1), weight decay
    aside, which moves both sides alike. Adagrad: |g| / sqrt(sum of g^2) <= 1. RMSprop:
    |g| / sqrt((1 - alpha) g^2) = 1 / sqrt(1 - alpha), times 1 / (1 - momentum) for the
    momentum buffer's geometric sum."""
    if "betas" in group:  # the Adam family
        beta1, beta2 = group["betas"]
        return max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)
    if "lr_decay" in group:  # Adagrad
        return 1.0
    if "alpha" in group and "centered" in group:  # RMSprop
        return 1 / ((1 - group["alpha"]) ** 0.5 * (1 - group.get("momentum", 0.0)))
    return None


def wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64, or in complex128 where it is complex: ``double()`` would drop its
    imaginary part (a Fourier layer's weights), and a comparison would see half of it."""
    return t.to(torch.complex128 if t.is_complex() else torch.float64)


def _cast(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model``'s floating parameters and buffers to ``dtype``, its complex ones to the complex
    dtype of that precision: ``Module.to(dtype)`` makes complex ones real, dropping their
    imaginary part."""
    complex_dtype = {torch.float32: torch.complex64, torch.float64: torch.complex128}[dtype]
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() or t.is_complex():
            t.data = t.data.to(complex_dtype if t.is_complex() else dtype)


def rounding_level(workload: Workload, model: torch.nn.Module,
                   batches: list[tuple[Any, torch.Tensor]],
                   keys: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Per trainable parameter of ``model``, which elements of the gradient of these
    micro-batches (the losses averaged, as ``Training.step_on``) are at rounding level
    (``ROUNDING_LEVEL``): computed on eager copies of the model at its present values, in
    float32 as the workload runs it (under its autocast: where bf16 decides an element's
    value, ulp-apart weights that round to other bf16 values flip it too) and in float64
    without autocast, on the same random numbers. ``model`` is left as it was. {} where the
    two losses disagree by more than 1e-3 of themselves (a forward whose random numbers depend
    on the dtype): then no element is excused."""
    eager = workload.replace(compile=None)
    state = model.state_dict()
    grads, losses = [], []
    for dtype, run in ((torch.float32, eager), (torch.float64, eager.replace(precision="fp32"))):
        copy = eager.build()
        copy.load_state_dict(state)
        _cast(copy, dtype)
        total = 0.0
        for (x, y), key in zip(batches, keys, strict=True):
            x = tree_map(lambda t: t.to(dtype) if t.is_floating_point() else
                         wide(t) if t.is_complex() and dtype == torch.float64 else t, x)
            loss = run.compute_loss(copy, x, y, key) / len(batches)
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append({n: p.grad for n, p in copy.named_parameters() if p.grad is not None})
    if abs(losses[0] - losses[1]) > 1e-3 * abs(losses[1]):
        return {}
    g32, g64 = grads
    return {n: (wide(g32[n]) - g64[n]).abs() > ROUNDING_LEVEL * g64[n].abs()
            for n in g64 if n in g32}


class NoiseBounds:
    """What ``compare``'s ``noise`` takes, built step by step along a reference run: an element
    once at rounding level may differ from the reference by 2 x ``largest_step_per_lr`` x the
    lr of each step since (the two sides stepped it in opposite directions at every step)."""

    def __init__(self) -> None:
        self.steps: list[Snapshot] = []
        self._bound: Snapshot = {}

    def add(self, run: Training, level: dict[str, torch.Tensor]) -> None:
        """Before ``run``'s next step: its gradient's elements at rounding level."""
        groups = {id(p): g for g in run.optimizer.param_groups for p in g["params"]}
        for name, p in run.model.named_parameters():
            group = groups.get(id(p))
            per_lr = None if group is None else largest_step_per_lr(group)
            if name not in level or per_lr is None:
                continue
            reach = 2 * per_lr * float(group["lr"])
            previous = self._bound.get(name, torch.zeros(p.shape, dtype=torch.float64))
            self._bound[name] = previous + torch.where(level[name] | (previous > 0), reach, 0.0)
        self.steps.append(dict(self._bound))


# -- every implementation against the for-loop --------------------------------------------------

# The standard implementations compared with the standard for-loop step, the independent
# reference, as PyTorch's test_optim.py does (test_foreach_matches_forloop,
# test_fused_matches_forloop): the grouped and bucketed modes are compared with the same
# implementation, which a regression inside its kernel passes on both sides alike.
AGAINST_FORLOOP = ("foreach", "fused")

# The options the suite's property tests draw (tests/mechanisms/test_optimizer_in_backward.py, optimizers)
# that a family's FAMILIES settings leave out, each added to those settings, so that every
# branch of each implementation meets the for-loop's.
OPTION_VARIANTS: dict[str, tuple[dict[str, Any], ...]] = {
    "sgd": ({"maximize": True}, {"nesterov": False, "dampening": 0.1},
            {"momentum": 0.0, "nesterov": False}),
    "adam": ({"maximize": True},),
    "adam_amsgrad": ({"maximize": True, "weight_decay": 1e-2},),
    "adamw": ({"amsgrad": True}, {"maximize": True}),
    "rmsprop": ({"maximize": True, "weight_decay": 1e-2}, {"momentum": 0.0, "centered": False}),
    "adagrad": ({"maximize": True, "weight_decay": 1e-2}, {"initial_accumulator_value": 0.1}),
}

# "family" (its FAMILIES settings) and "family+option=value..." (with a variant added)
IMPLEMENTATION_CASES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    family + "".join(f"+{k}" if v is True else f"+{k}={v}" for k, v in options.items()):
        (cls, {**kw, **options})
    for family, (cls, kw) in FAMILIES.items() for options in ({}, *OPTION_VARIANTS[family])
}


def accepts(cls: type[torch.optim.Optimizer], option: str) -> bool:
    """Whether ``cls``'s constructor names ``option`` ("foreach", "fused")."""
    return option in inspect.signature(cls).parameters


def missing_implementation(cls: type[torch.optim.Optimizer], implementation: str) -> str | None:
    """None where ``cls`` has ``implementation`` ("foreach" or "fused") in this torch; else how
    its constructor refuses the flag. A flag accepted without the implementation would step the
    for-loop and compare it with itself: that raises AssertionError."""
    if accepts(cls, implementation):
        return None
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **{implementation: True})
    except TypeError as e:
        return (f"none in torch {torch.__version__}: {cls.__name__}({implementation}=True) "
                f"raises TypeError: {e}")
    raise AssertionError(f"{cls.__name__} accepts {implementation}=True, which its signature "
                         f"does not name")


# -- low precision: one step at a time from the for-loop's state --------------------------------

STEPWISE_BOUND = ("each step from the for-loop's state, within 2 eps|new| + 16 eps|change| + "
                  "2 x the for-loop's own largest error against float64")


def stepwise(spec: Workload | TinySpec, cls: type[torch.optim.Optimizer],
             kwargs: dict[str, Any], implementation: str, *, steps: int = 3,
             accumulation: int = 1) -> Comparison:
    """The standard step with ``implementation`` ("foreach" or "fused") against the for-loop
    step in the model's own low precision, one step at a time: before each step the
    implementation's copy takes the for-loop's parameters, gradients and optimizer state, so
    the two take the same step from the same point.

    Why not whole trajectories, as in float32: a bf16 parameter keeps 8 bits, so one rounding
    of an update is as large as a small update itself, and two implementations that round
    one element differently feed the next forward different weights; their trajectories part
    for no fault of either (PyTorch's own test_fused_matches_forloop allows 5e-3 in low
    precision for that reason). From a shared state the difference is one step's rounding.

    The bound per element: both implementations round the same exact update, so they may
    differ by what the for-loop's rounding differs from that update (measured: a float64
    for-loop on the same state, the largest error over the tensor, twice: one each side), the
    rounding of the result (2 eps|new|) and of the update's intermediates (16 eps|change|:
    Adam's moments, its square root and division, each rounded), above the smallest normal
    number. A kernel that skips an update (pytorch#191763: CPU fused SGD in bf16 on torch
    2.12-2.13) misses by the whole change and fails. Raises ``ValueError`` where the for-loop
    itself makes a non-finite value: the workload does not train in this precision."""
    workload = of(spec)
    model = workload.build()
    dtype = next(model.parameters()).dtype
    eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
    params = [p for p in model.parameters()]
    names = {id(p): n for n, p in model.named_parameters()}
    groups = workload.optimizer_params(model) or [{"params": params}]
    loop = {"foreach": False} if accepts(cls, "foreach") else {}
    options = without_implementation(kwargs)
    twins = {kind: {id(p): p.detach().to(dtype if kind != "exact" else torch.float64, copy=True)
                    .requires_grad_(p.requires_grad) for p in params}
             for kind in ("implementation", "exact")}

    def optimizer(kind: str | None, flags: dict[str, Any]) -> torch.optim.Optimizer:
        own = [{**g, "params": [p if kind is None else twins[kind][id(p)] for p in g["params"]]}
               for g in groups]
        return cls(own, **{**options, **flags})

    reference = optimizer(None, loop)
    tested = optimizer("implementation", {implementation: True})
    exact = optimizer("exact", loop)
    scheduler = workload.scheduler(reference)
    ratio, where, max_abs = 0.0, "", 0.0  # the worst element's ratio and place; the largest diff
    identical = True
    for step in range(steps):
        micro = range(step * accumulation, (step + 1) * accumulation)
        for i in micro:
            x, y = workload.data(i)
            (workload.compute_loss(model, x, y, (i, 0)) / accumulation).backward()
        if workload.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, workload.clip_grad_norm, foreach=False)
        before = {id(p): wide(p.detach()) for p in params}
        before.update({(id(p), k): wide(v.detach()) for p in params
                       for k, v in reference.state.get(p, {}).items() if torch.is_tensor(v)})
        for kind, opt in (("implementation", tested), ("exact", exact)):
            _take_state(reference, opt, twins[kind])
        sparse = any(p.grad is not None and p.grad.is_sparse for p in params)
        with implementation_ran(None if sparse else implementation):
            tested.step()
        exact.step()
        reference.step()
        if scheduler is not None:
            scheduler.step()
        for p in params:
            if p.grad is None:
                continue
            name = names[id(p)]
            pairs = [(name, p, twins["implementation"][id(p)], twins["exact"][id(p)],
                      before[id(p)])]
            state, theirs, true = (reference.state[p], tested.state[twins["implementation"]
                                   [id(p)]], exact.state[twins["exact"][id(p)]])
            pairs += [(f"{name}/{k}", v, theirs[k], true[k], before.get((id(p), k), 0.0))
                      for k, v in state.items()
                      if torch.is_tensor(v) and (v.is_floating_point() or v.is_complex())
                      and v.shape == p.shape]
            for key, ours, got, truth, old in pairs:
                ours, got = wide(ours.detach()), wide(got.detach())
                if not torch.isfinite(ours).all():
                    raise ValueError(
                        f"the for-loop step in {str(dtype).removeprefix('torch.')} made a "
                        f"non-finite value at step {step}, {key}: the workload does not train "
                        f"in this precision" + (" (fp16 without loss scaling overflows or "
                        "underflows; train fp16 as precision='fp16', autocast with a "
                        "GradScaler)" if dtype == torch.float16 else ""))
                if torch.equal(ours, got):
                    continue
                identical = False
                change = (ours - old).abs()  # a state created by this step: from zero
                error = float((ours - truth.detach()).abs().max())
                allowed = (2 * eps * ours.abs() + 16 * eps * change + 2 * error + 2 * tiny)
                diff = (got - ours).abs().nan_to_num(nan=float("inf"))
                max_abs = max(max_abs, float(diff.max()))
                r = float((diff / allowed).max())
                if r > ratio or not where:
                    ratio, where = r, f"step {step}, {key}"
        model.zero_grad()
    return Comparison(identical, max_abs, ratio, where, Tolerance(rtol=2 * eps, atol=2 * tiny),
                      bound=STEPWISE_BOUND)


def _take_state(reference: torch.optim.Optimizer, opt: torch.optim.Optimizer,
                twins: dict[int, torch.Tensor]) -> None:
    """``opt``'s parameters (``twins`` of the reference's, by id), their gradients, optimizer
    state and hyperparameters (an LR scheduler's) set to the reference's."""
    flags = set(IMPLEMENTATION_FLAGS)
    for mine, theirs in zip(opt.param_groups, reference.param_groups):
        mine.update({k: v for k, v in theirs.items() if k != "params" and k not in flags})
        for p in theirs["params"]:
            twin = twins[id(p)]
            with torch.no_grad():
                twin.copy_(p)
            twin.grad = None if p.grad is None else p.grad.to(twin.dtype, copy=True)
            opt.state[twin] = {k: (v.to(twin.dtype, copy=True) if torch.is_tensor(v)
                                   and v.is_floating_point() and v.shape == p.shape
                                   else v.clone() if torch.is_tensor(v) else v)
                               for k, v in reference.state.get(p, {}).items()}


def against_forloop(spec: TinySpec, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any],
                    implementation: str, *, steps: int = 3, accumulation: int = 1) -> Comparison:
    """The standard step with ``implementation`` ("foreach" or "fused") against the standard
    for-loop step on ``spec``, within ``tolerance(implementation, spec.dtype)``."""
    run = functools.partial(trajectory, spec, cls, kwargs, steps=steps,
                            accumulation=accumulation)
    return compare(run(implementation), run("forloop"), tolerance(implementation, spec.dtype))
