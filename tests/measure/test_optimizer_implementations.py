"""Every standard optimizer implementation against the standard for-loop step (issue 26).

The grouped and bucketed modes of the optimizer in backward are compared with the standard step
of the same implementation (tests/mechanisms/test_optimizer_in_backward.py), which a regression inside that
kernel passes on both sides alike. Here foreach and fused meet the for-loop, as PyTorch's own
test_foreach_matches_forloop and test_fused_matches_forloop do, for every family and option the
suite uses (``parity.IMPLEMENTATION_CASES``), in float32 and float64 within
``parity.tolerance``; the gate's parity section runs the same comparison.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hookbench.measure.parity import (AGAINST_FORLOOP, FAMILIES, IMPLEMENTATION_CASES,
                                      against_forloop, compare, missing_implementation, tolerance,
                                      trajectory)
from hookbench.models.zoo import TinySpec

# Tied and frozen layers: a parameter in two modules, and parameters without a gradient, which
# every implementation must skip alike.
SPECS = {dtype: TinySpec(depth=3, tied=True, frozen=True, dtype=dtype)
         for dtype in (torch.float32, torch.float64)}
# What torch.optim does not implement for the suite's families: RMSprop has no fused kernel.
WITHOUT = {(torch.optim.RMSprop, "fused")}


def test_the_implementations_torch_lacks_are_refused_not_ignored():
    # Not skipped silently: each lacking one must raise when asked for (missing_implementation
    # asserts that), and a torch that gains or loses one fails here, to be compared or named.
    lacking = {(cls, impl): missing_implementation(cls, impl)
               for cls, _ in IMPLEMENTATION_CASES.values() for impl in AGAINST_FORLOOP}
    assert {k for k, why in lacking.items() if why} == WITHOUT
    assert "RMSprop(fused=True) raises TypeError" in lacking[torch.optim.RMSprop, "fused"]


@pytest.mark.parametrize("dtype", SPECS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case, implementation", [
    (case, impl) for case, (cls, _) in IMPLEMENTATION_CASES.items() for impl in AGAINST_FORLOOP
    if (cls, impl) not in WITHOUT])
def test_every_implementation_follows_the_forloop_step(case, implementation, dtype):
    cls, kw = IMPLEMENTATION_CASES[case]
    result = against_forloop(SPECS[dtype], cls, kw, implementation)
    assert result.ok, result.verdict()


# -- the comparison fails when a kernel breaks --------------------------------------------------

# torch.optim deletes its submodule names; Adam.step (and AdamW's, a subclass) calls adam(),
# which looks up _multi_tensor_adam or _fused_adam among torch.optim.adam's globals every step.
ADAM = importlib.import_module("torch.optim.adam")


def _update_scaled(kernel):
    # Every update 0.1% larger, as a changed bias correction or eps placement would make it.
    return lambda *args, lr, **kwargs: kernel(*args, lr=lr * 1.001, **kwargs)


def _weight_decay_dropped(kernel):
    return lambda *args, weight_decay, **kwargs: kernel(*args, weight_decay=0.0, **kwargs)


@pytest.mark.smoke
@pytest.mark.parametrize("fault", [_update_scaled, _weight_decay_dropped],
                         ids=["update_scaled", "weight_decay_dropped"])
@pytest.mark.parametrize("implementation, kernel, mode", [
    ("foreach", "_multi_tensor_adam", "in_backward_grouped_foreach"),
    ("fused", "_fused_adam", "in_backward_bucketed")])
def test_a_broken_kernel_fails_against_the_forloop_though_its_self_comparison_passes(
        monkeypatch, implementation, kernel, mode, fault):
    cls, kw = FAMILIES["adam"]  # weight_decay=1e-3
    spec = SPECS[torch.float32]
    monkeypatch.setattr(ADAM, kernel, fault(getattr(ADAM, kernel)))
    result = against_forloop(spec, cls, kw, implementation)
    assert not result.ok and result.verdict().startswith("FAIL"), result.verdict()
    # What issue 26 names: the optimizer in backward on the same broken kernel still agrees with
    # the standard step of that implementation (bucketed: fused=True, one bucket).
    options = {**kw, "fused": True} if implementation == "fused" else kw
    same = compare(trajectory(spec, cls, options, mode), trajectory(spec, cls, kw, implementation),
                   tolerance(implementation, spec.dtype))
    assert same.ok, same.verdict()
