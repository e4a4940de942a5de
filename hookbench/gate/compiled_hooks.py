"""Hooks under ``torch.compile``: does a compiled model keep the hook contract eager keeps?

The gate section "compile". Each check builds the same tiny MLP (``SPEC``, fixed seed), runs
one scenario on it and returns a short, JSON-able *observation* (hook events in order, call
counts, a parity verdict). ``run_all`` runs every check eagerly and under
``torch.compile(model, backend=b)`` for each backend and reports, per ``"backend/check"``, None
when the compiled observation equals the eager one, else what differs, or ``"raised Type:
message"``. A difference is not a failure by itself: the known ones are explained in
``EXPLAINED`` and pinned by the gate's baseline, which fails when any outcome changes.

Known history this section watches: global module hooks fire an extra time for the
``OptimizedModule`` wrapper (pytorch#149502, warned about since #152740); hooks registered
after the first compiled call were ignored (#117758, #117265); ``register_forward_pre_hook(
prepend=True)`` failed under compile from 2.7 (#160083).

Every check shares one graph shape (same model, same batch shapes, hooks that only append to
lists add no tensor op), so inductor compiles a handful of graphs and its FX-graph cache serves
the rest. Nothing here may raise out of ``run_all``, and it leaves no hook, no compiled code and
no changed config behind.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from hookbench.gate.checks import Run, Section
from hookbench.measure import parity
from hookbench.mechanisms.activation_capture import ActivationCapture
from hookbench.models.zoo import TinySpec

__all__ = ["BACKENDS", "CHECKS", "EXPLAINED", "SPEC", "observe", "run_all"]

# Compiling takes seconds: selfcheck runs the section clean and under its own fault.
FAULTS = ("compiled_module_skips_forward_hooks",)

BACKENDS = ("eager", "inductor")

# Sequential(0 Linear(6, 8), 1 ReLU, 2 Linear(8, 8), 3 ReLU, 4 Linear(8, 3)), batch 4.
SPEC = TinySpec(depth=2, width=8)
ROOT = "<root>"  # the model itself in observations (its name in named_modules() is "")
WRAPPER = "<OptimizedModule>"  # torch.compile's wrapper, seen only by global hooks
WARNED = "warned about global hooks"  # global_hooks' key for torch's warning (#152740)
_STEPS = 3  # optimizer steps in the parity check

Observation = Any  # str, or dicts/lists of str, int and bool: JSON-able and comparable


def _model_and_forward(backend: str | None) -> tuple[nn.Module, nn.Module]:
    """A fresh SPEC model and what to call it through: itself, or its compiled wrapper."""
    model = SPEC.build()
    return model, (model if backend is None else torch.compile(model, backend=backend))


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): n or ROOT for n, m in model.named_modules()}


@contextlib.contextmanager
def _removing() -> Iterator[list]:
    """A list to put hook handles in; all removed on exit, also when the check raises."""
    handles: list = []
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


# -- checks ------------------------------------------------------------------------------------


def forward_hooks(backend: str | None) -> Observation:
    """Forward-pre and forward hooks on every module, root included: events in order, per
    forward, over two forwards (the second runs the cached compiled code)."""
    model, fwd = _model_and_forward(backend)
    events: list[str] = []
    with _removing() as handles:
        for name, m in model.named_modules():
            name = name or ROOT
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, n=name: events.append(f"pre:{n}")))
            handles.append(m.register_forward_hook(
                lambda mod, args, out, n=name: events.append(f"fwd:{n}")))
        seen = {}
        for i in range(2):
            events.clear()
            fwd(SPEC.batch(i)[0])
            seen[f"forward {i + 1}"] = " ".join(events)
    return seen


def global_hooks(backend: str | None) -> Observation:
    """``register_module_forward_pre_hook`` / ``register_module_forward_hook``: calls per module
    over two forwards, and whether torch warned about global hooks on a compiled module
    (#152740). The wrapper's own calls are the extra ones of pytorch#149502."""
    model, fwd = _model_and_forward(backend)
    names = _names(model)
    counts: dict[str, int] = {}

    def count(kind: str, mod: nn.Module) -> None:
        name = names.get(id(mod))
        if name is None:  # the compile wrapper, or a module of something else entirely
            name = WRAPPER if mod is fwd else f"<other {type(mod).__name__}>"
        key = f"{kind} {name}"
        counts[key] = counts.get(key, 0) + 1

    with _removing() as handles, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handles.append(module_mod.register_module_forward_pre_hook(
            lambda mod, args: count("pre", mod)))
        handles.append(module_mod.register_module_forward_hook(
            lambda mod, args, out: count("fwd", mod)))
        for i in range(2):
            fwd(SPEC.batch(i)[0])
    warned = any("global hooks" in str(w.message) for w in caught)
    return {**dict(sorted(counts.items())), WARNED: warned}


def prepend_pre_hook(backend: str | None) -> Observation:
    """``register_forward_pre_hook(prepend=True)`` on module "2": the prepended hook, registered
    second, runs first, and the input it returns (x + 1, a bare tensor as in #160083's
    reproducer, which torch wraps in a tuple) is what the other hook and the module see.
    Observed: order, and the output of two forwards against the eager model with the same
    hooks (within 1e-6: inductor may round differently). The reproducer's tensor-parallel
    (DTensor) pre-hooks are not modelled: that needs a process group."""
    model, fwd = _model_and_forward(backend)
    target = model[2]
    events: list[str] = []

    def appended(mod: nn.Module, args: tuple) -> None:
        events.append("appended")

    def prepended(mod: nn.Module, args: tuple) -> torch.Tensor:
        events.append("prepended")
        return args[0] + 1

    with _removing() as handles:
        handles.append(target.register_forward_pre_hook(appended))
        handles.append(target.register_forward_pre_hook(prepended, prepend=True))
        orders, outputs = [], []
        for i in range(2):
            events.clear()
            outputs.append(fwd(SPEC.batch(i)[0]).detach())
            orders.append(" ".join(events))
        with torch.no_grad():
            expected = [model(SPEC.batch(i)[0]) for i in range(2)] if backend else outputs
    same = all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(outputs, expected))
    return {"order": orders, "output as eager with the hooks": same}


