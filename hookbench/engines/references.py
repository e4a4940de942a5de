"""The references a data-parallel strategy is judged against, in one place: what ZeRO-2 is held
to in the report, the gate and the pytest plugin, which only ask for a verdict here.

    DDP              torch's ``DistributedDataParallel`` (``hookbench.engines.ddp``) training the
                     workload on each rank's share of each batch, on the random numbers that
                     share draws. The first yardstick: where ZeRO-2 does the same arithmetic
                     (fp32 or autocast on gloo, an elementwise optimizer, no clipping), bit for
                     bit
    ranks            on every rank: a list of ZeRO-2 and engine runs from one start of the ranks
    single_process   in one process: the standard for-loop step on the mean of the ranks'
                     losses, each on its share; the second yardstick, with the bounds of the
                     elements whose gradient is at rounding level (``parity.NoiseBounds``),
                     from a float64 run where float64 can run the model
    measure          a workload's references (``Measured``), each measured once before any
                     row is judged: the single process, and the mixed-precision reference
                     where an engine computes in low precision
    noise_floor      per step and element, |DDP - single process|: how far two legal
                     references drift apart on this workload (another order of the same fp32
                     additions; BatchNorm over small shares amplifies it step by step)
    against_ddp, against_single, confirmed
                     a run held to one reference: DDP, the single process (within the
                     derived tolerance where DDP itself holds it, else within the measured
                     noise floor), and DDP's own run, confirmed by another engine where it
                     drifts; ``hookbench.gate.judge`` calls them in a row's declared order

Why two: the single process accumulates ``loss / N`` per share, data parallelism sums the
shares' gradients and divides; both are legal fp32 orders. On timm's resnet10t with SGD and
Nesterov momentum, 4 images per rank (examples/hf), the two drift 8.5e-5 apart in 3 steps,
74x the rounding-level tolerance, while ZeRO-2 and DDP agree to the bit. Against DDP a broken
reduction (a wrong slice, a bf16 round trip) fails at once, however noisy the model.
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hookbench.core import launch
from hookbench.core.prerequisites import one_line, warnings_kept
from hookbench.core.workload import Workload
from hookbench.engines import ddp, deepspeed, fsdp2
from hookbench.measure import trace, zero2_runs
from hookbench.measure.bounds import FLOOR_FACTOR
from hookbench.measure.faults import run_under
from hookbench.measure.parity import (Comparison, NoiseBounds, Snapshot, Tolerance, compare, wide,
                                      parameters_only, rounding_level, training)

__all__ = ["ENGINE_RUNS", "Held", "Key", "Measured", "against_ddp", "against_single",
           "arithmetic_differs", "confirmed", "ddp_beside", "ddp_order", "floor_bounds",
           "gathered", "largest", "measure", "noise_floor", "ranks", "shares_floor",
           "single_process"]

# A case's address in a launch: (workload, row, case), e.g. ("mlp", "engines/ddp", "ddp")
Key = tuple[str, str, str]


def ranks(rank: int, world: int, cases: list[dict[str, Any]], progress: str | None = None
          ) -> dict[Key, dict[str, Any]]:
    """Each case on this rank, from one start of the ranks, its result under the case's
    ``key`` (workload, row, case: ``gathered`` turns every rank's into one table, so nothing
    is read back by its position): ``{"engine": "ddp", ...}`` by ``ddp.trajectory``,
    ``"fsdp2"`` by ``fsdp2.trajectory``, any other by ``zero2_runs.trajectory`` (its keyword
    arguments). Its ``fault`` reaches it by ``faults.run_under``'s rule: what it raises is
    its result's ``error``, so every rank ends. The warnings a run raised are in its result's
    ``warnings``, each once. ``progress``: a folder where the rank keeps the index of the case
    it runs (``run_cases``)."""
    keys = [case["key"] for case in cases]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two cases share a key: {sorted(k for k in keys if keys.count(k) > 1)}")
    out = {}
    for index, case in enumerate(cases):
        if progress:
            Path(progress, f"rank{rank}").write_text(str(index))
        case = dict(case)
        key = case.pop("key")
        said: list[str] = []  # torch's warnings go into the result, not onto the terminal
        with warnings_kept(said):
            out[key] = _run(rank, world, case)
        if said:
            out[key]["warnings"] = said
    if progress:
        Path(progress, f"rank{rank}").write_text("done")
    return out


def run_cases(cases: list[dict[str, Any]], world: int, timeout: float, backend: str = "gloo"
              ) -> dict[Key, list[dict[str, Any]]]:
    """``ranks`` on ``cases`` from one start of ``world`` ranks, gathered by key. A rank whose
    process dies inside a case (torch crashing on the model: FSDP2 resharding a parameter its
    forward returns, SIGSEGV on torch 2.14.1) takes only that case down: its result on every
    rank is an ``error`` that names the death, and the ranks start again on the others. A
    death outside a case, or an exception, raises as ``launch.run`` does."""
    left, dead = list(cases), {}
    while True:
        with tempfile.TemporaryDirectory(prefix="hookbench-cases-") as progress:
            try:
                got = gathered(launch.run(ranks, world, left, progress, timeout=timeout,
                                          backend=backend))
                return {case["key"]: got.get(case["key"]) or dead[case["key"]]
                        for case in cases}
            except launch.RankFailed as e:
                if e.rank is None:
                    raise
                at = Path(progress, f"rank{e.rank}")
                index = at.read_text() if at.exists() else "done"
                if index == "done":
                    raise
                case = left.pop(int(index))
                how = launch.died(e.exit_code).removeprefix("was ")  # whichever rank died first
                words = (f"a rank's process {how} in this run: a crash, not an exception "
                         f"(the other runs ran again without it)")
                dead[case["key"]] = [{"error": words} for _ in range(world)]  # one dict a rank


def gathered(per_rank: list[dict[Key, dict[str, Any]]]) -> dict[Key, list[dict[str, Any]]]:
    """``ranks``' results from every rank, by key: each case's results in rank order."""
    return {key: [rank[key] for rank in per_rank] for key in per_rank[0]}


def _run(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    # Without a fault too, an engine that breaks on a setting the workload declares (DDP's
    # static_graph with no_sync(), pytorch#143580) fails its own row, and the others are judged
    run = ENGINE_RUNS[case.pop("engine", "zero2")]
    return run_under(case.pop("fault", None), run, rank, world, **case)


ENGINE_RUNS = {"zero2": zero2_runs.trajectory, "ddp": ddp.trajectory,
               "fsdp2": fsdp2.trajectory, "deepspeed": deepspeed.trajectory}


def ddp_beside(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A DDP case beside each ZeRO-2 case of ``cases``, keyed (workload, row, "ddp"): the same
    spec, optimizer, options and steps; never a fault, and never the workload's comm hook (the
    reference must be the release's own DDP, reducing as ZeRO-2 does)."""
    return [{**case, "engine": "ddp", "fault": None, "comm_hook": False,
             "key": (*case["key"][:2], "ddp")} for case in cases]


