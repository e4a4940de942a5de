"""Optimizer step fused into the backward pass.

The reference implementation of the PyTorch tutorial "How to save memory by fusing the optimizer
step into the backward pass", grown into something a training loop can use unchanged:

* every trainable parameter (or, with ``grouped=True``, every module's own parameters; with
  ``bucket_cap_mb``, each bucket of parameters as DDP buckets them) gets its
  own instance of the chosen ``torch.optim`` class, stepped from
  ``Tensor.register_post_accumulate_grad_hook`` as soon as its gradient is complete, after which
  the gradient is freed, so the gradients of the whole model never exist at once;
* gradient accumulation over ``accumulation_steps`` micro-batches, the same as a standard loop
  that calls ``optimizer.step()`` every k-th backward;
* ``OptimizerInBackward`` is itself a ``torch.optim.Optimizer`` whose ``param_groups`` and
  ``state`` are those of the per-parameter optimizers, so one LR scheduler drives them all and
  ``state_dict()`` / ``load_state_dict()`` interchange with a standard optimizer's checkpoint.

Usage::

    with OptimizerInBackward(model, torch.optim.AdamW, lr=1e-3) as opt:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        for x, y in data:
            loss_fn(model(x), y).backward()   # parameters are updated in here
            sched.step()

What it refuses, each with a ``ValueError`` (or ``RuntimeError`` in forward) that says why,
before anything changes:

* global gradient-norm clipping: it needs every gradient at once. ``clip_grad_norm_`` and the
  clipping options are refused; note that ``torch.nn.utils.clip_grad_norm_(model.parameters())``
  after backward cannot be intercepted and returns 0, since no gradient is left to clip;
* float16 training: fp16 needs loss scaling (``torch.amp.GradScaler``), which must see every
  gradient before any step to skip a step with inf/NaN. float16 parameters are refused at
  construction, an fp16 autocast forward of the model is refused before it runs, and
  ``scaler.step(opt)`` raises (the gradients were already applied, still scaled). bfloat16
  autocast needs no scaling and matches a standard step bit for bit;
* on FSDP2 (``fully_shard``: the parameters are DTensor shards, and FSDP2 calls their hooks
  itself after each reduce-scatter), ``accumulation_steps > 1``: accumulate with
  ``set_requires_gradient_sync(False)`` instead. A backward in which FSDP2 assigned a shard its
  gradient without calling its hook (as torch 2.4's FSDP2 does) raises at its end, before any
  step. A sharded unit run twice in one forward (a layer shared across depth) is refused at
  its second run, before backward: FSDP2 calls the hooks once per run. Where the forward takes
  ``torch.autograd.grad`` (forces, a gradient penalty), FSDP2 reduces what earlier
  micro-batches accumulated at its end and calls the hooks inside the forward: those calls
  are not stepped on, and backward's call steps the sum;
* reentrant activation checkpointing: its nested backward fires the hook of a parameter used
  inside and outside the checkpoint once in each, which would step it twice on partial
  gradients. A ``torch.utils.checkpoint`` node with ``use_reentrant=True`` in the graph of the
  model's output is refused at the end of forward; ``use_reentrant=False`` holds bit for bit.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["OptimizerInBackward", "reentrant_checkpoint_in_graph", "size_buckets", "unnamed"]

# Which OptimizerInBackward manages a parameter; refuses a second registration on it.
_OWNER: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

_FP16_ADVICE = (
    "float16 training needs loss scaling (torch.amp.GradScaler), which must see every gradient "
    "before any parameter is stepped, to skip the step when one is inf/NaN; with the optimizer "
    "in backward each parameter is stepped as soon as its own gradient is ready. Use bfloat16 "
    "(autocast(dtype=torch.bfloat16) needs no loss scaling), or a standard optimizer.step() "
    "with GradScaler, or hookbench.mechanisms.zero2.Zero2, which supports GradScaler."
)
_REENTRANT_ADVICE = (
    "the model's output depends on torch.utils.checkpoint with use_reentrant=True: its nested "
    "backward fires the hook of a parameter used inside and outside the checkpoint once in "
    "each, so the optimizer in backward would step it twice on partial gradients. Use "
    "checkpoint(..., use_reentrant=False), which matches a standard step bit for bit."
)
_FSDP2_ACCUMULATION_ADVICE = (
    "accumulation_steps > 1 on FSDP2-sharded parameters: FSDP2 calls the shards' hooks only "
    "when it reduce-scatters, so count micro-batches its way instead: call "
    "model.set_requires_gradient_sync(False) for all but the last micro-batch of a step and "
    "keep accumulation_steps=1; the step then runs on the accumulated, reduced gradient."
)
_CLIP_KEYS = ("max_grad_norm", "clip_grad_norm", "grad_clip", "max_norm")
_CLIP_ADVICE = (
    "global gradient-norm clipping needs the norm over every gradient, but with the optimizer "
    "in backward each parameter is stepped and its gradient freed before the next one exists. "
    "Clip per parameter instead (register your own post-accumulate-grad hook before creating "
    "OptimizerInBackward; hooks run in registration order), or use a standard optimizer.step()."
)


@dataclass(eq=False)
class _Unit:
    """One inner optimizer and the trainable parameters it steps together."""

    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    group_index: int
    ready: int = 0  # parameters whose gradient completed in the current backward
    fired: dict[int, int] = field(default_factory=dict)  # id(param) -> graph task id


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps ``optimizer_class`` per parameter (or per module) inside backward.

    Args:
        model: the module whose parameters are optimized; names come from ``named_parameters``.
        optimizer_class: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.AdamW``.
        params: ``None`` for every parameter of ``model``, an iterable of its parameters, or
            param groups (dicts with ``"params"`` and per-group options) as for any optimizer.
            Frozen parameters stay in the groups (so checkpoints line up with a standard
            optimizer's) but get no hook and no state.
        accumulation_steps: step on every k-th backward; gradients accumulate in between.
        grouped: step all parameters of one module together once all their gradients are
            ready, so the foreach / fused kernels of the optimizer apply within the module.
        bucket_cap_mb: instead, buckets of parameters as DDP's ``bucket_cap_mb`` makes them:
            each param group's parameters in reverse order (the order backward usually
            completes them), cut where a bucket would exceed this many MiB of gradients (a
            larger parameter is a bucket of its own). Each bucket is stepped with one call of
            the optimizer (one foreach or fused kernel launch per operation with
            ``foreach=True`` / ``fused=True``) when its last gradient arrives, so a model of
            many small tensors pays one Python-level step per bucket, not per parameter, and
            at most a bucket of gradients (plus those arriving) is alive at once.
        **defaults: options of ``optimizer_class`` (``lr``, ``betas``, ``foreach``, ...).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[Any] | None = None,
        *,
        accumulation_steps: int = 1,
        grouped: bool = False,
        bucket_cap_mb: float | None = None,
        **defaults: Any,
    ) -> None:
        # Everything is validated and every inner optimizer built before the first hook is
        # registered, so bad input leaves the model exactly as it was.
        _check_arguments(model, optimizer_class, accumulation_steps, grouped, bucket_cap_mb)
        names = {p: n for n, p in model.named_parameters()}
        sharded = [p for p in names if _is_dtensor(p)]
        if sharded and accumulation_steps != 1:
            raise ValueError(_FSDP2_ACCUMULATION_ADVICE)
        groups = _normalize_groups(params, names, defaults)
        # A probe on a dummy tensor validates the options (torch raises on a negative lr, ...)
        # and fills in the class defaults, so state_dict() reads exactly like that of
        # optimizer_class(model.named_parameters(), **defaults).
        template = optimizer_class([torch.zeros(1, requires_grad=True)], **defaults)
        units = _build_units(model, optimizer_class, groups, defaults, grouped, bucket_cap_mb,
                             first_group=0)
        super().__init__([_named_group(g, names) for g in groups], dict(template.defaults))

        self.model = model
        self.optimizer_class = optimizer_class
        self.accumulation_steps = accumulation_steps
        self.grouped = grouped
        self.bucket_cap_mb = bucket_cap_mb
        self._kwargs = defaults
        self._sharded = sharded
        self._units: list[_Unit] = []
        self._handles: list[RemovableHandle] = [
            # Refusals that must come before anything changes: an fp16 autocast forward before
            # it runs (BatchNorm statistics included), a reentrant checkpoint before backward.
            model.register_forward_pre_hook(functools.partial(
                _refuse_fp16_autocast, {p.device.type for p in names})),
            model.register_forward_hook(_refuse_reentrant_checkpoint),
        ]
        if self._sharded:  # FSDP2 calls the hooks itself: check at each backward's end
            self._handles.append(model.register_forward_hook(self._watch_backward))
            # and at the end of a torch.autograd.grad inside the forward (a force field's
            # forces, a gradient penalty), FSDP2 runs its post-backward too, reduce-scattering
            # what earlier micro-batches accumulated under set_requires_gradient_sync(False)
            # and calling the hooks on that part: a call while the forward runs is not
            # stepped on; FSDP2 adds the rest to the same shard gradient in backward and calls
            # the hook again (e3nn's potential, 2 ranks, 2 micro-batches: 0.0154 off the
            # standard step without this)
            self._handles += [
                model.register_forward_pre_hook(lambda *_: setattr(self, "_in_forward", True)),
                model.register_forward_hook(lambda *_: setattr(self, "_in_forward", False),
                                            always_call=True)]
            # and once per run of a unit: a unit run twice in one forward would be stepped
            # twice in one backward, so its second run is refused, before backward
            runs: dict[str, int] = {}
            self._handles.append(model.register_forward_pre_hook(lambda *_: runs.clear()))
            self._handles += [module.register_forward_pre_hook(functools.partial(
                _refuse_second_run, runs, name)) for name, module in model.named_modules()
                if name and hasattr(module, "_get_fsdp_state")]
        self._in_forward = False  # the model's forward is running (sharded only)
        self._backwards = 0  # backward passes (graph tasks) that reached a hook of ours
        self._graph_task = -1
        self._attach(units)

    def _attach(self, units: list[_Unit]) -> None:
        self._units.extend(units)
        for unit in units:
            self.state.update(unit.optimizer.state)  # state a class creates in __init__
        self._bind_inner_state()
        for unit in units:
            for p in filter(lambda p: p.requires_grad, unit.params):
                _OWNER[p] = self
                self._handles.append(
                    p.register_post_accumulate_grad_hook(self._make_hook(unit))
                )

    # -- hook --------------------------------------------------------------------------------

    def _make_hook(self, unit: _Unit):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(unit, param)

        return hook

    def _on_grad_ready(self, unit: _Unit, param: torch.Tensor) -> None:
        if self._in_forward:  # FSDP2's post-backward of an autograd.grad inside the forward
            return
        task = torch._C._current_graph_task_id()
        if task != self._graph_task:  # the first of our hooks in a new backward
            self._graph_task = task
            self._backwards += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if unit.fired.get(id(param)) == task:
            # PyTorch promises one call per backward, tied parameters included; a second call
            # would step again on a partial gradient.
            raise RuntimeError(
                f"post-accumulate-grad hook fired twice for parameter "
                f"'{self._name(param)}' in one backward pass"
            )
        unit.fired[id(param)] = task
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._finish(unit)

    def _watch_backward(self, module: nn.Module, args: Any, output: Any) -> None:
        # When backward reaches the output, queue a check behind FSDP2's own end-of-backward
        # callback (queued during backward; a callback queued from a callback runs last).
        engine = torch.autograd.Variable._execution_engine
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: engine.queue_callback(
                    lambda: engine.queue_callback(self._check_sharded_hooks_ran)))
                return

    def _check_sharded_hooks_ran(self) -> None:
        # FSDP2 assigns each shard its reduced gradient and then calls the shard's hooks,
        # which step it and free the gradient. A shard holding a gradient whose hook did not
        # run in this backward means FSDP2 assigned it and never called us: nothing stepped.
        task = torch._C._current_graph_task_id()
        missed = [self._name(p) for u in self._units for p in u.params
                  if p.requires_grad and p.grad is not None and u.fired.get(id(p)) != task
                  and _is_dtensor(p)]
        if missed:
            raise RuntimeError(
                f"FSDP2 reduce-scattered the gradients of {len(missed)} sharded parameters "
                f"(e.g. '{missed[0]}') without calling their post-accumulate-grad hooks, so "
                f"the optimizer in backward did not step them. This torch's FSDP2 does not "
                f"run the hooks on its shards (torch 2.4's did not); use a standard "
                f"optimizer.step() with FSDP2 on it.")

    def _end_of_backward(self) -> None:
        # A unit whose parameters did not all receive a gradient in this backward (an unused
        # branch, or a module only partly used) is stepped with what it has, as a standard
        # step would be; so is one holding gradients from earlier micro-batches only.
        for unit in self._units:
            if unit.ready or any(p.grad is not None for p in unit.params):
                self._finish(unit)

    def _finish(self, unit: _Unit) -> None:
        unit.ready = 0
        if self._backwards % self.accumulation_steps:
            return  # accumulate: the gradient stays in .grad until the k-th backward
        inner = unit.optimizer.param_groups[0]
        inner.update(
            (k, v)
            for k, v in self.param_groups[unit.group_index].items()
            if k not in ("params", "param_names")
        )
        unit.optimizer.step()
        unit.optimizer.zero_grad(set_to_none=True)
        # The flag LRScheduler reads to warn about scheduler.step() before optimizer.step();
        # the outer step() is a no-op the user need not call.
        self._opt_called = True

    # -- Optimizer API -----------------------------------------------------------------------

    # GradScaler.step(opt) then calls step() directly, setting found_inf and grad_scale on the
    # optimizer, instead of failing on "No inf checks were recorded for this optimizer".
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """A no-op: the parameters were updated during backward.

        Kept so that loops and LR schedulers written for a standard optimizer run unchanged.
        """
        if closure is not None:
            raise ValueError("OptimizerInBackward steps inside backward and takes no closure")
        if hasattr(self, "found_inf"):  # set by torch.amp.GradScaler.step(self)
            del self.found_inf
            self.__dict__.pop("grad_scale", None)
            raise ValueError("GradScaler.step() on OptimizerInBackward: the parameters were "
                             "already stepped in backward with the gradients still multiplied "
                             "by the loss scale. " + _FP16_ADVICE)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters of the model (a new head, unfrozen layers): they get their own inner
        optimizers and hooks, validated as in the constructor before anything changes."""
        if not hasattr(self, "_units"):  # torch.optim.Optimizer.__init__ adding the groups
            super().add_param_group(param_group)
            return
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        names = {p: n for n, p in self.model.named_parameters()}
        mine = [p for g in self.param_groups for p in g["params"]]
        groups = _normalize_groups([param_group], names, self._kwargs, taken=mine)
        units = _build_units(self.model, self.optimizer_class, groups, self._kwargs,
                             self.grouped, self.bucket_cap_mb,
                             first_group=len(self.param_groups))
        super().add_param_group(_named_group(groups[0], names))
        self._attach(units)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> None:
        raise ValueError(_CLIP_ADVICE)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``optimizer_class`` itself.

        Where the saved groups carry ``param_names`` the state is matched by name (a checkpoint
        of a model that lists its parameters in another order loads correctly), else by
        position, as ``torch.optim.Optimizer`` does. Shapes are checked before anything changes.
        """
        state_dict = _reorder_by_name(state_dict, self.param_groups)
        self._check_state_shapes(state_dict)
        names = [g["param_names"] for g in self.param_groups]
        super().load_state_dict(state_dict)  # validates group sizes before changing anything
        for group, own in zip(self.param_groups, names):  # torch < 2.6 drops them from
            group.setdefault("param_names", own)        # a checkpoint saved without names
            # An option an older torch did not save (AdamW's decoupled_weight_decay before
            # pytorch#143710) gets its default, as optimizer_class.__setstate__ gives it, so
            # the state saved next reads like the standard optimizer's.
            for key, default in self.defaults.items():
                group.setdefault(key, default)
        self._bind_inner_state()

    # -- lifetime ----------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove every hook; the model trains with a standard optimizer again. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit in self._units:
            for p in unit.params:
                if _OWNER.get(p) is self:
                    del _OWNER[p]

    def __enter__(self) -> OptimizerInBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- internals ---------------------------------------------------------------------------

    def _bind_inner_state(self) -> None:
        # One state dict for all: the inner optimizers read and write the outer one's entries,
        # so state_dict(), load_state_dict() and inspection see the live state.
        for unit in self._units:
            unit.optimizer.state = self.state

    def _check_state_shapes(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved) != len(params):
            return  # torch.optim.Optimizer.load_state_dict names the mismatch
        for index, p in zip(saved, params):
            for key, value in state_dict["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != p.shape:
                    raise ValueError(
                        f"state '{key}' of parameter '{self._name(p)}' has shape "
                        f"{tuple(value.shape)}, the parameter has {tuple(p.shape)}"
                    )

    def _name(self, param: torch.Tensor) -> str:
        for group in self.param_groups:
            for p, n in zip(group["params"], group["param_names"]):
                if p is param:
                    return n
        return "<unknown>"

    @property
    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-parameter (or per-module) optimizers, for inspection."""
        return [u.optimizer for u in self._units]


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a parameter FSDP2 sharded), without importing
    torch.distributed where it is not built."""
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _refuse_second_run(runs: dict[str, int], name: str, module: nn.Module, args: Any) -> None:
    # A training forward only: not under no_grad, and not a checkpoint's recomputation inside
    # backward (a graph task is running then).
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return
    runs[name] = runs.get(name, 0) + 1
    if runs[name] > 1:
        raise ValueError(
            f"FSDP2 unit '{name}' runs {runs[name]} times in one forward (a layer shared "
            f"across depth, as ALBERT's): FSDP2 reduce-scatters its gradients and calls their "
            f"post-accumulate-grad hooks once per run, so the optimizer in backward would "
            f"step its parameters more than once in one backward, on partial gradients. "
            f"Nothing was stepped; use a standard optimizer.step() for this model, or shard "
            f"the shared layer inside a unit that runs once.")


def _check_arguments(model: Any, optimizer_class: Any, accumulation_steps: Any, grouped: bool,
                     bucket_cap_mb: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    _check_optimizer_class(optimizer_class)
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
        raise TypeError(f"accumulation_steps must be an int, got {accumulation_steps!r}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
    if bucket_cap_mb is not None:
        if (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                or not 0 < bucket_cap_mb < float("inf")):
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got "
                             f"{bucket_cap_mb!r}")
        if grouped:
            raise ValueError("grouped=True and bucket_cap_mb are two ways of grouping the "
                             "parameters (by module, by size); pass one of them")


def _check_optimizer_class(optimizer_class: Any) -> None:
    if isinstance(optimizer_class, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_class must be an optimizer class such as torch.optim.Adam, got an "
            f"instance of {type(optimizer_class).__name__}; pass the class and its options "
            f"as keyword arguments"
        )
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, OptimizerInBackward):
        raise TypeError("optimizer_class cannot be OptimizerInBackward itself")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ValueError(
            f"{optimizer_class.__name__}.step() needs a closure that re-evaluates the loss, "
            f"which cannot run inside backward; use a standard optimizer.step(closure) for it"
        )


def _normalize_groups(
    params: Iterable[Any] | None, names: dict, defaults: dict, taken: Iterable = ()
) -> list[dict[str, Any]]:
    """Param groups as plain dicts of parameter lists plus options, validated. Parameters may
    be given as ``(name, tensor)`` pairs (``model.named_parameters()``), as torch accepts."""
    if params is None:
        raw = [{"params": list(names)}]
    else:
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors or of param-group dicts")
        raw = list(params)
        if not raw:
            raise ValueError("params is empty")
        if not all(isinstance(g, dict) for g in raw):  # tensors or (name, tensor) pairs
            raw = [{"params": raw}]
    groups, seen = [], set()
    for i, group in enumerate(raw):
        if "params" not in group:
            raise ValueError(f"param group {i} has no 'params' entry")
        options = {k: v for k, v in group.items() if k != "params"}
        for key in _CLIP_KEYS:
            if key in defaults or key in options:
                raise ValueError(f"'{key}' is not supported: {_CLIP_ADVICE}")
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        tensors = [unnamed(t) for t in tensors]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"param group {i} holds a {type(t).__name__}, not a tensor")
            if not t.is_leaf:
                raise ValueError(
                    f"param group {i} holds a non-leaf tensor (grad_fn={type(t.grad_fn).__name__})"
                    f"; post-accumulate-grad hooks exist only on leaf tensors"
                )
            if t not in names:
                raise ValueError(
                    f"param group {i} holds a tensor of shape {tuple(t.shape)} that is not a "
                    f"parameter of the model"
                )
            if t in seen or any(t is q for q in taken):
                raise ValueError(f"parameter '{names[t]}' appears in more than one place")
            if t.requires_grad and t.dtype == torch.float16:
                raise ValueError(f"parameter '{names[t]}' is float16: {_FP16_ADVICE}")
            owner = _OWNER.get(t)
            if owner is not None:
                raise ValueError(
                    f"parameter '{names[t]}' is already stepped by another OptimizerInBackward;"
                    f" call remove() on it (or leave its `with` block) first"
                )
            seen.add(t)
        groups.append({"params": tensors, **options})
    if not any(t.requires_grad for g in groups for t in g["params"]):
        raise ValueError("no parameter requires grad: there is nothing to optimize")
    return groups


def _named_group(group: dict[str, Any], names: dict) -> dict[str, Any]:
    """A group with tensors under "params" and their names under "param_names": what torch >=
    2.6 makes of ``(name, tensor)`` pairs, spelled out so that torch 2.4 and 2.5 (which accept
    only tensors) hold the same groups and save the same state dict."""
    return {**group, "params": list(group["params"]),
            "param_names": [names[p] for p in group["params"]]}


def _is_named(item: Any) -> bool:
    return (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor))


def unnamed(item: Any) -> Any:
    """The tensor of a ``(name, tensor)`` pair (``model.named_parameters()``); else the item."""
    return item[1] if _is_named(item) else item


def _refuse_fp16_autocast(device_types: set[str], module: nn.Module, args: Any) -> None:
    for device_type in device_types:
        if (torch.is_autocast_enabled(device_type)
                and torch.get_autocast_dtype(device_type) == torch.float16):
            raise RuntimeError(f"forward under float16 autocast ({device_type}): {_FP16_ADVICE}")


def _refuse_reentrant_checkpoint(module: nn.Module, args: Any, output: Any) -> None:
    if reentrant_checkpoint_in_graph(output):
        raise RuntimeError(_REENTRANT_ADVICE)


def reentrant_checkpoint_in_graph(output: Any) -> bool:
    """Whether the autograd graph of ``output`` (a tensor or a nest of them) contains a
    ``torch.utils.checkpoint(..., use_reentrant=True)`` node, whose backward runs a nested one.
    A walk over the graph's nodes, once per forward: 0.4 ms for ViT-B/16's (0.2% of its CPU
    forward, measured)."""
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


def _build_units(
    model: nn.Module, optimizer_class: type, groups: list[dict], defaults: dict, grouped: bool,
    bucket_cap_mb: float | None, first_group: int,
) -> list[_Unit]:
    options = [{**defaults, **{k: v for k, v in g.items() if k != "params"}} for g in groups]
    group_of = {p: i for i, g in enumerate(groups) for p in g["params"] if p.requires_grad}
    buckets: dict[Any, list[torch.Tensor]] = defaultdict(list)
    if bucket_cap_mb is not None:
        for i, g in enumerate(groups):
            for number, bucket in enumerate(
                    size_buckets([p for p in g["params"] if p.requires_grad], bucket_cap_mb)):
                buckets[(number, i)] = bucket
    elif grouped:
        seen: set = set()
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if p in group_of and p not in seen:  # a tied parameter joins its first module
                    seen.add(p)
                    buckets[(id(module), group_of[p])].append(p)
    else:
        for p, i in group_of.items():
            buckets[(id(p), i)].append(p)
    # Frozen parameters get an optimizer but no hook: some classes (Adagrad) create state for
    # every parameter up front, and a standard optimizer's state dict has it too.
    for i, g in enumerate(groups):
        for p in g["params"]:
            if not p.requires_grad:
                buckets[("frozen", i)].append(p)
    return [
        _Unit(optimizer_class(params, **options[i]), params, first_group + i)
        for (_, i), params in buckets.items()
    ]


def size_buckets(params: list[torch.Tensor], bucket_cap_mb: float) -> list[list[torch.Tensor]]:
    """``params`` in buckets as DDP's ``bucket_cap_mb`` makes them: in reverse order, cut
    where a bucket would exceed the cap (a larger parameter is a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > bucket_cap_mb * 2**20:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _reorder_by_name(state_dict: dict[str, Any], groups: list[dict]) -> dict[str, Any]:
    """Renumber a named state dict so that its parameter order is ours."""
    saved_groups = state_dict.get("param_groups", [])
    if len(saved_groups) != len(groups) or not all("param_names" in g for g in saved_groups):
        return state_dict
    saved_index = {n: i for g in saved_groups for n, i in zip(g["param_names"], g["params"])}
    ours = [n for g in groups for n in g["param_names"]]
    missing = sorted(set(ours) - set(saved_index))
    unexpected = sorted(set(saved_index) - set(ours))
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model's parameters: missing {missing}, "
            f"unexpected {unexpected}"
        )
    new_index = {n: i for i, n in enumerate(ours)}
    state = {new_index[n]: state_dict["state"][i] for n, i in saved_index.items()
             if i in state_dict["state"]}
    new_groups, start = [], 0
    for saved, group in zip(saved_groups, groups):
        names = group["param_names"]
        if sorted(saved["param_names"]) != sorted(names):
            raise ValueError(
                "state dict groups hold other parameters than this optimizer's groups"
            )
        new_groups.append({**saved, "params": list(range(start, start + len(names))),
                           "param_names": list(names)})
        start += len(names)
    return {**state_dict, "state": state, "param_groups": new_groups}