def hook_added_after_compile(backend: str | None) -> Observation:
    """Hooks registered after the first forward/backward (for a compiled model: after
    compilation): a forward hook on the root and on module "2" (#117758) and a full backward
    pre-hook on module "2" (#117265). Observed: the calls in the next forward and backward;
    then, the hooks removed, in the one after that."""
    model, fwd = _model_and_forward(backend)
    calls: list[str] = []

    def step() -> str:
        calls.clear()
        x, y = SPEC.batch(0)
        SPEC.loss(fwd(x), y).backward()
        return " ".join(calls)

    step()
    with _removing() as handles:
        handles.append(model.register_forward_hook(lambda m, a, o: calls.append(ROOT)))
        handles.append(model[2].register_forward_hook(lambda m, a, o: calls.append("2")))
        handles.append(model[2].register_full_backward_pre_hook(
            lambda m, grad_output: calls.append("backward-pre:2")))
        after_registration = step()
    return {"calls after registration": after_registration, "calls after removal": step()}


def _post_accumulate(backend: str | None, compiled_autograd: bool) -> Observation:
    """Post-accumulate-grad hooks on every parameter over two forward/backward passes: the
    parameters in the order their hooks fired, per backward, and whether .grad was set then;
    and the most parameter gradients one autograd node of the graph produces. Eager, each
    layer's backward produces its own (1); a compiled backward that is one node produces them
    all at once, so all exist before the first hook can step and free one."""
    model, fwd = _model_and_forward(backend)
    events: list[str] = []

    def hook(name: str, p: torch.Tensor) -> None:
        events.append(name if p.grad is not None else f"{name}(no grad)")

    captures = _counter("compiled_autograd", "captures")
    with _removing() as handles:
        for name, p in model.named_parameters():
            handles.append(p.register_post_accumulate_grad_hook(
                lambda p, name=name: hook(name, p)))
        seen = {}
        for i in range(2):
            events.clear()
            x, y = SPEC.batch(i)
            loss = SPEC.loss(fwd(x), y)
            if i == 0:
                seen["most gradients from one node"] = _most_grads_per_node(loss)
            with _compiled_autograd(backend) if compiled_autograd else contextlib.nullcontext():
                loss.backward()
            seen[f"backward {i + 1}"] = " ".join(events)
            model.zero_grad(set_to_none=True)
    if compiled_autograd and 0 <= captures == _counter("compiled_autograd", "captures"):
        # plain autograd ran: the observation would be eager's and prove nothing
        raise RuntimeError("compiled autograd was enabled but captured no backward")
    return seen


