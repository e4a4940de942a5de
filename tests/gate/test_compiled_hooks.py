"""Hooks under torch.compile (hookbench.gate.compiled_hooks): the outcomes pinned per torch, the
explanations, the state run_all leaves behind, and a fault that the checks must see."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.modules import module as module_mod

from hookbench.gate import compiled_hooks
from hookbench.gate.compiled_hooks import BACKENDS, CHECKS, EXPLAINED, run_all
from hookbench.measure.faults import inject

# run_all over every backend compiles with inductor: ~10 s with a warm cache, ~30 s cold; the
# tests that read it are the slow tier. The default tier runs the eager backend's forward-hook
# checks alone (test_the_eager_backend_keeps_forward_hooks), which the fault breaks too.

_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

# -- pinned outcomes ---------------------------------------------------------------------------

_EAGER_ORDER = "4.bias 4.weight 2.bias 2.weight 0.bias 0.weight"


def _orders(compiled: str) -> str:
    return "; ".join(f"backward {i}: compiled {compiled!r}, eager {_EAGER_ORDER!r}"
                     for i in (1, 2))


_WRAPPER_CALLS = ("warned about global hooks: compiled True, eager False; "
                  "fwd <OptimizedModule>: compiled 2, eager absent; "
                  "pre <OptimizedModule>: compiled 2, eager absent")
_NOT_FIRED = "calls after registration: compiled '', eager '2 <root> backward-pre:2'"
_ONE_NODE = "most gradients from one node: compiled 6, eager 1; "

# Measured the same on torch 2.8.0, 2.11.0, 2.13.0, 2.14.1 and 2.15.0 (2.5 to 2.7 not run);
# every other outcome is None. EXPLAINED says why each differs.
PINNED: dict[str, str] = {
    "eager/global_hooks": _WRAPPER_CALLS,
    "inductor/global_hooks": _WRAPPER_CALLS,
    "eager/hook_added_after_compile": _NOT_FIRED,
    "inductor/hook_added_after_compile": _NOT_FIRED,
    "inductor/post_accumulate_grad":
        _ONE_NODE + _orders("0.weight 2.weight 4.bias 4.weight 0.bias 2.bias"),
    "inductor/compiled_autograd":
        _ONE_NODE + _orders("4.weight 4.bias 2.weight 2.bias 0.weight 0.bias"),
}


def _global_hooks_2_4() -> str:
    # torch 2.4 (inline_inbuilt_nn_modules off) traces submodules as opaque modules: the global
    # hooks fire on module objects dynamo makes while compiling (fake-tensor copies of the
    # submodules; 9 Linear and 6 ReLU calls in all), never on the model's own modules or the
    # model itself; no warning yet.
    ours = [f"{kind} {name}" for kind in ("fwd", "pre")
            for name in ("0", "1", "2", "3", "4", "<root>")]
    return "; ".join([f"{k}: compiled absent, eager 2" for k in ours] + [
        f"{kind} {name}: compiled {n}, eager absent" for kind in ("fwd", "pre")
        for name, n in (("<OptimizedModule>", 2), ("<other Linear>", 9), ("<other ReLU>", 6))])


_RECORDS = {"records": " ".join(f"{m}#{call}[4, {3 if m == 4 else 8}]"
                                for call in (0, 1) for m in range(5)),
            "values vs eager": "bit-exact"}
# torch 2.4 runs a capture on a compiled model wholly eagerly: with its hook kept out of the
# graph (torch.compiler.disable) dynamo compiles no graph at all; the records are eager's.
_NO_GRAPH = "; ".join([*(f"{k}: compiled absent, eager {v!r}" for k, v in _RECORDS.items()),
                       "no graph compiled: compiled True, eager absent",
                       f"observed: compiled {_RECORDS!r}, eager absent"])

# Measured on torch 2.4.1.
PINNED_TORCH_2_4: dict[str, str] = {
    "eager/activation_capture": _NO_GRAPH,
    "inductor/activation_capture": _NO_GRAPH,
    "eager/global_hooks": _global_hooks_2_4(),
    "inductor/global_hooks": _global_hooks_2_4(),
    # The eager backend runs submodules as modules of the graph, so their new hooks fire;
    # the root's, traced away, does not.
    "eager/hook_added_after_compile":
        "calls after registration: compiled '2 backward-pre:2', eager '2 <root> backward-pre:2'",
    "inductor/hook_added_after_compile": _NOT_FIRED,
    "inductor/post_accumulate_grad":
        _ONE_NODE + _orders("0.weight 2.weight 4.bias 4.weight 0.bias 2.bias"),
    # Compiled autograd of 2.4 orders the hooks otherwise: with the eager backend all weights
    # first, with inductor as eager.
    "eager/compiled_autograd": _orders("4.weight 2.weight 0.weight 0.bias 2.bias 4.bias"),
    "inductor/compiled_autograd": "most gradients from one node: compiled 6, eager 1",
}


def _pinned() -> dict[str, str | None]:
    pins = PINNED_TORCH_2_4 if _TORCH < (2, 5) else PINNED
    return {f"{b}/{c}": pins.get(f"{b}/{c}") for b in BACKENDS for c in CHECKS}


# -- the one run_all of this module, and the global state around it ----------------------------


def _global_state() -> dict[str, Any]:
    from torch._dynamo import compiled_autograd as ca
    from torch._dynamo.eval_frame import OptimizedModule

    return {
        "global module hooks": {name: list(value) for name, value in vars(module_mod).items()
                                if name.startswith("_global_") and isinstance(value, dict)},
        "dynamo config": torch._dynamo.config.get_config_copy(),
        "inductor config": torch._inductor.config.get_config_copy(),
        "compiled autograd enabled": ca.compiled_autograd_enabled,
        "grad enabled": torch.is_grad_enabled(),
        "rng state": torch.random.get_rng_state().tolist(),
        "OptimizedModule.__call__": OptimizedModule.__dict__.get("__call__"),
    }


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    before = _global_state()
    outcomes = run_all()
    return {"outcomes": outcomes, "before": before, "after": _global_state()}


@pytest.mark.slow
def test_outcomes_are_the_pinned_ones(run):
    outcomes = run["outcomes"]
    assert list(outcomes) == [f"{b}/{c}" for b in BACKENDS for c in CHECKS]
    changed = {k: (v, _pinned()[k]) for k, v in outcomes.items() if v != _pinned()[k]}
    assert not changed, "\n".join(f"{k}:\n  now    {now}\n  pinned {pin}"
                                  for k, (now, pin) in changed.items())


@pytest.mark.slow
@pytest.mark.skipif(_TORCH < (2, 5), reason="EXPLAINED describes torch 2.14.1; torch 2.4's "
                                            "other differences are pinned with comments here")
def test_every_difference_is_explained_and_every_explanation_used(run):
    differing = {k for k, v in run["outcomes"].items() if v is not None}
    assert differing == set(EXPLAINED)
    assert all(EXPLAINED[k].strip() for k in differing)


@pytest.mark.slow
def test_nothing_raised(run):
    # A check that raises is an outcome too ("raised Type: message"), but none does on the
    # releases pinned above.
    assert not [v for v in run["outcomes"].values() if v and v.startswith(("raised", "eager "))]


@pytest.mark.slow
def test_run_all_leaves_no_global_state(run):
    before, after = run["before"], run["after"]
    for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_backward_hooks", "_global_backward_pre_hooks"):
        assert after["global module hooks"].get(name, []) == [], name
    changed = [k for k in before if before[k] != after[k]]
    if "dynamo config" in changed:
        changed.append([k for k, v in before["dynamo config"].items()
                        if after["dynamo config"].get(k) != v])
    assert not changed


FORWARD_CHECKS = ("forward_hooks", "activation_capture")


@pytest.mark.smoke
def test_the_eager_backend_keeps_forward_hooks():
    """The default tier's guard of forward hooks under torch.compile: the eager backend (dynamo
    without inductor, a second or two) against eager, as pinned; the fault
    compiled_module_skips_forward_hooks breaks it (test_faults.py runs the suite under it)."""
    got = run_all(backends=("eager",), checks=FORWARD_CHECKS)
    assert got == {f"eager/{c}": _pinned()[f"eager/{c}"] for c in FORWARD_CHECKS}
    with inject("compiled_module_skips_forward_hooks"):
        faulty = run_all(backends=("eager",), checks=FORWARD_CHECKS)
    assert all(faulty[k] is not None for k in got), faulty


# -- a check that raises -----------------------------------------------------------------------


def test_a_check_that_raises_is_an_outcome_with_the_address_masked(monkeypatch):
    def broken(backend):
        raise ValueError("hook at 0x7f3a12 id 4242 in /tmp/abc/def failed\nsecond line")

    monkeypatch.setitem(CHECKS, "broken", broken)
    assert run_all(backends=("eager",), checks=("broken",)) == {
        "eager/broken": "raised ValueError: hook at 0x? id ? in /tmp/... failed"}


# -- the fault ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_checks_see_compiled_modules_skipping_forward_hooks(run):
    checks = ("forward_hooks", "activation_capture")
    with inject("compiled_module_skips_forward_hooks"):
        faulty = run_all(backends=("eager",), checks=checks)
    for check in checks:
        key = f"eager/{check}"
        assert faulty[key] is not None and faulty[key] != run["outcomes"][key], faulty[key]
    assert "not compared: other records than eager's" in faulty["eager/activation_capture"]


def test_the_fault_restores_everything():
    from torch._dynamo.eval_frame import OptimizedModule

    own = OptimizedModule.__dict__.get("__call__")
    model = compiled_hooks.SPEC.build()
    calls = []
    handles = [model[2].register_forward_hook(lambda m, a, o: calls.append("a")),
               model[2].register_forward_hook(lambda m, a, o: calls.append("b"))]
    hooks, keys = model[2]._forward_hooks, list(model[2]._forward_hooks)
    try:
        torch._dynamo.reset()
        with inject("compiled_module_skips_forward_hooks"):
            assert OptimizedModule.__dict__.get("__call__") is not own
            torch.compile(model, backend="eager")(compiled_hooks.SPEC.batch(0)[0])
        assert calls == []
        assert model[2]._forward_hooks is hooks and list(hooks) == keys
        assert OptimizedModule.__dict__.get("__call__") is own
    finally:
        for h in handles:
            h.remove()
        torch._dynamo.reset()
