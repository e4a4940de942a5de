"""FSDP2 (``fully_shard``, what torchtitan and torchtune run) on a workload, in three settings:

    zero2        ``reshard_after_forward=False``: parameters stay gathered from forward to
                 backward, gradients are reduce-scattered to their shards (ZeRO stage 2)
    zero3        ``reshard_after_forward=True``: parameters are gathered again in backward
                 (ZeRO stage 3)
    in_backward  zero3 with ``OptimizerInBackward`` on the sharded parameters: each shard
                 stepped by the post-accumulate-grad hook FSDP2 itself calls after the
                 reduce-scatter (``foreach_reduce``), its gradient freed there

Under the workload's bf16, ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``:
the fp32 shards are the masters, what torchtitan's default does. Each repeated block (an element
of an ``nn.ModuleList``, a transformer layer, a ResNet stage's block) is a unit of its own,
then the root, as torchtitan shards a model; a block whose parameters are shared with a module
outside it (tied embeddings), or one of whose modules is called outside its forward (DiT's
conditioning embedding, called by the root), stays in its parent's unit. A workload that
declares its own settings (``Workload.fsdp2``: units, policy, resharding, offload) runs them on
every row instead, and each row shows they took effect (``setting_problems``): what the units'
parameters are in their forward and after it, and what FSDP2's state holds.

    trajectory   on every rank: the full parameters after every step and, per backward, the
                 calls of a counting post-accumulate-grad hook on every shard, what the hook
                 saw (a reduced shard-sized gradient), and what gradients were left
    peer_trajectory   the zoo's ZeRO-2 peer: FSDP2 ZeRO-2 on a TinySpec, the final parameters
    api          ``fully_shard`` and friends wherever this torch keeps them: torch 2.4 and 2.5
                 have FSDP2 at ``torch.distributed._composable.fsdp``
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hookbench.core.fsdp import api
from hookbench.core.prerequisites import one_line
from hookbench.core.workload import describe, of
from hookbench.engines.loop import Refused, train, wrapping
from hookbench.measure.memory import built
from hookbench.measure.trace import RankTrace
from hookbench.measure.zero2_runs import local_batch, rank_device
from hookbench.mechanisms.optimizer_in_backward import OptimizerInBackward

__all__ = ["SETTINGS", "api", "called_outside", "cannot_train_on_cpu", "chosen_units",
           "described", "hook_problems", "mixed_dtypes", "peer_trajectory", "remove_hooks",
           "repeated_units", "setting_problems", "shard", "trajectory", "unit_runs", "units"]

SETTINGS = {"zero2": {"reshard_after_forward": False, "in_backward": False},
            "zero3": {"reshard_after_forward": True, "in_backward": False},
            "in_backward": {"reshard_after_forward": True, "in_backward": True}}


def cannot_train_on_cpu() -> str | None:
    """Why this torch's FSDP2 cannot train on CPU ranks, or None; found by training: one Adam
    step of a two-unit MLP sharded over a fake process group of 2 in this process (about 1 s
    the first time, 5 ms after; not cached, so that a fault injected in this process is never
    remembered after it). What a release lacks shows as the exception it raises, named in the
    words, before any rank starts. Seen: 2.4.1 and 2.5.1 make CUDA streams whatever the device
    ("FSDP requires CUDA for streams"); 2.6.0 takes the device's (pytorch#136843), but
    ``torch.cpu.Stream`` has no ``record_event`` for the all-gather until 2.7 (pytorch#145935);
    2.7.1 on train (docs/releases.md, engines)."""
    if dist.is_initialized():
        raise ValueError("fsdp2.cannot_train_on_cpu trains on a fake process group of its own; "
                         "call it outside torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh

    try:  # torch-private: it may move between releases, and then nothing can be said of FSDP2
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:
        return (f"FSDP2 could not be tried on CPU ranks: the fake process group it is tried on "
                f"does not import ({one_line(e)})")
    try:
        with torch.random.fork_rng(), contextlib.ExitStack() as stack:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
            stack.callback(dist.destroy_process_group)
            model = torch.nn.Sequential(
                torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), torch.nn.Linear(4, 2))
            shard(model, init_device_mesh("cpu", (2,)), True, None)
            stack.callback(remove_hooks, model)
            optimizer = torch.optim.Adam(model.parameters())
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
    except Exception as e:  # noqa: BLE001 - whatever stops it: said in words, never a rank's crash
        return (f"this torch's FSDP2 cannot train on CPU ranks: one step of a two-layer MLP "
                f"sharded over 2 ranks raised {one_line(e)} (torch 2.7.1 and later train on "
                f"CPU ranks)")
    return None


def _blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module that could be a unit, by name: an element of an ``nn.ModuleList`` or
    ``nn.Sequential`` with submodules of its own (a transformer layer, a ResNet block, not a
    lone Linear), at any depth."""
    return {f"{name}.{key}" if name else key: block for name, module in model.named_modules()
            if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
            for key, block in module.named_children()
            if next(block.children(), None) is not None}


def units(model: torch.nn.Module, keep_whole: frozenset[str] = frozenset()
          ) -> list[torch.nn.Module]:
    """The modules sharded as units of their own (the root aside): every block (``_blocks``)
    whose trainable parameters no module outside it also holds (tied embeddings), outermost
    first; not those named in ``keep_whole`` (``called_outside``), whose parameters stay with
    their parent's unit."""
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(module))
    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for name, block in _blocks(model).items():
        own = {id(m) for m in block.modules()}
        params = [p for p in block.parameters() if p.requires_grad]
        if (id(block) not in inside and name not in keep_whole and params
                and all(owners[id(p)] <= own for p in params)):
            found.append(block)
            inside |= own
    return found


