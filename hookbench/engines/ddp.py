"""torch's ``DistributedDataParallel`` on a workload, as a team that outgrows one GPU runs it:
gradient accumulation under ``no_sync()``, ``find_unused_parameters=True`` (a forward that skips
layers at random, LayerDrop, trains as on one device), and a communication hook that counts.

    trajectory   on every rank: the parameters after every step, and per backward which
                 gradient buckets DDP's comm hook was handed and which parameters they held

The hook is torch's own ``default_hooks.allreduce_hook`` (divide by the world size, all-reduce
SUM: DDP's built-in arithmetic), wrapped to record each call. What it shows is DDP's contract
with the hooks: under ``no_sync()`` no bucket is reduced; in a synced backward every bucket is
reduced once and every parameter's gradient travels in exactly one bucket.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hookbench.core.workload import of
from hookbench.engines.loop import Refused, train, wrapping
from hookbench.measure.zero2_runs import rank_device

__all__ = ["bucket_problems", "trajectory", "wrap"]


def wrap(model: torch.nn.Module) -> DistributedDataParallel:
    """``model`` under DDP as the rows run it. No buffer sync: ZeRO-2 and FSDP2 broadcast none
    either, so BatchNorm statistics stay each rank's own everywhere. torch 2.14 renamed
    ``broadcast_buffers`` (a FutureWarning); its successor still syncs the buffers at init,
    where every rank's are equal anyway (the same seed builds the model)."""
    sync = ({"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else {"broadcast_buffers": False})
    return DistributedDataParallel(model, find_unused_parameters=True, **sync)


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
        ddp = wrapping("DistributedDataParallel", lambda: wrap(model))
    except Refused as e:  # on every rank alike: the same model, the same words
        return {"torch_refuses": str(e), "error": None}
    names = {p: n for n, p in model.named_parameters()}
    calls: list[tuple[int, list[str]]] = []

    def counting(state, bucket):  # unannotated: DDP checks the annotations it finds
        calls.append((bucket.index(), [names[p] for p in bucket.parameters()]))
        # looked up on the module at each call, as DDP's own dispatch would find it
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting)
    params = spec.optimizer_params(model)
    optimizer = optimizer_class(list(model.parameters()) if params is None else params, **kwargs)

    def observe(synced: bool) -> dict[str, Any]:
        seen = {"synced": synced, "buckets": list(calls)}
        calls.clear()
        return seen

    return train(rank, world, spec, model, ddp, optimizer, device, steps, accumulation,
                 ddp.no_sync, observe,
                 lambda: {n: p.detach().cpu().clone() for n, p in model.named_parameters()})


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
