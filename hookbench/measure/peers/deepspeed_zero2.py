"""DeepSpeed ZeRO stage 2 as a peer of hookbench's ZeRO-2 (``hookbench.mechanisms.zero2.Zero2``), in fp32
and in bf16 mixed precision.

What ``hookbench.mechanisms.zero2`` re-implements is DeepSpeed's own design (flat buffers cut into N
pieces, per-parameter post-accumulate-grad hooks filling buckets, each rank keeping its slice,
an all-gather after the step), so DeepSpeed itself is the natural reference: the same model,
batches, optimizer and bucket size trained both ways must give the same parameters, and the
two memory footprints can be measured side by side with the same tracker.

Run on every rank through ``hookbench.core.launch.run`` (gloo on CPU). DeepSpeed is initialised on
the process group that ``launch`` already set up (``deepspeed.initialize`` finds
torch.distributed initialised and wraps it), with ``DS_ACCELERATOR=cpu``, stage 2, fp32,
``gradient_clipping`` set explicitly (its config default is 1.0), ``reduce_bucket_size`` and
``allgather_bucket_size`` from ``bucket_numel``, a client torch optimizer
(``zero_allow_untested_optimizer``) and DeepSpeed's own gradient accumulation.

Mixed precision: ``kwargs`` holds Zero2's ``param_dtype=torch.bfloat16`` (and ``reduce_dtype``),
as for ``zero2_runs.trajectory``; on DeepSpeed's side they become its config (``config``):
``"bf16": {"enabled": true}`` (``deepspeed.initialize`` casts the parameters to bf16, flattens
them into one bf16 buffer, and keeps an fp32 copy of this rank's partition that the client
optimizer steps, rounded into the bf16 partition before the all-gather), with
``communication_data_type`` (the reduction's dtype) and ``data_types.grad_accum_dtype`` (the
partition's gradient) both set to Zero2's ``reduce_dtype`` (default bf16). Two things Zero2
does that DeepSpeed does not are done here on its side:

* its fp32 partition is copied from the bf16 parameters (``weights_partition = bf16
  partition.clone().to(fp32)``), so its masters start at the bf16-rounded values; Zero2's
  start at the original fp32 values. ``masters="original"`` (the default) sets them to those
  with DeepSpeed's own ``deepspeed.utils.safe_set_full_fp32_param`` after
  ``deepspeed.initialize``; ``masters="bf16"`` leaves DeepSpeed's;
* DeepSpeed's engine does not cast the inputs; a forward pre-hook casts the model's floating
  inputs to bf16, as Zero2's does (``hookbench.mechanisms.zero2._cast_inputs``).

    trajectory          DeepSpeed: the full parameters after every optimizer step
    zero2_trajectory    hookbench's Zero2 on the same terms, with optional global-norm clipping
    peer_cases          both of them (and faults) for many cases from one start of the ranks
    differences         the parity check: where two trajectories are not equal (or not close)
    master_differences  where two mixed-precision trajectories' fp32 masters are not equal
    rank_memory         one step's per-rank peak by category, for both, on real CPU tensors
    memory_cases        rank_memory for several cases from one start of the ranks
    bf16_valued         a workload whose initial fp32 values are bf16 values (masters agree)
    step_times          the time of one step of each, interleaved, on the same ranks
    Lockstep / follow   DeepSpeed steps led by rank 0, as ``zero2_runs.Lockstep`` (for
                        pytest-benchmark, beside the same for Zero2)

Needs deepspeed (the ``peers`` extra), installed by ``prerequisites.DEEPSPEED_INSTALL``'s
command; without it, every entry point raises ``hookbench.core.prerequisites.MissingPrerequisite``.
The module itself imports without deepspeed.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
import torch.distributed as dist

from hookbench.core.deepspeed_import import MISSING, load
from hookbench.core.workload import of
from hookbench.measure import zero2_runs
from hookbench.measure.faults import run_under
from hookbench.measure.memory import StorageTracker
from hookbench.measure.parity import Tolerance, compare
from hookbench.mechanisms.zero2 import Zero2, _cast_inputs

__all__ = ["MISSING", "Lockstep", "bf16_valued", "config", "differences", "engine", "follow",
           "master_differences", "memory_cases", "peer_cases", "rank_memory", "step_times",
           "trajectory", "zero2_trajectory"]

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _precision(kwargs: dict) -> tuple[dict, torch.dtype | None, torch.dtype | None]:
    """Zero2's precision options split off ``kwargs``: (the optimizer's options, param_dtype,
    reduce_dtype), both None in fp32; reduce_dtype defaults to param_dtype, as in Zero2."""
    kwargs = dict(kwargs)
    param_dtype, reduce_dtype = kwargs.pop("param_dtype", None), kwargs.pop("reduce_dtype", None)
    if kwargs.pop("shard_gradients", True) is not True:
        raise ValueError("the DeepSpeed peer compares ZeRO stage 2 (shard_gradients=True) only")
    if param_dtype == torch.float32:
        param_dtype = None
    if param_dtype not in (None, torch.bfloat16):
        raise ValueError(f"the DeepSpeed peer compares fp32 or bf16 parameters, not "
                         f"{param_dtype}: fp16 needs loss scaling, which Zero2 does not do")
    if reduce_dtype not in (None, *_DTYPE_NAMES) or (param_dtype is None
                                                     and reduce_dtype not in (None, torch.float32)):
        raise ValueError(f"reduce_dtype {reduce_dtype} with param_dtype {param_dtype}: the peer "
                         f"reduces bf16 parameters' gradients in bf16 or fp32, fp32 ones' in fp32")
    return kwargs, param_dtype, None if param_dtype is None else reduce_dtype or param_dtype


def config(micro_batch: int, bucket_numel: int, accumulation: int = 1,
           clipping: float = 0.0, param_dtype: torch.dtype | None = None,
           reduce_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The DeepSpeed config of the peer: stage 2, everything that matters stated. fp32, or with
    ``param_dtype=torch.bfloat16`` DeepSpeed's bf16 mode, reducing gradients and keeping the
    partition's gradient in ``reduce_dtype`` (default bf16, as Zero2)."""
    cfg = {
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
            "reduce_scatter": True,  # each piece reduced to its owner (dist.reduce), as Zero2
            # Zero2's flat layout: the parameters in registration order, nothing between them
            # (DeepSpeed pads only the end, to a multiple of 2N), so the ranks own the same
            # elements as Zero2's (up to that padding) and the masters compare rank by rank.
            "round_robin_gradients": False,
            "parameter_alignment": False,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if param_dtype is not None:
        if param_dtype != torch.bfloat16:
            raise ValueError(f"param_dtype must be torch.bfloat16 or None, got {param_dtype}")
        reduce = _DTYPE_NAMES[reduce_dtype or param_dtype]
        cfg["bf16"] = {"enabled": True}
        # The dtype of the reduction (DeepSpeed's default in bf16 mode: bf16). Each bucket is
        # divided by N in bf16 (exact for N = 2) and then converted to it.
        cfg["communication_data_type"] = reduce
        # The dtype of the partition's gradient. bf16 (its default): the reduced gradient is
        # copied into the bf16 grads_in_partition, micro-batches summed in bf16. fp32: each
        # reduced piece is added into an fp32 partition buffer (without it an fp32 reduction
        # would be rounded back to bf16 in the bucket); Zero2's reduce_dtype is both at once.
        cfg["data_types"] = {"grad_accum_dtype": reduce}
    return cfg


def _build(spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int,
           accumulation: int = 1, clipping: float = 0.0) -> tuple[Any, dict | None]:
    """A DeepSpeed engine on this rank (a collective), with its own fp32 masters; and, in
    mixed precision, the model's original fp32 values by name (None in fp32)."""
    deepspeed = load()
    spec = _fp32(spec)
    kwargs, param_dtype, reduce_dtype = _precision(kwargs)
    model = spec.build()
    original = None if param_dtype is None else {n: p.detach().clone()
                                                 for n, p in model.named_parameters()}
    optimizer = optimizer_class(model.parameters(), **kwargs)
    world = dist.get_world_size()
    ds, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer,
        config=config(spec.batch_size // world, bucket_numel, accumulation, clipping,
                      param_dtype, reduce_dtype))
    if param_dtype is not None:  # DeepSpeed does not cast inputs; Zero2 does, with this hook
        ds.module.register_forward_pre_hook(functools.partial(_cast_inputs, param_dtype),
                                            with_kwargs=True)
    return ds, original


