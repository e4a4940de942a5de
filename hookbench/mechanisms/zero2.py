"""Sharded gradient release: ZeRO stage 2 as DeepSpeed does it, one file that imports only torch.

With N data-parallel ranks, each rank keeps all parameters, but the gradients and the optimizer
state of only its 1/N of them: each param group is flattened into one buffer cut into N
pieces, a post-accumulate-grad hook per parameter moves its gradient into a bucket and frees
``param.grad`` at once, each full bucket is reduced to the ranks that own it while backward is
still running, ``step()`` updates the owned pieces and an all-gather rebuilds the parameters::

    zero = Zero2(model, torch.optim.AdamW, lr=1e-3)    # after dist.init_process_group
    for batch in data:
        loss_fn(model(batch)).backward()
        zero.step()
        zero.zero_grad()

Per rank, fp32 Adam: 4 Psi + 12 Psi / N bytes (the ZeRO paper's), plus activations and one
bucket; ``param_dtype=torch.bfloat16``: 2 Psi + 14 Psi / N with fp32 masters of the owned
pieces; ``torch.float16`` adds dynamic loss scaling (``zero.scale(loss).backward()``).
``clip_grad_norm_`` clips by the global norm. The optimizer must be elementwise
(``ELEMENTWISE``); a shape-aware one (Adafactor, LAMB, Muon) is refused, and so are
reentrant activation checkpointing and a parameter unfrozen after construction, on every rank
before anything changes. How each step works, and why: docs/zero2.md, "How it works".
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.hooks import RemovableHandle


__all__ = ["ELEMENTWISE", "Zero2", "reduce_to_owner"]

# torch.optim classes whose update of an element reads only that element's gradient and state
# (and per-tensor scalars that depend on the step count alone), so stepping 1-D pieces of a
# parameter is stepping the parameter. Checked by reading each class's single-tensor update.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)


def reduce_to_owner(chunk: torch.Tensor, owner: int, group: Any) -> None:
    """Sum ``chunk`` over the ranks into ``owner``'s copy (other ranks' copies are undefined).

    Module-level so that fault injection can replace the collective.
    """
    if _REDUCE_HAS_GROUP_DST:
        dist.reduce(chunk, group=group, group_dst=owner)
    else:  # torch < 2.6: dst is a global rank
        dist.reduce(chunk, dst=owner if group is None else dist.get_global_rank(group, owner),
                    group=group)


_REDUCE_HAS_GROUP_DST = "group_dst" in inspect.signature(dist.reduce).parameters  # torch 2.6
# From torch 2.11 the c10d ops have Meta kernels (registered at import, pytorch#162119), so they
# run under FakeTensorMode; before, they raise UnsupportedOperatorException there.
_C10D_HAS_META = torch.__version__ >= (2, 11)


# all_gather_single is the new name of all_gather_into_tensor (deprecated in torch 2.14)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class _Flat:
    """One param group, flattened."""

    params: list[nn.Parameter]
    offsets: list[int]  # of each parameter in the flat buffer
    buffer: torch.Tensor  # padded to world_size * shard_numel
    shard: torch.Tensor  # this rank's piece of the buffer
    shard_numel: int
    grad: torch.Tensor | None = None  # the shard's gradient, allocated at its first piece
    master: torch.Tensor | None = None  # mixed precision: this rank's pieces, in fp32
    # this rank's piece of each parameter it owns a part of: (parameter index, the piece as a
    # leaf view into shard, or into master in mixed precision, its offset within shard, its
    # start within the parameter); the optimizer steps these
    owned: list[tuple[int, nn.Parameter, int, int]] = field(default_factory=list)

    @property
    def owned_dtype(self) -> torch.dtype:
        """The dtype the optimizer steps in: the masters', else the buffer's."""
        return (self.buffer if self.master is None else self.master).dtype

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
class _Region:
    """One owner's part of a bucket: the unit that is reduced, to that owner."""

    owner: int
    numel: int
    # per member (group, parameter index): (position here, start, end within the parameter,
    # offset within the owner's shard) of each of its pieces that this owner owns
    slots: dict[tuple[int, int], list[tuple[int, int, int, int]]] = field(default_factory=dict)
    # Filled as gradients arrive (each copied in, then released), allocated at the first one:
    # the reduction needs no second, concatenated copy.
    buffer: torch.Tensor | None = None
    arrived: set[tuple[int, int]] = field(default_factory=set)


