"""Activation capture: what chosen modules produce in forward (and receive in backward).

``ActivationCapture`` registers forward hooks on the selected modules of a model and records,
for every call of every module, either the full output tensors (detached and cloned, so a later
in-place op such as ResNet's ``ReLU(inplace=True)`` cannot change them) or statistics computed
inside the hook (so capturing every layer of ViT-L costs a few numbers per layer). With
``grads=True`` it also records the gradient flowing into each captured output during backward.

    with ActivationCapture(model, include=["layer*", nn.Linear], stats=True) as cap:
        model(x)
    cap["layer1.0.relu", 1]          # the second call of a module used twice per forward
    cap.table()                      # rows: name, call, path, shape, statistics

Outputs that are tuples, lists, dicts, dataclasses or diffusers' ModelOutput are flattened into
paths ("0", "sample", "1.hidden"); non-tensor members are skipped. Hooks are removed on exit,
also when forward raises; when the constructor or ``__enter__`` raises, the model is left with no
hook of this capture. A gradient hook is removed once it has fired, or by ``clear()``, so a
training loop that clears every step does not accumulate them. ``global_hook=True`` uses
``register_module_forward_hook`` (one global hook, filtered to this model) instead of one hook
per module. Under activation checkpointing (reentrant or not) the recomputation in backward is
not recorded, so a capture records what the same forward without checkpointing records; modules
inside a reentrant checkpoint run forward without grad, so ``grads=True`` gets no gradient
for them.

Statistics are those of the values in float64, whatever the output's dtype (float16, bfloat16,
float32, float64, integer or bool; contiguous or not), and agree with torch's own reductions of
``t.double()`` to the rounding of float64 sums (``tests/mechanisms/test_activation_capture.py``
checks every statistic on adversarial data). ``std`` uses Bessel's correction, as ``torch.std``. An
empty tensor has ``numel`` 0 and every other statistic nan; a single element has ``std`` nan.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import math
import threading
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Union

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.hooks import RemovableHandle

__all__ = ["STATS", "ActivationCapture", "Record", "flatten", "statistics"]

Selector = Union[str, type, Callable[[str, nn.Module], bool]]
STATS = ("l2", "rms", "mean", "mean_abs", "std", "min", "max", "numel")


def statistics(t: torch.Tensor, which: Iterable[str] = STATS) -> dict[str, float]:
    """The statistics ``which`` (a subset of ``STATS``) of a tensor, as Python numbers (``numel``
    an int): those of its values in float64, see the module docstring."""
    return _Stats(_check_stats(which), t).resolve()


def _check_stats(which: Any) -> tuple[str, ...]:
    if isinstance(which, str):  # tuple("rms") would be ("r", "m", "s")
        raise TypeError(f"statistics are given as a sequence of names, e.g. ({which!r},), "
                        f"not the string {which!r}")
    which = tuple(which)
    bad = [s for s in which if not isinstance(s, str)]
    if bad:
        raise TypeError(f"statistics are names from {STATS}, got {bad!r}")
    unknown = sorted(set(which) - set(STATS))
    if unknown:
        raise ValueError(f"unknown statistics {unknown}; choose from {STATS}")
    return which


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in a nested output; other members are skipped."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):  # includes diffusers/transformers ModelOutput
        for k, v in value.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from flatten(v, f"{prefix}.{i}" if prefix else str(i))
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from flatten(getattr(value, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif type(value) in pytree.SUPPORTED_NODES:
        # a container a library registers with torch's pytree (TorchRec's KeyedTensor, which
        # its EmbeddingBagCollection returns): its tensors, in pytree's order (not every
        # library registers keys for them)
        for i, leaf in enumerate(pytree.tree_leaves(value)):
            yield from flatten(leaf, f"{prefix}.{i}" if prefix else str(i))


@dataclasses.dataclass
class Record:
    """One tensor of one call of one module."""

    name: str
    call: int  # 0 for the first call of this module since the capture began
    path: str  # "" for a plain tensor output
    shape: tuple[int, ...]
    dtype: torch.dtype
    raw: torch.Tensor | _Stats
    raw_grad: torch.Tensor | _Stats | None = None  # filled in by backward, grads=True

    @property
    def value(self) -> torch.Tensor | dict[str, float]:
        """The tensor, or its statistics."""
        return _read(self.raw)

    @property
    def grad(self) -> torch.Tensor | dict[str, float] | None:
        """The gradient with respect to this output, or its statistics (grads=True)."""
        return _read(self.raw_grad)


def _read(raw: torch.Tensor | _Stats | None) -> torch.Tensor | dict[str, float] | None:
    return raw.resolve() if isinstance(raw, _Stats) else raw


class ActivationCapture:
    """Context manager that records module outputs; see the module docstring.

    Args:
        model: the module whose submodules are captured.
        include: selectors, any of which selects a module: an exact name, a glob pattern
            (``"layer*.conv?"``), an ``nn.Module`` subclass, or a predicate
            ``(name, module) -> bool``. Default: every submodule.
        exclude: selectors of modules to leave out.
        stats: record statistics instead of tensors: True for all of ``STATS``, or the names of
            those wanted (fewer statistics, less overhead: most cost a pass over the output).
        grads: also record the gradient with respect to each captured output.
        device, dtype: where full tensors are moved (default: where they are).
        global_hook: one global forward hook instead of one per module.
    """

    def __init__(
        self,
        model: nn.Module,
        include: Selector | Iterable[Selector] | None = None,
        exclude: Selector | Iterable[Selector] | None = None,
        *,
        stats: bool | Iterable[str] = False,
        grads: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        global_hook: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.stats = STATS if stats is True else _check_stats(stats or ())
        named = [(n, m) for n, m in model.named_modules() if n]
        selected = _select(named, include) if include is not None else dict(named)
        if exclude is not None:
            for name in _select(named, exclude, strict=False):
                selected.pop(name, None)
        if not selected:
            raise ValueError("the selection leaves no module to capture")
        self.model = model
        self.names = {id(m): n for n, m in selected.items()}  # a module used twice keeps one name
        self.grads, self.device, self.dtype = grads, device, dtype
        self.global_hook = global_hook
        self.records: list[Record] = []
        self._calls: dict[str, int] = {}
        self._handles: list[RemovableHandle] = []  # forward hooks
        self._grad_handles: dict[int, RemovableHandle] = {}  # gradient hooks not yet fired

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> ActivationCapture:
        # Recording is eager work: one graph break under torch.compile, never a recompile.
        # Disabled here, not by decorating the method: the decorator imports torch._dynamo,
        # a second per process (every rank, every command) that never opens a capture.
        self._hook = torch.compiler.disable(self._record)
        try:
            if self.global_hook:
                self._handles.append(module_mod.register_module_forward_hook(self._hook))
            else:
                modules = {id(m): m for m in self.model.modules()}
                for key in self.names:
                    self._handles.append(modules[key].register_forward_hook(self._hook))
        except BaseException:
            self.remove()
            self._unhook_everywhere()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook (forward, and the gradient hooks of outputs not yet reached)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_grad_hooks()

    def clear(self) -> None:
        """Forget what was recorded; call indices restart at 0 (say, before the next step).
        Gradient hooks of outputs whose gradient has not arrived are removed with them."""
        self.records.clear()
        self._calls.clear()
        self._remove_grad_hooks()

    def _remove_grad_hooks(self) -> None:
        for handle in self._grad_handles.values():
            handle.remove()
        self._grad_handles.clear()

    def _unhook_everywhere(self) -> None:
        # A registration that failed after registering (a subclass's register_forward_hook
        # that calls super() and then raises) returned no handle to remove: find this
        # capture's hook by equality (a bound method of this very object) and drop it, with
        # the flags torch keeps beside it under the same id.
        owners = [module_mod] if self.global_hook else list(self.model.modules())
        prefix = "_global_forward_hooks" if self.global_hook else "_forward_hooks"
        for owner in owners:
            hooks = getattr(owner, prefix, {})
            for key in [k for k, h in hooks.items() if h == self._hook]:
                for suffix in ("", "_with_kwargs", "_always_called"):
                    getattr(owner, prefix + suffix, {}).pop(key, None)

    # -- hook --------------------------------------------------------------------------------

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:  # the global hook sees every module of every model
            return
        if torch._C._current_graph_task_id() != -1:
            # A forward inside backward: activation checkpointing recomputing what forward
            # already ran (and was recorded); recording it again would add calls that a
            # forward without checkpointing does not make.
            return
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        for path, t in flatten(output):
            record = Record(name, call, path, tuple(t.shape), t.dtype, self._keep(t))
            self.records.append(record)
            if self.grads and t.requires_grad:
                self._watch_grad(t, record)

    def _watch_grad(self, t: torch.Tensor, record: Record) -> None:
        def hook(grad: torch.Tensor) -> None:
            # Fired: drop the handle, or a loop that clears every step would keep one per
            # output per step. torch supports removing a hook from inside it (pytorch#58354).
            self._grad_handles.pop(handle.id, None)
            handle.remove()
            record.raw_grad = self._keep(grad)

        handle = t.register_hook(hook)
        self._grad_handles[handle.id] = handle

    def _keep(self, t: torch.Tensor) -> torch.Tensor | _Stats:
        if self.stats:
            return _Stats(self.stats, t)
        # clone: a later in-place op (ResNet's ReLU(inplace=True)) must not change the record
        return t.detach().to(device=self.device, dtype=self.dtype, copy=True)

    # -- reading -----------------------------------------------------------------------------

    def __getitem__(self, key: str | tuple[str, int] | tuple[str, int, str]):
        """``cap[name]``, ``cap[name, call]`` or ``cap[name, call, path]``: the recorded value."""
        name, call, path = (key, 0, "") if isinstance(key, str) else (*key, "")[:3]
        for r in self.records:
            if r.name == name and r.call == call and r.path == path:
                return r.value
        recorded = sorted({(r.name, r.call, r.path) for r in self.records if r.name == name})
        raise KeyError(f"nothing recorded for {(name, call, path)}; recorded for this name: "
                       f"{recorded or 'nothing'}")

    def calls(self, name: str) -> int:
        """How many times module ``name`` ran while capturing."""
        return self._calls.get(name, 0)

    def table(self) -> list[dict[str, Any]]:
        """One row per record: name, call, path, shape, and the statistics (of full tensors:
        all of ``STATS``), read from the device at once."""
        stats = [r.raw if isinstance(r.raw, _Stats) else _Stats(STATS, r.raw)
                 for r in self.records]
        _read_all(stats)
        return [{"name": r.name, "call": r.call, "path": r.path, "shape": r.shape,
                 **st.resolve()} for r, st in zip(self.records, stats)]


def _select(named: list[tuple[str, nn.Module]], selectors: Any,
            strict: bool = True) -> dict[str, nn.Module]:
    if isinstance(selectors, (str, type)) or callable(selectors) or not hasattr(selectors,
                                                                                "__iter__"):
        selectors = [selectors]  # one selector; a non-selector then gets the TypeError below
    chosen: dict[str, nn.Module] = {}
    names = [n for n, _ in named]
    for sel in selectors:
        if isinstance(sel, str):
            hits = {n: m for n, m in named if n == sel or fnmatch.fnmatchcase(n, sel)}
        elif isinstance(sel, type) and issubclass(sel, nn.Module):
            hits = {n: m for n, m in named if isinstance(m, sel)}
        elif callable(sel):
            hits = {n: m for n, m in named if sel(n, m)}
        else:
            raise TypeError(f"a selector is a name or glob, an nn.Module subclass or a "
                            f"predicate (name, module) -> bool; got {sel!r}")
        if strict and not hits:
            what = sel if isinstance(sel, str) else getattr(sel, "__name__", repr(sel))
            close = difflib.get_close_matches(sel, names, n=5) if isinstance(sel, str) else []
            raise ValueError(f"selector {what!r} matches no module"
                             + (f"; did you mean {close}?" if close else
                                f"; modules start with {names[:5]}"))
        chosen.update(hits)
    return chosen


# -- statistics: float64 sums on the device, turned into numbers on the host when first read --


_NAN = float("nan")


class _Plan(NamedTuple):
    """What the device sums for a set of statistics (see ``_moments``)."""

    std: bool  # the shift, and per chunk sum (x - shift) and sum (x - shift)^2
    mean: bool  # per chunk sum (x - shift), or sum x when std is not wanted
    l2: bool  # per chunk sum x^2 (l2, rms), unless std's sums give it
    mean_abs: bool  # per chunk sum |x|
    extremes: bool  # min and max, at the end

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(which: tuple[str, ...], n: int) -> _Plan:  # n: the numel, or 2 for any n > 1
        w = set(which) if n else set()  # an empty tensor: nothing to compute
        return _Plan("std" in w and n > 1, bool(w & {"mean", "std"}) and (n > 1 or "mean" in w),
                     bool(w & {"l2", "rms"}), "mean_abs" in w, bool(w & {"min", "max"}))


class _Stats:
    """The statistics of one tensor. The device computes float64 sums (``_sums``), which the host
    turns into statistics (``_finish``) when first asked for: a hook that synchronised on every
    module call would stall a GPU pipeline, so ``ActivationCapture.table`` reads all of a
    forward's at once (``_read_all``). What the host knows is never computed: numel, and nan
    for every statistic of an empty tensor and for the std of one element (Bessel's correction
    divides by n - 1 = 0: nan, as torch.std)."""

    def __init__(self, which: tuple[str, ...], t: torch.Tensor) -> None:
        x = t.detach()
        self.which, self.n = which, x.numel()
        self.plan = _Plan.of(which, min(self.n, 2))
        self.pending, self.chunks = _sums(x, self.plan) if any(self.plan) else (None, 0)
        self.values: dict[str, float] | None = None  # once read

    def resolve(self) -> dict[str, float]:
        _read_all([self])  # read once, then kept
        return dict(self.values)

    def _fill(self, raw: list[float]) -> None:
        values = _finish(self.plan, self.n, self.chunks, raw)
        self.values = {s: values.get(s, _NAN) for s in self.which}
        self.pending = None


def _read_all(stats: Iterable[_Stats]) -> None:
    """Read every unread ``_Stats`` with one device-to-host copy per device (one sync), not
    one per record."""
    by_device: dict[torch.device, list[_Stats]] = {}
    for st in stats:
        if st.values is not None:
            continue
        if st.pending is None:  # nothing computed on the device
            st._fill([])
        else:
            by_device.setdefault(st.pending[0].device, []).append(st)
    for group in by_device.values():
        # one stack of every record's 0-d sums, not one per record in the hook
        raw, start = torch.stack([t for st in group for t in st.pending]).tolist(), 0
        for st in group:
            end = start + len(st.pending)
            st._fill(raw[start:end])
            start = end


# Why float64: float32 arithmetic cannot meet any useful tolerance on plausible outputs. Float32
# L2 norms and sums overflow for values near 1e38 and square subnormals to 0; float32 cannot
# hold int64 values above 2**24; torch's float32 norm kernel is ~1e-5 off on 2**20 uniform
# values (measured); and the old std, sqrt((sum x^2 - n mean^2) / (n - 1)) in float32, loses
# ~1e-7 (mean/std)^2 relative: on 4096 values of std 1e-3, 0 at mean 1e4, 4.8x the std at
# mean 10, 16% off at mean 1. Every float dtype, bool and integer below 2**53 converts to
# float64 exactly, so each sum below is a float64 reduction of the very values, and the
# statistics agree with torch's float64 reductions of t.double() to the rounding of float64
# sums (the tests allow max(1e-13, n * 2**-53) relative; 7.6e-14 measured on 1.6M values
# against exact rational arithmetic).
#
# Cost: converting, one write of 8 bytes per element, then float64 passes (torch.sum and BLAS
# torch.dot, both faster than torch.linalg.vector_norm on float64; torch.var_mean's Welford
# slower still; CPU reductions with dtype=torch.float64 copy the whole input first). The CPU
# converts in chunks of _CHUNK elements into two float64 buffers of this thread that every call
# reuses (2 x 2 MiB, kept for the thread's life): fresh float64 tensors took 4x as long, since
# glibc gave their pages back after each free (1557 page faults per ResNet-18 forward, the size
# of its 64x112x112 output in float64, measured). Their views are cached per shape, as outputs
# repeat their shapes every forward. GPUs allocate from PyTorch's cache and convert whole
# tensors at once.
_CHUNK = 1 << 18
_local = threading.local()


def _views(shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's first float64 buffer viewed as ``shape`` and flat, and its second flat."""
    views = getattr(_local, "views", None)
    if views is None:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of the mode
            _local.buf = torch.empty(2, _CHUNK, dtype=torch.float64)
        views = _local.views = {}
    v = views.get(shape)
    if v is None:
        if len(views) >= 1024:  # shapes that vary without end (say, sequence lengths)
            views.clear()
        flat = _local.buf[0, :shape.numel()]
        v = views[shape] = (flat.view(shape), flat, _local.buf[1, :shape.numel()])
    return v


