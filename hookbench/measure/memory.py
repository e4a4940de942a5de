"""Peak memory of one training step, measured and attributed to what holds it.

``measure(spec, strategy)`` runs warm-up steps (Adam creates its state lazily), then one
measured step (forward, backward, optimizer) and returns a ``MemoryResult``: the peak, its
breakdown into parameters, gradients, optimizer state, activations and temporaries, a timeline
of the same, the most gradient bytes alive at once, and the theoretical floor of the step.

Backends:
    fake   the default without a GPU. The step runs under ``FakeTensorMode`` on fake CPU tensors
           (no data, so ViT-L's 6 GB step takes seconds and little real memory) while
           ``StorageTracker`` counts live tensor storage with the CUDA caching allocator's
           512-byte rounding. Deterministic to the byte: this is how CPU CI gates memory.
    eager  the same tracker on real CPU tensors; it must agree with ``fake`` exactly.
    cuda   real tensors on the GPU. The gated number is ``torch.cuda.max_memory_allocated``
           after ``reset_peak_memory_stats``, less what was live then and is not the step's
           (``ambient_bytes``: cuBLAS's workspaces, 32 MiB per handle and stream on sm90, and
           what the process held before); also ``max_memory_reserved``, the process's
           device memory from NVML, a memory snapshot for https://pytorch.org/memory_viz and
           the tracker's attribution. Refuses to run without CUDA: it never reports 0.

Categories: parameters (with buffers), gradients, optimizer state, activations, temporaries.
They are assigned when a storage is allocated (forward: activations; backward and
optimizer: temporaries) and corrected at each phase boundary and at every new peak by looking
at what the model and optimizer hold: parameters, ``p.grad``, optimizer state.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import logging
import math
import os
import pickle
import sys
import weakref
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hookbench.core.prerequisites import one_line
from hookbench.core.workload import of, to_device
from hookbench.measure import parity
from hookbench.mechanisms.activation_offload import copying_to_host
from hookbench.mechanisms.optimizer_in_backward import size_buckets

__all__ = ["BACKENDS", "CATEGORIES", "MemoryResult", "StorageTracker", "byte_unit",
           "format_bytes", "materialize", "measure", "measure_or_fall_back", "table_unit",
           "built", "collection_paused", "torch_log_kept"]

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
BACKENDS = ("fake", "eager", "cuda")
_BY_PHASE = {"data": "activations", "forward": "activations", "backward": "temporaries",
             "optimizer": "temporaries", "idle": "temporaries"}

# Memory in print: decimal units (1 KB = 1e3 bytes), the project's GB of 1e9 bytes (the ZeRO
# paper's), the largest that the amount reaches, so that a 1M-parameter model and a 7.5 B one
# both read at a glance. Nothing above GB: the largest step here, the paper's 7.5 B model, is 120.
UNITS = (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1))


def byte_unit(n: float) -> tuple[str, int]:
    """The unit to print ``n`` bytes in and its size in bytes: the largest of GB, MB and KB
    that ``n`` reaches, B below 1 KB (0 included)."""
    return next(unit for unit in UNITS if abs(n) >= unit[1] or unit[1] == 1)


def format_bytes(n: float, digits: int = 3) -> str:
    """``n`` bytes in its unit to ``digits`` significant digits, or whole where the integer
    part has more (``"120 GB"``, ``"1200 GB"``); below 1 KB the exact count: ``"0 B"``,
    ``"511 B"``, ``"1.00 KB"``, ``"4.21 MB"``, ``"6.09 GB"``."""
    rounded = float(f"{n:.{digits}g}")  # so that 999.9 KB to 3 digits is 1.00 MB, not 1000 KB
    name, size = byte_unit(rounded)
    if size == 1:
        return f"{round(n)} B"
    v = n / size
    return f"{v:.{max(0, digits - 1 - math.floor(math.log10(abs(rounded) / size)))}f} {name}"


def table_unit(values: Iterable[float], decimals: int = 3) -> tuple[str, Callable[[float], str]]:
    """One unit for a table of byte counts, so that a column compares by eye: the unit of its
    largest value, and the formatter of its cells (the number alone; the unit goes in the
    title). ``decimals`` in that unit, so the largest cell has at least 4 significant digits
    (ViT-L's GB tables print as they always have); more where the smallest nonzero cell would
    round to zero, up to 6 (byte resolution in MB, KB in GB: the 512-byte allocation that the
    fake backend rounds to still shows) and never finer than a byte."""
    values = [abs(v) for v in values]
    name, size = byte_unit(max(values, default=0))
    smallest = min((v for v in values if v), default=size)
    needed = math.ceil(-math.log10(2 * smallest / size))  # the decimals that round it above 0
    places = min(max(decimals, needed), 6, round(math.log10(size)))
    return name, lambda n: f"{n / size:.{places}f}"


@dataclass(eq=False)
class _Record:
    nbytes: int
    category: str
    ref: Any = None  # the weakref whose callback un-counts the storage; kept alive here


class StorageTracker(TorchDispatchMode):
    """Counts the live storage of every tensor an op returns, by category.

    ``round_to``: allocation granularity; 512 is what the CUDA caching allocator rounds every
    block to, so fake CPU tensors are counted as CUDA would count them. Storage resized in place
    (``UntypedStorage.resize_``, used by FSDP) is not seen.
    """

    def __init__(self, round_to: int = 512) -> None:
        super().__init__()
        self.round_to = round_to
        self.phase = "idle"
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.peak = 0
        self.peak_breakdown = dict(self.totals)
        self.peak_phase = "idle"
        self.timeline: list[tuple[str, tuple[int, ...]]] = []
        self.on_new_peak: Callable[[], None] | None = None
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refreshing = False
        self._counting = True
        # Host memory, apart from the device's: activations an ActivationOffload copied out
        # (on the fake and eager backends both are the CPU; the mechanism says which is which)
        self.host = self.host_peak = 0
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @property
    def current(self) -> int:
        return sum(self.totals.values())

    def rounded(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.round_to) * self.round_to

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Count ``tensor``'s storage; with ``category``, (re)classify it. A sparse COO
        tensor (an ``nn.EmbeddingBag(sparse=True)`` gradient) is its indices and values."""
        if tensor.is_sparse:
            for part in (tensor._indices(), tensor._values()):
                self.track(part, category)
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, nested: no plain storage
            return
        if storage in self._host:  # host memory stays host memory: an in-place op into an
            return  # offloaded copy (``host.copy_(value)``) returns the host tensor again
        record = self._records.get(storage)
        if record is not None:
            if category is not None and record.category != category:
                self.totals[record.category] -= record.nbytes
                self.totals[category] += record.nbytes
                record.category = category
            return
        record = _Record(self.rounded(storage.nbytes()), category or _BY_PHASE[self.phase])
        record.ref = weakref.ref(storage, partial(self._freed, record))
        self._records[storage] = record
        self._change(record.category, record.nbytes)

    def reset_peak(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: the peak restarts from what is live."""
        self.peak, self.host_peak = self.current, self.host
        self.peak_breakdown = dict(self.totals)
        self.peak_phase = self.phase
        self.timeline = [(self.phase, tuple(self.totals.values()))]

    def __exit__(self, *exc: Any) -> None:
        # Stop counting: storages freed after the measurement (the model, the optimizer) must
        # not extend the timeline.
        self._counting = False
        self.on_new_peak = None
        return super().__exit__(*exc)

    def _freed(self, record: _Record, _ref: weakref.ref) -> None:
        if self._counting:
            self._change(record.category, -record.nbytes)

    def _change(self, category: str, delta: int) -> None:
        self.totals[category] += delta
        self.timeline.append((self.phase, tuple(self.totals.values())))
        if self.current > self.peak and not self._refreshing:
            if self.on_new_peak is not None:
                self._refreshing = True
                try:
                    self.on_new_peak()
                finally:
                    self._refreshing = False
            self.peak = self.current
            self.peak_breakdown = dict(self.totals)
            self.peak_phase = self.phase

    def track_host(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage as host memory (``host``, ``host_peak``), not device."""
        storage = tensor.untyped_storage()
        if storage in self._host or storage in self._records:
            return
        nbytes = storage.nbytes()  # pinned host memory is not rounded like the device's
        self._host[storage] = weakref.ref(storage, partial(self._host_freed, nbytes))
        self.host += nbytes
        self.host_peak = max(self.host_peak, self.host)

    def _host_freed(self, nbytes: int, _ref: weakref.ref) -> None:
        if self._counting:
            self.host -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        host = copying_to_host()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track_host(t) if host else self.track(t)
        return out


@dataclass
class MemoryResult:
    """One measured training step. Bytes throughout; ``peak`` is the gated number."""

    model: str
    strategy: str
    backend: str
    batch_size: int
    peak: int
    peak_breakdown: dict[str, int]  # the tracker's attribution at its peak
    peak_phase: str
    parameters: int
    optimizer_state: int
    all_gradients: int  # every trainable parameter's gradient, as if all were alive
    gradients_alive_max: int  # the most gradient bytes alive at once in the measured step
    activations_peak: int
    # Live bytes by category when the measured step's backward has ended, before the
    # optimizer: the model states (parameters, gradients, optimizer state) the ZeRO paper counts.
    after_backward: dict[str, int]
    # The least any implementation of this strategy could need: parameters and optimizer state
    # live throughout; the peak activations must coexist with them at the end of forward, and
    # the gradients the strategy needs at once (all of them for a standard step, one parameter's
    # or one module's in backward, the rank's gradient shard for ZeRO-2) before they are
    # stepped. A lower bound, so the larger of the two, not their sum (a for-loop step already
    # runs below the sum). tests/measure/test_memory.py checks that no measured step goes below it.
    floor: int
    floor_breakdown: dict[str, int]
    timeline: list[tuple[str, tuple[int, ...]]] = field(repr=False)
    device: dict[str, Any] = field(default_factory=dict)  # cuda: allocator, NVML, snapshot
    host_peak: int = 0  # the most host memory offloaded activations held at once
    # The most gradient bytes one node of backward hands out at once, and that node: no step
    # in backward can free one of them before the others exist (``arriving_together``)
    gradients_together: int = 0
    together_from: str = ""

    @property
    def few_gradients_alive(self) -> bool:
        """Whether the step held fewer gradients at once than a standard step: not every one;
        bucketed in backward, at most a bucket and the one arriving (two of the largest
        bucket, as no parameter is larger than its bucket), which is every gradient of a model
        smaller than a bucket, as with DDP. Or every gradient comes from one node of backward
        (``gradients_together``): a model whose own autograd.Function hands them all out at
        the end of its backward (torchdiffeq's adjoint, as views of its flat adjoint state)
        holds them all in any step."""
        if self.all_gradients and self.gradients_together >= self.all_gradients:
            return True
        if self.strategy == "in_backward_bucketed":
            return self.gradients_alive_max <= 2 * self.floor_breakdown["gradients_needed"]
        return self.gradients_alive_max < self.all_gradients

    @property
    def above_floor(self) -> float:
        """(peak - floor) / floor: how far the step is from the least it could need."""
        return self.peak / self.floor - 1

    def to_dict(self, timeline_points: int = 400) -> dict[str, Any]:
        d = asdict(self)
        step = max(1, len(self.timeline) // timeline_points)
        d["timeline"] = {"categories": CATEGORIES,
                         "points": [[p, list(v)] for p, v in self.timeline[::step]]}
        d["above_floor"] = self.above_floor
        return d


def measure(
    spec: Any,
    strategy: str = "foreach",
    *,
    optimizer_class: type[torch.optim.Optimizer] | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    backend: str = "fake",
    warmup: int = 1,
    snapshot_path: str | os.PathLike | None = None,
    round_to: int = 512,
    world_size: int = 1,
    rank: int = 0,
) -> MemoryResult:
    """Measure one training step of ``spec`` (a ``hookbench.Workload`` or a ``TinySpec``)
    after ``warmup``, in the workload's precision and activation checkpointing. The fake
    backend cannot run a compiled model (measure ``workload.replace(compile=None)``) and
    leaves fp16's GradScaler out (its unscale works in place; its inf check reads a value,
    which fake tensors do not have).

    ``strategy`` is one of ``hookbench.measure.parity.STRATEGIES`` except ``peer``. For ``zero2``
    the step runs in the current process group, or, where none is initialized, as rank 0 of
    ``world_size`` ranks in a fake process group whose collectives move no data: one process
    simulates any number of ranks (with the fake backend, any model size); ``rank`` picks which
    rank (ranks differ: each owns other parameters, whose gradients arrive at other times).
    """
    spec = of(spec)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")
    if spec.compile is not None and backend == "fake":
        raise ValueError(f"workload {spec.name!r}: the fake backend cannot run a compiled "
                         f"model; measure workload.replace(compile=None), or use the cuda "
                         f"backend")
    if strategy not in parity.STRATEGIES or strategy == "peer":
        raise ValueError(f"unknown strategy {strategy!r}; choose from "
                         f"{[s for s in parity.STRATEGIES if s != 'peer']}")
    if warmup < 1:
        raise ValueError("warmup must be >= 1: the first step is not steady state")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if backend == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the cuda backend needs CUDA, and torch.cuda.is_available() is "
                           "False; use backend='fake' for a device-independent measurement")
    with contextlib.ExitStack() as stack:
        if strategy == "zero2" and not dist.is_initialized():
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
            stack.callback(dist.destroy_process_group)
        if backend == "fake":
            model = built(spec, True, stack)
            device = torch.device("cpu")
        else:
            device = torch.device("cuda" if backend == "cuda" else "cpu")
            model = spec.build().to(device)
        cls, kwargs = spec.optimizer  # the workload's own, unless the caller names another
        return _measure(model, spec, strategy, optimizer_class or cls,
                        kwargs if optimizer_kwargs is None else optimizer_kwargs,
                        backend, device, warmup, snapshot_path, round_to, stack)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off, and what exists so far frozen (``gc.freeze``), on
    again on exit. Where the collector runs depends on how many objects the process allocated
    before (a gate measures other rows first than a record does), and a model whose forward
    leaves reference cycles (Hugging Face's output objects) holds their tensors until it runs:
    measured, the same FSDP2 row of a ViT + GPT-2 captioner peaked 8.7 KB apart from one
    process to the next. Paused, the bytes are the same in every process; the measurements
    collect (``gc.collect``) where they count what is left, and, with the rest of the process
    frozen, a collection scans only what the measurement made (about 1 ms, not 140 ms)."""
    global _paused
    _paused += 1
    was = gc.isenabled()
    if _paused == 1:
        gc.disable()
        gc.freeze()
    try:
        yield
    finally:
        _paused -= 1
        if _paused == 0:
            gc.unfreeze()
            if was:
                gc.enable()


_paused = 0  # collection_paused's depth: only the outermost freezes and unfreezes


@contextlib.contextmanager
def torch_log_kept(lines: list[str]) -> Iterator[None]:
    """torch's own log records (FakeTensorMode logs an E-level traceback for every meta kernel
    that fails) appended to ``lines``, one line each, instead of printed: the caller puts them in
    the row's detail. torch gives each of its loggers a handler of its own (torch._logging);
    every one under "torch" is swapped for the keeper, and restored on exit."""
    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            lines.append(f"{record.levelname} {record.name}: "
                         f"{message.splitlines()[0] if message else ''}")

    keep = Keep()
    loggers = [logger for name, logger in logging.root.manager.loggerDict.items()
               if (name == "torch" or name.startswith("torch."))
               and isinstance(logger, logging.Logger) and logger.handlers]
    saved = [logger.handlers for logger in loggers]
    for logger in loggers:
        logger.handlers = [keep]
    try:
        yield
    finally:
        for logger, handlers in zip(loggers, saved):
            logger.handlers = handlers


def measure_or_fall_back(spec: Any, strategy: str = "foreach", **options: Any
                         ) -> tuple[MemoryResult, str | None]:
    """``measure`` on the fake backend, or, where fake tensors cannot run the model (a forward
    that reads a value, ``if torch.rand([]) < p``; a meta kernel narrower than the CPU kernel,
    ``torch._grouped_mm`` in float32), on real CPU tensors (backend "eager", the same tracker,
    exact as well). Returns the result and, after a fallback, why, in one line with what torch
    logged meanwhile; a row names its backend, so that a gate compares like with like."""
    if options.get("backend", "fake") != "fake":
        return measure(spec, strategy, **options), None
    logged: list[str] = []
    try:
        with torch_log_kept(logged):
            return measure(spec, strategy, **options), None
    except Exception as e:  # noqa: BLE001 - any refusal of fake tensors; eager must then run it
        why = f"fake tensors cannot run {of(spec).name}: {one_line(e)}"
    result = measure(spec, strategy, **{**options, "backend": "eager"})
    log = (f"; torch logged {len(logged)} line{'s' * (len(logged) > 1)}, the first: {logged[0]}"
           if logged else "")
    return result, f"{why}; measured on real CPU tensors{log}"


def _measure(model, spec, strategy, cls, kwargs, backend, device, warmup, snapshot_path,
             round_to, stack) -> MemoryResult:
    tracker = StorageTracker(round_to)
    params = [p for p in model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    started = parity.start(strategy, model, cls, kwargs, 1, params=spec.optimizer_params(model),
                           clip=spec.clip_grad_norm)
    stack.callback(started.close)
    with_grads = list({id(t): t for t in (*trainable, *started.optimized)}.values())

    def state_tensors() -> Iterator[torch.Tensor]:
        for p in started.optimized:
            for v in started.state_of(p).values():
                if torch.is_tensor(v):
                    yield v

    def refresh_gradients() -> None:
        for p in with_grads:
            if p.grad is not None:
                tracker.track(p.grad, "gradients")

    # What the optimizer steps but the model does not hold: mixed-precision ZeRO-2's fp32
    # masters, optimizer state as the ZeRO paper counts them (K = 12).
    model_storages = {id(p.untyped_storage()) for p in params}
    masters = [t for t in started.optimized if id(t.untyped_storage()) not in model_storages]

    def classify() -> None:
        for t in (*params, *model.buffers()):  # buffers (BatchNorm statistics) count as model
            tracker.track(t, "parameters")
        refresh_gradients()
        for t in started.held():
            tracker.track(t, "gradients")
        for t in (*state_tensors(), *masters):
            tracker.track(t, "optimizer_state")

    grads_alive: list[int] = [0]

    def count_gradients(grad: torch.Tensor) -> None:
        # by storage: gradients a model's backward hands out as views of one storage
        # (torchdiffeq's adjoint state) hold it once, until the last of them is freed
        alive = {_storage_key(t): tracker.rounded(_bytes(t))
                 for t in (*(p.grad for p in trainable if p.grad is not None), grad)}
        grads_alive[0] = max(grads_alive[0], sum(alive.values()))

    after_backward: dict[str, int] = {}  # what is live when the last backward has ended
    together: list[tuple[int, str]] = [(0, "")]  # the measured step's (arriving_together)

    def one_step(index: int) -> None:
        tracker.phase = "data"
        x, y = spec.data(index)
        x, y = to_device(x, device), to_device(y, device)
        tracker.phase = "forward"
        # on the random numbers of this batch (dropout, LayerDrop), the same for every
        # strategy and every run: a forward whose path is random allocates alike
        loss = spec.compute_loss(model, x, y, (index, 0))
        classify()
        together[0] = arriving_together(loss, trainable, tracker.rounded)
        tracker.phase = "backward"
        (loss if started.scale is None else started.scale(loss)).backward()  # fp16 ZeRO-2
        del loss
        classify()
        gc.collect()  # what is left when backward has ended, not cycles not yet collected
        after_backward.clear()
        after_backward.update(zip(CATEGORIES, (tracker.totals[c] for c in CATEGORIES)))
        tracker.phase = "optimizer"
        started.step()
        classify()
        tracker.phase = "idle"

    cuda = backend == "cuda"
    with collection_paused(), tracker:
        classify()
        for i in range(warmup):
            one_step(i)
        classify()
        tracker.on_new_peak = refresh_gradients
        hooks = [p.register_hook(count_gradients) for p in trainable]
        stack.callback(lambda: [h.remove() for h in hooks])
        ambient = 0
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            # Live on the device but not the step's, so outside its gated peak (like with like
            # with the fake backend, which has neither): cuBLAS's workspaces, one per handle
            # and stream (32 MiB each on sm90, inside the caching allocator; the warm-up's
            # first matmuls allocated them, forward's thread and backward's), and whatever
            # this process held before the step was built. The CUDA context is outside
            # max_memory_allocated anyway; blocks are rounded to 512 B as the tracker rounds.
            ambient = max(0, torch.cuda.memory_allocated() - tracker.current)
            if snapshot_path is not None:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
        tracker.reset_peak()
        one_step(warmup)
        classify()
    activations_peak = max(v[CATEGORIES.index("activations")] for _, v in tracker.timeline)
    device_info = {**_cuda_readings(snapshot_path), "ambient_bytes": ambient} if cuda else {}
    rounded = [tracker.rounded(p.nbytes) for p in trainable]
    floor = {
        "parameters": tracker.totals["parameters"],
        "optimizer_state": tracker.totals["optimizer_state"],
        "activations_peak": activations_peak,
        "gradients_needed": _gradients_needed(model, strategy, tracker, started.optimized),
    }
    peak = device_info["max_memory_allocated"] - ambient if cuda else tracker.peak
    return MemoryResult(
        model=spec.name,
        strategy=strategy,
        backend=backend,
        batch_size=spec.batch_size,
        peak=peak,
        peak_breakdown=tracker.peak_breakdown,
        peak_phase=tracker.peak_phase,
        parameters=tracker.totals["parameters"],
        optimizer_state=tracker.totals["optimizer_state"],
        all_gradients=sum(rounded),
        gradients_alive_max=grads_alive[0],
        activations_peak=activations_peak,
        after_backward=after_backward,
        floor=floor["parameters"] + floor["optimizer_state"]
        + max(floor["activations_peak"], floor["gradients_needed"]),
        floor_breakdown=floor,
        timeline=tracker.timeline,
        device=device_info,
        host_peak=tracker.host_peak,
        gradients_together=together[0][0],
        together_from=together[0][1],
    )


def arriving_together(loss: torch.Tensor, trainable: list[torch.Tensor],
                      rounded: Callable[[int], int] = lambda n: n) -> tuple[int, str]:
    """The most bytes of ``trainable``'s gradients that one node of ``loss``'s backward graph
    hands out at once (its ``next_functions`` that accumulate into them), and that node's
    name: a Linear's weight and bias from one addmm; every parameter from an autograd.Function
    that computes them all in its backward (torchdiffeq's adjoint, a recomputing Function)."""
    wanted = {id(p) for p in trainable}
    best, name = 0, ""
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        fed = {id(f.variable): f.variable for f, _ in node.next_functions
               if f is not None and id(getattr(f, "variable", None)) in wanted}
        total = sum(rounded(p.nbytes) for p in fed.values())  # as all_gradients counts
        if total > best:
            best, name = total, node.name()
        stack.extend(f for f, _ in node.next_functions if f is not None)
    return best, name


def _gradients_needed(model: nn.Module, strategy: str, tracker: StorageTracker,
                      optimized: list[torch.Tensor]) -> int:
    """The gradient bytes a strategy cannot do without at one moment."""
    if strategy == "zero2":
        # The shard's gradient (this rank's pieces, one allocation), which must exist at the
        # step. Not every gradient: the rank never holds them all. Not the shard's gradient on
        # top of the activations either: it is allocated when the rank's first piece arrives,
        # and for rank 0 (the first parameters, whose gradients come last) that is after most
        # activations are freed; so it stands in the max() with them.
        return tracker.rounded(sum(p.nbytes for p in optimized))
    if strategy == "in_backward":  # one parameter's
        return max(tracker.rounded(p.nbytes) for p in model.parameters() if p.requires_grad)
    if strategy == "in_backward_bucketed":  # the largest bucket's, cut as the mechanism cuts
        buckets = size_buckets([p for p in model.parameters() if p.requires_grad],
                               parity.BUCKET_CAP_MB)
        return max(sum(tracker.rounded(p.nbytes) for p in b) for b in buckets)
    if strategy.startswith("in_backward_grouped"):  # one module's own parameters'
        return max(sum(tracker.rounded(p.nbytes) for p in m.parameters(recurse=False)
                       if p.requires_grad) for m in model.modules())
    return sum(tracker.rounded(p.nbytes) for p in model.parameters() if p.requires_grad)


def built(workload: Any, fake: bool, stack: contextlib.ExitStack) -> nn.Module:
    """``workload``'s model: on fake tensors (built on the meta device, then ``materialize``d
    under a ``FakeTensorMode`` that ``stack`` holds open), or real ones."""
    if not fake:
        return workload.build()
    from torch._subclasses.fake_tensor import FakeTensorMode

    stack.enter_context(imports_as_real())
    with torch.device("meta"):  # outside FakeTensorMode, which refuses meta tensors
        model = workload.build()
    stack.enter_context(FakeTensorMode())
    materialize(model)
    return model


@contextlib.contextmanager
def imports_as_real() -> Iterator[None]:
    """Inside, a module imported for the first time runs its top level on real tensors on the
    default device of the moment this was entered, outside any ``torch.device("meta")`` or
    ``FakeTensorMode`` entered since. Measured on torchdiffeq, whose models import it in their
    forward: imported first inside a fake forward, its Butcher tableaus (module constants) were
    fake tensors, and every eager run after it in the process failed on them."""
    finder = _RealImports(torch.get_default_device())
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


class _RealImports(importlib.abc.MetaPathFinder):
    """Finds a module as the finders after it do, and runs its loader's ``exec_module`` with
    fake tensors unset and ``device`` the default."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        for finder in sys.meta_path:
            if isinstance(finder, _RealImports) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is None:
                continue
            loader = spec.loader
            # a loader class (builtins, frozen modules) makes no tensors; one without
            # exec_module (the old load_module protocol) is left as it is
            if (loader is not None and not isinstance(loader, type)
                    and hasattr(loader, "__dict__") and hasattr(type(loader), "exec_module")):
                loader.exec_module = partial(self._exec, loader, type(loader).exec_module)
            return spec
        return None

    def _exec(self, loader: Any, run: Callable, module: Any) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        vars(loader).pop("exec_module", None)  # the loader's own again (zipimport's is shared)
        with unset_fake_temporarily(), torch.device(self.device):
            run(loader, module)


def materialize(model: nn.Module) -> None:
    """Give a meta-device model fake CPU parameters and buffers (inside FakeTensorMode).

    Building under FakeTensorMode directly fails: the ViT init (torchvision's, and so
    hookbench.models.vision's) calls trunc_normal_, which loops on data. Initial values do not affect
    memory, so empty tensors do.
    """
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in new:  # tied parameters stay tied
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                              requires_grad=p.requires_grad)
                module._parameters[name] = new[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)


def _cuda_readings(snapshot_path: str | os.PathLike | None) -> dict[str, Any]:
    torch.cuda.synchronize()
    info: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
    }
    if info["max_memory_allocated"] <= 0:
        raise RuntimeError("torch.cuda.max_memory_allocated() returned 0 after a training "
                           "step: the allocator statistics are not working; refusing to report")
    if snapshot_path is not None:
        path = Path(snapshot_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        torch.cuda.memory._record_memory_history(enabled=None)
        info["snapshot"] = str(path)
    info.update(_nvml_readings())
    return info


def _nvml_readings() -> dict[str, Any]:
    """This process's device memory and the device's used memory, from NVML (information only:
    it includes the CUDA context and the allocator's cache)."""
    try:
        import pynvml
    except ImportError:
        return {"nvml": "pynvml (nvidia-ml-py) not installed"}
    try:
        pynvml.nvmlInit()
        try:
            # CUDA_VISIBLE_DEVICES mapped as torch maps it: ordinals, GPU- or MIG- UUIDs
            index = torch.cuda._get_nvml_device_index(torch.cuda.current_device())
        except (RuntimeError, ValueError) as e:
            return {"nvml": f"no NVML device for this CUDA device: {e}"}
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mine = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == os.getpid()]
        return {"nvml_process_bytes": mine[0] if mine else None,
                "nvml_device_used_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).used}
    except pynvml.NVMLError as e:
        return {"nvml": f"NVML error: {e}"}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _storage_key(t: torch.Tensor) -> int:
    """One key per storage (a sparse tensor's own: its indices and values)."""
    return id(t) if t.is_sparse else t.untyped_storage()._cdata


def _bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage: a sparse COO tensor's indices and values."""
    if t.is_sparse:
        return t._indices().nbytes + t._values().nbytes
    return t.untyped_storage().nbytes()
