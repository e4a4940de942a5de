"""torch's ``DistributedDataParallel`` on a workload, as a team that outgrows one GPU runs it:
gradient accumulation under ``no_sync()``, the workload's own DDP settings (``Workload.ddp``;
by default ``find_unused_parameters=True``: a forward that skips layers at random, LayerDrop,
trains as on one device), and a communication hook that counts.

    trajectory        on every rank: the parameters after every step, per backward which
                      gradient buckets DDP's comm hook was handed and which parameters they
                      held, and what DDP reports running for each declared setting
    setting_problems  a declared setting DDP does not run: what torch reports differs, or
                      (``gradient_as_bucket_view``) the gradients are not views of the buckets

The hook is the team's own where the workload declares one (``Workload.ddp["comm_hook"]``), else
torch's ``default_hooks.allreduce_hook`` (divide by the world size, all-reduce SUM: DDP's
built-in arithmetic), wrapped to record each call. What it shows is DDP's contract with the
hooks: under ``no_sync()`` no bucket is reduced; in a synced backward every bucket is reduced
once and every parameter's gradient travels in exactly one bucket.

A team's hook (fp16 or bf16 compression, PowerSGD) is another arithmetic than one process's
step, lossy by design, so it has its own yardstick (``by_hand``): the same hook applied by hand
on every rank, without DDP, to the gradients each rank accumulated over its micro-batches, in
the buckets DDP formed, in DDP's order. DDP runs the hook on exactly those inputs, so the two
agree bit for bit; a DDP that reduces with its built-in all-reduce instead, compresses each
micro-batch, or drops a bucket does not. The other engines are held to DDP without the hook
(``plain``), the arithmetic they share.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from hookbench.core.workload import DDP_HOOK_KEYS, of
from hookbench.engines.loop import Refused, train, wrapping
from hookbench.measure.trace import RankTrace
from hookbench.measure.zero2_runs import rank_device

__all__ = ["bucket_problems", "by_hand", "described", "hook_of", "in_words",
           "options", "reported", "setting_problems", "trajectory", "wrap"]


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
    # what register_comm_hook logs: the hook's qualified name (``trajectory`` keeps it)
    "comm_hook": ("comm_hook", lambda hook: in_words(hook)),
}


def options(declared: dict[str, Any] | None) -> dict[str, Any]:
    """DDP's keyword arguments for a workload's ``ddp``: as declared, else hookbench's choice.
    That choice syncs no buffers: ZeRO-2 and FSDP2 broadcast none either, so BatchNorm
    statistics stay each rank's own everywhere. torch 2.14 renamed ``broadcast_buffers`` (a
    FutureWarning); its successor still syncs the buffers at init, where every rank's are equal
    anyway (the same seed builds the model)."""
    if declared is not None:
        return {k: v for k, v in declared.items() if k not in DDP_HOOK_KEYS}
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


def hook_of(declared: dict[str, Any] | None) -> tuple[Callable, Any]:
    """The communication hook a workload's ``ddp`` declares and its state, made on this rank;
    torch's ``allreduce_hook`` on the default group where it declares none."""
    declared = declared or {}
    make = declared.get("comm_state")
    return declared.get("comm_hook", default_hooks.allreduce_hook), make() if make else None


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               steps: int, accumulation: int = 1, comm_hook: bool = True, **_: Any
               ) -> dict[str, Any]:
    """Train ``spec`` with DDP on this rank's share of each global batch (run on every rank),
    ``accumulation`` micro-batches per step, all but the last under ``no_sync()``. Returns the
    parameters after every step and, per backward, ``"buckets"``: for each comm-hook call the
    bucket's index and its parameters' names, in call order; ``{"torch_refuses": ...}`` where
    DDP refuses the model (``loop.Refused``). Where the workload declares a comm hook, also
    ``"by_hand"``, the hook applied by hand (``by_hand``), and ``"plain"``, DDP without it;
    ``comm_hook=False``: only DDP without it (the reference ZeRO-2 is held to)."""
    spec = of(spec)
    hooked = comm_hook and "comm_hook" in (spec.ddp or {})
    out = _train(rank, world, spec, optimizer_class, kwargs, steps, accumulation,
                 hook_of(spec.ddp if hooked else None))
    if hooked and "torch_refuses" not in out:
        out["by_hand"] = by_hand(rank, world, spec, optimizer_class, kwargs, steps,
                                 accumulation, out["after_backward"])
        out["plain"] = _train(rank, world, spec, optimizer_class, kwargs, steps, accumulation,
                              hook_of(None))["snapshots"]
    return out


