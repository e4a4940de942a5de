"""FSDP2's per-rank peak memory on fake tensors, against the ZeRO paper's formula.

One process plays rank 0 of ``world`` ranks: a fake process group (collectives move no data)
and ``FakeTensorMode`` (tensors without data), so a step of any model size takes seconds and
no memory. Where fake tensors cannot run the model (a forward that reads a value), the same
step runs on real CPU tensors, still on the fake group. The bytes are counted by torch's own
``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``): it follows the storage
FSDP2 frees and re-allocates in place (``UntypedStorage.resize_``, which a dispatch mode does
not see) and says what each byte is (sharded or gathered parameter, gradient, all-gather or
reduce-scatter buffer, optimizer state, activation, temporary).

Every simulated rank trains on the workload's whole batch (its per-rank micro-batch), two
steps; the second is the one the bound is for (the optimizer state exists by then).

The bound for rank 0, every term predicted from the model's shapes and the optimizer, except
the last, which the formula leaves out and is measured:

    model states       the paper's 16 Psi / N with Adam: each rank's shards of the fp32
                       parameters (4 Psi / N), of their gradients (4 Psi / N; with the optimizer
                       in backward only the largest unit's, freed as they are stepped) and of
                       the optimizer's state (8 Psi / N for Adam: the bytes per element and per
                       tensor of a step of the workload's optimizer); FSDP2 pads every
                       parameter's dim 0 to a multiple of N, and the padding counts
    gathered           ZeRO-2 (``reshard_after_forward=False``): every unit stays gathered from
                       forward to backward (the paper's 4 Psi, 2 Psi in bf16); ZeRO-3: the root
                       (FSDP2 does not reshard it after forward) and two more units, the one
                       computing and the one prefetched
    communication      three times the largest unit, gathered: the buffers in flight, all-gather
                       outputs not yet copied out (seen: two at once in ZeRO-2 on resnet18),
                       gathered gradients not yet reduce-scattered, reduce-scatter inputs (fp32)
    activations        activations, backward's temporaries, inputs and buffers, measured at
                       the peak

and, when backward has ended, the live bytes but activations and temporaries (the model
states, and anything gathered or in flight) are the model states within ``bounds.STATES_AGREEMENT``: at
least those of the parameters that get a gradient in one process, at most those of every
trainable parameter (``_predicted``). What
activations and temporaries are still live then (``left``: a cache the model keeps from its
forward, what FSDP2 itself holds on to, such as a copy of the root's inputs) is no formula's:
it is reported, held to the baseline, and the optimizer in backward may leave no more of it
than FSDP2's own standard step on the same model (``hookbench.gate.workload_checks``). A
parameter left gathered, a gradient kept past its reduce-scatter or after its step, a shard
the size of the whole: each shows as bytes above its term, or above the standard step's.
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from hookbench.core.prerequisites import one_line
from hookbench.core.workload import Workload
from hookbench.engines import fsdp2
from hookbench.engines.loop import Refused, wrapping
from hookbench.measure.bounds import STATES_AGREEMENT
from hookbench.measure.memory import (built, collection_paused, format_bytes, imports_as_real,
                                      materialize, torch_log_kept)
from hookbench.mechanisms.optimizer_in_backward import OptimizerInBackward

__all__ = ["WORLD", "rank_peak", "state_bytes"]

WORLD = 8  # rank 0 of 8 simulated ranks, as the gate's ZeRO-2 memory rows
_STEPS = 2

# FSDPMemTracker's categories, by the name its reference types print, in the row's words
_WORDS = {"Sharded Param": "sharded parameters", "Unsharded Param": "gathered parameters",
          "Sharded Grad": "sharded gradients", "Unsharded Grad": "gathered gradients",
          "All Gather": "all-gather buffers", "Reduce Scatter": "reduce-scatter buffers",
          "OptState": "optimizer state", "Activation": "activations",
          "Temp": "temporaries", "Inputs": "inputs", "Buffer": "buffers"}
_LEFT_OUT = ("activations", "temporaries", "inputs", "buffers")  # measured, not predicted
_COMMUNICATION = ("all-gather buffers", "gathered gradients", "reduce-scatter buffers")
_STATES = ("sharded parameters", "sharded gradients", "optimizer state")  # the paper's


def state_bytes(optimizer_class: type, kwargs: dict[str, Any],
                dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """The optimizer's state per parameter element and per parameter tensor, in bytes, read off
    one step of it on a 64-element parameter in ``dtype``: Adam in fp32 (8, 4), two moments
    and a step count; in pure bf16 (4, 4), the moments in the parameter's dtype."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=dtype))
    p.grad = torch.ones(64, dtype=dtype)
    optimizer = optimizer_class([p], **kwargs)
    optimizer.step()
    per_element = per_tensor = 0
    for value in optimizer.state[p].values():
        if torch.is_tensor(value):
            if value.numel() == p.numel():
                per_element += value.element_size()
            else:
                per_tensor += value.numel() * value.element_size()
    return per_element, per_tensor


