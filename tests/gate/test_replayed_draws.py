"""A workload's random draws through the gate (``hookbench.gate.workload_checks.measure``, a
baseline's ``<name>.replay.pt``): recorded with the baseline, replayed on the gate, in this
process and on the ranks. A torch that only draws other numbers gates clean, every row saying
so; a broken dropout fails the workload's ``draws`` row, naming the op, where every other row
holds on the replayed draws."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hookbench import gate
from hookbench.gate import replay, workload_checks
from hookbench.measure import trace
from tests.core.test_draws import WORKLOAD, OtherStreams

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("draws") / "baseline.replay.pt"
    base = gate.measure_all(("workloads",), workloads=[WORKLOAD], recording=True, replay=path)
    assert path.is_file() and base["workloads"]["drop/draws"]["draws"] > 0
    return base, path


def _verdicts(base: dict, now: dict) -> dict[str, tuple[bool, str]]:
    section = gate.check(base, now, parity=False)["workloads"]
    return {cells[0]: (ok, cells[-1]) for cells, ok in section.rows}


def test_a_torch_that_draws_other_numbers_gates_clean_and_says_so(recorded):
    base, path = recorded
    with OtherStreams():  # this process's draws: the strategies' rows and the references
        now = gate.measure_all(("workloads",), workloads=[WORKLOAD], replay=path)
    rows = _verdicts(base, now)
    assert all(ok for ok, _ in rows.values()), {k: v for k, (ok, v) in rows.items() if not ok}
    assert "differ from the baseline's" in rows["drop/draws"][1]
    assert rows["drop/forloop"][1].endswith("random draws differ from the baseline's: replayed")


def test_a_dropout_that_drops_another_fraction_fails_its_draws_row(recorded):
    base, path = recorded
    now = gate.measure_all(("workloads",), workloads=[WORKLOAD], replay=path,
                           fault="dropout_drops_half")
    rows = _verdicts(base, now)
    failed = {key: verdict for key, (ok, verdict) in rows.items() if not ok}
    assert list(failed) == ["drop/draws"], failed  # the other rows hold on the replayed draws
    assert failed["drop/draws"].startswith("aten::bernoulli_(0.9) draws mean 0.5")


class LastLinearOff(TorchDispatchMode):
    """A torch whose matmul rounds otherwise for one layer: the 4-wide output Linear's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.addmm.default and out.shape[-1] == 4:
            out = out * (1 + 1e-3)
        return out


def test_a_row_that_changed_says_where_it_first_changed_with_a_repro(recorded, tmp_path):
    base, path = recorded
    with LastLinearOff():
        now = gate.measure_all(("workloads",), workloads=[WORKLOAD], replay=path,
                               repro=tmp_path)
    rows = _verdicts(base, now)
    assert not rows["drop/forloop"][0]
    words = rows["drop/forloop"][1]
    assert ("first changed at step 0, forward: module b (Linear, call 0) given its recorded "
            "inputs returns another output") in words
    script = tmp_path / "drop-forloop.py"
    assert words.endswith(f"arithmetic of a module (Linear); repro: {script}"), words
    # standalone (torch alone, from any folder): on this torch, without the change, it gives
    # the recorded output; under the change, another
    run = [sys.executable, str(script)]
    assert subprocess.run(run, cwd="/", capture_output=True, timeout=120).returncode == 0
    text = script.read_text()
    assert "import hookbench" not in text and "from hookbench" not in text


@pytest.mark.slow
def test_an_optimizer_that_steps_otherwise_is_located_in_its_step(tmp_path):
    adam = WORKLOAD.replace(name="drop-adam", optimizer=(torch.optim.Adam, {"lr": 1e-2}))
    path = tmp_path / "b.replay.pt"
    base = gate.measure_all(("workloads",), workloads=[adam], recording=True, replay=path)
    now = gate.measure_all(("workloads",), workloads=[adam], replay=path,
                           fault="optimizer_arithmetic_changed")
    verdict = _verdicts(base, now)["drop-adam/forloop"]
    assert not verdict[0] and "first changed at step 0, optimizer step: a.weight updated " \
        "otherwise from its recorded gradient by the forloop step" in verdict[1], verdict
    assert verdict[1].endswith("arithmetic of the optimizer (forloop)")


