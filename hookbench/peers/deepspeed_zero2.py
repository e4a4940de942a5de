"""DeepSpeed ZeRO stage 2 as a peer of hookbench's ZeRO-2 (``hookbench.zero2.Zero2``), fp32.

What ``hookbench.zero2`` re-implements is DeepSpeed's own design (flat buffers cut into N
pieces, per-parameter post-accumulate-grad hooks filling buckets, each rank keeping its slice,
an all-gather after the step), so DeepSpeed itself is the natural reference: the same model,
batches, optimizer and bucket size trained both ways must give the same parameters, and the
two memory footprints can be measured side by side with the same tracker.

Run on every rank through ``hookbench.launch.run`` (gloo on CPU). DeepSpeed is initialised on
the process group that ``launch`` already set up (``deepspeed.initialize`` finds
torch.distributed initialised and wraps it), with ``DS_ACCELERATOR=cpu``, stage 2, fp32,
``gradient_clipping`` set explicitly (its config default is 1.0), ``reduce_bucket_size`` and
``allgather_bucket_size`` from ``bucket_numel``, a client torch optimizer
(``zero_allow_untested_optimizer``) and DeepSpeed's own gradient accumulation.

    trajectory          DeepSpeed: the full parameters after every optimizer step
    zero2_trajectory    hookbench's Zero2 on the same terms, with optional global-norm clipping
    peer_cases          both of them (and faults) for many cases from one start of the ranks
    differences         the parity check: where two trajectories are not equal (or not close)
    rank_memory         one step's per-rank peak by category, for both, on real CPU tensors
    step_times          the time of one step of each, interleaved, on the same ranks

Needs the ``peers`` extra (``pip install -e '.[peers]'``, i.e. deepspeed); without it, every
entry point raises ``hookbench.prerequisites.MissingPrerequisite``. The module itself imports
without deepspeed.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from hookbench import zero2_runs
from hookbench.faults import inject
from hookbench.memory import StorageTracker
from hookbench.parity import Tolerance, compare
from hookbench.prerequisites import MissingPrerequisite
from hookbench.workload import of
from hookbench.zero2 import Zero2

__all__ = ["MISSING", "config", "differences", "engine", "peer_cases", "rank_memory",
           "step_times", "trajectory", "zero2_trajectory"]

MISSING = "deepspeed is not installed (pip install deepspeed; the peers extra)"


def _deepspeed() -> Any:
    """Import deepspeed for a gloo (CPU) rank, or raise ``MissingPrerequisite``.

    On a rank (torch.distributed initialised) DeepSpeed gets what its launcher would set:
    ``DS_ACCELERATOR=cpu`` (its CPU accelerator, whose communication backend falls back to gloo
    where oneCCL's bindings are absent) and RANK/LOCAL_RANK/WORLD_SIZE; the CPU accelerator
    reads LOCAL_RANK. Outside a rank nothing is set, so a caller's environment is untouched.
    """
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            raise ValueError(f"the DeepSpeed peer runs on gloo ranks (DS_ACCELERATOR=cpu); "
                             f"this group is {dist.get_backend()}")
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    try:
        import deepspeed
    except ImportError as e:
        if e.name == "deepspeed":
            raise MissingPrerequisite(MISSING) from e
        raise MissingPrerequisite(f"deepspeed does not import: {type(e).__name__}: {e}") from e
    if dist.is_initialized():
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":  # chosen at import, before we could
            raise ValueError(f"deepspeed was imported in this process with the "
                             f"{get_accelerator().device_name()} accelerator; the peer needs "
                             f"DS_ACCELERATOR=cpu before deepspeed is first imported")
    return deepspeed


def config(micro_batch: int, bucket_numel: int, accumulation: int = 1,
           clipping: float = 0.0) -> dict[str, Any]:
    """The DeepSpeed config of the peer: stage 2, fp32, everything that matters stated."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": float(clipping),  # DeepSpeed's default is 1.0
        "zero_allow_untested_optimizer": True,  # a client torch.optim optimizer
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": int(bucket_numel),
            "allgather_bucket_size": int(bucket_numel),
            "contiguous_gradients": True,
            "overlap_comm": False,
            "reduce_scatter": True,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def engine(spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int,
           accumulation: int = 1, clipping: float = 0.0) -> Any:
    """A DeepSpeed engine training a fresh model of ``spec`` on this rank (a collective)."""
    deepspeed = _deepspeed()
    spec = _fp32(spec)
    model = spec.build()
    optimizer = optimizer_class(model.parameters(), **kwargs)
    world = dist.get_world_size()
    ds, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer,
        config=config(spec.batch_size // world, bucket_numel, accumulation, clipping))
    return ds


def _fp32(spec: Any) -> Any:
    spec = of(spec)
    if spec.precision != "fp32":
        raise ValueError(f"workload {spec.name!r} is {spec.precision}: the DeepSpeed peer "
                         f"compares fp32 training only")
    return spec


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               bucket_numel: int, steps: int = 5, accumulation: int = 1,
               clipping: float = 0.0) -> dict[str, Any]:
    """Train ``spec`` with DeepSpeed ZeRO-2 on this rank's share of each global batch, as
    ``hookbench.zero2_runs.trajectory`` trains it with Zero2: ``{"snapshots": [the full fp32
    parameters after every step, by model.named_parameters() name]}``; also the global gradient
    norm DeepSpeed saw at each step."""
    spec = _fp32(spec)
    ds = engine(spec, optimizer_class, kwargs, bucket_numel, accumulation, clipping)
    snapshots, norms = [], []
    try:
        for i in range(steps):
            for micro in range(accumulation):
                x, y = zero2_runs.local_batch(spec, i * accumulation + micro, rank, world, "cpu")
                loss = spec.compute_loss(ds, x, y)  # the engine's forward is the model's
                ds.backward(loss)  # divides by gradient_accumulation_steps itself
                ds.step()  # steps at the accumulation boundary only
            if ds.global_steps != i + 1:
                raise RuntimeError(f"DeepSpeed took {ds.global_steps} optimizer steps in "
                                   f"{i + 1} x {accumulation} micro-batches")
            norm = ds.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
            snapshots.append({n: p.detach().cpu().clone()
                              for n, p in ds.module.named_parameters()})
    finally:
        ds.destroy()
    return {"snapshots": snapshots, "grad_norms": norms}


def zero2_trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
                     bucket_numel: int, steps: int = 5, accumulation: int = 1,
                     clipping: float = 0.0, fault: str | None = None) -> dict[str, Any]:
    """hookbench's side: ``zero2_runs.trajectory`` where ``clipping`` is 0; otherwise the same
    loop with ``Zero2.clip_grad_norm_(clipping)`` before each step."""
    if not clipping:
        return zero2_runs.trajectory(rank, world, spec, optimizer_class, kwargs, bucket_numel,
                                     steps, accumulation, fault)
    spec = _fp32(spec)
    model = spec.build()
    result: dict[str, Any] = {"snapshots": [], "grad_norms": [], "error": None}
    with inject(fault), Zero2(model, optimizer_class, bucket_numel=bucket_numel,
                              **kwargs) as zero:
        try:
            for i in range(steps):
                for micro in range(accumulation):
                    x, y = zero2_runs.local_batch(spec, i * accumulation + micro, rank, world,
                                                  "cpu")
                    (spec.compute_loss(model, x, y) / accumulation).backward()
                result["grad_norms"].append(float(zero.clip_grad_norm_(clipping)))
                zero.step()
                zero.zero_grad()
                result["snapshots"].append({n: p.detach().cpu().clone()
                                            for n, p in model.named_parameters()})
        except Exception as e:  # noqa: BLE001 - under a fault anything may break; say what
            if fault is None:
                raise
            result["error"] = f"{type(e).__name__}: {e}"
    return result