def ddp_order(workload: Workload, optimizer_class: type, kwargs: dict[str, Any], steps: int,
              world: int, accumulation: int) -> list[Snapshot]:
    """The standard for-loop step on the ranks' shares summed in DDP's order: each rank's
    micro-batches first (what it accumulates under ``no_sync()``, each loss divided by the
    micro-batches as the engines' loop divides it), divided by the ranks and summed (DDP's
    bucket: divide, then all-reduce). On 2 ranks that is DDP's arithmetic bit for bit (a + b
    = b + a; scaling the loss otherwise is not exact in fp16, whose gradients reach
    subnormals), where ``single_process``'s order (every share of a micro-batch, then the
    next) is another legal one: BatchNorm CNNs drift 493x to 7.3e6x the tolerance apart in
    fp32, a pure-bf16 decoder 258x, and without FSDP2 (2.4.1 to 2.6.0 cannot train it on CPU
    ranks) nothing else confirmed it."""
    with training(workload, optimizer_class, kwargs, "forloop") as run:
        snapshots = []
        for i in range(steps):
            summed: dict[torch.nn.Parameter, torch.Tensor] = {}
            for r in range(world):
                for m in range(accumulation):
                    key = (i * accumulation + m, r)
                    x, y = zero2_runs.local_batch(workload, *key, world, "cpu")
                    loss = workload.compute_loss(run.model, x, y, key) / accumulation
                    (loss if run.scale is None else run.scale(loss)).backward()
                for p in run.model.parameters():  # this rank's accumulated gradient
                    if p.grad is not None:
                        g = p.grad / world
                        summed[p] = g if p not in summed else summed[p] + g
                        p.grad = None
            for p, g in summed.items():
                p.grad = g
            run.optimizer_step()
            snapshots.append(run.snapshot())
    return parameters_only(snapshots)


