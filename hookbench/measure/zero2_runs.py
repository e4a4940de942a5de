"""ZeRO-2 (``hookbench.mechanisms.zero2``) trained on spawned ranks: what the report, the gate, the
benchmarks and the tests run on each rank (through ``hookbench.core.launch``).

    trajectory / trajectories   train a spec with ZeRO-2 on this rank's share of each batch;
                                the parameters after every step and what each backward left
    Lockstep / follow           ZeRO-2 steps led by rank 0, to time a step from one process
    rank_memory                 this rank's measured memory for one step
    parity_cases                what parity with single-process training is checked on
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from hookbench.core.workload import batch_axes, cut, of, to_device
from hookbench.measure.faults import run_under
from hookbench.measure.memory import measure
from hookbench.measure.parity import compare
from hookbench.measure.trace import RankTrace
from hookbench.mechanisms import zero2 as zero2_mechanism
from hookbench.mechanisms.zero2 import Zero2
from hookbench.models.zoo import TinySpec

__all__ = ["PARITY_OPTIMIZERS", "PARITY_SPEC", "Lockstep", "follow",
           "local_batch", "mixed_reference", "own_masters", "own_part",
           "parity_cases", "rank_device", "rank_memory", "rank_problems", "trajectories",
           "trajectory"]

# What hookbench report and hookbench gate check ZeRO-2 parity on: 227 parameters, so that the
# shards cut parameters in two, and 50-element buckets, so that a backward reduces several.
PARITY_SPEC = TinySpec(depth=3, width=8, batch_size=6)
PARITY_OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "foreach": False}),
                     "adam": (torch.optim.Adam, {"lr": 1e-2, "foreach": False})}


def parity_cases(fault: str | None = None) -> list[dict[str, Any]]:
    """``trajectory`` keyword arguments for each of ``PARITY_OPTIMIZERS``: 5 steps."""
    return [dict(spec=PARITY_SPEC, optimizer_class=cls, kwargs=kw, bucket_numel=50, steps=5,
                 fault=fault) for cls, kw in PARITY_OPTIMIZERS.values()]


def trajectories(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``trajectory`` for each case (its keyword arguments, and its ``fault``: injected by
    ``faults.run_under``'s rule) on this rank: one process start serves many configurations."""
    return [run_under(case.get("fault"), trajectory, rank, world,
                      **{k: v for k, v in case.items() if k != "fault"}) for case in cases]


def local_batch(spec: Any, index: int, rank: int, world: int, device: str):
    """This rank's share of global batch ``index`` of ``spec`` (a Workload or a TinySpec):
    inputs and target cut along every batch axis (``workload.cut``: a tensor's first
    dimension, a list's items)."""
    x, y = of(spec).data(index)
    axes = batch_axes((y, x))
    rows = axes[0][1] if axes else 0
    if rows % world:
        raise ValueError(f"batch of {rows} does not split over {world} ranks")
    b = rows // world
    share = slice(rank * b, (rank + 1) * b)
    return to_device(cut(x, share), device), to_device(cut(y, share), device)


def rank_device(rank: int) -> str:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