def _set_masters(ds: Any, original: dict[str, torch.Tensor]) -> None:
    """DeepSpeed's fp32 masters set to the model's original fp32 values, as Zero2 takes them:
    each rank writes its own fragment of each parameter (no communication)."""
    from deepspeed.utils import safe_set_full_fp32_param

    for name, p in ds.module.named_parameters():
        safe_set_full_fp32_param(p, original[name])


def engine(spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int,
           accumulation: int = 1, clipping: float = 0.0, masters: str = "original") -> Any:
    """A DeepSpeed engine training a fresh model of ``spec`` on this rank (a collective).
    Mixed precision (``kwargs`` with ``param_dtype``): ``masters="original"`` sets its fp32
    masters to the original fp32 values, as Zero2's; ``"bf16"`` keeps DeepSpeed's own."""
    if masters not in ("original", "bf16"):
        raise ValueError(f"masters must be 'original' or 'bf16', got {masters!r}")
    ds, original = _build(spec, optimizer_class, kwargs, bucket_numel, accumulation, clipping)
    if original is not None and masters == "original":
        _set_masters(ds, original)
    return ds


def _fp32(spec: Any) -> Any:
    spec = of(spec)
    if spec.precision != "fp32":
        raise ValueError(f"workload {spec.name!r} is {spec.precision}: the DeepSpeed peer "
                         f"trains fp32 models (bf16 mixed precision through kwargs' "
                         f"param_dtype, as Zero2), not autocast")
    return spec