def _sums(x: torch.Tensor, plan: _Plan) -> tuple[list[torch.Tensor], int]:
    """Float64 partial results on x's device, 0-d tensors in the order ``_finish`` reads them,
    and the number of chunks. x is not empty."""
    parts: list[torch.Tensor] = []
    chunks = _moments(x, plan, parts) if plan.std or plan.mean or plan.l2 or plan.mean_abs else 0
    if plan.extremes:
        # exact in the output's own dtype (aminmax has no bool kernel: bool viewed as uint8)
        lo, hi = torch.aminmax(x.view(torch.uint8) if x.dtype == torch.bool else x)
        parts += [lo.double(), hi.double()]
    return parts, chunks


def _moments(x: torch.Tensor, plan: _Plan, parts: list[torch.Tensor]) -> int:
    """Appends to ``parts`` the sums ``plan`` asks for (for std, the shift first); returns the
    number of chunks."""
    n = x.numel()
    if x.device.type != "cpu" or type(x) is not torch.Tensor:  # GPU, or a fake/other subclass
        chunks = [(x, None)]
    elif n <= _CHUNK:
        chunks = [(x, _views(x.shape))]
    else:  # x.reshape(-1): a view, or (not contiguous) one copy in x's own dtype
        chunks = [(c, _views(c.shape)) for c in x.reshape(-1).split(_CHUNK)]
    shift = None
    for c, views in chunks:
        own = c.dtype != torch.float64  # d is then a copy of c that may change in place
        if not own:
            d = c.reshape(-1)
        elif views is None:
            d = c.double().reshape(-1)  # exact: every float dtype, bool, integers below 2**53
        else:
            views[0].copy_(c)
            d = views[1]
        if plan.std:
            # Shifted by the mean of the first m = min(n, 1024) values, which by Cauchy-Schwarz
            # lies within sqrt((n - m) / m) standard deviations of the mean, so that
            # sum (x - shift)^2 - (sum (x - shift))^2 / n cancels at most a factor n / m,
            # whatever mean/std is: 2**-53 n / 1024 relative at worst, below the rounding of
            # the n-term sums themselves. The second term corrects the shift's own rounding
            # (the corrected two-pass algorithm, its first pass over m values only).
            if shift is None:
                shift = d[:1024].mean()
                parts.append(shift)
            dev = d - shift if views is None else torch.sub(d, shift, out=views[2])
            parts += [dev.sum(), torch.dot(dev, dev)]
        elif plan.mean:
            parts.append(d.sum())
        if plan.l2 and not plan.std:
            parts.append(torch.dot(d, d))
        if plan.mean_abs:
            a = (d.abs_() if own else d.abs() if views is None else  # never the model's own
                 torch.abs(d, out=views[1]))
            parts.append(a.sum())
    return len(chunks)