def _with(steps: list, step: int, *path) -> list:
    """Rank 0's traced ``steps`` with one mark changed: another digest, another norm."""
    steps = copy.deepcopy(steps)
    where = steps[step]
    for key in path[:-1]:
        where = where[key]
    old, new = where[path[-1]], ("0" * 16, 1.0)
    where[path[-1]] = (old[0], new) if isinstance(old[1], tuple) else new  # (op, mark): mark
    return steps


def test_a_ranks_row_that_changed_on_the_ranks_says_where():
    """Where the standard step is as recorded, a ranks row's change is looked for in rank 0's
    own steps (``trace.RankTrace``): its share, its loss, what reached each collective, the
    gradients after them, the step. Each place changed in turn is the one named."""
    got = workload_checks.zero2([WORKLOAD], traced=True)
    ddp, zero2 = got["drop/engines/ddp"]["ranks_trace"], got["drop/zero2"]["ranks_trace"]
    assert ddp[0]["micro"][-1]["reached"][0][0] == "bucket 0 to allreduce_hook"
    assert got["drop/engines/fsdp2_zero2"]["ranks_trace"][0]["micro"][-1]["reached"][0][0] \
        == "c10d::_reduce_scatter_base_"
    # ZeRO-2's own reductions: what it hands each, to the rank that owns the bucket
    ops = [op for op, _ in zero2[0]["micro"][-1]["reached"]]
    assert set(ops) == {"reduce to rank 0", "reduce to rank 1"}, ops
    assert trace.locate_ranks(ddp, ddp) is None
    cases = {(1, "micro", 1, "data"): "step 1, data: rank 0's share of micro-batch 1",
             (1, "micro", 0, "loss"): "step 1, forward: rank 0's loss on micro-batch 0",
             (2, "micro", 1, "reached", 0): "step 2, backward: what reached collective 0 "
                                            "(bucket 0 to allreduce_hook) on micro-batch 1 "
                                            "after the recorded forward",
             (1, "synced", "b.bias"): "step 1, collective: the gradient of b.bias after the "
                                      "collectives, handed what was recorded",
             (1, "after", "a.weight"): "step 1, optimizer step: a.weight updated otherwise"}
    for (step, *path), words in cases.items():
        found = trace.locate_ranks(ddp, _with(ddp, step, *path))
        assert found["words"].startswith(f"on the ranks, first changed at {words}"), found
    # through the gate's locating: the standard step as recorded, rank 0's synced gradient not
    row = {"sha256": "x"}
    standard = {"forloop": trace.trace(WORKLOAD, "forloop", 1)}
    replay._locate(WORKLOAD, {"drop/engines/ddp": row}, standard, standard, ranks={
        "was": {"drop/engines/ddp": ddp},
        "now": {"drop/engines/ddp": _with(ddp, 0, "synced", "a.bias")}})
    assert row["located"].startswith("on the ranks, first changed at step 0, collective: the "
                                     "gradient of a.bias"), row
    assert row["located"].endswith("arithmetic of a collective (bucket 0 to allreduce_hook)")
    # ZeRO-2's own reduction, observed apart: what reached it, or what it made of that
    found = trace.locate_ranks(zero2, _with(zero2, 0, "micro", 0, "reached", 0))
    assert found["words"].startswith(f"on the ranks, first changed at step 0, backward: what "
                                     f"reached collective 0 ({ops[0]})"), found
    found = trace.locate_ranks(zero2, _with(zero2, 0, "synced", "shard 0 of the flat gradients"))
    assert found["words"].startswith("on the ranks, first changed at step 0, collective: the "
                                     "gradient of shard 0"), found
    assert found["kind"] == "arithmetic of a collective (reduce to rank 0, reduce to rank 1)"
