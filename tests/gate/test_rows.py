"""The row registry (``hookbench.gate.rows``): every row declared once, and what the runner and
the judges read from it. Each property is shown to be read: an entry changed here changes the
row it declares."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hookbench.engines import references, verdicts
from hookbench.gate import rows, workload_checks
from hookbench.measure import bounds
from hookbench.models.zoo import TinySpec

WORKLOAD = TinySpec(depth=2, width=8).workload().replace(
    name="tiny", optimizer=(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}))


def test_every_bound_is_a_rule_of_the_bounds_module_and_every_reference_a_run():
    for row in rows.ROWS.values():
        assert row.bound is None or row.bound in bounds.__all__, row.name
        assert row.kind in ("trajectory", "ranks", "capture", "transform", "memory",
                            "draws"), row.name
        assert all(ref.why for ref in row.references), row.name  # why (not) bit for bit
    strategies = {r.name for r in rows.STRATEGY_ROWS}
    for row in rows.STRATEGY_ROWS:  # a strategy is held to another strategy's run
        assert {ref.run for ref in row.references} <= strategies, row.name
    # every engine the engines layer runs, and only those, has its row
    assert [r.name for r in rows.ENGINE_ROWS] == [f"engines/{e}" for e in verdicts.ENGINES]


def test_a_row_key_finds_its_entry():
    assert rows.row("tiny/engines/ddp") is rows.ROWS["engines/ddp"]
    assert rows.row("tiny/memory/in_backward").kind == "memory"
    assert rows.row("tiny/in_backward_bucketed").kind == "trajectory"
    with pytest.raises(KeyError):
        rows.row("tiny/no_such_row")


def test_a_reference_applies_where_its_condition_holds():
    bucketed = rows.ROWS["in_backward_bucketed"]
    assert [r.run for r in bucketed.references_for(WORKLOAD)] == ["foreach"]
    fused = WORKLOAD.replace(optimizer=(torch.optim.AdamW, {"lr": 1e-2, "fused": True}))
    assert [r.run for r in bucketed.references_for(fused)] == ["fused"]
    assert workload_checks.strategies(fused)[:4] == ("forloop", "foreach", "fused",
                                                     "in_backward")
    assert "fused" not in workload_checks.strategies(WORKLOAD)


@pytest.mark.parametrize("changes, words", [
    (dict(precision="fp16"), "the optimizer in backward refuses fp16"),
    (dict(clip_grad_norm=1.0), "the optimizer in backward refuses global gradient-norm"),
])
def test_the_refusals_are_the_entries_words(changes, words):
    w = WORKLOAD.replace(**changes)
    for name in ("in_backward", "in_backward_grouped", "memory/in_backward",
                 "engines/fsdp2_in_backward"):
        assert rows.ROWS[name].refuses(w).startswith(words), name
    assert rows.refusal(WORKLOAD, "in_backward") is None
    lbfgs = WORKLOAD.replace(optimizer=(torch.optim.LBFGS, {"lr": 1e-2}))
    assert rows.refusal(lbfgs, "zero2") == (
        "ZeRO-2 refuses LBFGS: it steps 1-D pieces of parameters, and LBFGS is not known to "
        "update them elementwise")


def test_the_runner_reads_the_entry(monkeypatch):
    # The fault: a declared refusal the mechanism does not make. The row is run, trains the
    # workload, and fails saying it must refuse: the runner took the refusal from the entry.
    entry = rows.ROWS["in_backward"]
    monkeypatch.setitem(rows.ROWS, "in_backward", dataclasses.replace(
        entry, refuses=lambda w: "declared to refuse for this test"))
    got = workload_checks.trajectories(WORKLOAD)["tiny/in_backward"]
    assert got["problems"] == ["in_backward trained the workload; it must refuse (declared "
                               "to refuse for this test)"]
    # and a reference changed in the entry is the one the row is held to
    monkeypatch.setitem(rows.ROWS, "in_backward", dataclasses.replace(
        entry, references=(rows.Reference("foreach", True, "for this test"),)))
    got = workload_checks.trajectories(WORKLOAD)["tiny/in_backward"]
    assert got["parity"].startswith("vs foreach: "), got
    assert ("bit-exact" in got["parity"]) == (got["problems"] == []), got


def test_the_judge_reads_a_rows_kind_from_the_registry():
    # A capture row's result judged as the capture's, whatever keys it happens to have: the
    # kind is declared, not inferred from the dict.
    ok, words = workload_checks.live_verdict("tiny/capture", {"records": 3, "calls": 3,
                                                              "problems": []})
    assert ok and words.startswith("3 of 3 module calls recorded")
    with pytest.raises(KeyError):  # a row no entry declares cannot be judged at all
        workload_checks.live_verdict("tiny/nothing", {"records": 3, "calls": 3})


def test_the_references_are_measured_once_before_any_row_is_judged(monkeypatch):
    # One launch for ZeRO-2 and the engines; then each reference once (the single process for
    # ZeRO-2's shares, and with the engines' accumulation), then the judge, row by row.
    events = []
    measure, judge_row = references.measure, workload_checks.judge_row

    def measured(*args, **kwargs):
        events.append(("measure", args[4] if len(args) > 4 else kwargs.get("accumulation", 1)))
        return measure(*args, **kwargs)

    def judged(entry, runs):
        events.append(("judge", entry.name))
        return judge_row(entry, runs)

    monkeypatch.setattr(references, "measure", measured)
    monkeypatch.setattr(workload_checks, "judge_row", judged)
    got = workload_checks.zero2([WORKLOAD])
    assert not [(k, r) for k, r in got.items() if r.get("problems") or "error" in r], got
    kinds = [kind for kind, _ in events]
    assert sorted(e for e in events if e[0] == "measure") == [("measure", 1), ("measure", 2)]
    assert sorted(name for kind, name in events if kind == "judge") == sorted(
        ["zero2", *(f"engines/{e}" for e in verdicts.ENGINES)])
    assert kinds.index("judge") > max(i for i, k in enumerate(kinds) if k == "measure"), events
