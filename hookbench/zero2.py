"""Sharded gradient release: ZeRO stage 2 as DeepSpeed does it, small enough to read at once.

With N data-parallel ranks:

* each param group is flattened into one buffer (the model's parameters become views into it),
  padded to a multiple of N and cut into N contiguous pieces; rank r owns piece r, so a
  parameter may straddle two ranks. The optimizer (any ``torch.optim`` class) is built on the
  owned piece alone, so it holds state for 1/N of the model;
* during backward a post-accumulate-grad hook per parameter moves its gradient into a bucket
  and frees ``param.grad`` at once. A full bucket is reduced to the owners of its pieces (one
  ``dist.reduce`` per owning rank, so a bucket costs its own size and not N times it) and
  averaged; each rank adds only its own piece into its shard's gradient. The last, partial
  bucket is flushed at the end of backward: a callback queued on the autograd engine
  (``Variable._execution_engine.queue_callback``, as DeepSpeed does) runs once every hook of
  the graph task has fired, which counting hooks cannot know when some parameter gets no
  gradient;
* ``step()`` updates the owned piece, then an all-gather rebuilds the full flat
  buffer on every rank. Micro-batches accumulate into the shard's gradient; call ``step()``
  after the last of them, as with a standard optimizer.

Per rank, fp32 Adam: parameters 4 Psi + gradient shard 4 Psi/N + Adam state 8 Psi/N, the
ZeRO paper's 4 Psi + 12 Psi / N, plus activations, the bucket and its concatenated copy for
the reduction. The gradient shard is allocated when the rank's first piece arrives, and Adam's
for-loop step adds two shard-sized temporaries.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookbench.parity import Tolerance
from hookbench.zoo import TinySpec

__all__ = ["PARITY_OPTIMIZERS", "PARITY_SPEC", "TOLERANCE", "Zero2", "parity_cases",
           "reduce_to_owner"]

# Against single-process training on the global batch: the reduction sums the ranks' mean
# gradients and divides by N, where the reference takes one mean over the global batch, a
# different order of fp32 additions. DeepSpeed's own tests compare with DDP + torch Adam at
# rtol 1e-5, atol 1e-6 over 5 steps; so does hookbench.
TOLERANCE = Tolerance(rtol=1e-5, atol=1e-6)


# What hookbench report and hookbench gate check ZeRO-2 parity on: 227 parameters, so that the
# shards cut parameters in two, and 50-element buckets, so that a backward reduces several.
PARITY_SPEC = TinySpec(depth=3, width=8, batch_size=6)
PARITY_OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "foreach": False}),
                     "adam": (torch.optim.Adam, {"lr": 1e-2, "foreach": False})}


def parity_cases(fault: str | None = None) -> list[dict[str, Any]]:
    """``trajectory`` keyword arguments for each of ``PARITY_OPTIMIZERS``: 5 steps."""
    return [dict(spec=PARITY_SPEC, optimizer_class=cls, kwargs=kw, bucket_numel=50, steps=5,
                 fault=fault) for cls, kw in PARITY_OPTIMIZERS.values()]


def reduce_to_owner(chunk: torch.Tensor, owner: int, group: Any) -> None:
    """Sum ``chunk`` over the ranks into ``owner``'s copy (other ranks' copies are undefined).

    Module-level so that fault injection can replace the collective.
    """
    dist.reduce(chunk, group=group, group_dst=owner)


# all_gather_single is the new name of all_gather_into_tensor (deprecated in torch 2.14)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class _Flat:
    """One param group, flattened."""

    params: list[nn.Parameter]
    offsets: list[int]  # of each parameter in the flat buffer
    buffer: torch.Tensor  # padded to world_size * shard_numel
    shard: nn.Parameter  # this rank's piece: a view into buffer, what the optimizer steps
    shard_numel: int

    def pieces(self, i: int, world: int) -> list[tuple[int, int, int, int]]:
        """(owner, start, end within param i, offset within the owner's shard)."""
        lo, n = self.offsets[i], self.params[i].numel()
        out = []
        for owner in range(lo // self.shard_numel, world):
            a, b = owner * self.shard_numel, (owner + 1) * self.shard_numel
            if a >= lo + n:
                break
            start, end = max(lo, a), min(lo + n, b)
            out.append((owner, start - lo, end - lo, start - a))
        return out


@dataclass(eq=False)
class _Bucket:
    grads: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # group, index, g
    numel: int = 0


class Zero2:
    """ZeRO-2 over ``process_group`` (default: the world); see the module docstring.

    Args:
        model: its trainable parameters are sharded; every rank must pass the same model.
        optimizer_class, **defaults: the optimizer run on each rank's pieces.
        params: ``None`` for every trainable parameter, or param groups (dicts with ``"params"``
            and per-group options, as for any optimizer); each group is one flat buffer.
        bucket_numel: gradient elements per bucket before it is reduced (DeepSpeed's
            reduce_bucket_size); 1 flushes each parameter on its own.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        params: list[dict[str, Any]] | None = None,
        *,
        process_group: Any = None,
        bucket_numel: int = 2**22,
        **defaults: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call "
                             "dist.init_process_group first (torchrun sets the environment)")
        if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
        self.names = {p: n for n, p in model.named_parameters()}
        groups = _groups(params, self.names)
        optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)  # validates options
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.bucket_numel = bucket_numel
        self.flats = [_flatten(g["params"], self.world, self.rank) for g in groups]
        self.optimizer = optimizer_class(
            [{**g, "params": [f.shard]} for g, f in zip(groups, self.flats)], **defaults)
        self.hook_calls: Counter[str] = Counter()  # per parameter name, in the last backward
        self._bucket = _Bucket()
        self._graph_task = -1
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._make_hook(g, i))
            for g, flat in enumerate(self.flats) for i, p in enumerate(flat.params)
        ]

    # -- backward --------------------------------------------------------------------------------

    def _make_hook(self, group: int, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(group, index, param)

        return hook

    def _on_grad_ready(self, group: int, index: int, param: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._graph_task:  # the first hook of a new backward
            self._graph_task = task
            self.hook_calls.clear()
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)
        name = self.names[param]
        self.hook_calls[name] += 1
        if self.hook_calls[name] > 1:
            raise RuntimeError(f"post-accumulate-grad hook fired twice for parameter '{name}' "
                               f"in one backward pass")
        grad = param.grad.detach().reshape(-1)
        param.grad = None  # released at once: from here on only the bucket holds it
        if self._bucket.numel and self._bucket.numel + grad.numel() > self.bucket_numel:
            self._flush()
        self._bucket.grads.append((group, index, grad))
        self._bucket.numel += grad.numel()
        if self._bucket.numel >= self.bucket_numel:
            self._flush()

    @torch.no_grad()
    def _flush(self) -> None:
        """Reduce the bucket to the owners of its pieces; keep and average our own piece."""
        bucket, self._bucket = self._bucket, _Bucket()
        if not bucket.grads:
            return
        # Every rank filled its bucket in the same order (the same graph), so every rank builds
        # the same per-owner layout and the reductions line up.
        layout: dict[int, list[tuple[torch.Tensor, int, int]]] = {}
        for group, index, grad in bucket.grads:
            for owner, start, end, offset in self.flats[group].pieces(index, self.world):
                layout.setdefault(owner, []).append((grad[start:end], group, offset))
        for owner in sorted(layout):
            chunk = torch.cat([piece for piece, _, _ in layout[owner]])
            reduce_to_owner(chunk, owner, self.group)  # a global: faults can replace it
            if owner != self.rank:
                continue
            chunk /= self.world
            position = 0
            for piece, group, offset in layout[owner]:
                shard = self.flats[group].shard
                if shard.grad is None:
                    shard.grad = torch.zeros_like(shard)
                n = piece.numel()
                shard.grad[offset:offset + n] += chunk[position:position + n]
                position += n

    # -- step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Step the owned pieces, then all-gather so every rank holds the full parameters."""
        if self._bucket.grads:
            raise RuntimeError("step() with gradients still in the bucket: backward did not end")
        self.optimizer.step()
        for flat in self.flats:
            _all_gather(flat.buffer, flat.shard.detach().clone(), group=self.group)

    def zero_grad(self) -> None:
        for flat in self.flats:
            flat.shard.grad = None
            for p in flat.params:
                p.grad = None

    # -- state -----------------------------------------------------------------------------------

    def _layout(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world,
                "shard_numel": [f.shard_numel for f in self.flats]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards: their optimizer state and where they lie."""
        return {"optimizer": self.optimizer.state_dict(), **self._layout()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {k: state_dict.get(k) for k in ("rank", "world_size", "shard_numel")}
        if saved != self._layout():
            raise ValueError(f"sharded state of {saved} does not fit {self._layout()}; gather "
                             f"it with full_state_dict() and load that into a standard optimizer")
        self.optimizer.load_state_dict(state_dict["optimizer"])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Any]:
        """The state gathered from every rank, as ``optimizer_class`` built on the same param
        groups (with names) would save it; a collective: every rank must call it."""
        state: dict[int, dict[str, Any]] = {}
        param_groups, first = [], 0
        for flat, group in zip(self.flats, self.optimizer.param_groups):
            shard_state = self.optimizer.state.get(flat.shard, {})
            for key, value in sorted(shard_state.items()):
                if torch.is_tensor(value) and value.shape == flat.shard.shape:
                    full = torch.empty_like(flat.buffer)
                    _all_gather(full, value.contiguous(), group=self.group)
                    for i, (p, o) in enumerate(zip(flat.params, flat.offsets)):
                        state.setdefault(first + i, {})[key] = full[o:o + p.numel()].view_as(
                            p).clone()
                else:  # per-shard scalars (Adam's step) are equal on every rank
                    for i in range(len(flat.params)):
                        state.setdefault(first + i, {})[key] = (
                            value.clone() if torch.is_tensor(value) else value)
            param_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": list(range(first, first + len(flat.params))),
                                 "param_names": [self.names[p] for p in flat.params]})
            first += len(flat.params)
        return {"state": state, "param_groups": param_groups}

    # -- lifetime --------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove the hooks; parameters get storage of their own again. Idempotent."""
        for handle in self._handles:
            handle.remove()
        if self._handles:
            for flat in self.flats:
                for p in flat.params:
                    p.data = p.data.clone()
        self._handles.clear()

    def __enter__(self) -> Zero2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _groups(params: list[dict[str, Any]] | None, names: dict) -> list[dict[str, Any]]:
    """Validated param groups of trainable model parameters, one dtype each."""
    trainable = [p for p in names if p.requires_grad]
    params = [{"params": trainable}] if params is None else list(params)
    groups = ([dict(g) for g in params] if all(isinstance(g, dict) for g in params)
              else [{"params": params}])  # a plain list of tensors is one group
    seen: set = set()
    for i, g in enumerate(groups):
        g["params"] = list(g.get("params", []))
        for p in g["params"]:
            if not isinstance(p, torch.Tensor) or p not in names or not p.requires_grad:
                raise ValueError(f"param group {i} holds something that is not a trainable "
                                 f"parameter of the model")
            if p in seen:
                raise ValueError(f"parameter '{names[p]}' appears in more than one place")
            seen.add(p)
        dtypes = {p.dtype for p in g["params"]}
        if len(dtypes) > 1:
            raise ValueError(f"param group {i} mixes dtypes {sorted(map(str, dtypes))}: one "
                             f"flat buffer needs one dtype")
    if not any(g["params"] for g in groups):
        raise ValueError("no parameter requires grad: there is nothing to optimize")
    return [g for g in groups if g["params"]]


@torch.no_grad()
def _flatten(params: list[nn.Parameter], world: int, rank: int) -> _Flat:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    shard_numel = -(-total // world)
    buffer = torch.zeros(shard_numel * world, dtype=params[0].dtype, device=params[0].device)
    for p, o in zip(params, offsets):
        buffer[o:o + p.numel()].copy_(p.reshape(-1))
        p.data = buffer[o:o + p.numel()].view_as(p)  # the parameter now lives in the buffer
    shard = nn.Parameter(buffer[rank * shard_numel:(rank + 1) * shard_numel])
    return _Flat(params, offsets, buffer, shard, shard_numel)


def trajectories(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run ``trajectory`` for each case (its keyword arguments) on this rank: one process start
    serves many configurations."""
    return [trajectory(rank, world, **case) for case in cases]


def _local(spec: Any, index: int, rank: int, world: int, device: str):
    """This rank's share of global batch ``index``."""
    x, y = spec.batch(index)
    if len(x) % world:
        raise ValueError(f"batch of {len(x)} does not split over {world} ranks")
    b = len(x) // world
    return x[rank * b:(rank + 1) * b].to(device), y[rank * b:(rank + 1) * b].to(device)


def _device(rank: int) -> str:
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               bucket_numel: int, steps: int = 5, accumulation: int = 1,
               fault: str | None = None,
               groups: list[tuple[list[str], dict]] | None = None) -> dict[str, Any]:
    """Train ``spec`` with ZeRO-2 on this rank's share of each global batch (run it on every
    rank, e.g. through ``hookbench.launch.run``). Returns the full parameters after every
    step, and what each backward left behind: gradients on the model's parameters, the shard's
    gradient size, and the hook calls per parameter. ``groups``: param groups as (parameter
    names, options). ``fault`` names a ``hookbench.faults`` fault to inject; an error it
    causes is returned, not raised, so every rank finishes."""
    from hookbench.faults import inject

    device = _device(rank)
    model = spec.build().to(device)
    snapshots: list[dict[str, torch.Tensor]] = []
    after_backward: list[dict[str, Any]] = []
    result = {"snapshots": snapshots, "after_backward": after_backward, "error": None}
    named = dict(model.named_parameters())
    params = None if groups is None else [{"params": [named[n] for n in names], **options}
                                          for names, options in groups]
    with inject(fault), Zero2(model, optimizer_class, params, bucket_numel=bucket_numel,
                              **kwargs) as zero:
        result.update(shard_numel=sum(f.shard_numel for f in zero.flats))
        try:
            for i in range(steps):
                for micro in range(accumulation):
                    x, y = _local(spec, i * accumulation + micro, rank, world, device)
                    zero.hook_calls.clear()  # so that a backward whose hooks never fire shows
                    (spec.loss(model(x), y) / accumulation).backward()
                    after_backward.append({
                        "param_grads": [n for n, p in model.named_parameters()
                                        if p.grad is not None],
                        "shard_grad_numel": sum(f.shard.grad.numel() for f in zero.flats
                                                if f.shard.grad is not None),
                        "hook_calls": dict(zero.hook_calls),
                    })
                zero.step()
                zero.zero_grad()
                snapshots.append({n: p.detach().cpu().clone()
                                  for n, p in model.named_parameters()})
            result["full_state"] = zero.full_state_dict()
        except Exception as e:  # noqa: BLE001 - under a fault anything may break; say what
            if fault is None:
                raise
            result["error"] = f"{type(e).__name__}: {e}"
    return result


class Lockstep:
    """ZeRO-2 training led by rank 0, to time a step from one process: before each step rank
    0 broadcasts whether there is one, and the other ranks (``follow``) take as many as it
    asks for. Every step trains on the same global batch ``spec.batch(0)``. On nccl each rank
    uses its own GPU, and a step returns when the GPU has finished it."""

    def __init__(self, spec: Any, optimizer_class: type, kwargs: dict, bucket_numel: int):
        rank, world = dist.get_rank(), dist.get_world_size()
        self.device = _device(rank)
        self.spec, self.model = spec, spec.build().to(self.device)
        self.batch = _local(spec, 0, rank, world, self.device)
        self.zero = Zero2(self.model, optimizer_class, bucket_numel=bucket_numel, **kwargs)

    def step(self, go: bool = True) -> bool:
        flag = torch.tensor([int(go)], device=self.device)
        dist.broadcast(flag, src=0)
        if not flag.item():  # on a GPU this waits for the broadcast, and so for the last step
            return False
        x, y = self.batch
        self.spec.loss(self.model(x), y).backward()
        self.zero.step()
        self.zero.zero_grad()
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
            self.zero.remove()


def follow(rank: int, world: int, *args: Any) -> int:
    """A rank of ``Lockstep`` other than 0: steps until rank 0 stops; returns how many."""
    steps = 0
    with Lockstep(*args) as lock:
        while lock.step():
            steps += 1
    return steps


def fsdp2_trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
                     steps: int = 5) -> dict[str, torch.Tensor]:
    """The peer: the same training with FSDP2 ``fully_shard(reshard_after_forward=False)``,
    torch's own ZeRO-2 analogue, on the same group; the full parameters at the end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = _device(rank)
    mesh = init_device_mesh(torch.device(device).type, (world,))
    model = spec.build().to(device)
    for layer in model.children():
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = optimizer_class(model.parameters(), **kwargs)
    for i in range(steps):
        x, y = _local(spec, i, rank, world, device)
        spec.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def rank_memory(rank: int, world: int, spec: Any, kwargs: dict) -> dict[str, Any]:
    """This rank's measured memory for one ZeRO-2 step (the tracker on real tensors)."""
    from hookbench.memory import measure

    backend = "cuda" if dist.get_backend() == "nccl" else "eager"
    if backend == "cuda":
        _device(rank)
    result = measure(spec, "zero2", backend=backend, optimizer_kwargs=kwargs)
    return {"peak": result.peak, "breakdown": result.peak_breakdown,
            "timeline": result.timeline}