@contextlib.contextmanager
def _reaching(traced: RankTrace):
    """Tell ``traced`` what ZeRO-2 hands each reduction of a backward (the mechanism's
    module-level ``reduce_to_owner``, as a fault may have replaced it): so that a change
    located on the ranks is told apart, in backward or in the collective."""
    handed = zero2_mechanism.reduce_to_owner

    def reduce(chunk: torch.Tensor, owner: int, group: Any) -> None:
        traced.reach(f"reduce to rank {owner}", chunk)
        handed(chunk, owner, group)

    zero2_mechanism.reduce_to_owner = reduce
    try:
        yield
    finally:
        zero2_mechanism.reduce_to_owner = handed


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               bucket_numel: int, steps: int = 5, accumulation: int = 1,
               groups: list[tuple[list[str], dict]] | None = None,
               clipping: float = 0.0) -> dict[str, Any]:
    """Train ``spec`` with ZeRO-2 on this rank's share of each global batch (run it on every
    rank, e.g. through ``hookbench.core.launch.run``). Returns the full parameters after every
    step, and what each backward left behind: gradients on the model's parameters, the shard's
    gradient size, and the hook calls per parameter. ``groups``: param groups as (parameter
    names, options); a fault reaches it by ``hookbench.measure.faults.run_under``'s rule.
    ``clipping``: clip the global
    gradient norm to it before each step (``"grad_norms"``: the norms before clipping). In
    mixed precision also this rank's fp32 masters (``own_part``) before the first step
    (``"initial_masters"``) and after every step (``"masters"``); in fp16 the loss scale after
    every step (``"loss_scales"``)."""
    device = rank_device(rank)
    spec = of(spec)
    model = spec.build().to(device)
    scaler = spec.grad_scaler(device)
    snapshots: list[dict[str, torch.Tensor]] = []
    after_backward: list[dict[str, Any]] = []
    traced = RankTrace()  # what locates a change in this rank's steps
    result: dict[str, Any] = {"snapshots": snapshots, "after_backward": after_backward,
                              "grad_norms": [], "loss_scales": [], "trace": traced.steps,
                              "error": None}
    named = dict(model.named_parameters())
    params = None if groups is None else [{"params": [named[n] for n in names], **options}
                                          for names, options in groups]
    if params is None:
        params = spec.optimizer_params(model)
    clipping = clipping or spec.clip_grad_norm or 0.0
    with contextlib.ExitStack() as stack:
        try:
            zero = stack.enter_context(Zero2(model, optimizer_class, params,
                                             bucket_numel=bucket_numel, **kwargs))
        except (ValueError, TypeError) as e:  # its argument checks, alike on every rank and
            # before any collective: a refusal in words, returned so that a row records it
            return {**result, "refused": f"{type(e).__name__}: {e}"}
        scheduler = spec.scheduler(zero.optimizer)
        result.update(shard_numel=sum(f.shard_numel for f in zero.flats))
        mixed = zero.param_dtype is not None
        if zero.loss_scale is not None:  # fp16 mixed precision scales its own loss
            scaler = None
        if mixed:
            result.update(initial_masters=own_masters(zero), masters=[])
        for i in range(steps):
            for micro in range(accumulation):
                index = i * accumulation + micro
                x, y = local_batch(spec, index, rank, world, device)
                zero.hook_calls.clear()  # so that a backward whose hooks never fire shows
                # the random numbers (dropout) the reference draws for this share
                try:
                    loss = spec.compute_loss(model, x, y, (index, rank)) / accumulation
                except (ValueError, RuntimeError) as e:
                    if index:
                        raise
                    # the first forward, where Zero2 refuses what it sees only then (a
                    # reentrant checkpoint in the graph), nothing reduced or stepped yet
                    return {**result, "refused": f"{type(e).__name__}: {e}"}
                if zero.loss_scale is not None:
                    loss = zero.scale(loss)
                elif scaler is not None:
                    loss = scaler.scale(loss)
                with _reaching(traced):
                    loss.backward()
                traced.micro((x, y), loss)
                after_backward.append({
                    "param_grads": [n for n, p in model.named_parameters()
                                    if p.grad is not None],
                    "shard_grad_numel": sum(f.grad.numel() for f in zero.flats
                                            if f.grad is not None),
                    "hook_calls": dict(zero.hook_calls),
                })
            # this rank's shards of the reduced gradients, before the step
            traced.synced({f"shard {k} of the flat gradients": f.grad
                           for k, f in enumerate(zero.flats)})
            if clipping:
                if scaler is not None:
                    scaler.unscale_(zero)
                result["grad_norms"].append(float(zero.clip_grad_norm_(clipping)))
            if scaler is None:
                zero.step()
            else:  # every rank skips, or takes, the step alike (hookbench.mechanisms.zero2)
                scaler.step(zero)
                scaler.update()
            zero.zero_grad()
            if scheduler is not None:
                scheduler.step()
            snapshots.append({n: p.detach().cpu().clone()
                              for n, p in model.named_parameters()})
            traced.stepped(model)
            if mixed:
                result["masters"].append(own_masters(zero))
            if zero.loss_scale is not None:
                result["loss_scales"].append(float(zero.loss_scale))
        result["full_state"] = None if zero.simulated else zero.full_state_dict()
    return result


