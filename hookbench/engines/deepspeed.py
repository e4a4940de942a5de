"""DeepSpeed ZeRO stage 2 training a workload on the ranks, beside DDP and FSDP2 (the ``peers``
extra, i.e. deepspeed; without it the row is SKIPPED, naming it).

The workload's own loop as far as DeepSpeed runs one: each rank's share of every batch and its
random numbers (as ``loop.train``), the workload's param groups, scheduler (stepped by
DeepSpeed at each optimizer step) and clipping (DeepSpeed's ``gradient_clipping``), and
``ACCUMULATION`` micro-batches a step through DeepSpeed's own ``gradient_accumulation_steps``:
it scales each loss and reduces every micro-batch's gradients into the rank's partition (it has
no no-sync), so its sums come in another order than DDP's, and it is held to DDP within the
tolerance and the noise floor, not bit for bit. fp32 only: DeepSpeed's bf16 and fp16 modes train
low-precision parameters, which is not the workload's autocast. The config is the zoo peer's
(``hookbench.measure.peers.deepspeed_zero2.config``: stage 2, every default that matters
stated).

    available     None, or why deepspeed cannot be used here (the SKIPPED row's reason)
    cannot_train  why DeepSpeed cannot train a workload as hookbench compares it, or None
    trajectory    on every rank: the full parameters after every step
"""

from __future__ import annotations

import importlib.util
from typing import Any

from hookbench.core.workload import Workload, of
from hookbench.measure.peers import deepspeed_zero2 as peer
from hookbench.measure.zero2_runs import local_batch

__all__ = ["available", "cannot_train", "trajectory"]

BUCKET = 5 * 10**8  # DeepSpeed's default reduce bucket, in elements: one bucket for these models


def available() -> str | None:
    """Why the DeepSpeed row is SKIPPED here (deepspeed not installed), or None. Found without
    importing it: its import picks an accelerator for the whole process."""
    return None if importlib.util.find_spec("deepspeed") is not None else peer.MISSING


def cannot_train(workload: Workload) -> str | None:
    """Why DeepSpeed cannot train ``workload`` the way the engines are compared, or None."""
    if workload.precision != "fp32":
        return (f"DeepSpeed's {workload.precision} mode trains {workload.precision} "
                f"parameters with fp32 masters, not the workload's autocast")
    return None


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               steps: int, accumulation: int = 1, **_: Any) -> dict[str, Any]:
    """Train ``spec`` with DeepSpeed ZeRO-2 on this rank's share of each global batch (run on
    every rank): ``{"snapshots": [the full parameters after every step]}``."""
    deepspeed = peer._deepspeed()  # DS_ACCELERATOR=cpu on a gloo rank; MissingPrerequisite
    spec = of(spec)
    model = spec.build()
    params = spec.optimizer_params(model)
    optimizer = optimizer_class(list(model.parameters()) if params is None else params,
                                **kwargs)
    ds, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=spec.scheduler(optimizer),
        config=peer.config(spec.batch_size // world, BUCKET, accumulation,
                           spec.clip_grad_norm or 0.0))
    snapshots = []
    try:
        for i in range(steps):
            for micro in range(accumulation):
                index = i * accumulation + micro
                x, y = local_batch(spec, index, rank, world, "cpu")
                ds.backward(spec.compute_loss(ds, x, y, (index, rank)))  # it divides by GAS
                ds.step()  # an optimizer step at the accumulation boundary only
            if ds.global_steps != i + 1:
                raise RuntimeError(f"DeepSpeed took {ds.global_steps} optimizer steps in "
                                   f"{i + 1} x {accumulation} micro-batches")
            snapshots.append({n: p.detach().cpu().clone()
                              for n, p in ds.module.named_parameters()})
    finally:
        ds.destroy()
    return {"snapshots": snapshots, "error": None}