def _deepspeed_masters(ds: Any, rank: int) -> list[tuple[int, torch.Tensor]]:
    """This rank's fp32 partition per param group, as ``zero2_runs.own_masters`` gives
    Zero2's."""
    zero = ds.optimizer
    return [zero2_runs.own_part(fp32, size, rank, sum(p.numel() for p in group))
            for fp32, size, group in zip(zero.single_partition_of_fp32_groups,
                                         zero.partition_size, zero.bit16_groups)]


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               bucket_numel: int, steps: int = 5, accumulation: int = 1,
               clipping: float = 0.0, masters: str = "original") -> dict[str, Any]:
    """Train ``spec`` with DeepSpeed ZeRO-2 on this rank's share of each global batch, as
    ``hookbench.measure.zero2_runs.trajectory`` trains it with Zero2: ``{"snapshots": [the full
    parameters after every step, by model.named_parameters() name]}``; also the global gradient
    norm DeepSpeed saw at each step. In mixed precision also ``"masters"``: this rank's fp32
    partition after every step, per param group as (start in the flat buffer, the real
    elements), and ``"initial_masters"`` before the first step; and
    ``"deepspeed_initial_masters"``, DeepSpeed's own before ``masters="original"`` set them,
    and ``"deepspeed_dtypes"``: its parameters', masters', reduction's and partition gradient's
    dtypes, as its optimizer holds them."""
    if masters not in ("original", "bf16"):
        raise ValueError(f"masters must be 'original' or 'bf16', got {masters!r}")
    spec = _fp32(spec)
    ds, original = _build(spec, optimizer_class, kwargs, bucket_numel, accumulation, clipping)
    snapshots, norms = [], []
    result: dict[str, Any] = {"snapshots": snapshots, "grad_norms": norms}
    try:
        if original is not None:
            zero = ds.optimizer
            result["deepspeed_dtypes"] = {  # what the config made of it
                "parameters": {p.dtype for p in ds.module.parameters()},
                "masters": {t.dtype for t in zero.single_partition_of_fp32_groups},
                "communication": zero.communication_data_type,
                "gradient_accumulation": zero.gradient_accumulation_dtype}
            result["deepspeed_initial_masters"] = _deepspeed_masters(ds, rank)
            if masters == "original":
                _set_masters(ds, original)
            result["initial_masters"] = _deepspeed_masters(ds, rank)
            result["masters"] = []
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
            if original is not None:
                result["masters"].append(_deepspeed_masters(ds, rank))
    finally:
        ds.destroy()
    return result