def chosen_units(model: torch.nn.Module, declared: dict[str, Any] | None,
                 keep_whole: frozenset[str] = frozenset()) -> list[torch.nn.Module]:
    """The units besides the root: the modules a workload's ``fsdp2["units"]`` selects (a
    class, a tuple of them, or a pattern over full module names; nested matches too, as FSDP2
    nests units), else hookbench's (``units``)."""
    selector = (declared or {}).get("units")
    if selector is None:
        return units(model, keep_whole)
    if isinstance(selector, re.Pattern):
        return [m for n, m in model.named_modules() if n and selector.fullmatch(n)]
    return [m for n, m in model.named_modules() if n and isinstance(m, selector)]


def mixed_dtypes(workload: Any) -> tuple[torch.dtype, torch.dtype] | None:
    """(param_dtype, reduce_dtype) where the FSDP2 rows compute in another dtype than the
    fp32 shards (the masters), else None: the declared policy's, else hookbench's under bf16."""
    declared = (workload.fsdp2 or {}).get("mp_policy")
    if declared is not None:
        if declared.param_dtype is None:
            return None
        return declared.param_dtype, declared.reduce_dtype or declared.param_dtype
    return (torch.bfloat16, torch.float32) if workload.precision == "bf16" else None


@functools.lru_cache(maxsize=16)  # asked by each FSDP2 row of a workload; one forward each
def _probe(workload: Any, fake: bool = False) -> tuple[frozenset[str], dict[str, int]]:
    """One eager training forward of batch 0 in this process (on fake tensors: ``fake``, for
    a model too large to run): the blocks (``_blocks``) one of whose modules is called while
    the block itself is not running, and, for the units left (``units``), how often each
    trainable parameter's unit (else the root) runs.

    A block called from outside cannot be a unit: FSDP2 gathers a unit's parameters only
    around its own forward, so the call sees sharded DTensors and raises (diffusers' DiT: its
    root calls ``transformer_blocks.0.norm1.emb`` for the conditioning, "aten.addmm.default
    got mixed torch.Tensor and DTensor"). Its parameters stay with its parent's unit, as a
    user would wrap it."""
    with contextlib.ExitStack() as stack:
        model = built(workload, fake, stack)
        blocks = list(_blocks(model).items())
        # and the units a workload declares, which need not be blocks: their runs count too
        named = {id(m): n for n, m in model.named_modules()}
        blocks += [(named[id(m)], m) for m in chosen_units(model, workload.fsdp2)
                   if all(m is not b for _, b in blocks)]
        running, runs = [0] * len(blocks), [0] * len(blocks)
        containing: dict[int, list[int]] = {}
        for i, (_, block) in enumerate(blocks):
            for module in block.modules():
                containing.setdefault(id(module), []).append(i)
        outside: set[str] = set()

        def enter(i: int) -> None:
            running[i] += 1
            runs[i] += 1

        def called(module: torch.nn.Module) -> None:
            outside.update(blocks[i][0] for i in containing[id(module)] if not running[i])

        handles = [h for i, (_, block) in enumerate(blocks) for h in (
            block.register_forward_pre_hook(lambda *_, i=i: enter(i)),
            block.register_forward_hook(lambda *_, i=i: running.__setitem__(i, running[i] - 1),
                                        always_call=True))]
        # after the blocks' own: a block's call of itself counts as inside it
        handles += [m.register_forward_pre_hook(lambda m, _: called(m)) for m in model.modules()
                    if id(m) in containing]
        try:
            x, y = workload.data(0)
            workload.compute_loss(model, x, y, (0, 0))
        finally:
            for h in handles:
                h.remove()
    keep_whole = frozenset(outside)
    count = {id(block): runs[i] for i, (_, block) in enumerate(blocks)}
    owner = {id(p): count.get(id(b), 1) for b in chosen_units(model, workload.fsdp2, keep_whole)
             for p in b.parameters()}
    return keep_whole, {n: owner.get(id(p), 1) for n, p in model.named_parameters()
                        if p.requires_grad}


