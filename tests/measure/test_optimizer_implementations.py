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

from hookbench import Workload
from hookbench.gate import workload_checks
from hookbench.measure.faults import inject
from hookbench.measure.parity import (AGAINST_FORLOOP, FAMILIES, IMPLEMENTATION_CASES,
                                      against_forloop, compare, implementation_ran,
                                      missing_implementation, tolerance, trajectory)
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


# -- the user's implementation flag, run as given (issue 46) -----------------------------------

GIVEN = {"sgd_fused": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, fused=True)),
         "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=1e-2, fused=True)),
         "adam_foreach": (torch.optim.Adam, dict(lr=1e-2, foreach=True))}


def _given(name: str) -> Workload:
    return TinySpec(depth=3, width=8).workload().replace(name=name, optimizer=GIVEN[name])


@pytest.mark.parametrize("name", GIVEN)
def test_a_named_implementation_runs_as_given_and_every_other_beside_it(name):
    # Before: every foreach row raised "fused and foreach cannot be True together", and the
    # references (ZeRO-2, the engines) ran the fused kernel as their "for-loop".
    workload = _given(name)
    rows = workload_checks.trajectories(workload)
    fused = GIVEN[name][1].get("fused", False)
    assert set(rows) == {f"{name}/{s}" for s in
                         workload_checks.STRATEGIES + (("fused",) if fused else ())}
    assert list(rows) == [f"{name}/{s}" for s in workload_checks.strategies(workload)]
    assert not [(k, r) for k, r in rows.items() if r.get("problems") or "error" in r]
    if fused:  # the user's kernel, held to the for-loop step; its buckets to it
        assert rows[f"{name}/fused"]["parity"].startswith("vs forloop: ")
        assert rows[f"{name}/in_backward_bucketed"]["parity"].startswith("vs fused: ")
    options = workload_checks.forloop_options(workload)
    assert options["foreach"] is False and "fused" not in options
    assert workload_checks.zero2_case(workload)["kwargs"] == options


def test_a_flag_torch_ignores_fails_the_row_that_names_it():
    # The fault drops foreach and fused as a torch ignoring them would: each step is then the
    # for-loop, bit for bit its own reference, so only the kernel check can see it.
    with inject("implementation_flag_ignored"):
        rows = workload_checks.trajectories(_given("sgd_fused"))
    for strategy in ("foreach", "fused"):
        assert rows[f"sgd_fused/{strategy}"]["error"] == (
            f"RuntimeError: the {strategy} step ran no fused or foreach kernel: torch did not "
            f"run the implementation it was asked for")
    assert "error" not in rows["sgd_fused/forloop"]


@pytest.mark.parametrize("implementation", AGAINST_FORLOOP)
def test_each_implementation_dispatches_its_own_kernels(implementation):
    # The check itself: a step that ran the other kernels, or none, is named.
    cls, kw = FAMILIES["adam"]

    def step() -> None:
        p = torch.zeros(3, requires_grad=True)
        p.grad = torch.ones(3)
        cls([p], **kw, **{implementation: True}).step()

    with implementation_ran(implementation):
        step()
    for other in ("forloop", *(i for i in AGAINST_FORLOOP if i != implementation)):
        with pytest.raises(RuntimeError, match=f"the {other} step ran .*_{implementation}"), \
                implementation_ran(other):
            step()



def _overflowing(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Scaled by the GradScaler's 65536, this loss's gradients are inf in fp16: every step is
    # skipped, as real fp16 training skips its first steps until the scale has come down.
    return torch.nn.functional.mse_loss(output.float(), target) * 1e30


def test_a_step_the_grad_scaler_skips_is_no_missing_kernel():
    # A skipped step runs no optimizer kernel at all; only a step that ran is checked.
    workload = TinySpec().workload().replace(name="skipped", precision="fp16", loss=_overflowing)
    initial = {n: p.detach() for n, p in workload.build().named_parameters()}
    for implementation in ("foreach", "fused"):
        snapshots = trajectory(workload, torch.optim.SGD, {"lr": 0.1}, implementation, steps=2)
        assert all(torch.equal(snapshots[-1][n], p) for n, p in initial.items())


# -- capturable=True: run as given, or torch's refusal of it on this device (issue 46) ----------

CAPTURABLE = {"adam_capturable": (torch.optim.Adam, dict(lr=1e-2, capturable=True)),
              "adamw_fused_capturable": (torch.optim.AdamW,
                                         dict(lr=1e-2, weight_decay=1e-2, fused=True,
                                              capturable=True))}


def _capturable(name: str) -> Workload:
    return TinySpec(depth=3, width=8).workload().replace(name=name, optimizer=CAPTURABLE[name])


def test_capturable_runs_as_given_where_torch_takes_it_and_is_its_refusal_where_not():
    # On the CPU torch refuses capturable Adam (its step count must be on a device it can
    # capture), and takes it with the fused kernel; the other rows run without the flag.
    rows = {**workload_checks.trajectories(_capturable("adam_capturable")),
            **workload_checks.trajectories(_capturable("adamw_fused_capturable"))}
    assert list(rows)[:4] == ["adam_capturable/forloop", "adam_capturable/foreach",
                              "adam_capturable/capturable", "adam_capturable/in_backward"]
    assert rows["adam_capturable/capturable"] == {"torch_refuses": (
        "AssertionError: If capturable=True, params and state_steps must be on supported "
        "devices: ['cuda', 'xpu', 'hpu', 'privateuseone', 'xla'].")}
    assert rows["adamw_fused_capturable/capturable"]["parity"].startswith("vs forloop: ok")
    assert not [(k, r) for k, r in rows.items() if r.get("problems") or "error" in r]


def test_a_capturable_flag_torch_ignores_fails_its_row():
    # Ignored, capturable Adam steps as the for-loop does, reading its step count back with
    # .item(): no longer refused on the CPU, and caught by what capturable promises.
    with inject("capturable_ignored"):
        rows = workload_checks.trajectories(_capturable("adam_capturable"))
    assert rows["adam_capturable/capturable"]["error"] == (
        "RuntimeError: the capturable step read a value back to the host "
        "(aten._local_scalar_dense): torch did not run the capturable step it was asked for")
    assert not [k for k, r in rows.items() if k != "adam_capturable/capturable" and
                (r.get("problems") or "error" in r)]