def zero2_trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
                     bucket_numel: int, steps: int = 5, accumulation: int = 1,
                     clipping: float = 0.0) -> dict[str, Any]:
    """hookbench's side: ``zero2_runs.trajectory`` on the same terms (an fp32 model; in mixed
    precision, ``kwargs`` with ``param_dtype``, it also returns this rank's fp32 masters as
    ``trajectory`` returns DeepSpeed's: ``"initial_masters"``, ``"masters"``)."""
    return zero2_runs.trajectory(rank, world, _fp32(spec), optimizer_class, kwargs,
                                 bucket_numel, steps, accumulation, clipping=clipping)


def peer_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case (``trajectory`` keyword arguments, plus ``fault`` for hookbench's side;
    ``masters`` is DeepSpeed's only): ``{"hookbench": zero2_trajectory(...), "deepspeed":
    trajectory(...)}`` on this rank. A case with a fault has no DeepSpeed side: compare it
    with the same case without one."""
    out = []
    for case in cases:
        case = dict(case)
        fault, masters = case.pop("fault", None), case.pop("masters", "original")
        got = {"hookbench": run_under(fault, zero2_trajectory, rank, world, **case)}
        if fault is None:
            got["deepspeed"] = trajectory(rank, world, masters=masters, **case)
        out.append(got)
    return out


def _round_to_bf16(model_fn: Any) -> torch.nn.Module:
    model = model_fn()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model


def bf16_valued(spec: Any) -> Any:
    """``spec`` as a workload whose model's initial fp32 values are bf16 values (each rounded
    to bf16, and back): masters taken from the original values and masters taken from the
    bf16 parameters (DeepSpeed's) are then the same."""
    spec = of(spec)
    return spec.replace(name=f"{spec.name}-bf16-valued",
                        model=functools.partial(_round_to_bf16, spec.model))


def differences(ours: dict[str, Any], theirs: dict[str, Any],
                tolerance: Tolerance | None = None) -> list[str]:
    """The parity check: what differs between two trajectories (``{"snapshots": [...]}``,
    hookbench's first): an error hookbench's side returned, a different number of steps or
    set of parameters, and every (step, parameter) whose tensors are not ``torch.equal``, or,
    with ``tolerance``, the first outside it (``hookbench.measure.parity.compare``). Where either holds
    ``"initial_masters"`` (mixed precision, on one rank), also ``master_differences``: the
    fp32 masters are compared bit for bit, with or without ``tolerance``. Empty: equal."""
    if ours.get("error"):  # it stopped (``faults.run_under``): nothing else to compare
        return [f"hookbench: {ours['error']}"]
    problems: list[str] = []
    a, b = ours["snapshots"], theirs["snapshots"]
    if not b or len(a) != len(b):
        problems.append(f"{len(a)} steps of hookbench against {len(b)} of DeepSpeed")
    for step, (x, y) in enumerate(zip(a, b)):
        if list(x) != list(y):
            problems.append(f"step {step}: parameters {list(x)} against {list(y)}")
        elif tolerance is None:
            problems += [f"step {step}, {name}: max |diff| "
                         f"{(x[name].double() - y[name].double()).abs().max().item():.3g}"
                         for name in x if not torch.equal(x[name], y[name])]
    if tolerance is not None and not problems:
        result = compare(a, b, tolerance)
        if not result.ok:
            problems.append(result.verdict())
    if "initial_masters" in ours or "initial_masters" in theirs:  # mixed precision
        problems += master_differences(ours, theirs)
    return problems


def master_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Where this rank's fp32 masters differ (hookbench's first; ``"initial_masters"`` and
    ``"masters"`` as ``trajectory`` and ``zero2_trajectory`` return them), bit for bit: before
    the first step and after each, the same elements of the flat buffer on both sides."""
    if "initial_masters" not in ours or "initial_masters" not in theirs:
        return [f"masters from {'hookbench' if 'initial_masters' in ours else 'DeepSpeed'} "
                f"only"]
    problems = []
    a = [ours["initial_masters"], *ours["masters"]]
    b = [theirs["initial_masters"], *theirs["masters"]]
    if len(a) != len(b):
        problems.append(f"masters at {len(a)} steps against {len(b)}")
    for step, (x, y) in enumerate(zip(a, b)):
        when = "initially" if step == 0 else f"after step {step - 1}"
        if len(x) != len(y):
            problems.append(f"masters {when}: {len(x)} param groups against {len(y)}")
        for group, ((s, m), (t, n)) in enumerate(zip(x, y)):
            if (s, m.shape, m.dtype) != (t, n.shape, n.dtype):
                problems.append(f"masters {when}, group {group}: elements from {s}, "
                                f"{tuple(m.shape)} {m.dtype} against from {t}, "
                                f"{tuple(n.shape)} {n.dtype}")
            elif not torch.equal(m, n):
                where = (m != n).nonzero().flatten()
                problems.append(f"masters {when}, group {group}: {len(where)} of {m.numel()} "
                                f"differ, max |diff| {(m - n).abs().max().item():.3g}, first at "
                                f"flat element {s + int(where[0])}")
    return problems


# -- memory --------------------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an attribute of DeepSpeed's optimizer: a tensor, or lists and dicts of
    them (``averaged_gradients`` is a dict of lists, or with an fp32 ``grad_accum_dtype`` of
    ``GradPartitionBufferGroup``, whose ``flat_partition`` holds the gradient)."""
    if torch.is_tensor(value):
        return [value]
    if torch.is_tensor(getattr(value, "flat_partition", None)):
        return [value.flat_partition]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class _Tracker(StorageTracker):
    """``hookbench.measure.memory``'s tracker, except that a meta tensor is not counted: it has a size
    but no memory. DeepSpeed keeps one per parameter (``round_robin_bit16_meta``, for the
    shapes, from ``torch.zeros_like(param, device="meta")``), which the tracker would otherwise
    count as a parameter-sized temporary (12 MB of phantom memory on the 3M MLP in fp32)."""

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        if tensor.device.type != "meta":
            super().track(tensor, category)