def called_outside(workload: Any, fake: bool = False) -> frozenset[str]:
    """The blocks of ``workload``'s model that cannot be FSDP2 units: one of their modules is
    called outside their forward (``_probe``; on fake tensors: ``fake``)."""
    return _probe(workload, fake)[0]


def mixed_unit(workload: Any) -> str | None:
    """Where a unit FSDP2 would shard (``chosen_units``, or the root) holds trainable
    parameters of more than one dtype (a Fourier layer's complex weights beside real ones):
    torch's FSDP2 takes one dtype per unit (its lazy init raises "FSDP expects uniform original
    parameter dtype"), in words; else None."""
    model = workload.meta_model()
    blocks = chosen_units(model, workload.fsdp2, called_outside(workload.replace(compile=None)))
    names = {id(m): n for n, m in model.named_modules()}

    def own(unit: torch.nn.Module, prefix: str) -> list[torch.nn.Parameter]:
        nested = {id(p) for b in blocks if names[id(b)].startswith(prefix)
                  for p in b.parameters()}  # the units inside it hold theirs
        return [p for p in unit.parameters() if p.requires_grad and id(p) not in nested]

    held = [(f"unit {names[id(b)]}", own(b, names[id(b)] + ".")) for b in blocks]
    held.append(("the root", own(model, "")))
    for name, params in held:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        if len(dtypes) > 1:
            return (f"torch's FSDP2 takes one dtype of trainable parameters per unit (\"FSDP "
                    f"expects uniform original parameter dtype\"): {name} holds "
                    f"{' and '.join(dtypes)}; declare units that keep them apart "
                    f"(fsdp2={{'units': ...}})")
    return None


def unit_runs(workload: Any) -> dict[str, int]:
    """Trainable parameter name -> how often the unit that holds it (``units``, else the root)
    runs in one training forward of batch 0 (``_probe``): FSDP2 reduces a unit's gradients and
    calls their post-accumulate-grad hooks once per run (seen: in pieces, up to once per run),
    so that is how often each hook may fire per synced backward."""
    return _probe(workload)[1]


def repeated_units(workload: Any) -> str | None:
    """Why the optimizer in backward refuses ``workload`` under FSDP2, or None: a unit that
    runs several times in one forward (``unit_runs``) would have its parameters stepped once
    per run, in one backward (``OptimizerInBackward`` refuses it at the unit's second run)."""
    repeated = {n: k for n, k in unit_runs(workload).items() if k > 1}
    if not repeated:
        return None
    name = next(iter(repeated))
    return (f"the optimizer in backward refuses FSDP2 units run more than once in one forward "
            f"({len(repeated)} parameters, e.g. {name}: {repeated[name]} runs): FSDP2 calls "
            f"their hooks once per run, which would step them more than once per backward")


def shard(model: torch.nn.Module, mesh: Any, reshard_after_forward: bool,
          param_dtype: torch.dtype | None, keep_whole: frozenset[str] = frozenset(),
          declared: dict[str, Any] | None = None) -> list[torch.nn.Module]:
    """``fully_shard`` every unit (``chosen_units``) and the root, with the workload's declared
    settings (``declared``: ``Workload.fsdp2``) where it has them, else hookbench's; the units
    besides the root."""
    fsdp = api()
    declared = declared or {}
    options: dict[str, Any] = {
        "reshard_after_forward": declared.get("reshard_after_forward", reshard_after_forward),
        "mp_policy": declared.get("mp_policy") or fsdp.MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)}
    if "offload_policy" in declared:
        options["offload_policy"] = declared["offload_policy"]
    blocks = chosen_units(model, declared, keep_whole)
    for block in blocks:
        fsdp.fully_shard(block, mesh=mesh, **options)
    fsdp.fully_shard(model, mesh=mesh, **options)
    return blocks