def single_process(workload: Workload, optimizer_class: type, kwargs: dict[str, Any],
                   steps: int, world: int, accumulation: int = 1
                   ) -> tuple[list[Snapshot], list[Snapshot] | None, str]:
    """The standard for-loop step on the mean of ``world`` ranks' losses, each on its share of
    the batch and its random numbers (``accumulation`` batches per step), in one process: the parameters after every step; the
    per-step bounds of the elements whose gradient is at rounding level (None where float64
    cannot run the model); and, then, why. Against the whole batch in one forward, low
    precision would round differently (a bf16 mean over 8 rows is not the mean of two bf16 means
    over 4). ``measure`` runs it with a rank's threads, so its kernels are the ranks': on 2
    ranks without accumulation it is then DDP's arithmetic bit for bit; with accumulation the
    micro-batches come in another order than DDP's (a0 + a1 + b0 + b1 against (a0 + b0) +
    (a1 + b1)), and from 3 ranks on gloo adds the ranks in another order."""
    noise: NoiseBounds | None = NoiseBounds()
    why = ""
    with training(workload, optimizer_class, kwargs, "forloop") as run:
        snapshots = []
        for i in range(steps):
            keys = [(i * accumulation + m, r) for m in range(accumulation)
                    for r in range(world)]
            batches = [zero2_runs.local_batch(workload, index, r, world, "cpu")
                       for index, r in keys]
            if noise is not None:
                try:
                    level = rounding_level(workload, run.model, batches, keys)
                except Exception as e:  # noqa: BLE001 - a float64 kernel this model lacks
                    noise, why = None, f"float64 cannot run this model ({one_line(e)})"
                else:
                    noise.add(run, level)
            run.step_on(batches, keys)
            snapshots.append(run.snapshot())
    return parameters_only(snapshots), None if noise is None else noise.steps, why


@dataclass(frozen=True)
class Measured:
    """One workload's references for its data-parallel rows: ``single_process``'s parameters
    after every step (``single``), its rounding-level bounds (None where float64 cannot run
    the model, and ``why``), and ``zero2_runs.mixed_reference``'s fp32 masters after every
    step by (compute, reduce) dtypes, for each pair an engine computes in (``mixed``)."""
    single: list[Snapshot]
    rounding: list[Snapshot] | None
    why: str
    mixed: dict[tuple[torch.dtype, torch.dtype], list[Snapshot]] = field(default_factory=dict)
    # ``ddp_order``'s parameters where micro-batches accumulate, measured on first call: only
    # a DDP row further from ``single`` than its tolerance needs them
    ddp_order: Callable[[], list[Snapshot]] | None = None
    # the workload's rounding floor on the ranks' shares (``shares_floor``), measured on first
    # call: what a run whose arithmetic differs by design (compiled kernels, a clipping norm
    # summed shard by shard) may be held to
    floor: Callable[[], dict[str, float]] | None = None


def measure(workload: Workload, kwargs: dict[str, Any], steps: int, world: int,
            accumulation: int = 1, mixed: tuple[tuple[torch.dtype, torch.dtype], ...] = ()
            ) -> Measured:
    """The references of ``workload`` trained with its optimizer class and ``kwargs`` on
    ``world`` ranks' shares, ``accumulation`` micro-batches per step, measured once, with a
    rank's threads: with this machine's, the CPU kernels would sum in other orders than the
    ranks' (torchvision's resnet18, one image a rank: DDP 2.1e3 from the single process after
    one step on 2 threads, bit for bit on 1)."""
    cls = workload.optimizer[0]
    with launch.rank_threads():
        single, rounding, why = single_process(workload, cls, kwargs, steps, world,
                                               accumulation)
        mixed_steps = {dtypes: zero2_runs.mixed_reference(
            workload, cls, kwargs, steps, world, *dtypes, accumulation=accumulation,
            clipping=workload.clip_grad_norm or 0.0)["master_steps"] for dtypes in mixed}

    @functools.cache
    def ordered() -> list[Snapshot]:
        with launch.rank_threads():
            return ddp_order(workload, cls, kwargs, steps, world, accumulation)

    @functools.cache
    def floor() -> dict[str, float]:
        return shares_floor(workload, steps, world, accumulation)

    return Measured(single, rounding, why, mixed_steps, ordered if accumulation > 1 else None,
                    floor)


