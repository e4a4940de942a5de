"""Injected faults: how hookbench proves that its checks can fail.

Each fault makes PyTorch misbehave the way a regression would, by swapping one function for a
broken version while ``inject(name)`` is active and restoring it in ``finally``: hook faults
replace ``torch.Tensor.register_post_accumulate_grad_hook``; ``removal_does_nothing`` replaces
``RemovableHandle.remove``; ``optimizer_arithmetic_changed`` replaces the functional Adam that
``Adam`` and ``AdamW`` step through; collective faults replace the reduction ZeRO-2 sends
gradients through (``hookbench.mechanisms.zero2.reduce_to_owner``); ``reduce_scatter_ignores_op`` makes
``torch.distributed``'s reduce-scatter sum whatever op it is given; upgrade faults make a
torch-private module unimportable, change a private API's signature (``FakeTensorMode``), or
make the memory tracker miss allocations; checkpoint faults load ``step`` as another dtype or
save a param-group key under a new name; ``new_warning`` makes forward-hook registration warn;
``compiled_module_skips_forward_hooks`` makes a ``torch.compile``'d model skip its submodules'
forward hooks; saved-tensor faults make ``saved_tensors_hooks`` call pack twice per tensor or
unpack hand back the tensor unpacked before (``unpack_returns_stale``), make activation offload
keep each offloaded tensor's device copy alive, or compress in lossless mode; engine faults make
FSDP2 forget the hooks on its shards, the reduce-scatter hand a rank its neighbour's slice, or
DDP hand each gradient bucket to its communication hook twice, or DDP run its defaults for
``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb``, ``find_unused_parameters``
and ``broadcast_buffers`` whatever it is given
(``ddp_drops_settings``), or reduce with its built-in all-reduce whatever comm hook it is
given (``ddp_ignores_comm_hook``), or DeepSpeed build its ZeRO optimizer with its defaults
whatever the config says (``deepspeed_drops_settings``, on a rank where deepspeed is), or
FSDP2 its defaults for ``mp_policy``, ``reshard_after_forward`` and ``offload_policy`` and
merge the units after a model's first into its root (``fsdp2_drops_settings``);
``implementation_flag_ignored`` drops an optimizer's ``foreach``/``fused`` choice, so its step
runs the for-loop;
``capturable_ignored`` drops ``capturable=True``, so the step reads its count back to the host
(and torch no longer refuses it on the CPU);
``kernel_ignores_maximize`` makes the foreach and fused kernels descend whatever ``maximize``
says; ``fused_sgd_skips_low_precision`` leaves bf16 and fp16 parameters unchanged by fused SGD
(pytorch#191763, torch 2.12 and 2.13 on CPU); ``checkpoint_forgets_rng_state`` recomputes
a checkpointed block on other random numbers than its forward drew; ``dropout_drops_half``
``fsdp2_reduces_in_bf16`` hands every fp32 reduce-scatter bf16 (FSDP2's policy says fp32);
``dropout_drops_half`` draws every dropout mask keeping half the inputs whatever the probability, and
``dropout_ignores_seed`` draws each from one fixed state whatever the seed (caught where
pinned draws are replayed: a workload's ``draws`` row).
A fault reaches a run on the ranks by one rule, ``run_under``. The fault tests,
``pytest --hookbench-fault NAME``
and ``hookbench selfcheck`` run the checks under each fault and require that they fail.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import warnings
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hookbench.core import fsdp, names
from hookbench.core.prerequisites import one_line
from hookbench.measure.memory import StorageTracker
from hookbench.mechanisms import zero2
from hookbench.mechanisms.activation_offload import ActivationOffload

__all__ = ["FAULTS", "HOOK_FAULTS", "inject", "run_under"]

_Register = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], object]


def _fires_twice(original: _Register) -> _Register:
    def register(self, hook):
        def twice(t):
            hook(t)
            hook(t)

        return original(self, twice)

    return register


def _stops_after_first_backward(original: _Register) -> _Register:
    def register(self, hook):
        calls = []

        def first_only(t):
            if not calls:
                calls.append(1)
                hook(t)

        return original(self, first_only)

    return register


def _never_fires(original: _Register) -> _Register:
    # Registration succeeds and returns a working handle; the hook is never called.
    def register(self, hook):
        return original(self, lambda t: None)

    return register


def _fires_before_accumulation(original: _Register) -> _Register:
    # A tensor hook runs before AccumulateGrad: .grad does not yet hold this backward's gradient.
    def register(self, hook):
        return self.register_hook(lambda grad: hook(self))

    return register


def _keeps_gradients_alive(original: _Register) -> _Register:
    # Something holds every gradient the hook sees, so freeing .grad in the hook frees nothing.
    kept: list[torch.Tensor] = []

    def register(self, hook):
        def keep(t):
            kept.append(t.grad)
            hook(t)

        return original(self, keep)

    return register


def _fires_late(original: _Register) -> _Register:
    # The hook runs once, after accumulation, but only when the whole backward pass has ended:
    # the numbers come out right and every gradient is alive at once, the saving gone.
    def register(self, hook):
        def late(t):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: hook(t))

        return original(self, late)

    return register


def _removal_does_nothing(original: Callable) -> Callable:
    # handle.remove() returns and the hook stays registered.
    def remove(self):
        pass

    return remove


def _optimizer_arithmetic_changed(original: Callable) -> Callable:
    # Every Adam/AdamW update comes out 0.1% larger, as a changed bias correction or eps
    # placement would make it; both sides of a parity check use it, so only a stored baseline
    # can see it.
    def adam(*args, lr, **kwargs):
        return original(*args, lr=lr * 1.001, **kwargs)

    return adam


def _ignores(*flags: str) -> Callable[[Callable], Callable]:
    # Every param group's ``flags`` are dropped to None once added, as a torch that ignored the
    # user's choice would: the step then runs torch's default (the for-loop on CPU, with the
    # step count read back to the host), the arithmetic of the reference it is compared with.
    def breaks(original: Callable) -> Callable:
        def add_param_group(self, param_group):
            original(self, param_group)
            for flag in flags:
                if self.param_groups[-1].get(flag):
                    self.param_groups[-1][flag] = None

        return add_param_group

    return breaks


def _optimizer_kernels() -> list[tuple[object, str]]:
    # the foreach and fused kernels of the families the parity rows run with maximize=True
    # (AdamW steps through Adam's from torch 2.8; before, its own)
    return [(module, name) for module in (importlib.import_module(f"torch.optim.{family}")
                                          for family in ("sgd", "adam", "adamw", "adagrad",
                                                         "rmsprop"))
            for name in vars(module) if name.startswith(("_multi_tensor_", "_fused_"))
            and callable(vars(module)[name])]


def _ignores_maximize(original: Callable) -> Callable:
    # A kernel that ignores one of the user's options (maximize here): the step descends where
    # the user asked to ascend, in that implementation only; the for-loop it is held to
    # still honours it.
    @functools.wraps(original)
    def kernel(*args, **kwargs):
        if "maximize" in kwargs:
            kwargs["maximize"] = False
        return original(*args, **kwargs)

    return kernel


def _skips_low_precision(original: Callable) -> Callable:
    # pytorch#191763 (torch 2.12 and 2.13, fixed by #192545): CPU fused SGD skips the update
    # of bf16 and fp16 parameters, which stay as they were; the kernel still runs.
    def _fused_sgd(params, *args, **kwargs):
        kept = [(p, p.detach().clone()) for p in params
                if p.dtype in (torch.bfloat16, torch.float16)]
        original(params, *args, **kwargs)
        with torch.no_grad():
            for p, value in kept:
                p.copy_(value)

    return _fused_sgd


def _forgets_rng_state(original: Callable) -> Callable:
    # The recompute in backward no longer runs on the RNG state the forward drew from, as if
    # torch ignored preserve_rng_state: dropout inside a checkpointed block draws another mask
    # in backward than in forward, and the gradients are those of neither.
    def checkpoint(function, *args, **kwargs):
        return original(function, *args, **{**kwargs, "preserve_rng_state": False})

    return checkpoint


def _wrong_slice(original: Callable) -> Callable:
    # The owner receives its reduced piece shifted by one element: another slice's data.
    def reduce(chunk, owner, group):
        original(chunk, owner, group)
        chunk.copy_(chunk.roll(1))

    return reduce


def _low_precision(original: Callable) -> Callable:
    # The reduction silently goes through bfloat16 (8 bits of mantissa).
    def reduce(chunk, owner, group):
        original(chunk, owner, group)
        chunk.copy_(chunk.to(torch.bfloat16).to(chunk.dtype))

    return reduce


def _sums_whatever_op(original: Callable) -> Callable:
    # gloo's reduce_scatter before torch 2.9 (pytorch#162338): every op is summed, so AVG,
    # MAX, MIN and PRODUCT silently become SUM.
    def reduce_scatter(output, input, op=None, *args, **kwargs):
        return original(output, input, torch.distributed.ReduceOp.SUM, *args, **kwargs)

    return reduce_scatter


def _fake_tensor_mode_changed(original: type) -> type:
    # A private API changes its signature in a release, as private APIs do: the measurement
    # that calls it raises (a TypeError, not an ImportError), and must fail, not skip.
    class Changed(original):
        def __init__(self, *args, shape_env=None, **kwargs):
            if shape_env is None:
                raise TypeError("FakeTensorMode.__init__() missing 1 required keyword-only "
                                "argument: 'shape_env' (injected fault)")
            super().__init__(*args, shape_env=shape_env, **kwargs)

    return Changed


def _misses_forward_allocations(original: Callable) -> Callable:
    # Ops run in forward stop reaching the dispatch mode (as a new C++-side decomposition
    # might make them): the tracker sees no activations, and the peak drops.
    def track(self, tensor, category=None):
        if category is None and self.phase == "forward":
            return
        original(self, tensor, category)

    return track


def _loads_step_as_float64(original: Callable) -> Callable:
    # A release loads a checkpoint's ``step`` as float64 (pytorch#110940, #115841 moved it
    # between dtypes): the arithmetic is identical, the state saved next is not.
    def process(param, value, param_id, param_groups, key=None):
        value = original(param, value, param_id, param_groups, key)
        return value.to(torch.float64) if key == "step" else value

    return process


def _renames_a_key(original: Callable) -> Callable:
    # A release saves a param-group key under a new name, as AdamW's new
    # ``decoupled_weight_decay`` (pytorch#143710) and ``param_names`` (#134107) were additions.
    def state_dict(self):
        saved = original(self)
        for group in saved["param_groups"]:
            if "weight_decay" in group:
                group["weight_decay_rate"] = group.pop("weight_decay")
        return saved

    return state_dict


def _warns_on_registration(original: Callable) -> Callable:
    # A release deprecates an API the mechanisms call: every forward hook registration warns.
    def register(self, *args, **kwargs):
        warnings.warn("Module.register_forward_hook will change its signature in a future "
                      "release (injected fault)", FutureWarning, stacklevel=2)
        return original(self, *args, **kwargs)

    return register


def _skips_submodule_forward_hooks(original: Callable) -> Callable:
    # A compiled model whose submodules' forward hooks stop running (as hooks added after
    # compilation did, pytorch#117758): while each call runs they are emptied, so dynamo
    # traces, and any eager fallback runs, a forward without them; restored afterwards in the
    # same order, with any registered during the call kept after them.
    def call(self, *args, **kwargs):
        root, emptied = self._orig_mod, []
        for m in root.modules():
            if m is not root and m._forward_hooks:
                emptied.append((m._forward_hooks, list(m._forward_hooks.items())))
                m._forward_hooks.clear()
        try:
            return original(self, *args, **kwargs)
        finally:
            for hooks, saved in emptied:
                added = list(hooks.items())
                hooks.clear()
                hooks.update(saved)
                hooks.update(added)

    return call


def _hook_registration() -> list[tuple[object, str]]:
    return [(torch.Tensor, "register_post_accumulate_grad_hook")]


def _handle_removal() -> list[tuple[object, str]]:
    return [(torch.utils.hooks.RemovableHandle, "remove")]


def _functional_adams() -> list[tuple[object, str]]:
    # torch.optim deletes its submodule names; Adam.step calls torch.optim.adam's global
    # ``adam``, and so does AdamW where it subclasses Adam (pytorch#143710); before that, AdamW
    # steps through torch.optim.adamw's own ``adamw`` (torch 2.4 to 2.5), broken alike.
    places = [(importlib.import_module("torch.optim.adam"), "adam")]
    if not issubclass(torch.optim.AdamW, torch.optim.Adam):
        places.append((importlib.import_module("torch.optim.adamw"), "adamw"))
    return places


def _zero2_reduction() -> list[tuple[object, str]]:
    return [(zero2, "reduce_to_owner")]


def _fake_tensor_mode() -> list[tuple[object, str]]:
    return [(importlib.import_module("torch._subclasses.fake_tensor"), "FakeTensorMode")]


def _memory_tracker() -> list[tuple[object, str]]:
    return [(StorageTracker, "track")]


def _reduces_in_bf16(original: Callable) -> Callable:
    # FSDP2 keeps MixedPrecisionPolicy(reduce_dtype=torch.float32) but hands the reduce-scatter
    # bf16: its fp32 gradients rounded to bf16 before they are summed
    def reduce_scatter(output, input, *args, **kwargs):
        if input.dtype != torch.float32:
            return original(output, input, *args, **kwargs)
        low = torch.empty_like(output, dtype=torch.bfloat16)
        work = original(low, input.to(torch.bfloat16), *args, **kwargs)
        if work is not None:
            work.wait()
        output.copy_(low)
        return work

    return reduce_scatter


class _DropoutMasks(TorchDispatchMode):
    """Every dropout mask (``aten::bernoulli_`` with a float probability, as dropout draws on
    the CPU) drawn by ``draw(func, args, kwargs)`` instead: a broken random op, which pinning
    the draws must not hide (``hookbench.core.draws``)."""

    def __init__(self, draw: Callable[..., Any]):
        super().__init__()
        self.draw = draw

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bernoulli_.float:
            return self.draw(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def _drops_half() -> contextlib.AbstractContextManager:
    # whatever the probability asked: half the inputs kept (dropout at p=0.1 drops half)
    return _DropoutMasks(lambda func, args, kwargs: func(args[0], 0.5, **kwargs))


def _ignores_seed() -> contextlib.AbstractContextManager:
    # every mask drawn from one fixed state, whatever the generator was seeded with
    return _DropoutMasks(lambda func, args, kwargs: func(
        *args, **{**kwargs, "generator": torch.Generator().manual_seed(0)}))


@contextlib.contextmanager
def _private_module_gone() -> Iterator[None]:
    # A torch-private module hookbench imports (the fake process group that simulates N ranks
    # for ZeRO-2's memory) stops importing, as private modules do between releases. None in
    # sys.modules makes every import of it raise ImportError until restored.
    name = "torch.testing._internal.distributed.fake_pg"
    before = sys.modules.get(name, _ABSENT)
    sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if before is _ABSENT:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = before


def _step_loading() -> list[tuple[object, str]]:
    return [(torch.optim.Optimizer, "_process_value_according_to_param_policy")]


def _optimizer_saving() -> list[tuple[object, str]]:
    return [(torch.optim.Optimizer, "state_dict")]


def _forward_hook_registration() -> list[tuple[object, str]]:
    return [(torch.nn.Module, "register_forward_hook")]


def _compiled_module_call() -> list[tuple[object, str]]:
    from torch._dynamo.eval_frame import OptimizedModule  # imported only when injected

    return [(OptimizedModule, "__call__")]


def _reduce_scatters() -> list[tuple[object, str]]:
    import torch.distributed as dist

    return [(dist, name) for name in ("reduce_scatter_tensor", "reduce_scatter_single")
            if hasattr(dist, name)]  # reduce_scatter_single from torch 2.13


def _saved_tensors_hooks() -> list[tuple[object, str]]:
    return [(torch.autograd.graph.saved_tensors_hooks, "__init__")]


def _packs_twice(original: Callable) -> Callable:
    def __init__(self, pack_hook, unpack_hook):
        def twice(t):
            pack_hook(t)
            return pack_hook(t)

        original(self, twice, unpack_hook)

    return __init__


def _unpacks_stale(original: Callable) -> Callable:
    def __init__(self, pack_hook, unpack_hook):
        last: list[torch.Tensor] = []

        def stale(packed):  # the tensor unpacked before, where it could pass for this one
            t = unpack_hook(packed)
            previous = last[0] if last else None
            last[:] = [t]
            same = previous is not None and (previous.shape, previous.dtype) == (t.shape,
                                                                                 t.dtype)
            return previous if same else t

        original(self, pack_hook, stale)

    return __init__


def _offloading() -> list[tuple[object, str]]:
    return [(ActivationOffload, "_offload")]


def _keeps_device_copies(original: Callable) -> Callable:
    kept: list[torch.Tensor] = []  # freed when the fault is lifted

    def _offload(self, t):
        kept.append(t)
        return original(self, t)

    return _offload


def _compression() -> list[tuple[object, str]]:
    return [(ActivationOffload, "_compressed")]


def _compresses_exact_tensors(original: Callable) -> Callable:
    def _compressed(self, t):
        if self.compress is None and t.dtype == torch.float32:  # lossless asked for
            return t.to(torch.bfloat16), None
        return original(self, t)

    return _compressed


def _fsdp2_reduction() -> list[tuple[object, str]]:
    # FSDP2's param group calls foreach_reduce by the name it imported; torch 2.4 and 2.5 keep
    # FSDP2 at torch.distributed._composable.fsdp
    for name in ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                 "torch.distributed._composable.fsdp._fsdp_param_group"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "foreach_reduce"):
            return [(module, "foreach_reduce")]
    raise ImportError("this torch has no FSDP2 foreach_reduce to break")


def _forgets_shard_hooks(original: Callable) -> Callable:
    # FSDP2 reduce-scatters and assigns every shard's gradient, but no longer calls the hooks
    # registered on the shards (as FSDP2 did before it learnt to): the optimizer in backward
    # never steps, a counting hook counts nothing.
    def foreach_reduce(fsdp_params, *args, **kwargs):
        hidden = [(fp.sharded_param, fp.sharded_param._post_accumulate_grad_hooks)
                  for fp in fsdp_params]
        for param, _ in hidden:
            param._post_accumulate_grad_hooks = None
        try:
            return original(fsdp_params, *args, **kwargs)
        finally:
            for param, hooks in hidden:
                param._post_accumulate_grad_hooks = hooks

    return foreach_reduce


def _hands_wrong_slice(original: Callable) -> Callable:
    # Each rank receives its reduced slice shifted by one element: a neighbour's data.
    def reduce_scatter(output, input, *args, **kwargs):
        work = original(output, input, *args, **kwargs)
        if work is not None:
            work.wait()
        output.copy_(output.roll(1))
        return work

    return reduce_scatter


def _comm_hook_registration() -> list[tuple[object, str]]:
    from torch.nn.parallel import DistributedDataParallel

    return [(DistributedDataParallel, "register_comm_hook")]


def _reduces_each_bucket_twice(original: Callable) -> Callable:
    # DDP hands every gradient bucket to the communication hook twice. The mean of a mean is
    # the mean again, so the numbers may not move: only the hook's calls show it.
    def register_comm_hook(self, state, hook):
        def twice(state, bucket):  # unannotated: DDP checks the annotations it finds
            hook(state, bucket).wait()
            return hook(state, bucket)

        return original(self, state, twice)

    return register_comm_hook


def _ignores_comm_hook(original: Callable) -> Callable:
    # DDP reduces every bucket with its built-in arithmetic (divide by the world size, all-reduce
    # SUM) whatever hook it was given. The hook is still called, so its calls and collectives
    # run as before, and its result is thrown away: where the hook is torch's allreduce_hook
    # nothing moves, and a compressing hook's row differs from the hook applied by hand.
    def register_comm_hook(self, state, hook):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        @functools.wraps(hook)
        def builtin(state, bucket):
            kept = bucket.buffer().clone()
            hook(state, bucket).wait()
            bucket.buffer().copy_(kept)  # the gradients as handed over, reduced the built-in way
            return default_hooks.allreduce_hook(None, bucket)

        return original(self, state, builtin)

    return register_comm_hook


def _ddp_construction() -> list[tuple[object, str]]:
    from torch.nn.parallel import DistributedDataParallel

    return [(DistributedDataParallel, "__init__")]


def _drops_settings(original: Callable) -> Callable:
    # DDP runs its defaults for the settings that change how it reduces, not what: the
    # numbers may not move, only what DDP reports running and where the gradients live show it.
    @functools.wraps(original)  # the signature a workload's DDP settings are checked against
    def __init__(self, module, *args, **kwargs):
        for setting in ("static_graph", "gradient_as_bucket_view", "bucket_cap_mb",
                        "find_unused_parameters", "broadcast_buffers", "forward_sync_buffers"):
            kwargs.pop(setting, None)
        original(self, module, *args, **kwargs)

    return __init__


def _fully_shard() -> list[tuple[object, str]]:
    try:
        return [(fsdp.api(), "fully_shard")]
    except ImportError:  # no FSDP2 on this torch: nothing to break
        return []


def _fsdp2_drops_settings(original: Callable) -> Callable:
    # FSDP2 shards with its defaults (reshard after forward, no policy, no offload) whatever it
    # is given, and merges the units it is given into their root: after a model's first unit,
    # fully_shard does nothing until the root's call (the module that holds one given before),
    # so their parameters are the root's. The units' parameters in and after their forward
    # show it, and the state.
    given: list[torch.nn.Module] = []

    @functools.wraps(original)
    def fully_shard(module, *args, **kwargs):
        for setting in ("mp_policy", "reshard_after_forward", "offload_policy"):
            kwargs.pop(setting, None)
        if isinstance(module, torch.nn.Module):
            root = any(m is g for m in module.modules() for g in given)
            if given and not root:
                return module  # a unit after the first: ignored
            if root:
                given.clear()  # the model is sharded; the next call starts another
            else:
                given.append(module)
        return original(module, *args, **kwargs)

    return fully_shard


def _deepspeed_initialize() -> list[tuple[object, str]]:
    # only on a rank, where DeepSpeed runs: importing it elsewhere would pick its accelerator
    # for the whole process (``deepspeed_import.load``); without deepspeed, nothing to break
    from hookbench.core.deepspeed_import import load
    from hookbench.core.prerequisites import MissingPrerequisite

    if not torch.distributed.is_initialized():
        return []
    try:
        return [(load(), "initialize")]
    except MissingPrerequisite:
        return []


def _deepspeed_drops_settings(original: Callable) -> Callable:
    # DeepSpeed builds its ZeRO optimizer with its defaults for how it reduces (buckets,
    # overlap, contiguous gradients, reduce-scatter, the reduction's dtype and scaling) whatever
    # the config says: only what its optimizer was built with shows it.
    @functools.wraps(original)
    def initialize(*args, config=None, **kwargs):
        if isinstance(config, dict):
            config = {k: v for k, v in config.items() if k not in (
                "communication_data_type", "prescale_gradients", "gradient_predivide_factor")}
            config["zero_optimization"] = {
                "stage": config.get("zero_optimization", {}).get("stage", 2)}
        return original(*args, config=config, **kwargs)

    return initialize


_ABSENT = object()

Swap = tuple[Callable[[], list[tuple[object, str]]], Callable[[Callable], Callable]]

# name -> (where the broken functions go, how to break each original), or a context manager
FAULTS: dict[str, Swap | Callable[[], contextlib.AbstractContextManager]] = {
    "fires_twice": (_hook_registration, _fires_twice),
    "stops_after_first_backward": (_hook_registration, _stops_after_first_backward),
    "never_fires": (_hook_registration, _never_fires),
    "fires_before_accumulation": (_hook_registration, _fires_before_accumulation),
    "keeps_gradients_alive": (_hook_registration, _keeps_gradients_alive),
    "fires_late": (_hook_registration, _fires_late),
    "removal_does_nothing": (_handle_removal, _removal_does_nothing),
    "optimizer_arithmetic_changed": (_functional_adams, _optimizer_arithmetic_changed),
    "collective_wrong_slice": (_zero2_reduction, _wrong_slice),
    "collective_low_precision": (_zero2_reduction, _low_precision),
    "private_module_missing": _private_module_gone,
    "private_api_changed": (_fake_tensor_mode, _fake_tensor_mode_changed),
    "tracker_misses_allocations": (_memory_tracker, _misses_forward_allocations),
    "reduce_scatter_ignores_op": (_reduce_scatters, _sums_whatever_op),
    "step_dtype_changed": (_step_loading, _loads_step_as_float64),
    "checkpoint_key_renamed": (_optimizer_saving, _renames_a_key),
    "new_warning": (_forward_hook_registration, _warns_on_registration),
    "compiled_module_skips_forward_hooks": (_compiled_module_call,
                                            _skips_submodule_forward_hooks),
    "pack_called_twice": (_saved_tensors_hooks, _packs_twice),
    "unpack_returns_stale": (_saved_tensors_hooks, _unpacks_stale),
    "offload_keeps_device_copy": (_offloading, _keeps_device_copies),
    "compression_on_exact_tensor": (_compression, _compresses_exact_tensors),
    "fsdp2_forgets_shard_hooks": (_fsdp2_reduction, _forgets_shard_hooks),
    "reduce_scatter_wrong_slice": (_reduce_scatters, _hands_wrong_slice),
    "ddp_bucket_reduced_twice": (_comm_hook_registration, _reduces_each_bucket_twice),
    "ddp_drops_settings": (_ddp_construction, _drops_settings),
    "ddp_ignores_comm_hook": (_comm_hook_registration, _ignores_comm_hook),
    "deepspeed_drops_settings": (_deepspeed_initialize, _deepspeed_drops_settings),
    "fsdp2_drops_settings": (_fully_shard, _fsdp2_drops_settings),
    "implementation_flag_ignored": (lambda: [(torch.optim.Optimizer, "add_param_group")],
                                    _ignores("foreach", "fused")),
    "capturable_ignored": (lambda: [(torch.optim.Optimizer, "add_param_group")],
                           _ignores("capturable")),
    "kernel_ignores_maximize": (_optimizer_kernels, _ignores_maximize),
    "fused_sgd_skips_low_precision": (lambda: [(importlib.import_module("torch.optim.sgd"),
                                                "_fused_sgd")],
                                      _skips_low_precision),
    "checkpoint_forgets_rng_state": (lambda: [(importlib.import_module("torch.utils.checkpoint"),
                                               "checkpoint")], _forgets_rng_state),
    "fsdp2_reduces_in_bf16": (_reduce_scatters, _reduces_in_bf16),
    "dropout_drops_half": _drops_half,
    "dropout_ignores_seed": _ignores_seed,
}
assert tuple(FAULTS) == names.FAULTS, "hookbench.core.names.FAULTS lists the faults"
HOOK_FAULTS = [name for name, fault in FAULTS.items()
               if isinstance(fault, tuple) and fault[0] is _hook_registration]


def run_under(fault: str | None, run: Callable[..., dict[str, Any]], *args: Any,
              **kwargs: Any) -> dict[str, Any]:
    """The one rule by which a fault reaches a run on the ranks (ZeRO-2, DDP, FSDP2,
    DeepSpeed): injected around the whole run, before it registers any hook, and never into a
    reference (the callers pass None there: DDP beside ZeRO-2, the single process). What the
    run raises is its result's ``error``, in one line, fault or not, so that its row fails
    naming it and every rank ends; a rank whose peer raised mid-collective ends at the
    launch's timeout, never hangs."""
    try:
        with inject(fault):
            return run(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the row fails in the words it raised
        return {"error": one_line(e)}


@contextlib.contextmanager
def inject(name: str | None) -> Iterator[None]:
    """Run the block with fault ``name`` injected (None: no fault)."""
    if name is None:
        yield
        return
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose from {sorted(FAULTS)}")
    fault = FAULTS[name]
    if not isinstance(fault, tuple):
        with fault():
            yield
        return
    where, breaks = fault
    with contextlib.ExitStack() as restore:
        for owner, attribute in where():
            # Restored exactly as it was: a staticmethod stays one, an inherited attribute
            # is deleted again rather than copied onto the subclass.
            raw = vars(owner).get(attribute, _ABSENT)
            broken = breaks(getattr(owner, attribute))
            setattr(owner, attribute, staticmethod(broken) if isinstance(raw, staticmethod)
                    else broken)
            restore.callback(*(delattr, owner, attribute) if raw is _ABSENT
                             else (setattr, owner, attribute, raw))
        yield