def remove_hooks(model: torch.nn.Module) -> None:
    """Remove the forward hooks ``fully_shard`` registered on every unit of ``model`` (FSDP2
    has no inverse of ``fully_shard``): for a model sharded, measured and dropped in this
    process, whose hooks must not outlive the measurement. Read from FSDP2's state's handles,
    where ``FSDPMemTracker`` also finds them."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        for name in ("_pre_forward_hook_handle", "_post_forward_hook_handle"):
            handle = getattr(state() if state else None, name, None)
            if handle is not None:
                handle.remove()


def _local_bytes(t: torch.Tensor) -> int:
    """Bytes of this rank's shard of a DTensor (of the tensor, for a plain one)."""
    local = getattr(t, "_local_tensor", t)
    return local.numel() * local.element_size()


def _unsharded_grads(model: torch.nn.Module) -> list[str]:
    """FSDP2's gathered parameters that still hold a gradient after backward (FSDP2 frees each
    once it is reduce-scattered). Read from its private state; [] where that moved."""
    left = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = getattr(state() if state else None, "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fp, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                left.append(fp._param_fqn if hasattr(fp, "_param_fqn") else repr(fp))
    return left


def trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
               steps: int, accumulation: int = 1, setting: str = "zero2",
               **_: Any) -> dict[str, Any]:
    """Train ``spec`` with FSDP2 in ``setting`` (``SETTINGS``) on this rank's share of each
    global batch (run on every rank), ``accumulation`` micro-batches per step with gradient
    sync off for all but the last. Returns the full parameters after every step, ``units``
    (blocks sharded besides the root), and per backward ``"hook_calls"`` (shard name -> calls
    of the counting hook), ``"not_reduced"`` (shards whose hook saw a gradient that is not a
    shard of the parameter's size), ``"shard_grads"`` (shards holding a gradient after it) and
    ``"unsharded_grads"``, ``"peak_shard_grad_bytes"`` (the most bytes of shard gradients held
    at once), and ``"unit_bytes"`` (each unit's trainable shards on this rank, the root's
    last). ``{"refused": ...}`` where the optimizer in backward refuses, ``{"torch_refuses":
    ...}`` where ``fully_shard`` refuses the model (``loop.Refused``)."""
    from torch.distributed.device_mesh import init_device_mesh

    settings = SETTINGS[setting]
    device = rank_device(rank)
    spec = of(spec)
    model = spec.build().to(device)
    mesh = init_device_mesh(torch.device(device).type, (world,))
    param_dtype = torch.bfloat16 if spec.precision == "bf16" else None
    keep_whole = called_outside(spec.replace(compile=None))  # what it raises is no refusal
    try:
        blocks = wrapping("fully_shard", lambda: shard(model, mesh,
                                                       settings["reshard_after_forward"],
                                                       param_dtype, keep_whole, spec.fsdp2))
    except Refused as e:  # on every rank alike: the same model, the same words
        return {"torch_refuses": str(e), "error": None}
    watched, watch_handles = _watch(model, blocks)
    names = {p: n for n, p in model.named_parameters()}
    calls: dict[str, int] = {}
    not_reduced: list[str] = []
    live = [0]  # the most bytes of shard gradients held at once in this backward

    forward, inner = [False], [0]  # the model's forward is running; hook calls inside it
    carried: dict[str, int] = {}  # shard gradient bytes reduced inside a forward, by name

    def count(p: torch.Tensor) -> None:
        if forward[0]:
            inner[0] += 1
            carried[names[p]] = _local_bytes(p.grad) if p.grad is not None else 0
            # FSDP2's post-backward at the end of an autograd.grad inside the forward (e3nn's
            # forces): it reduce-scatters what earlier micro-batches accumulated, and the
            # backward adds the rest; the parity rows hold the sum, the optimizer in backward
            # does not step on it (OptimizerInBackward), and the count is backward's
            return
        calls[names[p]] = calls.get(names[p], 0) + 1
        grad = p.grad
        local = getattr(grad, "_local_tensor", grad)
        if grad is None or local.shape != getattr(p, "_local_tensor", p).shape:
            not_reduced.append(names[p])
        # FSDP2 assigns a unit's shard gradients, then calls their hooks: counted here, before
        # an optimizer in backward steps and frees them, this is the rank's most held at once
        live[0] = max(live[0], sum(_local_bytes(q.grad) for q in names if q.grad is not None))

    # registered first, so that it runs before the optimizer in backward steps and frees
    handles = [p.register_post_accumulate_grad_hook(count)
               for p in model.parameters() if p.requires_grad]
    handles += [model.register_forward_pre_hook(lambda *_: forward.__setitem__(0, True)),
                model.register_forward_hook(lambda *_: forward.__setitem__(0, False),
                                            always_call=True)]
    params = spec.optimizer_params(model)
    params = list(model.parameters()) if params is None else params
    try:
        if settings["in_backward"]:
            try:
                optimizer: Any = OptimizerInBackward(model, optimizer_class, params, **kwargs)
                if spec.clip_grad_norm is not None:
                    optimizer.clip_grad_norm_(spec.clip_grad_norm)
            except ValueError as e:
                return {"refused": f"{type(e).__name__}: {e}", "error": None}
        else:
            optimizer = optimizer_class(params, **kwargs)

        traced = RankTrace()
        reaching = _Reaching(traced)

        def observe(synced: bool) -> dict[str, Any]:
            seen = {"synced": synced, "hook_calls": dict(calls),
                    "not_reduced": list(not_reduced),
                    "shard_grads": sorted(n for p, n in names.items() if p.grad is not None),
                    "unsharded_grads": _unsharded_grads(model),
                    "peak_shard_grad_bytes": live[0],
                    "carried_shard_grad_bytes": sum(carried.values()),
                    "calls_in_forward": inner[0],
                    "reduce_scatter_dtypes": sorted(reaching.dtypes)}
            calls.clear()
            not_reduced.clear()
            reaching.dtypes.clear()
            carried.clear()
            live[0] = inner[0] = 0
            return seen

        try:
            result = train(rank, world, spec, model, model, optimizer, device, steps,
                           accumulation, lambda: _no_sync(model), observe,
                           lambda: {n: p.full_tensor().detach().cpu().clone()
                                    for n, p in model.named_parameters()},
                           synced_backward=lambda: reaching,  # where reduce-scatters run
                           traced=traced)
        except (ValueError, RuntimeError) as e:
            if not settings["in_backward"]:
                raise
            # what it refuses in forward (an fp16 autocast, a unit run twice), on every rank
            # alike; where no
            # refusal is due, the row says it refused (workload_checks), never passes
            return {"refused": f"{type(e).__name__}: {e}", "error": None}
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        unit_bytes = [sum(_local_bytes(p) for p in b.parameters() if p.requires_grad)
                      for b in blocks] + [sum(_local_bytes(p) for p in model.parameters()
                                              if p.requires_grad and id(p) not in in_blocks)]
        module_names = {id(m): n for n, m in model.named_modules()}
        return {**result, "units": len(blocks), "unit_bytes": unit_bytes,
                "unit_names": sorted(module_names[id(b)] for b in blocks),
                "settings": {**_reported(model), **{k: sorted(v) for k, v in watched.items()}}}
    finally:
        for h in handles + watch_handles:
            h.remove()
        if settings["in_backward"] and "optimizer" in locals():
            optimizer.remove()