def shares_floor(workload: Workload, steps: int, world: int, accumulation: int = 1
                 ) -> dict[str, float]:
    """``trace.rounding_floor`` of ``workload``'s for-loop step on ``world`` ranks' shares,
    ``accumulation`` micro-batches a step, with a rank's threads: how far kernel rounding moves
    the parameters where the ranks train (timm's MobileNetV3, one image a rank: 133x the floor
    of the whole batch, BatchNorm over a share amplifying more)."""
    def micro(i: int) -> list[tuple[Any, tuple[int, int]]]:
        keys = [(i * accumulation + m, r) for m in range(accumulation) for r in range(world)]
        return [(zero2_runs.local_batch(workload, *key, world, "cpu"), key) for key in keys]

    with launch.rank_threads():
        return trace.rounding_floor(workload, "forloop", steps, micro)


def noise_floor(a: list[Snapshot], b: list[Snapshot]) -> list[Snapshot]:
    """Per step and entry, |a - b| element by element in float64."""
    return [{k: (wide(x[k]) - wide(y[k])).abs() for k in x if k in y} for x, y in zip(a, b)]


def floor_bounds(floor: list[Snapshot], rounding: list[Snapshot] | None) -> list[Snapshot]:
    """``FLOOR_FACTOR`` x the floor's largest element of each tensor (per step), or the
    rounding-level bound where that is larger."""
    out = []
    for step, entries in enumerate(floor):
        bounds = {k: FLOOR_FACTOR * (v.max() if v.numel() else v).expand_as(v)
                  for k, v in entries.items()}
        for k, v in (rounding[step] if rounding else {}).items():
            if k in bounds:
                bounds[k] = torch.maximum(bounds[k], v)
        out.append(bounds)
    return out


def per_tensor_bounds(steps: list[Snapshot], per_tensor: dict[str, float]) -> list[Snapshot]:
    """``FLOOR_FACTOR`` x a rounding floor's value for each tensor (``trace.rounding_floor``),
    as element-wise bounds shaped like ``steps``."""
    return [{k: torch.full_like(v, FLOOR_FACTOR * per_tensor.get(k, 0.0), dtype=torch.float64)
             for k, v in step.items()} for step in steps]


def within_floor(run: list[Snapshot], reference: list[Snapshot], tol: Tolerance,
                 floor: Callable[[], dict[str, float]],
                 rounding: list[Snapshot] | None = None) -> Comparison:
    """``run`` against ``reference`` within ``tol`` or ``FLOOR_FACTOR`` x the workload's
    rounding floor per tensor (``floor()``, ``shares_floor``), whichever is larger: how far
    another rounding of the same arithmetic may move training on these shares. The first
    step within ``tol`` and the rounding-level bounds (``rounding``) all the same: a rounding
    moves one step no further, training amplifies it after (a bf16 round trip in ZeRO-2's
    reduction, which the floor of a chaotic workload would hold, moves the first step 9.94x
    the tolerance on hookbench's clipped BatchNorm convnet)."""
    first = compare(run[:1], reference[:1], tol, rounding[:1] if rounding else None)
    if not first.ok:
        return first
    bounds = per_tensor_bounds(reference, floor())
    return dataclasses.replace(compare(run, reference, tol, bounds), rounding_level=0,
                               bound=f"the tolerance or {FLOOR_FACTOR:g}x this workload's "
                                     f"rounding floor on the ranks' shares per tensor")


def largest(floor: list[Snapshot]) -> list[float]:
    """Per step, the floor's largest element (``noise_floor``): what the baseline stores."""
    return [max((float(v.max()) for v in step.values() if v.numel()), default=0.0)
            for step in floor]


def arithmetic_differs(workload: Workload, world: int) -> list[str]:
    """Why a sharded run cannot match DDP bit for bit on ``workload``, in words ([] where it
    must). Two ranks' gradients sum to the same fp32 value in any order (a + b = b + a); from
    three on, a reduce or reduce-scatter and DDP's all-reduce add them in other orders (seen:
    5.99e-07 on GPT-2's embedding after one step on 4 gloo ranks under torchrun). Parameters
    kept in bf16 or fp16 are stepped in other pieces than DDP's whole tensors, and torch's CPU
    kernels round a low-precision element by where it falls in the tensor (the vectorised body
    or the scalar tail: on 2.14.1, ``p.add_(g, alpha=-0.1)`` on 200 bf16 elements differs by an
    ulp at element 33 when the tensor is cut at 37; an SGD for-loop step in pure bf16 then
    lands 1.2e-4, an ulp, from DDP's)."""
    return [why for cond, why in (
        (workload.pure is not None,
         f"{str(workload.pure).removeprefix('torch.')} parameters are stepped in other "
         f"pieces, which CPU kernels round by place"),
        (workload.clip_grad_norm is not None, "the clipping norm is summed shard by shard"),
        (workload.compile is not None, "the model is compiled"),
        (world > 2, f"{world} ranks' gradients are summed in another order than DDP's"))
        if cond]