def _finish(plan: _Plan, n: int, chunks: int, raw: list[float]) -> dict[str, float]:
    """The statistics from ``_sums``'s partial results, in Python's float64 arithmetic."""
    it = iter(raw)
    shift = next(it) if plan.std else 0.0
    sums, dev_squares, squares, abs_sums = [], [], [], []
    for _ in range(chunks):
        if plan.mean:
            sums.append(next(it))
        if plan.std:
            dev_squares.append(next(it))
        if plan.l2 and not plan.std:
            squares.append(next(it))
        if plan.mean_abs:
            abs_sums.append(next(it))
    out = {"numel": n}
    if plan.mean:
        out["mean"] = shift + sum(sums) / n
    if plan.std:  # n > 1. The variance is >= 0 in exact arithmetic (Cauchy-Schwarz); a
        # constant tensor can round below 0. max() keeps a nan.
        var = (sum(dev_squares) - sum(sums) ** 2 / n) / (n - 1)
        out["std"] = math.sqrt(max(var, 0.0))
    if plan.l2:
        # with std: sum x^2 = sum (x - shift)^2 + 2 shift sum (x - shift) + n shift^2 saves a
        # pass; with |mean - shift| <= k std, k = sqrt((n - m) / m) (see _moments), it cancels
        # at most a factor 1 + k + 2 k^2 <= 2 n / m
        out["l2"] = math.sqrt(sum(squares) if not plan.std else
                              sum(dev_squares) + 2 * shift * sum(sums) + n * shift * shift)
        out["rms"] = out["l2"] / math.sqrt(n)
    if plan.mean_abs:
        out["mean_abs"] = sum(abs_sums) / n
    if plan.extremes:
        out["min"], out["max"] = next(it), next(it)
    return out
