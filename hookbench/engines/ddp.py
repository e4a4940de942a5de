"""torch's ``DistributedDataParallel`` on a workload, as a team that outgrows one GPU runs it:
gradient accumulation under ``no_sync()``, the workload's own DDP settings (``Workload.ddp``;
by default ``find_unused_parameters=True``: a forward that skips layers at random, LayerDrop,
trains as on one device), and a communication hook that counts.

    trajectory        on every rank: the parameters after every step, per backward which
                      gradient buckets DDP's comm hook was handed and which parameters they
                      held, and what DDP reports running for each declared setting
    setting_problems  a declared setting DDP does not run: what torch reports differs, or
                      (``gradient_as_bucket_view``) the gradients are not views of the buckets

The hook is torch's own ``default_hooks.allreduce_hook`` (divide by the world size, all-reduce
SUM: DDP's built-in arithmetic), wrapped to record each call. What it shows is DDP's contract
with the hooks: under ``no_sync()`` no bucket is reduced; in a synced backward every bucket is
reduced once and every parameter's gradient travels in exactly one bucket.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hookbench.core.workload import of
from hookbench.engines.loop import Refused, train, wrapping
from hookbench.measure.zero2_runs import rank_device

__all__ = ["bucket_problems", "described", "options", "reported", "setting_problems",
           "trajectory", "wrap"]

# For each setting a workload may declare: the field of DDP's own report
# (``DistributedDataParallel._get_ddp_logging_data``, what its C++ reducer was built with) and
# the value the declaration means there.
_REPORTED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "find_unused_parameters": ("find_unused_parameters", bool),
    "static_graph": ("static_graph", bool),
    "gradient_as_bucket_view": ("gradient_as_bucket_view", bool),
    "bucket_cap_mb": ("bucket_cap_bytes", lambda mb: int(mb * 1024 * 1024)),
    "broadcast_buffers": ("broadcast_buffers", bool),
    "forward_sync_buffers": ("broadcast_buffers", bool),
}


def options(declared: dict[str, Any] | None) -> dict[str, Any]:
    """DDP's keyword arguments for a workload's ``ddp``: as declared, else hookbench's choice.
    That choice syncs no buffers: ZeRO-2 and FSDP2 broadcast none either, so BatchNorm
    statistics stay each rank's own everywhere. torch 2.14 renamed ``broadcast_buffers`` (a
    FutureWarning); its successor still syncs the buffers at init, where every rank's are equal
    anyway (the same seed builds the model)."""
    if declared is not None:
        return dict(declared)
    sync = ({"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else {"broadcast_buffers": False})
    return {"find_unused_parameters": True, **sync}


def wrap(model: torch.nn.Module, declared: dict[str, Any] | None = None
         ) -> DistributedDataParallel:
    """``model`` under DDP as the rows run it (``options``)."""
    return DistributedDataParallel(model, **options(declared))


def reported(ddp: DistributedDataParallel, declared: dict[str, Any] | None) -> dict[str, Any]:
    """What DDP reports running (its report's field -> value), for each declared setting it
    reports (``_REPORTED``)."""
    data = ddp._get_ddp_logging_data()
    return {_REPORTED[key][0]: data.get(_REPORTED[key][0])
            for key in declared or {} if key in _REPORTED}


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               steps: int, accumulation: int = 1, **_: Any) -> dict[str, Any]:
    """Train ``spec`` with DDP on this rank's share of each global batch (run on every rank),
    ``accumulation`` micro-batches per step, all but the last under ``no_sync()``. Returns the
    parameters after every step and, per backward, ``"buckets"``: for each comm-hook call the
    bucket's index and its parameters' names, in call order; ``{"torch_refuses": ...}`` where
    DDP refuses the model (``loop.Refused``)."""
    device = rank_device(rank)
    spec = of(spec)
    model = spec.build().to(device)
    try:
        ddp = wrapping("DistributedDataParallel", lambda: wrap(model, spec.ddp))
    except Refused as e:  # on every rank alike: the same model, the same words
        return {"torch_refuses": str(e), "error": None}
    names = {p: n for n, p in model.named_parameters()}
    calls: list[tuple[int, list[str]]] = []
    buffers: set[int] = set()  # the storages of the buckets handed to the hook

    def counting(state, bucket):  # unannotated: DDP checks the annotations it finds
        calls.append((bucket.index(), [names[p] for p in bucket.parameters()]))
        if bucket.buffer().layout == torch.strided:
            buffers.add(bucket.buffer().untyped_storage().data_ptr())
        # looked up on the module at each call, as DDP's own dispatch would find it
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting)
    params = spec.optimizer_params(model)
    optimizer = optimizer_class(list(model.parameters()) if params is None else params, **kwargs)

    views = bool((spec.ddp or {}).get("gradient_as_bucket_view"))

    def observe(synced: bool) -> dict[str, Any]:
        seen = {"synced": synced, "buckets": list(calls)}
        if views:  # dense gradients only: DDP reduces sparse ones outside its buckets
            grads = [p.grad for p in model.parameters()
                     if p.grad is not None and p.grad.layout == torch.strided]
            seen["grads_in_buckets"] = bool(grads) and all(
                g.untyped_storage().data_ptr() in buffers for g in grads)
        calls.clear()
        buffers.clear()
        return seen

    out = train(rank, world, spec, model, ddp, optimizer, device, steps, accumulation,
                ddp.no_sync, observe,
                lambda: {n: p.detach().cpu().clone() for n, p in model.named_parameters()})
    out["settings"] = reported(ddp, spec.ddp)
    return out


def described(settings: dict[str, Any]) -> str:
    """Settings in words: ``key=value, ...``."""
    return ", ".join(f"{key}={value!r}" for key, value in settings.items()) or "nothing"


def setting_problems(declared: dict[str, Any] | None, rank0: dict[str, Any]) -> list[str]:
    """Each declared setting DDP does not run (rank 0's ``trajectory``): what DDP reports
    differs from the declaration, or ``gradient_as_bucket_view=True`` and after a synced
    backward a gradient is not a view of the buckets the hook was handed."""
    problems = []
    for key, value in (declared or {}).items():
        if key in _REPORTED:
            field, means = _REPORTED[key]
            ran = rank0["settings"].get(field)
            if ran is None or ran != means(value):
                problems.append(f"declared {key}={value!r}, DDP runs {field}={ran}")
    if (declared or {}).get("gradient_as_bucket_view"):
        apart = [i for i, seen in enumerate(rank0["after_backward"])
                 if seen["synced"] and not seen["grads_in_buckets"]]
        if apart:
            problems.append(f"declared gradient_as_bucket_view=True, but after backward "
                            f"{apart[0]} the gradients are not views of DDP's buckets")
    return problems


def bucket_problems(after_backward: list[dict[str, Any]], trainable: list[str]) -> list[str]:
    """What a DDP run's comm-hook calls show wrong: a bucket reduced under ``no_sync()``, a
    synced backward that reduced a bucket twice or a parameter in no bucket or in two."""
    for i, seen in enumerate(after_backward):
        indices = [index for index, _ in seen["buckets"]]
        if not seen["synced"]:
            if indices:
                return [f"backward {i} under no_sync(): buckets {indices} reduced"]
            continue
        carried = sorted(n for _, names in seen["buckets"] for n in names)
        twice = sorted({b for b in indices if indices.count(b) > 1})
        if twice or carried != sorted(trainable):
            return [f"backward {i}: bucket{'s' * (len(twice) > 1)} {twice} reduced more than "
                    f"once" if twice else f"backward {i}: the buckets carried "
                    f"{len(carried)} gradients for {len(trainable)} trainable parameters"]
    return []
