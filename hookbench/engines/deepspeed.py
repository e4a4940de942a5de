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
stated) with the team's own (``Workload.deepspeed``) merged over it (``config``), and what
DeepSpeed's ZeRO optimizer was built with is read back for every declared setting it keeps
(``_RUNS``), so that a setting DeepSpeed ignores fails the row (``setting_problems``).

    available         None, or why deepspeed cannot be used here (the SKIPPED row's reason)
    cannot_train      why DeepSpeed cannot train a workload as hookbench compares it, or None
    config            the config the row runs: hookbench's, the workload's merged over it
    trajectory        on every rank: the full parameters after every step, and what runs
    setting_problems  each declared setting DeepSpeed does not run, in words
    described         the declared settings and what runs, in words
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

from hookbench.core.deepspeed_import import MISSING, load
from hookbench.core.workload import Workload, of
from hookbench.measure.peers import deepspeed_zero2 as peer
from hookbench.measure.zero2_runs import local_batch

__all__ = ["available", "cannot_train", "config", "described", "setting_problems",
           "trajectory"]

BUCKET = 5 * 10**8  # DeepSpeed's default reduce bucket, in elements: one bucket for these models

# For each declared setting DeepSpeed keeps where it can be read back: (its path in the
# config, the attribute of DeepSpeed's ZeRO stage-1/2 optimizer built from it, what the
# declared value means there). Another declared key is passed on as given and said so.
_DTYPES = {"fp32": "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}
_RUNS: dict[tuple[str, ...], tuple[str, Callable[[Any], Any]]] = {
    ("zero_optimization", "stage"): ("partition_gradients", lambda stage: stage >= 2),
    **{("zero_optimization", key): (key, int) for key in
       ("reduce_bucket_size", "allgather_bucket_size")},
    **{("zero_optimization", key): (key, bool) for key in
       ("overlap_comm", "contiguous_gradients", "reduce_scatter", "round_robin_gradients")},
    ("communication_data_type",): ("communication_data_type",
                                   lambda name: _DTYPES.get(name, name)),
    ("prescale_gradients",): ("postscale_gradients", lambda pre: not pre),
    ("gradient_predivide_factor",): ("gradient_predivide_factor", float),
}


def available() -> str | None:
    """Why the DeepSpeed row is SKIPPED here (deepspeed not installed), or None. Found without
    importing it: its import picks an accelerator for the whole process."""
    return None if importlib.util.find_spec("deepspeed") is not None else MISSING


def cannot_train(workload: Workload) -> str | None:
    """Why DeepSpeed cannot train ``workload`` the way the engines are compared, or None."""
    if workload.precision != "fp32":
        return (f"DeepSpeed's {workload.precision} mode trains {workload.precision} "
                f"parameters with fp32 masters, not the workload's autocast")
    return None


def config(workload: Workload, world: int, accumulation: int) -> dict[str, Any]:
    """The config the DeepSpeed row runs: the peer's (stage 2, fp32, one bucket, the
    workload's batch share, accumulation and clipping), the workload's own merged over it,
    key by key inside ``zero_optimization``."""
    cfg = peer.config(workload.batch_size // world, BUCKET, accumulation,
                      workload.clip_grad_norm or 0.0)
    declared = workload.deepspeed or {}
    zero = {**cfg["zero_optimization"], **declared.get("zero_optimization", {})}
    return {**cfg, **declared, "zero_optimization": zero}


def _declared(workload: Workload) -> dict[tuple[str, ...], Any]:
    """The workload's DeepSpeed settings, each by its path in the config."""
    return {path: value for key, v in (workload.deepspeed or {}).items()
            for path, value in ([((key, k), w) for k, w in v.items()]
                                if key == "zero_optimization" else [((key,), v)])}


def _reported(ds: Any, workload: Workload) -> dict[str, str]:
    """What DeepSpeed's ZeRO optimizer was built with, for each declared setting it keeps."""
    return {_RUNS[path][0]: str(getattr(ds.optimizer, _RUNS[path][0], None))
            for path in _declared(workload) if path in _RUNS}


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               steps: int, accumulation: int = 1, **_: Any) -> dict[str, Any]:
    """Train ``spec`` with DeepSpeed ZeRO-2 on this rank's share of each global batch (run on
    every rank): ``{"snapshots": [the full parameters after every step], "settings": what
    its ZeRO optimizer runs for each declared setting}``."""
    deepspeed = load()  # DS_ACCELERATOR=cpu on a gloo rank; MissingPrerequisite
    spec = of(spec)
    model = spec.build()
    params = spec.optimizer_params(model)
    optimizer = optimizer_class(list(model.parameters()) if params is None else params,
                                **kwargs)
    ds, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=spec.scheduler(optimizer),
        config=config(spec, world, accumulation))
    settings = _reported(ds, spec)
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
    return {"snapshots": snapshots, "settings": settings, "error": None}


def setting_problems(workload: Workload, rank0: dict[str, Any]) -> list[str]:
    """Each declared setting DeepSpeed's ZeRO optimizer does not run (rank 0's
    ``trajectory``), in words."""
    problems = []
    for path, value in _declared(workload).items():
        if path in _RUNS:
            field, means = _RUNS[path]
            ran = rank0["settings"].get(field)
            if ran != str(means(value)):
                problems.append(f"declared {'.'.join(path)}={value!r}, DeepSpeed's ZeRO "
                                f"optimizer runs {field}={ran}")
    return problems


def described(workload: Workload, rank0: dict[str, Any]) -> str:
    """The declared settings and what DeepSpeed runs for them, in words."""
    declared = _declared(workload)
    unread = [".".join(path) for path in declared if path not in _RUNS]
    said = ", ".join(f"{'.'.join(path)}={value!r}" for path, value in declared.items())
    return (f"declared {said}; DeepSpeed's ZeRO optimizer runs "
            f"{', '.join(f'{k}={v}' for k, v in rank0['settings'].items()) or 'nothing read'}"
            + (f"; passed as given, not read back: {', '.join(unread)}" if unread else ""))
