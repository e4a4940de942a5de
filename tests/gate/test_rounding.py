"""A release whose kernels only round otherwise against one that changed what is computed
(``hookbench.gate.replay.within_rounding``, ``hookbench.measure.trace.rounding_floor``,
``hookbench.measure.bounds.rounding``). Training amplifies a one-ulp change far beyond any
fixed tolerance where a gradient is zero but for rounding (an attention key's bias, which
softmax ignores, under Adam: 662x the trajectory tolerance after 3 steps here). The gate tells
the two apart by the change where it first happened (its norm within a kernel's rounding) and
by the workload's own rounding floor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hookbench import Workload
from hookbench.core import draws
from hookbench.gate import replay, workload_checks
from hookbench.gate.checks import Run, Verdict
from hookbench.measure import bounds, trace


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x).reshape(-1, 4, 32)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.out(h.reshape(-1, 32))


def batch(g: torch.Generator):
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


ATTENTION = Workload(name="attention", model=Attention, batch=batch, loss=F.cross_entropy,
                     optimizer=(torch.optim.Adam, {"lr": 1e-2}))


class BackwardMatmul(TorchDispatchMode):
    """A release whose matmuls in backward give another output: ``by`` None rounds every
    element one ulp up (a kernel that sums in another order); a factor scales it (a changed
    formula, as RMSNorm's epsilon in bf16 changed its output)."""

    def __init__(self, by: float | None = None):
        super().__init__()
        self.by = by

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mm.default and torch._C._current_graph_task_id() != -1:
            out = (torch.nextafter(out, torch.full_like(out, float("inf"))) if self.by is None
                   else out * self.by)
        return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """ATTENTION's trajectory rows recorded on this torch, with their draws and traces."""
    path = tmp_path_factory.mktemp("rounding") / "b.replay.pt"
    base = replay.measured(Run(workloads=(ATTENTION,), recording=True, replay=path),
                           lambda: workload_checks.trajectories(ATTENTION))
    return base, path


def _gated(recorded, release: TorchDispatchMode, rule: bool = True) -> dict:
    """ATTENTION's for-loop and in-backward rows gated under ``release``: row -> (ok,
    words); ``rule=False``: as the gate judged before the rounding rule."""
    base, path = recorded
    run = Run(workloads=(ATTENTION,), replay=path)
    with release:
        now = replay.measured(run, lambda: workload_checks.trajectories(ATTENTION))
    if not rule:
        for value in now.values():
            value.pop("rounding", None)
    section = workload_checks.judge(base, now, run)
    return {cells[0]: (ok == Verdict.PASS, cells[-1]) for cells, ok in section.rows
            if cells[0] in ("attention/forloop", "attention/in_backward")}


def test_a_release_whose_kernels_round_otherwise_passes_naming_kernel_rounding(recorded):
    rows = _gated(recorded, BackwardMatmul())
    for ok, words in rows.values():
        assert ok, words
        assert words.startswith("CHANGED bits by KERNEL ROUNDING: where it first changed, its "
                                "norm moved"), words
        assert "first changed at step 0, backward" in words and "attn.in_proj_bias" in words
    # without the rule, the same rows fail: beyond the tolerance, by hundreds of times
    rows = _gated(recorded, BackwardMatmul(), rule=False)
    assert not any(ok for ok, _ in rows.values()), rows
    assert "x of tolerance" in rows["attention/forloop"][1]


def test_a_release_that_changes_what_is_computed_fails_naming_it(recorded):
    rows = _gated(recorded, BackwardMatmul(by=1.001))
    for ok, words in rows.values():
        assert not ok, words
        assert ("where it first changed, its norm moved 0.001 relative, more than a kernel's "
                "rounding") in words, words
        assert words.endswith("arithmetic of backward"), words


def test_a_rounding_first_and_a_larger_change_after_it_fail_beyond_the_floor(recorded):
    """The first change a rounding; later every Adam update applied twice (a broken step): the
    parameters are beyond the rounding floor, so the row fails though its first change is
    benign."""
    class AndAdamOff(BackwardMatmul):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is torch.ops.aten.addcdiv_.default:  # Adam's update, applied twice
                func(*args, **(kwargs or {}))
            return out

    rows = _gated(recorded, AndAdamOff())
    ok, words = rows["attention/forloop"]
    assert not ok and "a kernel's rounding (up to" in words, words
    assert "but the parameters moved further than rounding moves them" in words, words


def test_the_rounding_limit_is_a_few_ulps_of_the_lowest_precision_the_step_computes_in():
    eps32, eps16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
    assert bounds.rounding(ATTENTION, 1.0, 1 + eps32)[0]
    assert not bounds.rounding(ATTENTION, 1.0, 1 + 5 * eps32)[0]
    bf16 = ATTENTION.replace(precision="bf16")
    assert bounds.rounding(bf16, 1.0, 1 + 3 * eps16)[0]
    assert not bounds.rounding(bf16, 1.0, 1.85)[0]  # RMSNorm's epsilon in bf16
    assert bounds.rounding(ATTENTION, 0.0, 0.0) == (True, 0.0, 4 * eps32)
    assert not bounds.rounding(ATTENTION, 0.0, 1e-30)[0]


def test_the_rounding_floor_is_what_training_makes_of_rounding():
    floor = trace.rounding_floor(ATTENTION)
    assert set(floor) == {k for n, _ in ATTENTION.build().named_parameters()
                          for k in (n, f"{n}#norm")}
    # the key bias: zero gradient but for rounding, which Adam turns into whole steps
    assert floor["attn.in_proj_bias"] > 1e-3
    assert floor["out.weight"] < 1e-4  # a gradient well above rounding moves by little
    assert trace.rounding_floor(ATTENTION) == floor  # the signs come from a fixed generator
    # under bf16 autocast an ulp is a bf16 one, also for the fp32 gradients it moves
    autocast = trace.rounding_floor(ATTENTION.replace(precision="bf16"))
    assert autocast["out.weight"] > 100 * floor["out.weight"], (autocast, floor)


def batchnorm_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


# BatchNorm over a share of 2 rows (2 ranks, 4 rows a batch) amplifies a rounding far more than
# over the whole batch (timm's MobileNetV3, torch 2.6.0 -> 2.9.1: its ZeRO-2 row 133x the
# floor of the whole batch)
BATCHNORM = Workload(name="bn", model=batchnorm_mlp, batch=lambda g: (
    torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)),
    loss=F.cross_entropy, optimizer=(torch.optim.Adam, {"lr": 1e-2}))