def _most_grads_per_node(output: torch.Tensor) -> int:
    """The most AccumulateGrad nodes (parameters) one node of output's autograd graph feeds."""
    stack, seen, most = [output.grad_fn], set(), 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        most = max(most, sum(type(fn).__name__ == "AccumulateGrad" for fn in nexts))
        stack.extend(nexts)
    return most


def post_accumulate_grad(backend: str | None) -> Observation:
    """Post-accumulate-grad hooks on the parameters of a compiled model (plain autograd runs
    the compiled backward, then AccumulateGrad per parameter, where the hooks fire)."""
    return _post_accumulate(backend, compiled_autograd=False)


def compiled_autograd(backend: str | None) -> Observation:
    """The same with compiled autograd capturing the backward (hooks traced into its graph);
    the eager reference is plain autograd on the eager model."""
    return _post_accumulate(backend, compiled_autograd=backend is not None)


@contextlib.contextmanager
def _compiled_autograd(backend: str) -> Iterator[None]:
    # torch >= 2.5 calls it _enable (context manager); 2.4 had enable. A torch without either
    # raises AttributeError here, which run_all reports as the outcome.
    from torch._dynamo import compiled_autograd as ca

    enable = getattr(ca, "_enable", None) or ca.enable
    with enable(lambda gm: torch.compile(gm, backend=backend, fullgraph=True)):
        yield


def optimizer_in_backward_parity(backend: str | None) -> Observation:
    """OptimizerInBackward(Adam, foreach=False) against a standard Adam(foreach=False) step, both
    driving the same (compiled) model for 3 steps; parameters and Adam state compared bit for
    bit. The optimizers run eagerly either way: only forward and backward are compiled."""
    cls, kwargs = parity.FAMILIES["adam"]
    runs = [_trajectory(backend, cls, kwargs, s) for s in ("in_backward", "forloop")]
    return parity.compare(*runs).verdict()


def _trajectory(backend: str | None, cls: type, kwargs: dict, strategy: str) -> list:
    torch._dynamo.reset()  # the second model must not run code compiled for the first
    model = SPEC.build()
    started = parity.start(strategy, model, cls, kwargs, 1)  # hooks before the first compile
    try:
        fwd = model if backend is None else torch.compile(model, backend=backend)
        run = parity.Training(SPEC, model, 1, started.step, started.state_of)
        snapshots = []
        for i in range(_STEPS):
            x, y = SPEC.batch(i)
            SPEC.loss(fwd(x), y).backward()
            started.step()
            snapshots.append(run.snapshot())
        return snapshots
    finally:
        started.close()


def activation_capture(backend: str | None) -> Observation:
    """ActivationCapture (full tensors, every submodule) over two forwards: the records (name,
    call, path, shape) in order, and their values against an eager capture of the same model
    (bit-exact, or within 1e-6: inductor may round differently)."""
    def capture(b: str | None) -> list:
        model, fwd = _model_and_forward(b)
        with ActivationCapture(model) as cap:
            for i in range(2):
                fwd(SPEC.batch(i)[0])
        return cap.records

    def key(r: Any) -> str:
        return f"{r.name}#{r.call}{'.' + r.path if r.path else ''}{list(r.shape)}"

    records = capture(backend)
    reference = capture(None) if backend else records
    pairs = list(zip(records, reference))
    if [key(r) for r in records] != [key(r) for r in reference]:
        values = "not compared: other records than eager's"
    elif all(torch.equal(a.value, b.value) for a, b in pairs):
        values = "bit-exact"
    else:
        diff = [float((a.value - b.value).abs().max()) for a, b in pairs]
        worst = max(range(len(diff)), key=diff.__getitem__)
        values = ("within 1e-6" if diff[worst] <= 1e-6 else
                  f"differ: max |diff| {diff[worst]:.3g} at {key(records[worst])}")
    return {"records": " ".join(key(r) for r in records), "values vs eager": values}


CHECKS: dict[str, Callable[[str | None], Observation]] = {
    f.__name__: f for f in (
        forward_hooks,
        global_hooks,
        prepend_pre_hook,
        hook_added_after_compile,
        post_accumulate_grad,
        compiled_autograd,
        optimizer_in_backward_parity,
        activation_capture,
    )
}