def _deepspeed_memory(spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int,
                      warmup: int, round_to: int) -> dict[str, Any]:
    """One DeepSpeed step measured as ``hookbench.measure.memory.measure`` measures one of hookbench's
    strategies: ``StorageTracker`` on real CPU tensors (meta tensors not counted: ``_Tracker``),
    ``warmup`` steps, then the peak of one step by category. The tracker is on before
    ``deepspeed.initialize``, so that what the engine allocates there (its flat parameter
    buffer, the fp32 partition) is seen.

    Categories, assigned as in ``hookbench.measure.memory``: parameters (the model's parameters: views
    of DeepSpeed's flat buffer, counted once), gradients (``param.grad`` of the model, the
    contiguous ``grads_in_partition``, ``averaged_gradients``, the fp32 partition's ``.grad``),
    optimizer state (the client optimizer's state, and the fp32 copy of this rank's partition
    that it steps: the ZeRO paper counts that master copy as optimizer state; its size is also
    returned alone as ``fp32_partition``), activations (allocated in forward), temporaries
    (allocated in backward or the step and in none of those: the reduction buckets, the
    flattened gradient partition built for the step, the all-gather's buffers). Mixed
    precision (``kwargs`` with ``param_dtype``): DeepSpeed's bf16 mode (``config``), inputs
    cast as Zero2 casts them; the parameters are then bf16, the fp32 partition the masters.
    """
    deepspeed = load()
    spec = _fp32(spec)
    kwargs, param_dtype, reduce_dtype = _precision(kwargs)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = spec.build()
    tracker = _Tracker(round_to)
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracker)
        optimizer = optimizer_class(model.parameters(), **kwargs)
        ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=config(spec.batch_size // world, bucket_numel,
                                                    param_dtype=param_dtype,
                                                    reduce_dtype=reduce_dtype))
        stack.callback(ds.destroy)
        if param_dtype is not None:  # as _build: the inputs cast as Zero2 casts them
            ds.module.register_forward_pre_hook(functools.partial(_cast_inputs, param_dtype),
                                                with_kwargs=True)
        zero = ds.optimizer  # DeepSpeedZeroOptimizer, wrapping the client optimizer
        params = list(ds.module.parameters())

        def gradient_tensors() -> list[torch.Tensor]:
            out = [p.grad for p in params if p.grad is not None]
            out += [g.grad for g in zero.single_partition_of_fp32_groups if g.grad is not None]
            for name in ("grads_in_partition", "averaged_gradients", "all_grad_tensors"):
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
    bytes. hookbench's is ``hookbench.measure.memory.measure(spec, "zero2", backend="eager")`` in this
    process group (the measurement ``zero2_runs.rank_memory`` and the report make);
    DeepSpeed's is the same tracker and protocol around its engine (``_deepspeed_memory``)."""
    from hookbench.measure.memory import measure

    load()  # refuse before measuring anything
    ours = measure(spec, "zero2", optimizer_class=optimizer_class, backend="eager",
                   optimizer_kwargs={**kwargs, "bucket_numel": bucket_numel}, warmup=warmup,
                   round_to=round_to)
    dist.barrier()
    theirs = _deepspeed_memory(spec, optimizer_class, kwargs, bucket_numel, warmup, round_to)
    return {"hookbench": {"peak": ours.peak, "breakdown": ours.peak_breakdown,
                          "peak_phase": ours.peak_phase},
            "deepspeed": theirs}