def peer_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case (``trajectory`` keyword arguments, plus ``fault`` for hookbench's side):
    ``{"hookbench": zero2_trajectory(...), "deepspeed": trajectory(...)}`` on this rank. A
    case with a fault has no DeepSpeed side: compare it with the same case without one."""
    out = []
    for case in cases:
        case = dict(case)
        fault = case.pop("fault", None)
        got = {"hookbench": zero2_trajectory(rank, world, fault=fault, **case)}
        if fault is None:
            got["deepspeed"] = trajectory(rank, world, **case)
        out.append(got)
    return out


def differences(ours: dict[str, Any], theirs: dict[str, Any],
                tolerance: Tolerance | None = None) -> list[str]:
    """The parity check: what differs between two trajectories (``{"snapshots": [...]}``,
    hookbench's first): an error hookbench's side returned, a different number of steps or
    set of parameters, and every (step, parameter) whose tensors are not ``torch.equal``, or,
    with ``tolerance``, the first outside it (``hookbench.parity.compare``). Empty: equal."""
    problems = [f"hookbench: {ours['error']}"] if ours.get("error") else []
    a, b = ours["snapshots"], theirs["snapshots"]
    if not b or len(a) != len(b):
        problems.append(f"{len(a)} steps of hookbench against {len(b)} of DeepSpeed")
    for step, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            problems.append(f"step {step}: parameters {list(x)} against {list(y)}")
        elif tolerance is None:
            problems += [f"step {step}, {name}: max |diff| "
                         f"{(x[name] - y[name]).abs().max().item():.3g}"
                         for name in x if not torch.equal(x[name], y[name])]
    if tolerance is not None and not problems:
        result = compare(a, b, tolerance)
        if not result.ok:
            problems.append(result.verdict())
    return problems


# -- memory --------------------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an attribute of DeepSpeed's optimizer: a tensor, or lists and dicts of
    them (``averaged_gradients`` is a dict of lists)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _deepspeed_memory(spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int,
                      warmup: int, round_to: int) -> dict[str, Any]:
    """One DeepSpeed step measured as ``hookbench.memory.measure`` measures one of hookbench's
    strategies: ``StorageTracker`` on real CPU tensors, ``warmup`` steps, then the peak of one
    step by category. The tracker is on before ``deepspeed.initialize``, so that what the
    engine allocates there (its flat parameter buffer, the fp32 partition) is seen.

    Categories, assigned as in ``hookbench.memory``: parameters (the model's parameters: views
    of DeepSpeed's flat buffer, counted once), gradients (``param.grad`` of the model, the
    contiguous ``grads_in_partition``, ``averaged_gradients``, the fp32 partition's ``.grad``),
    optimizer state (the client optimizer's state, and the fp32 copy of this rank's partition
    that it steps: the ZeRO paper counts that master copy as optimizer state; its size is also
    returned alone as ``fp32_partition``), activations (allocated in forward), temporaries
    (allocated in backward or the step and in none of those: the reduction buckets, the
    flattened gradient partition built for the step, the all-gather's buffers).
    """
    deepspeed = _deepspeed()
    spec = _fp32(spec)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = spec.build()
    tracker = StorageTracker(round_to)
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracker)
        optimizer = optimizer_class(model.parameters(), **kwargs)
        ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=config(spec.batch_size // world, bucket_numel))
        stack.callback(ds.destroy)
        zero = ds.optimizer  # DeepSpeedZeroOptimizer, wrapping the client optimizer
        params = list(ds.module.parameters())

        def gradient_tensors() -> list[torch.Tensor]:
            out = [p.grad for p in params if p.grad is not None]
            out += [g.grad for g in zero.single_partition_of_fp32_groups if g.grad is not None]
            for name in ("grads_in_partition", "averaged_gradients"):
                out += _tensors(getattr(zero, name, None))
            return out

        def refresh_gradients() -> None:
            for t in gradient_tensors():
                tracker.track(t, "gradients")

        def classify() -> None:
            for t in (*params, *ds.module.buffers()):
                tracker.track(t, "parameters")
            for t in zero.single_partition_of_fp32_groups:
                tracker.track(t, "optimizer_state")
            for state in zero.optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v):
                        tracker.track(v, "optimizer_state")
            refresh_gradients()

        def one_step(index: int) -> None:
            tracker.phase = "data"
            x, y = zero2_runs.local_batch(spec, index, rank, world, "cpu")
            tracker.phase = "forward"
            loss = spec.compute_loss(ds, x, y)
            classify()
            tracker.phase = "backward"
            ds.backward(loss)
            del loss
            classify()
            tracker.phase = "optimizer"
            ds.step()
            classify()
            tracker.phase = "idle"

        classify()
        for i in range(warmup):
            one_step(i)
        classify()
        tracker.on_new_peak = refresh_gradients
        tracker.reset_peak()
        one_step(warmup)
        classify()
        fp32_partition = sum(tracker.rounded(t.untyped_storage().nbytes())
                             for t in zero.single_partition_of_fp32_groups)
    return {"peak": tracker.peak, "breakdown": tracker.peak_breakdown,
            "peak_phase": tracker.peak_phase, "fp32_partition": fp32_partition,
            "partition_numel": [int(n) for n in zero.partition_size]}


def rank_memory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
                bucket_numel: int, warmup: int = 1, round_to: int = 512) -> dict[str, Any]:
    """This rank's peak for one step of ``spec``, by category, for both on the same terms:
    ``{"hookbench": ..., "deepspeed": ...}``, each ``{"peak", "breakdown", "peak_phase"}`` in
    bytes. hookbench's is ``hookbench.memory.measure(spec, "zero2", backend="eager")`` in this
    process group (the measurement ``zero2_runs.rank_memory`` and the report make);
    DeepSpeed's is the same tracker and protocol around its engine (``_deepspeed_memory``)."""
    from hookbench.memory import measure

    _deepspeed()  # refuse before measuring anything
    ours = measure(spec, "zero2", optimizer_class=optimizer_class, backend="eager",
                   optimizer_kwargs={**kwargs, "bucket_numel": bucket_numel}, warmup=warmup,
                   round_to=round_to)
    dist.barrier()
    theirs = _deepspeed_memory(spec, optimizer_class, kwargs, bucket_numel, warmup, round_to)
    return {"hookbench": {"peak": ours.peak, "breakdown": ours.peak_breakdown,
                          "peak_phase": ours.peak_phase},
            "deepspeed": theirs}


# -- time ----------------------------------------------------------------------------------------


def step_times(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               bucket_numel: int, rounds: int = 20, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per training step (forward, backward, step, zero_grad on this rank's share of
    batch 0) for hookbench's Zero2 and DeepSpeed's engine, each on its own copy of the model
    in the same processes, interleaved: every round times one step of each, in alternating
    order, each started after a barrier. Compare the minima (or medians) over rounds; a
    rank's time includes waiting for the other rank in the collectives."""
    deepspeed_engine = engine(spec, optimizer_class, kwargs, bucket_numel)
    spec = _fp32(spec)
    model = spec.build()
    x, y = zero2_runs.local_batch(spec, 0, rank, world, "cpu")
    times: dict[str, list[float]] = {"hookbench": [], "deepspeed": []}
    with Zero2(model, optimizer_class, bucket_numel=bucket_numel, **kwargs) as zero:

        def hookbench_step() -> None:
            spec.compute_loss(model, x, y).backward()
            zero.step()
            zero.zero_grad()

        def deepspeed_step() -> None:
            deepspeed_engine.backward(spec.compute_loss(deepspeed_engine, x, y))
            deepspeed_engine.step()  # zeroes the gradients itself

        steps = {"hookbench": hookbench_step, "deepspeed": deepspeed_step}
        try:
            for r in range(warmup + rounds):
                order = ("hookbench", "deepspeed") if r % 2 == 0 else ("deepspeed", "hookbench")
                for name in order:
                    dist.barrier()
                    start = time.perf_counter()
                    steps[name]()
                    elapsed = time.perf_counter() - start
                    if r >= warmup:
                        times[name].append(elapsed)
        finally:
            deepspeed_engine.destroy()
    return times