# What differs from eager on torch 2.14.1, one sentence each; run_all's outcome for the key is
# pinned in the gate's baseline, so these explain a recorded difference rather than excuse it.
_WRAPPER_CALLS = (
    "OptimizedModule is an nn.Module whose own __call__ runs the global forward-pre and forward "
    "hooks before calling the original model, which runs them again, so each fires once more "
    "per forward, for the wrapper (pytorch#149502; the warning since #152740)."
)
_HOOK_GUARDS = (
    "Dynamo does not guard on module hook dicts (torch._dynamo.config.skip_nnmodule_hook_guards "
    "is True by default), so the code compiled at the first call, traced without the hooks, keeps "
    "running and forward and backward hooks registered afterwards silently never fire "
    "(pytorch#117758, #117265); register hooks before the first compiled call, or "
    "torch._dynamo.reset()."
)
EXPLAINED: dict[str, str] = {
    "eager/global_hooks": _WRAPPER_CALLS,
    "inductor/global_hooks": _WRAPPER_CALLS,
    "eager/hook_added_after_compile": _HOOK_GUARDS,
    "inductor/hook_added_after_compile": _HOOK_GUARDS,
    "inductor/post_accumulate_grad": (
        "AOTAutograd makes the whole compiled backward one autograd node that returns every "
        "parameter's gradient at once; each post-accumulate-grad hook still fires once per "
        "backward, but in the order the engine takes the AccumulateGrad nodes from its ready "
        "queue, not layer by layer, and all gradients exist before the first hook runs, so "
        "OptimizerInBackward steps correctly but frees no gradient early inside a compiled graph."
    ),
    "inductor/compiled_autograd": (
        "Compiled autograd traces the same single compiled-backward node and calls the "
        "post-accumulate-grad hooks from its graph once per backward, last layer first with "
        "weight before bias, and, as without it, all gradients exist before the first hook runs."
    ),
}


# -- running -----------------------------------------------------------------------------------

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_ID = re.compile(r"\b(id[ =:(]*)\d+")
_TMP = re.compile(r"/tmp/\S*")


def _masked(e: BaseException) -> str:
    """``raised Type: message``: the first line, without addresses, ids or temporary paths, so
    the same failure reads the same on every run."""
    lines = str(e).strip().splitlines()
    message = lines[0] if lines else ""
    message = _TMP.sub("/tmp/...", _ID.sub(r"\1?", _ADDRESS.sub("0x?", message)))
    if len(message) > 200:
        message = message[:200] + "..."
    return f"raised {type(e).__name__}: {message}"


def observe(check: str, backend: str | None) -> Observation:
    """One case: ``CHECKS[check]`` eagerly (backend None) or compiled with ``backend``, from a
    reset dynamo; a check that raises observes ``"raised Type: message"``. Does not raise."""
    try:
        torch._dynamo.reset()
        graphs = _counter("stats", "unique_graphs")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what a check must see it records itself
            seen = CHECKS[check](backend)
        if backend is not None and graphs >= 0 and _counter("stats", "unique_graphs") == graphs:
            # dynamo gave up and ran everything eagerly: equal to eager, but proving nothing
            return {"no graph compiled": True, "observed": seen}
        return seen
    except Exception as e:  # noqa: BLE001 - the outcome, reported and pinned
        return _masked(e)
    finally:
        try:
            torch._dynamo.reset()  # no compiled code keeps this check's models alive
        except Exception:  # noqa: BLE001 - run_all must not raise
            pass


def _counter(group: str, name: str) -> int:
    """One of dynamo's counters (they survive torch._dynamo.reset(), so callers compare before
    and after); -1 where this torch keeps none by that name."""
    try:
        return int(torch._dynamo.utils.counters.get(group, {}).get(name, 0))
    except Exception:  # noqa: BLE001 - an older or newer layout: then we cannot tell
        return -1


_ABSENT = object()


def _raised(observation: Observation) -> bool:
    return isinstance(observation, str) and observation.startswith("raised ")


def _show(observation: dict, key: str) -> str:
    return repr(observation[key]) if key in observation else "absent"


def _describe(compiled: Observation, eager: Observation) -> str:
    """What differs, shortly: the differing keys of two dicts, else both values."""
    if _raised(compiled):
        return compiled
    if _raised(eager):
        return f"eager {eager}"
    if isinstance(compiled, dict) and isinstance(eager, dict):
        parts = []
        for key in list(eager) + [k for k in compiled if k not in eager]:
            if compiled.get(key, _ABSENT) != eager.get(key, _ABSENT):
                parts.append(f"{key}: compiled {_show(compiled, key)}, eager {_show(eager, key)}")
        return "; ".join(parts)
    return f"compiled: {compiled!r}; eager: {eager!r}"