def _padded(p: torch.Tensor, world: int) -> int:
    """Elements of a rank's shard of ``p``, a complex one's as its real pairs: FSDP2 chunks dim
    0 and pads every chunk to the first's length."""
    rows = p.shape[0] if p.dim() else 1
    return math.ceil(rows / world) * (p.numel() // max(rows, 1)) * (2 if p.is_complex() else 1)


def _gradients(workload: Workload, fake: bool) -> list[set[str]]:
    """Per backward of ``_STEPS``, the trainable parameters that get a gradient: in one
    process, without FSDP2, on the batches and random numbers ``_run`` trains on (on fake
    tensors where it runs on them). A module the forward does not use (an unused pooler, an
    expert no token was routed to) gets no gradient, so no shard of one, and no optimizer
    state until it has had one."""
    with contextlib.ExitStack() as stack:
        model = built(workload, fake, stack)
        got = []
        for i in range(_STEPS):
            model.zero_grad(set_to_none=True)
            x, y = workload.data(i)
            workload.compute_loss(model, x, y, (i, 0)).backward()
            got.append({n for n, p in model.named_parameters() if p.grad is not None})
    return got


def _shards(model: torch.nn.Module, world: int, groups: list[list[torch.nn.Parameter]],
            have: set[str]) -> list[list[int]]:
    """Per unit, the shard elements of its parameters named in ``have``."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[_padded(p, world) for p in g if names[id(p)] in have] for g in groups]


def _states(model: torch.nn.Module, world: int, groups: list[list[torch.nn.Parameter]],
            setting: str, optimizer: tuple[int, int], with_grad: set[str], stepped: set[str],
            element: int) -> dict[str, int]:
    """The paper's model states on a rank: the shards of every parameter, of the gradients of
    ``with_grad`` (with the optimizer in backward, only the largest unit's at once) and of the
    optimizer state of ``stepped``; ``element``: bytes of a sharded parameter's element (4 in
    fp32 and under a mixed-precision policy, whose shards stay fp32; 2 in pure bf16)."""
    grads, state = (_shards(model, world, groups, have) for have in (with_grad, stepped))
    per_element, per_tensor = optimizer
    return {"sharded parameters": element * sum(_padded(p, world) for g in groups for p in g),
            "sharded gradients": element * (max(map(sum, grads)) if setting == "in_backward"
                                            else sum(map(sum, grads))),
            "optimizer state": per_element * sum(map(sum, state))
            + per_tensor * sum(map(len, state))}


def _predicted(model: torch.nn.Module, blocks: list[torch.nn.Module], world: int,
               setting: str, param_bytes: int, optimizer: tuple[int, int],
               gradients: list[set[str]], element: int = 4
               ) -> tuple[dict[str, int], tuple[int, int]]:
    """The bound's predicted terms, on a model before ``fully_shard``, and the least and the
    most model states live when the last backward has ended; ``gradients``: the parameters
    that get one in one process, per backward (``_gradients``).

    At the peak every trainable parameter may have a gradient and state. When the last
    backward has ended: at least its gradients (none with the optimizer in backward, which has
    stepped and freed them) and the state of what was stepped before it (and in it, in
    backward), as in one process; at most those of every trainable parameter, since FSDP2 may
    give a parameter the forward does not use a gradient where one process gives it none
    (DeBERTa-v2's unused ``rel_embeddings``: its Adam state, 516 B on rank 0 of 8)."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    groups = [list(b.parameters()) for b in blocks] + [
        [p for p in model.parameters() if id(p) not in in_blocks]]
    every = {n for n, p in model.named_parameters() if p.requires_grad}
    in_backward = setting == "in_backward"
    states = _states(model, world, groups, setting, optimizer, every, every, element)
    low = _states(model, world, groups, setting, optimizer,
                  set() if in_backward else gradients[-1],
                  set().union(*(gradients if in_backward else gradients[:-1])), element)
    high = _states(model, world, groups, setting, optimizer, set() if in_backward else every,
                   every, element)
    shard = [[_padded(p, world) for p in g] for g in groups]
    trainable = [[_padded(p, world) for p in g if p.requires_grad] for g in groups]
    gathered = [world * sum(s) for s in shard]  # elements of each unit when gathered
    grads = [world * sum(t) for t in trainable]
    largest = max(range(len(groups)), key=lambda i: gathered[i])
    two = sorted(gathered[:-1], reverse=True)[:2]
    held = (sum(gathered) if setting == "zero2" else gathered[-1] + sum(two))
    return {**states, "gathered parameters": param_bytes * held,
            "communication": (param_bytes * gathered[largest] + param_bytes * grads[largest]
                              + element * grads[largest])}, (sum(low.values()), sum(high.values()))


def _run(workload: Workload, setting: str, world: int, fake: bool) -> dict[str, Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    settings = fsdp2.SETTINGS[setting]
    # The workload's declared units, policy and offload (Workload.fsdp2); the rows' reshard
    # choice stays theirs, the axis they compare (zero2: none, zero3 and in_backward: after
    # forward).
    declared = {k: v for k, v in (workload.fsdp2 or {}).items() if k != "reshard_after_forward"}
    mixed = fsdp2.mixed_dtypes(workload)
    param_dtype = mixed[0] if mixed else None
    cls, kwargs = workload.optimizer
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    with contextlib.ExitStack() as stack:
        stack.callback(dist.destroy_process_group)
        mesh = init_device_mesh("cpu", (world,))  # outside FakeTensorMode: it reads its ranks
        if fake:
            stack.enter_context(imports_as_real())
            with torch.device("meta"):
                model = workload.build()
        else:
            model = workload.build()
        keep_whole = fsdp2.called_outside(workload, fake)
        blocks = fsdp2.chosen_units(model, declared, keep_whole)
        # pure bf16: 2; fp32 and mixed: 4; a complex parameter counts as its real pairs
        real = workload.parameter_dtype.to_real()
        element = real.itemsize
        predicted, at_end = _predicted(
            model, blocks, world, setting, param_dtype.itemsize if param_dtype else element,
            state_bytes(cls, kwargs, real), _gradients(workload, fake), element)
        if fake:
            stack.enter_context(FakeTensorMode())
            materialize(model)
        stack.callback(fsdp2.remove_hooks, model)  # also those of units sharded before a refusal
        wrapping("fully_shard", lambda: fsdp2.shard(model, mesh, settings["reshard_after_forward"],
                                                    param_dtype, keep_whole, declared))
        params = workload.optimizer_params(model)
        params = list(model.parameters()) if params is None else params
        if settings["in_backward"]:
            optimizer: Any = OptimizerInBackward(model, cls, params, **kwargs)
            stack.callback(optimizer.remove)
        else:
            optimizer = cls(params, **kwargs)
        tracker = FSDPMemTracker(model, None if settings["in_backward"] else optimizer)
        tracker._mod_tracker = _leaf_safe_mod_tracker()  # before __enter__ registers it
        cpu = torch.device("cpu")
        with collection_paused(), tracker:  # the same bytes in every process
            for i in range(_STEPS):
                x, y = workload.data(i)
                tracker.track_inputs((x, y))  # the batch, apart from the model states
                workload.compute_loss(model, x, y, (i, 0)).backward()
                gc.collect()  # what is left when backward has ended, not uncollected cycles
                end = tracker.get_tracker_snapshot()[cpu]
                optimizer.step()
                optimizer.zero_grad()
                if settings["in_backward"]:
                    # the inner optimizers stepped in backward, where the tracker calls every new
                    # tensor a temporary: their state is the optimizer's (a private method: the
                    # tracker has no public way to be told)
                    for inner in optimizer.inner_optimizers:
                        tracker._track_optimizer_states(_FSDPRefType.OPT, inner)
                tracker.reset_mod_stats()  # per-module stats are per iteration
        peak = tracker.get_tracker_snapshot("peak")[cpu]

    def words(snapshot: dict[Any, int]) -> dict[str, int]:
        return {_WORDS.get(getattr(k, "value", k), str(k)): v for k, v in snapshot.items()
                if k != "Total"}

    return {"peak": peak["Total"], "breakdown": words(peak),
            "end_of_backward": words(end), "predicted": predicted, "at_end": at_end}


def _leaf_safe_mod_tracker() -> Any:
    """torch's ``ModTracker`` (what ``FSDPMemTracker`` tells forward from backward with), made
    to follow a forward that takes ``torch.autograd.grad`` inside it (a PINN's derivatives, a
    WGAN-GP penalty). ModTracker's gradient hooks fire inside that inner derivative as if
    backward had begun: on a leaf input ``register_multi_grad_hook`` raises "A leaf node was
    passed to _will_engine_execute_node but we are currently running autograd.grad()", and
    otherwise it finds "The Module hierarchy tracking is wrong": torch's tracker failing, not
    the step it measures, which FSDP2 trains. Here a hook firing while a forward is still
    running is not backward, and a module whose inputs needing a gradient are all leaves
    leaves backward when it ends, as ModTracker has a module with none do.

    It also knows modules by identity. ModTracker keys their names by hash, and a module whose
    hash follows its state (torchmetrics' ``Metric`` hashes its metric states, which its own
    forward updates) got another name at the end of its forward than at its start: "The
    Module hierarchy tracking is wrong"."""
    from torch.distributed._tools.mod_tracker import ModTracker

    class InnerGradSafe(ModTracker):
        forwards = 0  # module forwards running

        def __init__(self) -> None:
            super().__init__()
            self._known_modules = WeakIdKeyDictionary()

        def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:
            self.forwards += 1
            return super()._fw_pre_hook(mod, tree_map_only(
                torch.Tensor, lambda t: t.detach() if t.is_leaf and t.requires_grad else t,
                input))

        def _fw_post_hook(self, mod: torch.nn.Module, input: Any, output: Any) -> None:
            self.forwards -= 1
            return super()._fw_post_hook(mod, input, output)

        def _get_append_fn(self, w_mod: Any, name: str, is_bw: bool) -> Callable:
            return self._in_backward_only(super()._get_append_fn(w_mod, name, is_bw), is_bw)

        def _get_pop_fn(self, w_mod: Any, name: str, is_bw: bool) -> Callable:
            return self._in_backward_only(super()._get_pop_fn(w_mod, name, is_bw), is_bw)

        def _in_backward_only(self, fn: Callable, is_bw: bool) -> Callable:
            if not is_bw:
                return fn
            return lambda *args: None if self.forwards else fn(*args)

    return InnerGradSafe()


def rank_peak(workload: Workload, setting: str, world: int = WORLD) -> dict[str, Any]:
    """Rank 0 of ``world``'s peak under FSDP2 in ``setting`` (``fsdp2.SETTINGS``), against its
    bound: ``peak``, ``breakdown`` (bytes by category at the peak), ``bound`` and its
    ``terms``; when backward ended, ``states`` (live bytes but the batch, the buffers,
    activations and temporaries) and ``left`` (activations and temporaries); ``backend``
    ("fake", or "eager" with ``fallback``: why), ``against`` (the row's words), ``problems``.
    ``loop.Refused`` where ``fully_shard`` refuses the model."""
    if setting not in fsdp2.SETTINGS:
        raise ValueError(f"unknown FSDP2 setting {setting!r}; choose from {list(fsdp2.SETTINGS)}")
    if dist.is_initialized():
        raise ValueError("rank_peak simulates its ranks in a fake process group of its own; "
                         "call it outside torch.distributed")
    fallback = None
    logged: list[str] = []
    try:
        with torch_log_kept(logged):
            got = _run(workload, setting, world, fake=True)
        backend = "fake"
    except Refused:
        raise  # torch's design, on any tensors
    except Exception as e:  # noqa: BLE001 - what fake tensors cannot run: real tensors must
        fallback = f"fake tensors cannot run {workload.name} under FSDP2: {one_line(e)}"
        got, backend = _run(workload, setting, world, fake=False), "eager"
    predicted = got.pop("predicted")
    measured = sum(v for k, v in got["breakdown"].items() if k in _LEFT_OUT)
    bound = sum(predicted.values()) + measured
    paper = sum(predicted[k] for k in _STATES)  # 16 Psi / N with Adam
    # when backward has ended, what is live besides the batch, the buffers, activations and
    # temporaries is the model states; activations and temporaries still live are what the
    # model or FSDP2 keeps (a gradient kept after its step shows as a temporary)
    end = got["end_of_backward"]
    states = sum(v for k, v in end.items() if k not in _LEFT_OUT)
    left = sum(end.get(k, 0) for k in ("activations", "temporaries"))
    low, high = got.pop("at_end")
    # each predicted term bounds its own categories at the peak, and all of them the peak
    at_peak = dict(got["breakdown"])
    at_peak["communication"] = sum(at_peak.pop(k, 0) for k in _COMMUNICATION)
    b = format_bytes
    over = [f"{k} {b(at_peak[k])} > {b(v)}" for k, v in predicted.items() if at_peak.get(k, 0) > v]
    problems = []
    if got["peak"] > bound or over:
        problems.append(f"rank 0 of {world}: peak {b(got['peak'])}, bound {b(bound)}"
                        + (f"; above their terms: {', '.join(over)}" if over else ""))
    # the model states must be there (a state missing is below), and nothing gathered or in
    # flight beside them (a parameter left gathered, a gradient not reduce-scattered is above)
    if not low * (1 - STATES_AGREEMENT) <= states <= high * (1 + STATES_AGREEMENT):
        # and what of it is no model state: what FSDP2 kept gathered or in flight
        kept = [f"{k} {b(v)}" for k, v in end.items()
                if v and k not in _LEFT_OUT and k not in _STATES]
        problems.append(f"when backward ended {b(states)} were live besides the batch, the "
                        f"buffers, activations and temporaries, not the model states' "
                        + (b(low) if low == high else f"{b(low)} to {b(high)}")
                        + f" (within {STATES_AGREEMENT:.0%})"
                        + (f": {', '.join(kept)} still live" if kept else ""))
    held = {"zero2": "every unit"}.get(setting, "the root and two units")
    against = (f"rank 0 of {world}: peak {b(got['peak'])}, {got['peak'] / bound:.2f}x the bound "
               f"{b(bound)}: model states {b(paper)} (shards of the parameters "
               f"{b(predicted['sharded parameters'])}, of the gradients "
               f"{b(predicted['sharded gradients'])}"
               + (" (the largest unit's)" if setting == "in_backward" else "")
               + f", of the optimizer state {b(predicted['optimizer state'])}) + gathered "
               f"{b(predicted['gathered parameters'])} ({held}) + communication "
               f"{b(predicted['communication'])} + activations and temporaries {b(measured)} "
               f"(measured); when backward ended {b(states)} of model states and {b(left)} "
               f"of activations and temporaries live")
    return {"peak": got["peak"], "breakdown": got["breakdown"], "bound": bound,
            "terms": {**predicted, "activations (measured)": measured}, "states": states,
            "left": left,
            "world": world, "backend": backend, **({"fallback": fallback} if fallback else {}),
            "against": against, "problems": problems}