def memory_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rank_memory`` for each case (its keyword arguments) on this rank: one start of the
    ranks for several measurements."""
    out = []
    for case in cases:
        dist.barrier()
        out.append(rank_memory(rank, world, **case))
    return out


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


class Lockstep(zero2_runs.Lockstep):
    """``zero2_runs.Lockstep`` with DeepSpeed's stage 2 engine in place of Zero2: training led
    by rank 0, every step on global batch 0, so that pytest-benchmark times the two alike."""

    def _start(self, optimizer_class: type, kwargs: dict, bucket_numel: int) -> None:
        self.engine = engine(self.spec, optimizer_class, kwargs, bucket_numel)

    def _train(self) -> None:
        x, y = self.batch
        self.engine.backward(self.spec.compute_loss(self.engine, x, y))
        self.engine.step()  # zeroes the gradients itself

    def _close(self) -> None:
        try:
            self.engine.destroy()
        finally:  # destroy() leaves the engine's forward hooks on the model (deepspeed 0.19.8)
            for name in ("module_forward_pre_hook", "module_forward_post_hook"):
                handle = getattr(self.engine, name, None)
                if handle is not None:
                    handle.remove()


def follow(rank: int, world: int, *args: Any) -> int:
    """A rank of ``Lockstep`` other than 0 (``zero2_runs.follow``)."""
    return zero2_runs.follow(rank, world, *args, lockstep=Lockstep)