def run_all(backends: tuple[str, ...] = BACKENDS,
            checks: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """``{"backend/check": None or the difference from eager}`` for every backend and every
    check (or those named in ``checks``), in that order.

    Never raises. Resets dynamo before and after each case, so compiled code of the caller's
    is discarded too; leaves the RNG, grad mode, config and hooks as it found them.
    """
    names = tuple(CHECKS) if checks is None else tuple(checks)
    results: dict[str, str | None] = {}
    rng = torch.random.get_rng_state()
    grad_enabled = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(True)
        eager = {name: observe(name, None) for name in names}
        for backend in backends:
            for name in names:
                seen = observe(name, backend)
                # an eager reference that raised is a broken check, never "the same as eager"
                same = seen == eager[name] and not _raised(seen)
                results[f"{backend}/{name}"] = None if same else _describe(seen, eager[name])
    except Exception as e:  # noqa: BLE001 - only if something outside the checks broke
        results["run_all"] = _masked(e)
    finally:
        torch.random.set_rng_state(rng)
        torch.set_grad_enabled(grad_enabled)
    return results


def measure(run: Run) -> dict[str, str | None]:
    return run_all()


_ITEM = re.compile(r"(?P<key>.+?): compiled .*, eager .*")


def differences(outcome: str | None) -> dict[str, str]:
    """An outcome (``_describe``'s words, or None: equal to eager) as its differences from
    eager, by what differs (``"fwd 0"``: ``"fwd 0: compiled absent, eager 2"``); an outcome
    that is not such a list (a raise) is one difference, keyed by itself."""
    if outcome is None:
        return {}
    parts = outcome.split("; ")
    matched = [_ITEM.fullmatch(part) for part in parts]
    if not all(matched):
        return {outcome: outcome}
    return {m["key"]: part for m, part in zip(matched, parts)}


def _compared(recorded: str, outcome: str | None) -> tuple[bool, str]:
    """Another difference from eager than the recorded one, judged difference by difference:
    a recorded difference gone is a fix; a difference new or changed (a hook that fires
    otherwise than it did) is a failure, except torch's warning about global hooks, which
    changes no hook's calls (the warnings section gates warnings)."""
    was, now = differences(recorded), differences(outcome)
    gone = [k for k in was if k not in now]
    still = [now[k] for k in now if was.get(k) == now[k]]
    new = [now[k] for k in now if k not in was and k != WARNED]
    changed = [f"{now[k]} (recorded: {was[k][len(k) + 2:]})" for k in now
               if k in was and now[k] != was[k] and k != WARNED]
    warned = [now[WARNED]] if WARNED in now and now[WARNED] != was.get(WARNED) else []
    words = "; ".join(
        f"{label}: {' | '.join(items)}" for label, items in (
            ("new", new), ("changed", changed), ("gone, as in eager", gone),
            ("now warned", warned), ("as recorded", still))
        if items)
    if new or changed:
        return False, f"CHANGED: {words} (re-record only if intended)"
    return True, (f"FIXED in part since the baseline: {len(gone)} of {len(was)} recorded "
                  f"differences from eager gone; {words}")


def judge(base: dict, now: dict, run: Run) -> Section:
    section = Section("Hooks and mechanisms under torch.compile against eager, as recorded",
                      ("backend/check", "recorded", "verdict"))
    for key, outcome in now.items():
        recorded = base.get(key, "not recorded")
        explained = EXPLAINED.get(key)
        if outcome == recorded:
            ok, verdict = True, "equal to eager" if outcome is None else (
                f"pinned difference: {outcome}" + (f" ({explained})" if explained else ""))
        elif recorded in (None, "not recorded"):
            ok, verdict = False, (f"CHANGED: {'equal to eager' if outcome is None else outcome} "
                                  f"(re-record only if intended)")
        elif outcome is None:  # toward eager is a fix: a recorded difference gone passes
            ok, verdict = True, (f"FIXED since the baseline: equal to eager now (recorded: "
                                 f"{recorded}); record again to hold it")
        else:
            ok, verdict = _compared(recorded, outcome)
        shown = {None: "equal", "not recorded": "not recorded"}.get(recorded, "differs")
        section.add(ok, key, shown, verdict)
    return section
