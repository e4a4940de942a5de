"""Activations offloaded (and optionally compressed) through saved-tensor hooks.

Autograd keeps every tensor a backward formula needs from the end of its op in forward to its
use in backward; at real batch sizes those activations, not the parameters or gradients, are
what a step runs out of memory on. ``torch.autograd.graph.saved_tensors_hooks`` lets a pack hook
replace each saved tensor by anything and an unpack hook give the tensor back when backward
needs it. ``ActivationOffload`` packs each saved activation of at least ``min_bytes`` into host
memory and unpacks it back onto its device, as ``torch.autograd.graph.save_on_cpu`` and
torchtune's ``OffloadActivations`` do, optionally compressed::

    with ActivationOffload(model):                  # lossless: gradients bit for bit the same
        loss_fn(model(x), y).backward()

    with ActivationOffload(model, compress="bf16"):  # float32 activations kept as bfloat16
        ...

What it handles, and why:

* parameters (and views of them: ``weight.t()`` in a linear layer) are left as they are: they
  stay alive anyway, a copy would only cost host memory and time. ``model`` names them; without
  it, any leaf that requires grad counts as one;
* a tensor saved twice (``x * x`` saves ``x`` twice) is copied once: its second pack returns the
  first one's copy, kept while either is in use;
* a tensor unpacked twice (a saved tensor used by two backward formulas, or a graph kept with
  ``retain_graph=True``) is brought back each time, from the same host copy;
* an in-place change of a saved tensor after it was saved raises in backward, in torch's own
  words: autograd checks no version counter while saved-tensor hooks are active (identity
  hooks and ``save_on_cpu`` let it through silently), so unpack checks it;
* on CUDA the device-to-host copy runs on a side stream into pinned memory, overlapping the
  forward; the device tensor is kept from reuse until the copy is done (``record_stream``),
  and unpack waits for it;
* nested in non-reentrant activation checkpointing, the checkpoint's own saved-tensor hooks are
  the innermost and take precedence: what a checkpointed block saves is recomputed, not
  offloaded; the rest of the model is offloaded. Reentrant checkpointing runs its forward
  without grad (nothing is saved) and recomputes in backward, after this context has exited;
* under ``torch.compile`` the compiled graph's saved tensors are offloaded. While it traces,
  torch 2.4 runs the hooks on the tracer's fake tensors too (pytorch#113263): those are kept,
  as a compressed copy made there would be traced into the graph and applied again.

Compression (``compress``), float32 tensors only, never parameters or non-float tensors:

* ``"bf16"``: rounded to bfloat16; each element within 2**-8 of itself (relative): bfloat16
  keeps 8 significant bits and rounds to nearest, half an ulp of 2**-7 relative;
* ``"int8"``: per tensor, ``q = round(x / s)`` with ``s = max|x| / 127``; each element within
  ``s / 2`` (absolute), and float32's rounding of ``s``, ``x / s`` and ``q * s``: at most
  ``(1 + 2**-15) s / 2``. An all-zero tensor is stored as zeros.

Backward then differentiates at the decompressed values, so gradients differ from the exact
ones by what the formulas do with those errors; tests/mechanisms/test_activation_offload.py states
and checks the resulting tolerance per mode.

Counting: ``packed`` (saved tensors offloaded), ``kept`` (left on the device), ``unpacked``
(brought back), ``host_bytes`` (live host copies, in bytes) and ``host_tensors()`` (the live
copies, which a memory tracker counts as host memory, not device memory).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["COMPRESSIONS", "ActivationOffload", "copying_to_host"]

COMPRESSIONS = (None, "bf16", "int8")
_COPYING = threading.local()


def copying_to_host() -> bool:
    """Whether the tensors being created now are an ``ActivationOffload``'s host copies: what
    a memory tracker that sees every allocation (a ``TorchDispatchMode``) needs to count them as
    host memory, not device memory, where both are the CPU (fake tensors, CPU training)."""
    return getattr(_COPYING, "active", False)


@contextlib.contextmanager
def _host_copy() -> Iterator[None]:
    _COPYING.active = True
    try:
        yield
    finally:
        _COPYING.active = False


@dataclass(eq=False)
class _Saved:
    """One saved tensor as packed: the tensor itself (kept on its device) or its host copy
    (``host``, with what unpack needs to rebuild it), and the version it was saved at."""

    source: weakref.ref  # the saved tensor, to check its version counter at unpack
    version: int
    kept: torch.Tensor | None = None
    host: torch.Tensor | None = None
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    scale: torch.Tensor | None = None  # int8: the per-tensor scale
    copied: Any = None  # CUDA: the event after which ``host`` holds the data


class ActivationOffload(saved_tensors_hooks):
    """Context manager: every tensor autograd saves inside it, of at least ``min_bytes``,
    lives in host memory until backward needs it.

    Args:
        model: the module whose parameters stay where they are (optional; without it every
            leaf tensor that requires grad does).
        min_bytes: smaller saved tensors stay on the device (the copy would cost more than it
            saves; torchtune's default is 1024).
        compress: None (lossless), "bf16" or "int8", for float32 tensors (module docstring).
        pin_memory: CUDA only: pinned host copies, copied on a side stream.
    """

    def __init__(self, model: nn.Module | None = None, *, min_bytes: int = 1024,
                 compress: str | None = None, pin_memory: bool = True) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {min_bytes!r}")
        if compress not in COMPRESSIONS:
            raise ValueError(f"compress must be one of {COMPRESSIONS}, got {compress!r}")
        self.min_bytes, self.compress, self.pin_memory = min_bytes, compress, pin_memory
        # Storages, not tensors: a view of a parameter is a new tensor on the same storage.
        # By the storage object (one per storage while it lives), not its data pointer, which
        # fake tensors do not have.
        self._parameters = ({id(p.untyped_storage()) for p in model.parameters()}
                            if model is not None else None)
        self._copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._sources: dict[int, weakref.ref] = {}  # id(tensor) -> the tensor, while alive
        self._host: weakref.WeakSet = weakref.WeakSet()
        self._stream: Any = None
        self.packed = self.kept = self.unpacked = 0
        super().__init__(self._pack, self._unpack)

    # -- what stays --------------------------------------------------------------------------

    def _is_parameter(self, t: torch.Tensor) -> bool:
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return True
        return (self._parameters is not None
                and id(t.untyped_storage()) in self._parameters)

    def _stays(self, t: torch.Tensor) -> bool:
        # While torch.compile traces: torch 2.4 runs the hooks then too, on the tracer's fake
        # tensors (pytorch#113263; 2.5 disables them, #123196). Offloaded there, a compressed
        # copy would be traced into the graph and applied again to the real tensors.
        return (t.device.type == "meta" or t.is_sparse or self._is_parameter(t)
                or t.untyped_storage().nbytes() < self.min_bytes
                or torch._guards.TracingContext.try_get() is not None)

    # -- the hooks ----------------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> _Saved:
        if self._stays(t):
            self.kept += 1
            return _Saved(weakref.ref(t), t._version, kept=t)
        key = id(t)
        source = self._sources.get(key)
        if source is not None and source() is t and key in self._copies:
            saved = self._copies[key]
            if saved.version == t._version:
                return saved  # saved before, unchanged since: one copy serves both
        saved = self._offload(t)
        self._copies[key] = saved
        self._sources[key] = weakref.ref(t, lambda _, key=key: self._sources.pop(key, None))
        self.packed += 1
        return saved

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        # Autograd checks no version counter while saved-tensor hooks are active (pinned in
        # hookbench.measure.hook_contract): without this, an in-place change of a kept tensor after
        # it
        # was saved would silently enter backward. torch's own words, as without hooks.
        source = saved.source()
        if source is not None and source._version != saved.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{source.type()} {list(source.shape)}] is at version "
                f"{source._version}; expected version {saved.version} instead "
                f"(ActivationOffload checks this itself: autograd does not while saved-tensor "
                f"hooks are active)")
        if saved.kept is not None:
            return saved.kept
        self.unpacked += 1
        if saved.copied is not None:  # the side stream's copy must be complete
            torch.cuda.current_stream(saved.device).wait_event(saved.copied)
        # A copy also on CPU, where host and device are one memory: what the device gets back
        # is a new tensor, as on CUDA, so that a tracker counts it as device memory again.
        # Asynchronous only from pinned memory, which only the CUDA path makes (not asked with
        # is_pinned(): fake tensors have none on torch 2.4).
        pinned = saved.copied is not None and self.pin_memory
        t = saved.host.to(saved.device, non_blocking=pinned, copy=True)
        if saved.scale is not None:
            return t.to(saved.dtype) * saved.scale.to(saved.device)
        return t.to(saved.dtype)

    # -- copies ---------------------------------------------------------------------------------

    def _compressed(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.compress is None or t.dtype != torch.float32:
            return t, None
        if self.compress == "bf16":
            return t.to(torch.bfloat16), None
        scale = t.detach().abs().amax() / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all zeros: q = 0
        return torch.round(t / scale).to(torch.int8), scale

    def _offload(self, t: torch.Tensor) -> _Saved:
        detached = t.detach()
        if t.device.type != "cuda":  # CPU (and fake tensors): the compressed value is the copy
            with _host_copy():
                value, scale = self._compressed(detached)
                host = value.clone() if value is detached else value
            saved = _Saved(weakref.ref(t), t._version, host=host, device=t.device,
                           dtype=t.dtype, scale=scale)
        else:
            value, scale = self._compressed(detached)
            saved = _Saved(weakref.ref(t), t._version, device=t.device, dtype=t.dtype)
            if self._stream is None:
                self._stream = torch.cuda.Stream(t.device)
            stream, current = self._stream, torch.cuda.current_stream(t.device)
            with _host_copy():
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=self.pin_memory)
            stream.wait_stream(current)  # the tensor (and its compression) is computed
            with torch.cuda.stream(stream), _host_copy():  # copy_ returns the host tensor
                host.copy_(value, non_blocking=self.pin_memory)
                copied = torch.cuda.Event()
                copied.record(stream)
            value.record_stream(stream)  # not reused by the allocator before the copy is done
            saved.host, saved.copied, saved.scale = host, copied, scale  # scale: 4 B, stays
        self._host.add(saved.host)
        return saved

    # -- counting -------------------------------------------------------------------------------

    def host_tensors(self) -> list[torch.Tensor]:
        """The live host copies."""
        return list(self._host)

    @property
    def host_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._host)