@dataclass(frozen=True)
class Held:
    """One reference's verdict on a row: what was compared, in words, and whether it held."""
    words: str
    ok: bool


def against_ddp(workload: Workload, run: list[Snapshot], ddp: list[Snapshot],
                single: list[Snapshot], rounding: list[Snapshot] | None, tol: Tolerance,
                world: int, exact: bool, differs: str = "",
                floor: Callable[[], dict[str, float]] | None = None) -> Held:
    """A run's parameters (rank 0's, every step) against DDP's on the same shares. Bit for bit
    where the row declares DDP's arithmetic (``exact``), except where it differs by design
    (``arithmetic_differs``: a clipping norm summed shard by shard, a compiled model; then
    within ``tol``). Where the sums themselves come in another order (more than two ranks, or
    a row not ``exact``: ``differs`` says why), within ``tol`` and the rounding-level bounds or
    ``FLOOR_FACTOR`` x the measured noise floor |DDP - single process|, whichever is larger:
    two legal orders drift apart as far as DDP and the single process do (an attention key's
    bias, whose gradient is zero but for rounding: Adam turns either order's noise into whole
    steps; ViT on 4 ranks, 140x the tolerance without); beyond that too, within
    ``FLOOR_FACTOR`` x the rounding floor on the ranks' shares (``floor``, ``within_floor``):
    a third order drifts from DDP further than DDP from the single process where training
    amplifies a rounding (MONAI's UNETR under FSDP2: 4.61x the tolerance). Where only the
    arithmetic that differs by design sets them apart, beyond ``tol`` within the same rounding
    floor: a norm summed in another order rounds otherwise, and BatchNorm over a share
    amplifies it (segformer's ZeRO-2 with clipping: 10.4x the tolerance)."""
    reordered = world > 2 or not exact
    why = [*arithmetic_differs(workload, world), *([differs] if differs else [])]
    if reordered:
        bounds = floor_bounds(noise_floor(ddp, single), rounding)
        against = dataclasses.replace(compare(run, ddp, tol, bounds), rounding_level=0)
        how = f"within tolerance and {FLOOR_FACTOR:g}x the noise floor"
        if not against.ok and floor is not None:
            # a third legal order is one more rounding of the same sums: where it lies further
            # from DDP than DDP from the single process, training on the shares amplified it
            # (MONAI's UNETR under FSDP2, Adam: 4.61x the tolerance at step 1)
            against = within_floor(run, ddp, tol, floor, rounding)
            how += (f", or {FLOOR_FACTOR:g}x the rounding floor per tensor: another order "
                    f"rounds otherwise, and training on the shares amplifies it")
    else:  # the same sums, a clipping norm or a compiled kernel apart: the tolerance alone
        against = compare(run, ddp, tol if why else None)
        how = "within tolerance"
        if why and not against.ok and floor is not None:
            against = within_floor(run, ddp, tol, floor, rounding)
            how = (f"within tolerance or {FLOOR_FACTOR:g}x the rounding floor per tensor, "
                   f"another rounding that training on the shares amplifies")
    return Held(f"vs DDP on the same shares: {against.verdict()}"
                + (f" ({'; '.join(why)}: {how}, not bit for bit)" if why else ""), against.ok)