def own_part(flat: torch.Tensor, shard_numel: int, rank: int,
             numel: int) -> tuple[int, torch.Tensor]:
    """(start in the whole flat buffer, a copy of the elements that are parameters, not
    padding) of this rank's partition ``flat`` of ``shard_numel`` elements, of a buffer whose
    first ``numel`` elements are parameters. Concatenated over the ranks: the parameters."""
    start = rank * shard_numel
    return start, flat[:max(0, min(shard_numel, numel - start))].detach().cpu().clone()


def own_masters(zero: Zero2) -> list[tuple[int, torch.Tensor]]:
    """This rank's fp32 masters (mixed precision), per param group (``own_part``)."""
    return [own_part(f.master, f.shard_numel, zero.rank, sum(p.numel() for p in f.params))
            for f in zero.flats]


def rank_problems(ranks: list[dict[str, Any]]) -> list[str]:
    """What every rank's result of one ``trajectory`` shows wrong: an error it returned, a
    backward that left a gradient on a parameter or did not run every hook exactly once, a
    rank whose parameters are not rank 0's."""
    problems = [f"rank {r}: {got['error']}" for r, got in enumerate(ranks) if got["error"]]
    if problems:
        return problems
    for r, got in enumerate(ranks):
        for i, after in enumerate(got["after_backward"]):
            if after["param_grads"] or set(after["hook_calls"].values()) != {1}:
                problems.append(f"rank {r}, backward {i}: gradients left on "
                                f"{after['param_grads']}, hook calls {after['hook_calls']}")
                break
        if not compare(got["snapshots"], ranks[0]["snapshots"]).bit_exact:
            problems.append(f"rank {r} holds other parameters than rank 0")
    return problems


def mixed_reference(spec: Any, optimizer_class: type, kwargs: dict, steps: int, world: int,
                    param_dtype: torch.dtype, reduce_dtype: torch.dtype | None = None,
                    accumulation: int = 1, loss_scaling: dict | None = None,
                    clipping: float = 0.0) -> dict[str, Any]:
    """What ``Zero2(param_dtype=..., reduce_dtype=...)`` on ``world`` ranks computes, in one
    process and without sharding: a ``param_dtype`` model, fp32 masters of every trainable
    parameter stepped by a standard optimizer, and each micro-batch's gradient the sum over
    the ranks' shares (inputs cast to ``param_dtype``, as Zero2 casts them; each a
    ``param_dtype`` backward) in ``reduce_dtype``, rank 0 first,
    divided by ``world``, accumulated in ``reduce_dtype`` and converted to fp32 for the step.
    fp16: a ``torch.amp.GradScaler`` (``loss_scaling``: its options) scales each loss, unscales
    the masters' gradients and skips a step on an inf/NaN. ``clipping``:
    ``torch.nn.utils.clip_grad_norm_`` on the masters' (unscaled) gradients before each step.
    The workload's param groups and scheduler apply to the masters. Returns the parameters
    after every step, the final masters, flat, the masters by name after every step
    (``"master_steps"``), and (fp16) the loss scale after every step."""
    reduce_dtype = reduce_dtype or param_dtype
    model = of(spec).build()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    masters = [p.detach().clone() for p in trainable]
    master_of = {id(p): m for p, m in zip(trainable, masters)}
    groups = of(spec).optimizer_params(model)  # the workload's param groups, on the masters
    groups = masters if groups is None else [
        {**g, "params": [master_of[id(p)] for p in g["params"] if id(p) in master_of]}
        for g in groups]
    for p in trainable:
        p.data = p.data.to(param_dtype)
    opt = optimizer_class(groups, **kwargs)
    scheduler = of(spec).scheduler(opt)
    scaler = (torch.amp.GradScaler("cpu", **(loss_scaling or {}))
              if param_dtype == torch.float16 else None)
    snapshots, scales, master_steps = [], [], []
    for i in range(steps):
        total = [torch.zeros(p.numel(), dtype=reduce_dtype) for p in trainable]
        for micro in range(accumulation):
            summed = [torch.zeros(p.numel(), dtype=reduce_dtype) for p in trainable]
            for rank in range(world):
                index = i * accumulation + micro
                x, y = local_batch(spec, index, rank, world, "cpu")
                x = tree_map(lambda t: t.to(param_dtype) if t.is_floating_point() else t, x)
                loss = of(spec).compute_loss(model, x, y, (index, rank)) / accumulation
                (loss if scaler is None else scaler.scale(loss)).backward()
                for s, p in zip(summed, trainable):
                    s += p.grad.reshape(-1).to(reduce_dtype)
                    p.grad = None
            for t, s in zip(total, summed):
                t += s / world
        for m, t in zip(masters, total):
            m.grad = t.to(m.dtype).view_as(m)
        if scaler is not None:
            scaler.unscale_(opt)
        if clipping:
            torch.nn.utils.clip_grad_norm_(masters, clipping)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        with torch.no_grad():
            for p, m in zip(trainable, masters):
                p.copy_(m)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
        master_steps.append({n: m.detach().clone() for (n, _), m in zip(named, masters)})
    return {"snapshots": snapshots, "masters": torch.cat([m.reshape(-1) for m in masters]),
            "master_steps": master_steps, "scales": scales}