def _train(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
           steps: int, accumulation: int, hook: tuple[Callable, Any]) -> dict[str, Any]:
    device = rank_device(rank)
    model = spec.build().to(device)
    try:
        ddp = wrapping("DistributedDataParallel", lambda: wrap(model, spec.ddp))
    except Refused as e:  # on every rank alike: the same model, the same words
        return {"torch_refuses": str(e), "error": None}
    names = {p: n for n, p in model.named_parameters()}
    calls: list[tuple[int, list[str]]] = []
    buffers: set[int] = set()  # the storages of the buckets handed to the hook
    comm_hook, state = hook

    traced = RankTrace()

    @functools.wraps(comm_hook)  # DDP logs the hook's name, and checks its annotations
    def counting(state, bucket):
        calls.append((bucket.index(), [names[p] for p in bucket.parameters()]))
        traced.reach(f"bucket {bucket.index()} to {in_words(comm_hook)}", bucket.buffer())
        if bucket.buffer().layout == torch.strided:
            buffers.add(bucket.buffer().untyped_storage().data_ptr())
        return comm_hook(state, bucket)

    counting.__qualname__ = in_words(comm_hook)  # a partial has none for wraps to copy
    ddp.register_comm_hook(state, counting)
    optimizer = _optimizer(spec, model, optimizer_class, kwargs)
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
                ddp.no_sync, observe, _parameters(model), traced=traced)
    out["settings"] = reported(ddp, spec.ddp)
    return out


def _optimizer(spec: Any, model: torch.nn.Module, optimizer_class: type, kwargs: dict) -> Any:
    params = spec.optimizer_params(model)
    return optimizer_class(list(model.parameters()) if params is None else params, **kwargs)


def _parameters(model: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


class _Bucket:
    """What a comm hook is handed, as ``dist.GradBucket`` gives it: one flat buffer of the
    bucket's gradients in its parameters' order, and views of it shaped as the gradients."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool) -> None:
        self._index, self._params, self._last = index, params, last
        sparse = len(params) == 1 and params[0].grad is not None and params[0].grad.is_sparse
        # a sparse gradient is a bucket of its own, handed over as it is (as DDP does)
        self._buffer = params[0].grad if sparse else torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
             for p in params])

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        if self._buffer.is_sparse:
            return [self._buffer]
        sizes = [p.numel() for p in self._params]
        return [v.view_as(p) for v, p in zip(self._buffer.split(sizes), self._params)]


def by_hand(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
            steps: int, accumulation: int, after_backward: list[dict[str, Any]]
            ) -> list[dict[str, torch.Tensor]]:
    """The workload's comm hook applied by hand (run on every rank): the same loop on the same
    share without DDP, the gradients accumulated over the micro-batches as under
    ``no_sync()``, then, after the synced backward, each bucket DDP formed (DDP's run's
    ``after_backward``: its membership and order, which DDP may rebuild after the first
    step) handed to the hook, with a fresh state, and its result written back as DDP writes
    it: into every parameter some rank computed a gradient for. The parameters after every
    step."""
    device = rank_device(rank)
    model = spec.build().to(device)
    named = dict(model.named_parameters())
    comm_hook, state = hook_of(spec.ddp)
    backwards = iter(after_backward)

    def observe(synced: bool) -> dict[str, Any]:
        buckets = next(backwards)["buckets"]
        if synced:
            # a parameter no rank computed a gradient for keeps none, as under DDP
            params = [named[n] for _, names in buckets for n in names]
            used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                                device=device)
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
            used_by = dict(zip(map(id, params), used.tolist()))
            for k, (index, names) in enumerate(buckets):
                bucket = _Bucket(index, [named[n] for n in names], k == len(buckets) - 1)
                result = comm_hook(state, bucket).wait()
                if result.is_sparse:
                    bucket.parameters()[0].grad = result
                    continue
                for p, g in zip(bucket.parameters(), result.split([p.numel() for p in
                                                                   bucket.parameters()])):
                    if used_by[id(p)]:
                        p.grad = g.view_as(p).clone()
        return {}

    return train(rank, world, spec, model, model, _optimizer(spec, model, optimizer_class,
                                                             kwargs),
                 device, steps, accumulation, contextlib.nullcontext, observe,
                 _parameters(model))["snapshots"]


def described(settings: dict[str, Any]) -> str:
    """Settings in words: ``key=value, ...``."""
    return ", ".join(f"{key}={in_words(value)}" for key, value in settings.items()) or "nothing"


def in_words(value: Any) -> str:
    """A setting's value in words: a function (a comm hook) by its name, a partial by its
    function's (a repr would name addresses, which differ between the ranks and this process),
    else its repr."""
    if isinstance(value, functools.partial):
        return f"partial({in_words(value.func)})"
    return (getattr(value, "__qualname__", None) or type(value).__qualname__) if callable(
        value) else repr(value)


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
                problems.append(f"declared {described({key: value})}, DDP runs {field}={ran}")
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