def against_single(run: list[Snapshot], single: list[Snapshot],
                   rounding: list[Snapshot] | None, why: str, tol: Tolerance,
                   floor_of: list[Snapshot] | None = None, differs: list[str] | None = None,
                   floor: Callable[[], dict[str, float]] | None = None) -> Held:
    """A run against the single process on the ranks' shares: within ``tol`` and the
    rounding-level bounds (``why``: why there are none, where float64 could not run the
    model). ``floor_of``: DDP's run, where the row's fallback is its noise floor: where DDP
    itself holds the bound, the bound stays (the derived tolerance is the tighter one); where
    DDP is further (another legal fp32 order), the run within ``FLOOR_FACTOR`` x the measured
    noise floor |DDP - single process|, tensor by tensor. Where the run's arithmetic differs
    from the single process's by design (``differs``: ``arithmetic_differs``), or its sums
    come in another legal order as DDP's do (DDP beyond the tolerance), and it is beyond both,
    within ``FLOOR_FACTOR`` x the rounding floor on the ranks' shares (``floor``), as
    against DDP."""
    derived = compare(floor_of, single, tol, rounding) if floor_of is not None else None
    derived_ok = derived is None or derived.ok
    if derived_ok:
        result = compare(run, single, tol, rounding)
        how = "" if rounding is not None else f"; {why}, so no element is excused as noise"
        if derived is not None:
            how += "; DDP within the same tolerance"
    else:
        result = compare(run, single, tol, floor_bounds(noise_floor(floor_of, single), rounding))
        result = dataclasses.replace(result, rounding_level=0)  # the bounds are the floor's
        how = (f"; DDP itself is {derived.ratio:.3g}x the tolerance from it (another legal fp32 "
               f"order), so judged within {FLOOR_FACTOR:g}x the measured noise floor per "
               f"tensor" + ("" if rounding is not None else f"; {why}"))
    if not result.ok and floor is not None and (differs or not derived_ok):
        # the arithmetic differs by design, or the sums come in another legal order, as DDP's
        # do (beyond the tolerance itself): another rounding that training amplifies
        result = within_floor(run, single, tol, floor, rounding)
        how += (f"; {'; '.join(differs) if differs else 'another legal order'}: within "
                f"tolerance or {FLOOR_FACTOR:g}x the rounding floor per tensor")
    return Held(f"vs one process on the ranks' shares: {result.verdict()}{how}", result.ok)


def confirmed(ddp: list[Snapshot], peer: list[Snapshot] | None, single: list[Snapshot],
              rounding: list[Snapshot] | None, tol: Tolerance, dtype: str,
              ordered: Callable[[], list[Snapshot]] | None = None,
              floor: Callable[[], dict[str, float]] | None = None) -> Held:
    """DDP's own run against the single process: within ``tol`` and the rounding-level bounds;
    where it is further, it holds if it is bit for bit the single process in DDP's order
    (``ordered()``, ``ddp_order``: the same arithmetic, so the distance is the order's), else
    only if ``peer`` (FSDP2 ZeRO-2: another order of the sums on other tensors) drifts from
    the single process too, and stays within ``FLOOR_FACTOR`` x the noise floor |DDP - single
    process| of DDP: no engine does DDP's arithmetic, so a DDP that is wrong where FSDP2 is
    right fails. A compiled model (``floor``: its rounding floor on the ranks' shares) is held
    within ``FLOOR_FACTOR`` x that floor per tensor: compiled under DDP, its graphs are split
    at the buckets and fused otherwise than one process's, so its kernels round otherwise
    (timm's ConvNeXt under inductor: 6.27x the tolerance), which is what the floor measures."""
    result = compare(ddp, single, tol, rounding)
    words = f"vs one process on the ranks' shares: {result.verdict()}"
    if not result.ok and ordered is not None and compare(ddp, ordered()).bit_exact:
        return Held(f"vs one process on the ranks' shares: {result.ratio:.3g}x the "
                    f"tolerance, another legal {dtype} order: bit-exact with one process "
                    f"summing each rank's micro-batches first, then the ranks (DDP's order)",
                    True)
    if not result.ok and floor is not None:
        held = within_floor(ddp, single, tol, floor, rounding)
        return Held(f"vs one process on the ranks' shares: {result.ratio:.3g}x the tolerance; "
                    f"compiled, DDP's kernels round otherwise than one process's (its graphs "
                    f"split at the buckets): within tolerance and {FLOOR_FACTOR:g}x the "
                    f"rounding floor per tensor: {held.verdict()}", held.ok)
    if result.ok or peer is None:
        return Held(words, result.ok)
    bounds = floor_bounds(noise_floor(ddp, single), rounding)
    if compare(peer, single, tol, rounding).ok or not compare(peer, ddp, tol, bounds).ok:
        return Held(words, False)
    return Held(f"vs one process on the ranks' shares: {result.ratio:.3g}x the tolerance, "
                f"another legal {dtype} order, confirmed by FSDP2 ZeRO-2 drifting from it too "
                f"and within {FLOOR_FACTOR:g}x the noise floor of DDP: this workload's noise "
                f"floor", True)