class _Reaching(TorchDispatchMode):
    """The dtypes of what reaches the process group's reduce-scatter (its c10d op): a
    collective judged by what it is handed, not by the policy FSDP2 holds; and what reaches
    each collective of a synced backward, told to ``traced``."""

    def __init__(self, traced: RankTrace) -> None:
        super().__init__()
        self.dtypes: set[str] = set()
        self.traced = traced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            if "reduce_scatter" in func.__name__:
                self.dtypes.update(str(t.dtype) for t in tensors)
            if tensors:
                self.traced.reach(func._schema.name, tensors)
        return func(*args, **(kwargs or {}))


def reduction_problems(after_backward: list[dict[str, Any]], expected: set[torch.dtype]
                       ) -> list[str]:
    """A synced backward whose reduce-scatter was handed a dtype not in ``expected`` (the
    policy's ``reduce_dtype``; without one, the shards' of each unit), naming it."""
    allowed = sorted(str(d) for d in expected)
    for i, seen in enumerate(after_backward):
        handed = [d for d in seen.get("reduce_scatter_dtypes", []) if d not in allowed]
        if seen["synced"] and handed:
            return [f"backward {i}: the reduce-scatter was handed {', '.join(handed)} where "
                    f"FSDP2 reduces in {', '.join(allowed)} (its mixed-precision policy's "
                    f"reduce_dtype, or the shards' dtype)"]
    return []