class Lockstep:
    """ZeRO-2 training led by rank 0, to time a step from one process: before each step rank
    0 broadcasts whether there is one, and the other ranks (``follow``) take as many as it
    asks for. Every step trains on the same global batch 0 of ``spec``. On nccl each rank
    uses its own GPU, and a step returns when the GPU has finished it."""

    def __init__(self, spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.device = rank_device(rank)
        self.spec = of(spec)
        self.batch = local_batch(spec, 0, rank, world, self.device)
        self._start(optimizer_class, kwargs, bucket_numel)

    def _start(self, optimizer_class: type, kwargs: dict, bucket_numel: int) -> None:
        """Build what ``_train`` steps (a subclass builds another system's)."""
        self.model = self.spec.build().to(self.device)
        self.zero = Zero2(self.model, optimizer_class, bucket_numel=bucket_numel, **kwargs)

    def _train(self) -> None:
        """One training step (a subclass times another system's)."""
        x, y = self.batch
        self.spec.compute_loss(self.model, x, y).backward()
        self.zero.step()
        self.zero.zero_grad()

    def _close(self) -> None:
        self.zero.remove()

    def step(self, go: bool = True) -> bool:
        flag = torch.tensor([int(go)], device=self.device)
        dist.broadcast(flag, src=0)
        if not flag.item():  # on a GPU this waits for the broadcast, and so for the last step
            return False
        self._train()
        if self.device != "cpu":
            torch.cuda.synchronize()
        return True

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if dist.get_rank() == 0:
                self.step(go=False)  # releases the followers
        finally:
            self._close()


def follow(rank: int, world: int, *args: Any, lockstep: type[Lockstep] = Lockstep) -> int:
    """A rank of ``lockstep`` other than 0: steps until rank 0 stops; returns how many."""
    steps = 0
    with lockstep(*args) as lock:
        while lock.step():
            steps += 1
    return steps


def rank_memory(rank: int, world: int, spec: Any, kwargs: dict,
                optimizer_class: type | None = None) -> dict[str, Any]:
    """This rank's measured memory for one ZeRO-2 step (the tracker on real tensors), with
    ``optimizer_class`` (default: ``measure``'s)."""
    backend = "cuda" if dist.get_backend() == "nccl" else "eager"
    if backend == "cuda":
        rank_device(rank)
    result = measure(spec, "zero2", backend=backend, optimizer_class=optimizer_class,
                     optimizer_kwargs=kwargs)
    return {"peak": result.peak, "breakdown": result.peak_breakdown,
            "timeline": result.timeline}