def test_a_ranks_rows_rounding_floor_is_measured_on_the_ranks_shares(monkeypatch):
    from hookbench.gate import rows

    assert replay._shares(rows.ROWS["forloop"]) == (1, 1)
    assert replay._shares(rows.ROWS["zero2"]) == (rows.ZERO2_RANKS, 1)
    assert replay._shares(rows.ROWS["engines/ddp"]) == (rows.ZERO2_RANKS, 2)
    whole = replay._floor(BATCHNORM, "forloop", 1, 1)
    assert whole == trace.rounding_floor(BATCHNORM)
    shares = replay._floor(BATCHNORM, "forloop", 2, 1)
    assert shares["0.weight"] > 1000 * whole["0.weight"], (shares, whole)
    # the gate's locating asks each row for the floor it trains on: a first change that is a
    # rounding, in the standard step both rows are located in
    monkeypatch.setattr(trace, "locate", lambda a, b: {
        "words": "first changed at step 0, backward", "kind": "arithmetic of backward",
        "norms": (1.0, 1.0)})
    got = {"bn/forloop": {"sha256": "a"}, "bn/zero2": {"sha256": "b"}}
    replay._locate(BATCHNORM, got, {"forloop": {}}, {"forloop": {}})
    assert got["bn/forloop"]["rounding"]["floor"] == whole
    assert got["bn/zero2"]["rounding"]["floor"] == shares


def test_the_floors_own_draws_are_not_named_as_the_workloads(recorded):
    # its signs come from a generator of its own inside the forward it perturbs: a session
    # replaying the workload's draws must not see them (examples/charlm on 2.9.1 against
    # 2.6.0: `not in the baseline, drawn anew: aten::randint x168`, the floor's)
    _, path = recorded
    with draws.replaying(draws.load(path)["draws"]) as session:
        trace.rounding_floor(ATTENTION)
    report = session.report("attention")
    assert report["draws"] > 0 and report["not_recorded"] == {}, report


def _row(values: list[float], standard: bool | None) -> dict:
    row = {"sha256": "0" * 64, "final": {"w": {"dtype": "float32", "shape": [2],
                                              "values": values}}}
    return row if standard is None else {**row, "standard_on_shares": standard}


@pytest.mark.parametrize("was, now, holds", [
    (True, True, True), (True, False, False), (False, True, False), (None, True, False)])
def test_beyond_the_floor_holds_only_as_the_standard_step_on_the_shares_on_both(was, now,
                                                                              holds):
    """A ranks row whose first change is a kernel's rounding, amplified past 2x the floor (the
    floor one draw of what training makes of a rounding, and on a share of one image
    BatchNorm makes it chaotic: torchvision's ShuffleNet's ZeRO-2 row, 2.9.1 -> 2.6.0, 1.75x
    the bound). It holds only where the row is the standard step on the ranks' shares bit for
    bit on both torches: then its mechanism adds nothing to the distance. A row that is not
    (its mechanism's own arithmetic, on either torch) fails, as before the rule."""
    recorded = _row([1.0, 2.0], was)
    value = {**_row([1.0, 2.0 + 3.5], now),
             "rounding": {"relative": 4.5e-11, "limit": 4.8e-7, "floor": {"w": 1.0}}}
    ok, words = replay.within_rounding(recorded, value, bounds.Tolerance(1e-5, 1e-6))
    assert ok is holds, words
    assert "1.75x of the bound" in words, words
    assert ("bit for bit the standard step on the ranks' shares, as recorded" in words) is holds
    if not holds:
        assert "the parameters moved further than rounding moves them" in words, words