class Zero2:
    """ZeRO-2 over ``process_group`` (default: the world); see the module docstring.

    Args:
        model: its trainable parameters are sharded; every rank must pass the same model
            (checked at construction: a difference raises on every rank, naming it).
        optimizer_class, **defaults: the optimizer run on each rank's pieces; one of
            ``ELEMENTWISE`` unless ``elementwise=True``.
        params: ``None`` for every trainable parameter, or param groups (dicts with ``"params"``
            and per-group options, as for any optimizer); each group is one flat buffer.
        bucket_numel: gradient elements per bucket before it is reduced (DeepSpeed's
            reduce_bucket_size); 1 reduces each parameter on its own.
        elementwise: True to assert that ``optimizer_class`` updates every element from its own
            gradient and state alone (a class not in ``ELEMENTWISE``).
        param_dtype: mixed precision: the dtype the parameters are converted to (bf16); the
            optimizer steps fp32 masters of this rank's pieces. None: train in the
            parameters' own dtype.
        reduce_dtype: the dtype gradients are reduced and the shard's gradient kept in
            (default: the parameters' dtype). Where it is not the dtype the optimizer steps
            in (mixed precision), the pieces get no ``.grad`` until ``step()``, so a
            ``torch.amp.GradScaler`` has nothing to unscale: bf16 needs none, and fp16 mixed
            precision scales its own loss (``scale``).
        shard_gradients: False is ZeRO stage 1 (P_os): gradients are all-reduced and every
            rank keeps the whole gradient, only the optimizer state is sharded; for comparing
            memory with stage 2 (``hookbench.measure.zero_paper``).
        loss_scaling: with ``param_dtype=torch.float16`` only: ``torch.amp.GradScaler``'s
            keyword arguments (``init_scale``, ``growth_factor``, ``backoff_factor``,
            ``growth_interval``) for the dynamic loss scaling; its defaults where omitted.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        params: list[dict[str, Any]] | None = None,
        *,
        process_group: Any = None,
        bucket_numel: int = 2**22,
        elementwise: bool = False,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        shard_gradients: bool = True,
        loss_scaling: dict[str, float] | None = None,
        **defaults: Any,
    ) -> None:
        # Everything is validated (on every rank alike) before the model's parameters are
        # moved into the flat buffers, so a refusal leaves the model as it was.
        _check_arguments(model, optimizer_class, elementwise, bucket_numel)
        self.names = {p: n for n, p in model.named_parameters()}
        groups = _groups(params, self.names)
        param_dtype = _mixed_dtype(groups, param_dtype, reduce_dtype)
        if not isinstance(shard_gradients, bool):
            raise TypeError(f"shard_gradients must be a bool, got {shard_gradients!r}")
        scaling = _loss_scaling(loss_scaling, param_dtype)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.shard_gradients = shard_gradients
        optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)  # validates options
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # A fake process group (hookbench.measure.memory simulating rank 0 of N) moves no data: its
        # other ranks are taken to do as this one does, and their state cannot be gathered.
        self.simulated = dist.get_backend(process_group) == "fake"
        # Before torch 2.11 the c10d ops have no Meta kernel, so under FakeTensorMode (the fake
        # memory backend) they raise; on a fake group they move no data: skip them there.
        self._collectives = not self.simulated or _C10D_HAS_META
        if not self.simulated:
            _check_same_on_every_rank(groups, self.names, optimizer_class, bucket_numel,
                                      process_group, (param_dtype, reduce_dtype, shard_gradients,
                                                      scaling))
        self.bucket_numel = bucket_numel
        self.flats = [_flatten(g["params"], self.world, self.rank, param_dtype) for g in groups]
        # Whether step() converts the shard's gradient a bucket at a time: it is in another
        # dtype than what the optimizer steps, or (fp16) must be unscaled first.
        self._convert = scaling is not None or any(
            (self.reduce_dtype or f.buffer.dtype) != f.owned_dtype for f in self.flats)
        self.optimizer = optimizer_class(
            [{**g, "params": [piece for _, piece, _, _ in f.owned]}
             for g, f in zip(groups, self.flats)], **defaults)
        self.hook_calls: Counter[str] = Counter()  # per parameter name, in the last backward
        # fp16: GradScaler's state (the scale, steps since the last overflow) and options
        self._scaling = scaling
        self.loss_scale = None if scaling is None else torch.full(
            (), scaling["init_scale"], dtype=torch.float32, device=self.flats[0].buffer.device)
        self._growth_tracker = 0
        self._scaled = False  # scale() was called for the coming backward
        self._unscaled_backward = False  # fp16: a backward since zero_grad() had no scale()
        self._nonfinite = False  # some rank's reduced gradient held an inf/NaN since zero_grad
        self._clip_coef: torch.Tensor | None = None  # mixed: clipping, applied in step()
        # Not flattened, so unfrozen later their gradients would be neither reduced nor stepped:
        # each backward checks them, and step() refuses while any is unfrozen on any rank.
        self._frozen = [p for p in self.names if not p.requires_grad]
        # names of those this rank saw unfrozen since zero_grad(); None where no rank saw any
        self._unfrozen: list[str] | None = None
        self._regions = _regions(self.flats, bucket_numel, self.world)
        self._region_of: dict[tuple[int, int], list[_Region]] = {}
        for region in self._regions:
            for member in region.slots:
                self._region_of.setdefault(member, []).append(region)
        self._members = list(self._region_of)  # (group, parameter index), the same on every rank
        self._next = 0  # the first region not yet reduced in this backward
        self._arrived: set[tuple[int, int]] = set()  # (group, index) in this backward
        self._got_grad: dict[tuple[int, int], bool] = {}  # (group, index) -> any rank, any pass
        self._graph_task = -1
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._make_hook(g, i))
            for g, flat in enumerate(self.flats) for i, p in enumerate(flat.params)
        ]
        self._handles.append(model.register_forward_hook(_refuse_reentrant_checkpoint))
        if param_dtype is not None:  # as FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True)
            self._handles.append(model.register_forward_pre_hook(
                functools.partial(_cast_inputs, param_dtype), with_kwargs=True))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError("Zero2 flattens its param groups into sharded buffers once, at "
                         "construction, on every rank alike; to train more parameters, remove() "
                         "this Zero2 and build a new one with every group (its state can be "
                         "carried over through full_state_dict())")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (over this rank's pieces): what ``GradScaler`` unscales
        and an LR scheduler (given ``zero.optimizer``) drives."""
        return self.optimizer.param_groups

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
            if self.loss_scale is not None and not self._scaled:
                self._unscaled_backward = True  # step() refuses; raising here would hang ranks
            self._scaled = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        name = self.names[param]
        self.hook_calls[name] += 1
        if self.hook_calls[name] > 1:
            raise RuntimeError(f"post-accumulate-grad hook fired twice for parameter '{name}' "
                               f"in one backward pass")
        self._arrived.add((group, index))
        grad = param.grad.detach().reshape(-1)
        for region in self._region_of[group, index]:
            if region.buffer is None:  # zeros: what this rank did not use goes as zeros
                region.buffer = self._new_grad(group, region.numel)
            for position, start, end, _ in region.slots[group, index]:
                region.buffer[position:position + end - start].copy_(grad[start:end])
            region.arrived.add((group, index))
        del grad
        param.grad = None  # released at once: from here on only the buckets hold it
        while (self._next < len(self._regions)
               and len(self._regions[self._next].arrived) == len(self._regions[self._next].slots)):
            self._reduce(self._regions[self._next])
            self._next += 1

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        for region in self._regions[self._next:]:
            self._reduce(region)  # what this rank did not use goes as zeros
        self._next = 0
        self._graph_task = -1
        local = [int(m in self._arrived) for m in self._members]
        self._arrived.clear()
        unfrozen = [self.names[p] for p in self._frozen if p.requires_grad or p.grad is not None]
        if self.simulated:
            used, nonfinite, anywhere = local, False, bool(unfrozen)
        else:
            # the largest |g| is inf or NaN exactly when some element is; no shard-sized temporary
            bad = [f.grad is not None
                   and not bool(torch.isfinite(torch.linalg.vector_norm(f.grad, float("inf"))))
                   for f in self.flats]
            flags = torch.tensor([*local, int(any(bad)), int(bool(unfrozen))], dtype=torch.int32,
                                 device=self.flats[0].buffer.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            *used, nonfinite, anywhere = flags.tolist()
        self._nonfinite = self._nonfinite or bool(nonfinite)
        if anywhere:  # refused by step(); raising here would leave the flat gradients half done
            self._unfrozen = sorted({*(self._unfrozen or ()), *unfrozen})
        for member, u in zip(self._members, used):
            self._got_grad[member] = self._got_grad.get(member, False) or bool(u)
        for g, flat in enumerate(self.flats):
            if nonfinite and flat.grad is not None:
                # the global gradient is not finite: no rank's shard may look finite, or one
                # rank's GradScaler would step (and grow its scale) while another skips
                flat.grad.fill_(float("nan"))
            if self._convert:
                continue  # converted a bucket at a time by step()
            for index, piece, offset, _ in flat.owned:
                if self._got_grad.get((g, index)) and flat.grad is not None:
                    piece.grad = self._shard_grad(flat)[offset:offset + piece.numel()]

    def _shard_grad(self, flat: _Flat) -> torch.Tensor | None:
        """The gradient of this rank's shard (stage 1: its slice of the whole gradient)."""
        if flat.grad is None or self.shard_gradients:
            return flat.grad
        return flat.grad[self.rank * flat.shard_numel:(self.rank + 1) * flat.shard_numel]

    def _new_grad(self, group: int, numel: int) -> torch.Tensor:
        buffer = self.flats[group].buffer
        return buffer.new_zeros(numel, dtype=self.reduce_dtype or buffer.dtype)

    @torch.no_grad()
    def _reduce(self, region: _Region) -> None:
        """Reduce the region to its owner; the owner averages it into its shard's gradient."""
        # The same fixed layout on every rank, so the reductions line up.
        if region.buffer is None:  # no member got a gradient on this rank
            region.buffer = self._new_grad(next(iter(region.slots))[0], region.numel)
        if self._collectives and self.shard_gradients:
            reduce_to_owner(region.buffer, region.owner, self.group)  # faults can replace it
        elif self._collectives:  # stage 1: every rank keeps the whole gradient
            dist.all_reduce(region.buffer, group=self.group)
        if region.owner == self.rank or not self.shard_gradients:
            region.buffer /= self.world
            for (group, _), pieces in region.slots.items():
                flat = self.flats[group]
                if flat.grad is None:
                    flat.grad = self._new_grad(group, flat.shard_numel * (
                        1 if self.shard_gradients else self.world))
                base = 0 if self.shard_gradients else region.owner * flat.shard_numel
                for position, start, end, offset in pieces:
                    flat.grad[base + offset:base + offset + end - start] += region.buffer[
                        position:position + end - start]
        region.buffer, region.arrived = None, set()

    # -- step ------------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: ``loss`` times the current loss scale, to call ``backward()`` on (as
        ``GradScaler.scale``); every backward needs it, or ``step()`` refuses."""
        if self.loss_scale is None:
            raise ValueError("scale() is for param_dtype=torch.float16, whose gradients need "
                             "dynamic loss scaling; bf16 and fp32 gradients need none: call "
                             "loss.backward()")
        self._scaled = True
        return loss * self.loss_scale.to(loss.device)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shard gradients so that the global gradient's norm is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` over the full gradients would;
        returns the global norm. A collective: every rank must call it, after backward. In
        mixed precision the factor is applied to the fp32 gradients by the next ``step()``,
        and the norm is the unscaled gradient's (fp16 loss scaling)."""
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or max_norm <= 0:
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self._refuse_unfrozen()  # the norm would leave their gradients out
        norm_type = float(norm_type)
        grads = [self._shard_grad(f) for f in self.flats if f.grad is not None]
        device = self.flats[0].buffer.device
        if norm_type == float("inf"):
            total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else \
                torch.zeros((), device=device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=self.group)
        else:
            total = sum((torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) ** norm_type
                         for g in grads),
                        torch.zeros((), device=device))
            dist.all_reduce(total, group=self.group)
            total = total ** (1.0 / norm_type)
        if self.loss_scale is not None:  # the norm of the unscaled gradient
            total = total * self.loss_scale.double().reciprocal().float()
        if self._clip_coef is not None:  # clipped before: the norm of the clipped gradient
            total = total * self._clip_coef
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own formula
        if self._convert:  # applied to the fp32 gradients by the next step(): they exist only
            # there, a bucket at a time, and the shard's gradient is not rounded twice
            self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef
        else:
            for g in grads:
                g.mul_(coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Step the owned pieces, then all-gather so every rank holds the full parameters."""
        self._refuse_unfrozen()
        if any(r.arrived for r in self._regions):
            raise RuntimeError("step() with gradients still in a bucket: backward did not end")
        if self._unscaled_backward:
            raise RuntimeError("param_dtype=torch.float16: a backward since zero_grad() ran on "
                               "an unscaled loss, whose small gradients flush to zero in fp16; "
                               "call zero.scale(loss).backward(), then zero_grad() and retry")
        if self.loss_scale is not None and self._nonfinite:
            # The flag was all-reduced, so every rank skips alike, as GradScaler.step does: the
            # parameters, masters and optimizer state stay as they were; the scale backs off.
            self._update_scale(found_inf=True)
            return
        if not self._convert:
            self.optimizer.step()
        inv_scale = (None if self.loss_scale is None  # as GradScaler.unscale_ computes it
                     else self.loss_scale.double().reciprocal().float())
        for group, flat in enumerate(self.flats if self._convert else ()):
            # The pieces' gradients in their own dtype, about a bucket of elements at a time:
            # pieces without a gradient are skipped by the optimizer, so each piece is stepped
            # once, as in one step() over all of them.
            chunks: list[list] = [[]]
            numel = 0
            for owned in flat.owned:  # at most a bucket, or one piece larger than a bucket
                if chunks[-1] and numel + owned[1].numel() > self.bucket_numel:
                    chunks.append([])
                    numel = 0
                chunks[-1].append(owned)
                numel += owned[1].numel()
            for chunk in chunks:
                for index, piece, offset, _ in chunk:
                    if self._got_grad.get((group, index)) and flat.grad is not None:
                        piece.grad = self._shard_grad(flat)[offset:offset + piece.numel()].to(
                            piece.dtype, copy=True)
                        if inv_scale is not None:  # GradScaler.unscale_'s multiplication
                            piece.grad.mul_(inv_scale)
                        if self._clip_coef is not None:
                            piece.grad.mul_(self._clip_coef)
                self.optimizer.step()
                for _, piece, _, _ in chunk:
                    piece.grad = None
        for flat in self.flats:
            if flat.master is not None:  # the updated masters, rounded into the shard
                flat.shard.copy_(flat.master)
            # in place: the shard is this rank's slice of the output (as FSDP gathers), so the
            # step holds no shard-sized copy
            if self._collectives:
                _all_gather(flat.buffer, flat.shard, group=self.group)
        self._clip_coef = None  # consumed by this step
        if self.loss_scale is not None:
            self._update_scale(found_inf=False)

    def _refuse_unfrozen(self) -> None:
        """Raise on every rank alike, before anything changes, if a backward since zero_grad()
        found a parameter frozen at construction unfrozen (the flag was all-reduced, so every
        rank is here to gather which ranks saw which)."""
        if self._unfrozen is None:
            return
        every = {self.rank: self._unfrozen}
        if not self.simulated:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, self._unfrozen, group=self.group)
            every = dict(enumerate(gathered))
        seen = {n: [r for r, names in every.items() if n in names]
                for names in every.values() for n in names}
        raise ValueError(
            "parameters frozen when Zero2 was built now require grad or have a .grad: "
            + ", ".join(f"'{n}' (rank{'s' * (len(r) > 1)} {', '.join(map(str, r))})"
                        for n, r in seen.items())
            + ". Zero2 partitions, reduces and steps only the parameters that required grad at "
            "construction, so their gradients would be neither reduced nor stepped and training "
            "would go on silently wrong. Nothing has changed: remove() this Zero2 and build a "
            "new one after changing requires_grad (once the layer is unfrozen), or unfreeze it "
            "before construction")

    def _update_scale(self, found_inf: bool) -> None:
        """GradScaler.update's schedule (torch._amp_update_scale_), in Python: the inf/NaN
        flag is already on the host."""
        options = self._scaling
        if found_inf:
            self.loss_scale.mul_(options["backoff_factor"])
            self._growth_tracker = 0
        elif self._growth_tracker + 1 == options["growth_interval"]:
            grown = self.loss_scale * options["growth_factor"]
            if torch.isfinite(grown):  # as torch._amp_update_scale_: never grow to inf
                self.loss_scale.copy_(grown)
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1

    def zero_grad(self) -> None:
        self._got_grad.clear()
        self._nonfinite = self._unscaled_backward = False
        self._clip_coef, self._unfrozen = None, None
        for flat in self.flats:
            flat.grad = None
            for _, piece, _, _ in flat.owned:
                piece.grad = None
            for p in flat.params:
                p.grad = None

    # -- state -----------------------------------------------------------------------------------

    def _layout(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world,
                "shard_numel": [f.shard_numel for f in self.flats]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's pieces: their optimizer state and where they lie."""
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
        groups (with names) would save it; a collective: every rank must call it. A parameter
        that never got a gradient has no state, as in a standard optimizer."""
        if self.simulated:
            raise ValueError("a fake process group holds no other rank's state to gather")
        mine: dict[int, dict[str, Any]] = {}  # parameter number -> key -> [(start, piece)]
        first = 0
        for flat in self.flats:
            for index, piece, _, start in flat.owned:
                for key, value in self.optimizer.state.get(piece, {}).items():
                    per_element = torch.is_tensor(value) and value.shape == piece.shape
                    mine.setdefault(first + index, {}).setdefault(key, []).append(
                        (start, value.detach().cpu().clone()) if per_element else (None, value))
            first += len(flat.params)
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        state: dict[int, dict[str, Any]] = {}
        params = [p for f in self.flats for p in f.params]
        for number in sorted({n for rank in every for n in rank}):
            p = params[number]
            merged: dict[str, list] = {}
            for rank in every:
                for key, parts in rank.get(number, {}).items():
                    merged.setdefault(key, []).extend(parts)
            entry = {}
            for key, parts in sorted(merged.items()):
                if parts[0][0] is None:  # a per-piece scalar (Adam's step): equal on each
                    value = parts[0][1]
                    entry[key] = value.to(p.device) if torch.is_tensor(value) else value
                else:
                    full = torch.cat([t for _, t in sorted(parts, key=lambda sp: sp[0])])
                    entry[key] = full.view_as(p).to(p.device)
            state[number] = entry
        param_groups, first = [], 0
        for flat, group in zip(self.flats, self.optimizer.param_groups):
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


# torch.amp.GradScaler's defaults
def _check_arguments(model: Any, optimizer_class: Any, elementwise: Any,
                     bucket_numel: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                        f"{optimizer_class!r}")
    if optimizer_class not in ELEMENTWISE and elementwise is not True:
        raise ValueError(
            f"{optimizer_class.__name__} is not known to update parameters elementwise: "
            f"ZeRO-2 steps 1-D pieces of parameters, so an update that uses a parameter's "
            f"shape or a per-tensor norm (Adafactor, LAMB, Muon, ...) would change "
            f"meaning. Use one of {[c.__name__ for c in ELEMENTWISE]}, or pass "
            f"elementwise=True if every element's update reads only its own gradient and "
            f"state")
    sparse = [name for name, m in model.named_modules() if getattr(m, "sparse", False) is True
              and any(p.requires_grad for p in m.parameters(recurse=False))]
    if sparse:
        raise ValueError(
            f"ZeRO-2 reduces gradients as flat dense buckets, and {sparse[0]!r} "
            f"({type(model.get_submodule(sparse[0])).__name__}(sparse=True)) makes sparse "
            f"gradients: build it with sparse=False, or keep such tables out of ZeRO-2 "
            f"(torch's DDP reduces sparse gradients)")
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call "
                         "dist.init_process_group first (torchrun sets the environment)")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")


def _mixed_dtype(groups: list[dict[str, Any]], param_dtype: Any,
                 reduce_dtype: Any) -> torch.dtype | None:
    """The dtype to train the parameters in, None for their own (param_dtype already theirs)."""
    for what, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dtype is not None and not (isinstance(dtype, torch.dtype)
                                      and dtype.is_floating_point):
            raise ValueError(f"{what} must be a floating torch.dtype or None, got {dtype!r}")
    own = {g["params"][0].dtype for g in groups}
    if param_dtype in own:
        return None  # already the parameters' dtype: nothing to mix
    if param_dtype is not None and not all(d.itemsize > param_dtype.itemsize for d in own):
        raise ValueError(f"param_dtype {param_dtype} must be narrower than the parameters' "
                         f"{sorted(map(str, own))}, whose values become the masters")
    return param_dtype


_LOSS_SCALING = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5,
                 "growth_interval": 2000}


def _loss_scaling(options: dict[str, float] | None,
                  param_dtype: torch.dtype | None) -> dict[str, float] | None:
    """The validated loss-scaling options: fp16 mixed precision only."""
    if param_dtype != torch.float16:
        if options is not None:
            raise ValueError("loss_scaling is for param_dtype=torch.float16 only: bf16 and fp32 "
                             "gradients have fp32's range and need no loss scaling")
        return None
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"loss_scaling must be a dict of GradScaler's options, got {options!r}")
    unknown = set(options or {}) - set(_LOSS_SCALING)
    if unknown:
        raise ValueError(f"loss_scaling has unknown options {sorted(unknown)}; known: "
                         f"{sorted(_LOSS_SCALING)}")
    options = {**_LOSS_SCALING, **(options or {})}
    checks = {"init_scale": lambda v: 0 < v < float("inf"), "growth_factor": lambda v: v > 1,
              "backoff_factor": lambda v: 0 < v < 1,
              "growth_interval": lambda v: isinstance(v, int) and v >= 1}
    for key, ok in checks.items():
        value = options[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"loss_scaling {key}={value!r} is out of range (init_scale > 0 "
                             f"and finite, growth_factor > 1, 0 < backoff_factor < 1, "
                             f"growth_interval a positive int)")
    return options


def _cast_inputs(dtype: torch.dtype, module: nn.Module, args: Any, kwargs: Any) -> Any:
    """The model's floating-point inputs in the parameters' dtype."""
    def cast(t: Any) -> Any:
        return t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t

    return tree_map(cast, (args, kwargs))


def _refuse_reentrant_checkpoint(module: nn.Module, args: Any, output: Any) -> None:
    if reentrant_checkpoint_in_graph(output):
        raise RuntimeError(
            "the model's output depends on torch.utils.checkpoint with use_reentrant=True: its "
            "nested backward fires the hook of a parameter used inside and outside the "
            "checkpoint once in each, after its bucket may have been reduced. Use "
            "checkpoint(..., use_reentrant=False)")


def _check_same_on_every_rank(groups: list[dict[str, Any]], names: dict, optimizer_class: type,
                              bucket_numel: int, process_group: Any,
                              options: tuple[Any, ...] = (None, None, True, None)) -> None:
    """Raise on every rank, naming the difference, unless every rank shards the same thing:
    otherwise the reductions would not line up and the ranks would hang or mix gradients."""
    mine = [f"optimizer {optimizer_class.__module__}.{optimizer_class.__qualname__}",
            f"bucket_numel {bucket_numel}", f"{len(groups)} param groups",
            "param_dtype {}, reduce_dtype {}, shard_gradients {}, loss_scaling {}".format(
                *options)]
    mine += [f"group {i}: '{names[p]}' {tuple(p.shape)} {p.dtype}"
             for i, g in enumerate(groups) for p in g["params"]]
    every: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(every, mine, group=process_group)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            diff = next(((a, b) for a, b in zip(every[0], theirs) if a != b),
                        (f"{len(every[0])} entries", f"{len(theirs)} entries"))
            raise ValueError(f"Zero2 differs between ranks: rank 0 has {diff[0]}, rank {rank} "
                             f"has {diff[1]}; every rank must pass the same model, param "
                             f"groups, optimizer class, bucket_numel and dtypes")


def _regions(flats: list[_Flat], bucket_numel: int, world: int) -> list[_Region]:
    """Fixed buckets: parameters in reverse registration order, the order in which backward
    usually completes them, cut at ``bucket_numel`` elements; each bucket cut again into one
    region per owner of its pieces, in the order they complete (the last owner's first). The
    order is the same on every rank: the schedule of the reductions."""
    buckets: list[list[tuple[int, int]]] = []
    size = 0
    for g, i in [(g, i) for g, f in enumerate(flats) for i in range(len(f.params))][::-1]:
        n = flats[g].params[i].numel()
        if not buckets or size + n > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append((g, i))
        size += n
    regions = []
    for members in buckets:
        by_owner: dict[int, _Region] = {}
        for g, i in members:
            for owner, start, end, offset in flats[g].pieces(i, world):
                region = by_owner.setdefault(owner, _Region(owner, 0))
                region.slots.setdefault((g, i), []).append((region.numel, start, end, offset))
                region.numel += end - start
        regions += [by_owner[owner] for owner in sorted(by_owner, reverse=True)]
    return regions


def _groups(params: list[dict[str, Any]] | None, names: dict) -> list[dict[str, Any]]:
    """Validated param groups of trainable model parameters, one dtype each."""
    trainable = [p for p in names if p.requires_grad]
    params = [{"params": trainable}] if params is None else list(params)
    groups = ([dict(g) for g in params] if all(isinstance(g, dict) for g in params)
              else [{"params": params}])  # a plain list of tensors (or named ones): one group
    seen: set = set()
    for i, g in enumerate(groups):
        g["params"] = [unnamed(p) for p in g.get("params", [])]
        for p in g["params"]:
            if not isinstance(p, torch.Tensor) or p not in names or not p.requires_grad:
                raise ValueError(f"param group {i} holds something that is not a trainable "
                                 f"parameter of the model")
            if p in seen:
                raise ValueError(f"parameter '{names[p]}' appears in more than one place")
            seen.add(p)
        dtypes = {p.dtype for p in g["params"]}
        if len(dtypes) > 1:
            raise ValueError(f"param group {i} mixes dtypes {sorted(map(str, dtypes))}; give "
                             f"each dtype a param group of its own: one flat buffer needs one "
                             f"dtype")
    if not any(g["params"] for g in groups):
        raise ValueError("no parameter requires grad: there is nothing to optimize")
    return [g for g in groups if g["params"]]


@torch.no_grad()
def _flatten(params: list[nn.Parameter], world: int, rank: int,
             param_dtype: torch.dtype | None = None) -> _Flat:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    shard_numel = -(-total // world)
    buffer = torch.zeros(shard_numel * world, dtype=param_dtype or params[0].dtype,
                         device=params[0].device)
    flat = _Flat(params, offsets, buffer, buffer[rank * shard_numel:(rank + 1) * shard_numel],
                 shard_numel)
    if param_dtype is not None:  # the masters: this rank's pieces at their original precision
        flat.master = torch.zeros(shard_numel, dtype=params[0].dtype, device=buffer.device)
        for i, p in enumerate(params):
            for owner, start, end, offset in flat.pieces(i, world):
                if owner == rank:
                    flat.master[offset:offset + end - start].copy_(p.reshape(-1)[start:end])
    for p, o in zip(params, offsets):
        buffer[o:o + p.numel()].copy_(p.reshape(-1))
        p.data = buffer[o:o + p.numel()].view_as(p)  # the parameter now lives in the buffer
    stepped = flat.shard if flat.master is None else flat.master
    for i in range(len(params)):
        for owner, start, end, offset in flat.pieces(i, world):
            if owner == rank:  # a leaf sharing the storage it steps: the optimizer writes there
                piece = nn.Parameter(stepped[offset:offset + end - start])
                flat.owned.append((i, piece, offset, start))
    return flat


# -- copied from optimizer_in_backward.py, so that each mechanism is one file to copy ---------


def _is_named(item: Any) -> bool:
    return (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor))


def unnamed(item: Any) -> Any:
    """The tensor of a ``(name, tensor)`` pair (``model.named_parameters()``); else the item."""
    return item[1] if _is_named(item) else item


def reentrant_checkpoint_in_graph(output: Any) -> bool:
    """Whether the autograd graph of ``output`` (a tensor or a nest of them) contains a
    ``torch.utils.checkpoint(..., use_reentrant=True)`` node, whose backward runs a nested one."""
    stack = [t.grad_fn for t in tree_leaves(output)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False