def _watch(model: torch.nn.Module, blocks: list[torch.nn.Module]
           ) -> tuple[dict[str, set[str]], list[Any]]:
    """What FSDP2 makes of each unit's parameters (those no nested unit holds): their dtype
    inside the unit's forward (the policy's ``param_dtype``) and whether they are sharded
    DTensors again after it (``reshard_after_forward``). Registered after ``fully_shard``'s
    own hooks, so that it runs after FSDP2 gathered them and after it resharded them."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4: still private
        from torch.distributed._tensor import DTensor

    seen: dict[str, set[str]] = {"param_dtype_in_forward": set(),
                                 "resharded_after_forward": set()}
    owner: dict[int, torch.nn.Module] = {}
    order = {id(m): i for i, m in enumerate(model.modules())}
    for block in sorted(blocks, key=lambda b: order[id(b)]):  # outer first: a nested unit wins
        owner.update((id(m), block) for m in block.modules())
    handles = []
    for block in blocks:
        own = [(m, n) for m in block.modules() if owner[id(m)] is block
               for n, _ in m.named_parameters(recurse=False)]
        if not own:
            continue

        def inside(module, args, own=own):
            seen["param_dtype_in_forward"].update(str(getattr(m, n).dtype) for m, n in own)

        def after(module, args, output, own=own):
            seen["resharded_after_forward"].update(
                str(isinstance(getattr(m, n), DTensor)) for m, n in own)

        handles += [block.register_forward_pre_hook(inside), block.register_forward_hook(after)]
    return seen, handles


def _reported(model: torch.nn.Module) -> dict[str, Any]:
    """What FSDP2's own state holds for the model: the modules it shards besides the root,
    each unit's policy and whether it offloads (read from its private state; a field that
    moved reads None)."""
    fsdp = api()
    policies, offload = set(), set()
    for module in model.modules():
        state = module._get_fsdp_state() if isinstance(module, fsdp.FSDPModule) else None
        group = getattr(state, "_fsdp_param_group", None)
        if group is not None:
            for fp in group.fsdp_params:
                # each parameter's policy where torch keeps one (2.15 resolves it per
                # parameter, param_dtype_override_fn, and its groups hold none), else its group's
                policies.add(repr(getattr(fp, "mp_policy", None)
                                  or getattr(group, "mp_policy", None)))
                offload.add(str(getattr(fp, "offload_to_cpu", None)))
    return {"units": sorted(n for n, m in model.named_modules()
                            if n and isinstance(m, fsdp.FSDPModule)),
            "mp_policy": sorted(policies), "offload_to_cpu": sorted(offload)}


def described(settings: dict[str, Any]) -> str:
    """Settings in words: ``key=value, ...``; the units as the workload selects them."""
    def said(key: str, value: Any) -> str:
        return describe(value) if key == "units" and not isinstance(value, list) else repr(value)

    return ", ".join(f"{key}={said(key, value)}" for key, value in settings.items()) or "nothing"


def setting_problems(declared: dict[str, Any] | None, rank0: dict[str, Any]) -> list[str]:
    """Each declared setting FSDP2 does not run (rank 0's ``trajectory``): the units it shards
    are not those declared; the units' parameters inside their forward are not in the
    policy's ``param_dtype``, or its state holds another policy; after forward they are (not)
    sharded again against ``reshard_after_forward`` (a bool; an int reshards to a smaller
    group, which only the state shows); an offload policy whose shards are not offloaded."""
    if not declared:
        return []
    ran, problems = rank0["settings"], []
    if "units" in declared and ran["units"] != rank0["unit_names"]:
        problems.append(f"declared units {rank0['unit_names'][:3]}..., FSDP2 shards "
                        f"{ran['units'][:3]}...")
    policy = declared.get("mp_policy")
    if policy is not None:
        if policy.param_dtype is not None and ran["param_dtype_in_forward"] not in (
                [], [str(policy.param_dtype)]):
            problems.append(f"declared param_dtype={policy.param_dtype}, the units' parameters "
                            f"were {ran['param_dtype_in_forward']} in their forward")
        if ran["mp_policy"] != [repr(policy)]:
            problems.append(f"declared {policy!r}, FSDP2 holds {ran['mp_policy']}")
    reshard = declared.get("reshard_after_forward")
    if isinstance(reshard, bool) and ran["resharded_after_forward"] not in ([], [str(reshard)]):
        problems.append(f"declared reshard_after_forward={reshard}, the units' parameters "
                        f"after forward were sharded: {ran['resharded_after_forward']}")
    offload = declared.get("offload_policy")
    if offload is not None:
        expected = str(type(offload).__name__ == "CPUOffloadPolicy")
        if ran["offload_to_cpu"] != [expected]:
            problems.append(f"declared {offload!r}, FSDP2's shards offload_to_cpu="
                            f"{ran['offload_to_cpu']}")
    return problems


@contextlib.contextmanager
def _no_sync(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's gradient sync off for one micro-batch, on every unit (``recurse`` defaults on)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def hook_problems(after_backward: list[dict[str, Any]], runs: dict[str, int],
                  in_backward: bool) -> list[str]:
    """What an FSDP2 run shows wrong: in a synced backward a shard's post-accumulate-grad hook
    not called once per run of its unit (``runs``: ``unit_runs``; between once and that
    often where a unit runs several times, as FSDP2 may reduce such a unit's pieces
    together), or called with another gradient than its reduced shard; a hook called in a
    backward without sync; a gathered gradient left; in backward, a shard's gradient left
    after its step.

    A shard without a gradient after a synced backward (a module this forward did not use:
    an unused pooler, an expert no token was routed to, a dropped layer) is not reduced, and
    its hook is not called: it may be called 0 times. With the optimizer in backward every
    gradient is gone after its step, so any hook may be called 0 times there, and a hook that
    was due and not called shows as the shard gradient it leaves behind."""
    for i, seen in enumerate(after_backward):
        calls = seen["hook_calls"]
        if not seen["synced"]:
            if calls:
                return [f"backward {i} without gradient sync: hooks called on {sorted(calls)[:3]}"]
            continue
        grads = set(seen["shard_grads"])
        wrong = {n: calls.get(n, 0) for n, k in runs.items()
                 if not (0 if in_backward or n not in grads else min(1, k))
                 <= calls.get(n, 0) <= max(1, k)}
        if wrong:
            shown = dict(list(wrong.items())[:3])
            expected = {n: runs[n] for n in list(wrong)[:3]}
            return [f"backward {i}: the shards' post-accumulate-grad hooks were called "
                    f"{shown} times (once per run of the shard's unit expected, at most "
                    f"{expected}; {len(wrong)} of {len(runs)} differ)"]
        if seen["not_reduced"]:
            return [f"backward {i}: hooks saw no reduced shard gradient on "
                    f"{seen['not_reduced'][:3]}"]
        if seen["unsharded_grads"]:
            return [f"backward {i}: gathered gradients left on {seen['unsharded_grads'][:3]}"]
        if in_backward and seen["shard_grads"]:
            return [f"backward {i}: shard gradients left after their step on "
                    f"{seen['shard_grads'][:3]}"]
    return []


def peer_trajectory(rank: int, world: int, spec: Any, optimizer_class: type, kwargs: dict,
                    steps: int = 5, param_dtype: torch.dtype | None = None,
                    reduce_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The zoo's ZeRO-2 peer: ``spec`` trained with FSDP2 ``reshard_after_forward=False``, each
    child with parameters a unit, on the same group; the full parameters at the end. With
    ``param_dtype``, under ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``: FSDP2 keeps the
    sharded fp32 parameters as the masters, and those are returned."""
    from torch.distributed.device_mesh import init_device_mesh

    fsdp = api()
    device = rank_device(rank)
    mesh = init_device_mesh(torch.device(device).type, (world,))
    spec = of(spec)
    model = spec.build().to(device)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.children():
        if any(p.requires_grad for p in layer.parameters()):
            fsdp.fully_shard(layer, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fsdp.fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    opt = optimizer_class(model.parameters(), **kwargs)
    for i in range(steps):
        x, y = local_batch(spec, i, rank, world, device)
        spec.compute_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
