"""The training loop every engine runs on its ranks: the workload's own loop (its batches, loss,
random numbers, param groups, scheduler, clipping, loss scaling), with the engine's gradient
synchronisation switched off for all but the last micro-batch of a step, and what each
backward left recorded by the engine's ``observe``.

Every engine trains rank ``r`` on share ``r`` of each global batch (``zero2_runs.local_batch``)
on the random numbers that share draws (``Workload.forward_rng`` key ``(index, r)``), so the
engines, ZeRO-2 and the single-process reference see the same data and the same dropout masks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from hookbench.core.workload import Workload
from hookbench.measure.trace import RankTrace
from hookbench.measure.zero2_runs import local_batch

__all__ = ["ACCUMULATION", "Refused", "train", "wrapping"]

# Micro-batches per optimizer step in the engines' rows: the first under the engine's no-sync
# (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``), the second reduced.
# Two is the fewest that exercises both paths.
ACCUMULATION = 2


class Refused(Exception):
    """The engine will not wrap the model, by torch's design, in torch's words: what its
    wrapper raised before anything ran (``fully_shard``'s "doesn't support scalar
    parameters" on CLIP's 0-dim ``logit_scale``). Its row is a recorded refusal, gated as
    hookbench's own refusals are, never a failure of the check."""


def wrapping(engine: str, wrap: Callable[[], Any]) -> Any:
    """``wrap()``, the engine's wrapper around the model; ``Refused`` naming ``engine`` and
    torch's words where it raises the exceptions torch refuses a model with by design
    (``ValueError``, ``NotImplementedError``, and Python's ``TypeError`` where a unit's
    class cannot be subclassed in place). Anything else it raises is a failure."""
    try:
        return wrap()
    except (ValueError, NotImplementedError, TypeError) as e:
        # FSDP2 makes each unit an instance of a subclass of its own class, which Python
        # refuses for some classes ("__class__ assignment: ... object layout differs": a
        # module that derives from ABC first, as sentence-transformers' do, cpython#79229);
        # any other TypeError is no refusal
        if isinstance(e, TypeError) and "__class__ assignment" not in str(e):
            raise
        # torch's words whole, on one line (a refused module's repr spans several)
        raise Refused(f"{engine}: {type(e).__name__}: {' '.join(str(e).split())}") from None


def train(rank: int, world: int, spec: Workload, model: torch.nn.Module, wrapped: Any,
          optimizer: Any, device: str, steps: int, accumulation: int,
          no_sync: Callable[[], ContextManager], observe: Callable[[bool], dict[str, Any]],
          full_parameters: Callable[[], dict[str, torch.Tensor]],
          synced_backward: Callable[[], ContextManager] = contextlib.nullcontext,
          traced: RankTrace | None = None) -> dict[str, Any]:
    """Train ``wrapped`` (the engine's model; ``model`` the module whose parameters the
    optimizer holds) for ``steps`` optimizer steps of ``accumulation`` micro-batches. After
    each backward ``observe(synced)`` says what it left (hook calls, gradients); each synced
    backward runs inside ``synced_backward()`` (what watches its collectives); after each
    step ``full_parameters()`` gives every parameter whole, on the CPU. ``"trace"``: the
    rank's steps traced (``traced``, which the engine tells what reaches its collectives),
    which locate a change in them."""
    scheduler = spec.scheduler(optimizer)
    scaler = spec.grad_scaler(device)
    snapshots, after_backward = [], []
    traced = traced or RankTrace()
    for i in range(steps):
        for micro in range(accumulation):
            index = i * accumulation + micro
            synced = micro == accumulation - 1
            x, y = local_batch(spec, index, rank, world, device)
            with contextlib.nullcontext() if synced else no_sync():
                loss = spec.compute_loss(wrapped, x, y, (index, rank)) / accumulation
                with synced_backward() if synced else contextlib.nullcontext():
                    (loss if scaler is None else scaler.scale(loss)).backward()
            traced.micro((x, y), loss)
            after_backward.append(observe(synced))
            if synced:
                traced.synced({n: p.grad for n, p in model.named_parameters()})
        if spec.clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters()
                                            if p.grad is not None], spec.clip_grad_norm,
                                           foreach=False)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        snapshots.append(full_parameters())
        traced.stepped(model)
    return {"snapshots": snapshots, "after_backward": after_backward, "trace": traced.steps,
            "error": None}
