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
also when forward raises. ``global_hook=True`` uses ``register_module_forward_hook`` (one global
hook, filtered to this model) instead of one hook per module.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from typing import Any, Callable, Iterable, Iterator, Union

import torch
from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.hooks import RemovableHandle

__all__ = ["STATS", "ActivationCapture", "Record", "flatten", "statistics"]

Selector = Union[str, type, Callable[[str, nn.Module], bool]]
STATS = ("l2", "rms", "mean", "mean_abs", "std", "min", "max", "numel")


def statistics(t: torch.Tensor, which: Iterable[str] = STATS) -> dict[str, float]:
    """The statistics ``which`` (a subset of ``STATS``) of a tensor, in float32 (float64 stays
    float64)."""
    return _Stats(tuple(which), t).resolve()


class _Stats:
    """Statistics computed on the device, read only when first asked for: a hook that
    synchronised on every module call would stall a GPU pipeline. ``ActivationCapture.table``
    reads all of a forward's at once (``_read_all``)."""

    def __init__(self, which: tuple[str, ...], t: torch.Tensor) -> None:
        x = t.detach()
        x = x.double() if x.dtype == torch.float64 else x.float()
        self.which, self.n = which, x.numel()
        self.numbers = [s for s in which if s != "numel"]
        self.values = _reductions(x, set(which), self.numbers) if self.n else None

    def resolve(self) -> dict[str, float]:
        _read_all([self])  # read once, then kept
        return dict(self.values)

    def _fill(self, numbers: list[float]) -> None:
        out = dict(zip(self.numbers, numbers))
        self.values = {s: self.n if s == "numel" else out[s] for s in self.which}


def _read_all(stats: Iterable[_Stats]) -> None:
    """Read every unread ``_Stats`` with one device-to-host copy per device (one sync), not
    one per record. float32 values pass through float64 exactly."""
    by_device: dict[torch.device, list[_Stats]] = {}
    for st in stats:
        if st.values is None:  # an empty tensor has no statistics
            st._fill([float("nan")] * len(st.numbers))
        elif not isinstance(st.values, dict):
            by_device.setdefault(st.values.device, []).append(st)
    for group in by_device.values():
        numbers = torch.cat([st.values.double() for st in group]).tolist()
        for st in group:
            st._fill(numbers[:len(st.numbers)])
            numbers = numbers[len(st.numbers):]


def _reductions(x: torch.Tensor, need: set[str], numbers: list[str]) -> torch.Tensor:
    # The hook runs on every module call, so this is the capture's overhead: only the
    # reductions asked for, each a single cheap kernel (on CPU torch.std alone costs more than
    # all of them). std is derived from the sum of squares, which loses relative precision
    # ~1e-7 * (mean / std)^2 when |mean| >> std.
    n = x.numel()
    values: dict[str, torch.Tensor] = {}
    if need & {"l2", "rms", "std"}:
        values["l2"] = torch.linalg.vector_norm(x)
        values["rms"] = values["l2"] / n ** 0.5
    if need & {"mean", "std"}:
        values["mean"] = x.mean()
    if "std" in need:
        var = (values["l2"].square() - n * values["mean"].square()).clamp(min=0)
        values["std"] = (var / max(n - 1, 1)).sqrt()
    if "mean_abs" in need:
        values["mean_abs"] = x.abs().mean()
    if need & {"min", "max"}:
        values["min"], values["max"] = torch.aminmax(x)
    return torch.stack([values[s] for s in numbers])


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
            those wanted (fewer statistics, less overhead: each is a pass over the output).
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
        self.stats = STATS if stats is True else tuple(stats or ())
        unknown = set(self.stats) - set(STATS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; choose from {STATS}")
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
        self._handles: list[RemovableHandle] = []

    # -- lifetime ----------------------------------------------------------------------------

    def __enter__(self) -> ActivationCapture:
        try:
            if self.global_hook:
                self._handles.append(module_mod.register_module_forward_hook(self._hook))
            else:
                modules = {id(m): m for m in self.model.modules()}
                for key in self.names:
                    self._handles.append(modules[key].register_forward_hook(self._hook))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove every hook (forward, and the gradient hooks of outputs not yet reached)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        """Forget what was recorded; call indices restart at 0 (say, before the next step)."""
        self.records.clear()
        self._calls.clear()

    # -- hook --------------------------------------------------------------------------------

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:  # the global hook sees every module of every model
            return
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        for path, t in flatten(output):
            record = Record(name, call, path, tuple(t.shape), t.dtype, self._keep(t))
            self.records.append(record)
            if self.grads and t.requires_grad:
                self._handles.append(t.register_hook(self._grad_hook(record)))

    def _grad_hook(self, record: Record):
        def hook(grad: torch.Tensor) -> None:
            record.raw_grad = self._keep(grad)

        return hook

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
    if isinstance(selectors, (str, type)) or callable(selectors):
        selectors = [selectors]
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
