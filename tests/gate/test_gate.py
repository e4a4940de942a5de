"""The upgrade gate: the installed torch holds the committed baseline (baselines/gate.json), each
check fails and names both numbers when the baseline is exceeded, recording is explicit, and
``hookbench selfcheck`` catches the whole fault catalogue."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from hookbench import gate
from hookbench.cli import main
from hookbench.core import names
from hookbench.core.prerequisites import attempt
from hookbench.gate import baselines, checks, known_failures, memory, numerics, parity, step_time
from hookbench.gate.checks import Run, Verdict
from hookbench.measure import bounds
from hookbench.measure.faults import FAULTS, inject
from hookbench.measure.memory import format_bytes
from hookbench.measure.parity import FAMILIES, IMPLEMENTATION_CASES, accepts
from hookbench.report import render

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "baselines" / "gate.json"


@pytest.fixture(scope="module")
def base():
    return baselines.load(BASELINE)


def _judge(base, now):
    now = {"recorded_with": baselines.environment(), **now}
    return gate.check(base, now, parity=False)


# -- the committed baseline holds on the installed torch ------------------------------------------


@pytest.mark.smoke
def test_hook_behaviour_and_trajectories_match_the_baseline(base):
    sections = _judge(base, gate.measure_all(("hooks", "numerics")))
    assert all(s.ok for s in sections.values()), render(list(sections.values()))
    if baselines.same_kernels(base["recorded_with"], baselines.environment()):
        # Same torch, same CPU kernels: the arithmetic is identical, so bit for bit.
        assert all(cells[-1].startswith("identical") for cells, _ in sections["numerics"].rows)


# ViT-B/16 (11 s) is the slow tier's: the default tier keeps a transformer and a CNN.
@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == "vit_b_16"
                                   else m for m in gate.MODELS])
def test_peak_memory_by_category_within_1_percent_of_the_baseline(base, model):
    section = _judge(base, {"memory": memory.measure(Run(models=(model,)))})["memory"]
    assert section.ok, render([section])


# -- each check fails, naming both numbers --------------------------------------------------------


@pytest.mark.smoke
def test_a_kept_gradient_exceeds_the_memory_baseline_naming_both_numbers(base):
    with inject("keeps_gradients_alive"):
        now = memory.measure(Run(models=("transformer",)))
    section = _judge(base, {"memory": now})["memory"]
    failed = {cells[0]: cells[-1] for cells, ok in section.rows if not ok}
    assert "transformer/in_backward" in failed and "transformer/foreach" not in failed
    recorded = base["memory"]["transformer/in_backward"]["peak"]
    peak = now["transformer/in_backward"]["peak"]
    # Both numbers, as the report prints them (each in its unit, 4 digits), and by how much.
    assert (f"peak {format_bytes(peak, 4)} > recorded {format_bytes(recorded, 4)} "
            f"({peak / recorded - 1:+.1%})") in failed["transformer/in_backward"]
    assert re.search(r"peak \d\d\.\d\d MB > recorded \d\d\.\d\d MB", failed[
        "transformer/in_backward"])  # ~52 MB: MB, 4 digits


def test_changed_optimizer_arithmetic_fails_the_trajectories_it_touches(base):
    with inject("optimizer_arithmetic_changed"):
        now = numerics.measure(Run())
    rows = {cells[0]: (ok, cells[-1]) for cells, ok in _judge(base, {"numerics": now})[
        "numerics"].rows}
    assert {k for k, (ok, _) in rows.items() if not ok} == {
        f"{family}/{strategy}" for family in ("adam", "adam_amsgrad", "adamw")
        for strategy in numerics.TRAJECTORY_STRATEGIES}
    assert "x of tolerance" in rows["adam/forloop"][1]


def test_a_last_bit_change_is_reported_and_passes_a_larger_one_fails(base):
    key = "sgd/forloop"
    stored = base["numerics"][key]
    name = next(iter(stored["final"]))
    for nudge, passes in ((1, True), (10_000, False)):
        now = json.loads(json.dumps(stored))
        value = torch.tensor(now["final"][name]["values"][0], dtype=torch.float32)
        for _ in range(nudge):  # nudge ulps up
            value = torch.nextafter(value, torch.tensor(float("inf")))
        now["final"][name]["values"][0] = value.item()
        now["sha256"] = "0" * 64
        (cells, ok), = _judge(base, {"numerics": {key: now}})["numerics"].rows
        assert bool(ok) is passes, cells
        assert cells[-1].startswith("CHANGED bits")


def test_a_changed_hook_outcome_fails(base):
    now = dict.fromkeys(base["hooks"]) | {"removal": "the hook fired 2 times across a removal"}
    section = _judge(base, {"hooks": now})["hooks"]
    assert [cells[0] for cells, ok in section.rows if not ok] == ["removal"]


@pytest.mark.parametrize("key", list(step_time.TIME_TARGETS))
def test_time_ratio_fails_only_past_its_slack(base, key):
    # Every ratio the time section measures has a recorded value (else its row fails with "no
    # baseline recorded"), and each fails just past the slack, only there.
    recorded = base["time"][key]
    within = _judge(base, {"time": {key: recorded * (1 + step_time.SLACK) * 0.99}})["time"]
    beyond = _judge(base, {"time": {key: recorded * (1 + step_time.SLACK) * 1.01}})["time"]
    assert within.ok and not beyond.ok
    assert "SLOWER" in beyond.rows[0][0][-1] and f"{recorded:.2f}x" in beyond.rows[0][0]


@pytest.mark.parametrize("again, holds", [
    # one disturbed measurement (another process slowed the step down), then an undisturbed one
    ((0.9,), True),
    # a step that really became slower is slow every time it is measured
    ((2.0, 2.1), False),
])
def test_a_slower_ratio_is_measured_again_before_it_fails(base, again, holds):
    key = "in_backward_grouped_vs_foreach"
    recorded = base["time"][key]
    first = recorded * (1 + step_time.SLACK) * 2
    fresh = iter(again)
    asked = []

    def measure_again(keys):
        asked.append(keys)
        return {key: recorded * (1 + step_time.SLACK) * next(fresh)}

    now = step_time.confirm(base["time"], {key: first, "capture_stats_vs_plain":
                                           base["time"]["capture_stats_vs_plain"]},
                            step_time.SLACK, again=measure_again)
    assert asked == [{key}] * len(again)  # only the slower ratio, until it holds
    section = _judge(base, {"time": now})["time"]
    assert section.ok is holds
    (cells, _), = [row for row in section.rows if row[0][0] == key]
    assert f"lowest of {1 + len(again)} measurements ({first:.2f}x" in cells[-1]
    assert ("SLOWER" in cells[-1]) is not holds


def test_missing_baseline_entries_fail(base):
    sections = _judge({"recorded_with": base["recorded_with"]},
                      {"memory": {"transformer/foreach": base["memory"]["transformer/foreach"]},
                       "numerics": {"sgd/forloop": base["numerics"]["sgd/forloop"]}})
    assert not sections["memory"].ok and not sections["numerics"].ok
    assert "no baseline recorded" in sections["memory"].rows[0][0][-1]


# -- a verdict has one meaning: only a declared prerequisite skips ---------------------------------


def test_a_private_module_that_stops_importing_fails_naming_it(base):
    with inject("private_module_missing"):
        now = memory.measure(Run(models=("transformer",)))
    section = _judge(base, {"memory": now})["memory"]
    failed = {cells[0]: cells[-1] for cells, ok in section.rows if not ok}
    assert set(failed) == {"transformer/zero2"}  # the one measurement that imports it
    assert failed["transformer/zero2"].startswith("FAILED: ModuleNotFoundError")
    assert "torch.testing._internal.distributed.fake_pg" in failed["transformer/zero2"]
    assert section.skipped == 0


def test_gate_with_a_private_import_blocked_exits_1_naming_the_module(capsys):
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "memory", "--models",
                 "transformer", "--fault", "private_module_missing"]) == 1
    out = capsys.readouterr().out
    assert ("! transformer/zero2" in out and "FAILED: ModuleNotFoundError: import of "
            "torch.testing._internal.distributed.fake_pg halted" in out)
    assert "GATE FAILED in memory" in out and "SKIPPED" not in out


def test_a_measurement_that_raises_fails_and_is_named(base):
    with inject("private_api_changed"):
        now = memory.measure(Run(models=("transformer",)))
    section = _judge(base, {"memory": now})["memory"]
    assert not section.ok and section.skipped == 0
    for cells, ok in section.rows:
        assert not ok and "TypeError" in cells[-1] and "shape_env" in cells[-1], cells


def test_a_missing_prerequisite_skips_and_says_which(base):
    from hookbench.core.prerequisites import MissingPrerequisite

    def needs() -> dict:
        raise MissingPrerequisite("fused CPU Adam needs torch >= 2.4; this is 2.3.1")

    def broken() -> dict:
        raise ImportError("cannot import name 'FakeStore'")

    now = {"transformer/foreach": attempt(needs),
           "transformer/forloop": attempt(broken)}
    section = _judge(base, {"memory": now})["memory"]
    (skip_cells, skipped), (fail_cells, failed) = section.rows
    assert skipped and skipped.name == "SKIPPED" and section.skipped == 1
    assert skip_cells[-1] == "SKIPPED: fused CPU Adam needs torch >= 2.4; this is 2.3.1"
    assert not failed and fail_cells[-1] == "FAILED: ImportError: cannot import name 'FakeStore'"
    assert "1 SKIPPED for a missing prerequisite" in render([section])


def test_a_section_that_crashes_is_one_failed_row_not_a_crash(base):
    crashed = launch_error = RuntimeError("rank 1 of 2 exited with code -6")
    now = gate.measure_all(("hooks", "zero2"), zero2_ranks=crashed)
    sections = _judge(base, now)
    assert sections["hooks"].ok
    (cells, ok), = sections["zero2"].rows
    assert not ok and cells[-1] == f"FAILED: RuntimeError: {launch_error}"
    assert gate.failures(now) == [f"zero2: RuntimeError: {crashed}"]


def test_each_section_is_one_module_of_the_registry(monkeypatch):
    assert tuple(gate.REGISTRY) == names.GATE_SECTIONS  # what the command line offers
    for module in gate.REGISTRY.values():
        assert module.__name__.startswith("hookbench.gate.") and callable(module.judge)
        assert module.measure is None or callable(module.measure)
        assert module.FAULTS is None or set(module.FAULTS) <= set(FAULTS), module.__name__
    # A new section is its module and its line in the registry: measured under the run's
    # fault, judged against its recorded rows, and a measurement that raises is one failed row.
    def judge(base, now, run):
        section = checks.Section("extra", ("row", "verdict"))
        for key, value in now.items():
            section.add(base.get(key) == value, key, str(value))
        return section

    extra = types.SimpleNamespace(measure=lambda run: {"fault": run.fault}, judge=judge,
                                  FAULTS=None)
    monkeypatch.setitem(gate.REGISTRY, "extra", extra)
    now = gate.measure_all(("extra",), fault="fires_twice")
    assert now["extra"] == {"fault": "fires_twice"}
    assert gate.check({"recorded_with": now["recorded_with"], "extra": {"fault": None}}, now,
                      parity=False)["extra"].rows == [(("fault", "fires_twice"), Verdict.FAIL)]
    monkeypatch.setattr(extra, "measure", lambda run: 1 / 0)
    now = gate.measure_all(("extra",))
    (cells, verdict), = gate.check(now, now, parity=False)["extra"].rows
    assert not verdict and cells == ("extra", "FAILED: ZeroDivisionError: division by zero")


def test_selfcheck_runs_only_the_faults_the_chosen_sections_target(monkeypatch):
    # A section that catches its one fault: selfcheck on it alone runs the clean gate and that
    # fault, not the 24 others (which no chosen section targets, so would read as MISSED).
    def judge(base, now, run):
        section = checks.Section("extra", ("row", "verdict"))
        section.add(now == {"fault": None}, "row", str(now))
        return section

    extra = types.SimpleNamespace(measure=lambda run: {"fault": run.fault}, judge=judge,
                                  FAULTS=("fires_twice",))
    monkeypatch.setitem(gate.REGISTRY, "extra", extra)
    base = gate.measure_all(("extra",))
    assert gate.selfcheck(base, ("extra",)) == {
        None: {}, "fires_twice": {"extra": {"row": "{'fault': 'fires_twice'}"}}}
    # A section that every fault reaches (FAULTS None) brings the whole catalogue back, but
    # the DeepSpeed row's faults: the gate has no DeepSpeed row (the peers tier catches them)
    monkeypatch.setattr(extra, "FAULTS", None)
    caught = gate.selfcheck(base, ("extra",))
    run = [f for f in FAULTS if f not in (*names.PEER_FAULTS, *names.DRAW_FAULTS)]
    assert list(caught) == [None, *run] and all(caught[f] for f in run)


def test_a_tracker_that_misses_allocations_fails_on_the_drop(base):
    with inject("tracker_misses_allocations"):
        now = memory.measure(Run(models=("transformer",)))
    section = _judge(base, {"memory": now})["memory"]
    failed = {cells[0]: cells[-1] for cells, ok in section.rows if not ok}
    # A standard step peaks in the optimizer step, after the activations are gone, so its
    # peak cannot see them; the in-backward and ZeRO-2 steps peak with them alive.
    assert set(failed) == {f"transformer/{s}" for s in
                           ("in_backward", "in_backward_grouped_foreach", "zero2")}
    for verdict in failed.values():
        # The drop is named (ZeRO-2's missed activations may also shift its temporaries up).
        assert "DROPPED" in verdict and "re-record on purpose" in verdict
        assert "activations" in verdict.split("DROPPED")[1]


def test_memory_fails_below_and_above_the_slack_in_both_directions(base):
    key = "transformer/foreach"
    rec = base["memory"][key]
    for factor, passes in ((1 - bounds.MEMORY_SLACK * 1.5, False), (1 - bounds.MEMORY_SLACK / 2, True),
                           (1 + bounds.MEMORY_SLACK / 2, True), (1 + bounds.MEMORY_SLACK * 1.5, False)):
        now = json.loads(json.dumps(rec))
        now["peak"] = round(rec["peak"] * factor)
        (cells, ok), = _judge(base, {"memory": {key: now}})["memory"].rows
        assert bool(ok) is passes, (factor, cells)
        if not passes:
            assert ("DROPPED" if factor < 1 else "EXCEEDED") in cells[-1]


def test_a_change_within_the_slack_prints_two_different_amounts(base):
    # 512 B on a 68.76 MB peak: 4 digits would print both alike; the row gets the digits that
    # tell them apart, and an unchanged row keeps 4 (issue 26: each amount in its own unit).
    key = "transformer/foreach"
    rec = base["memory"][key]
    now = {**json.loads(json.dumps(rec)), "peak": rec["peak"] + 512}
    (cells, ok), = _judge(base, {"memory": {key: now}})["memory"].rows
    assert ok and cells[-1] == "changed: peak"
    assert cells[1] != cells[2] and cells[1].endswith(" MB") and cells[2].endswith(" MB")
    for printed, exact in zip(cells[1:3], (rec["peak"], now["peak"])):  # each to its last digit
        number = printed.split()[0]
        assert abs(float(number) - exact / 1e6) <= 0.5 * 10.0 ** -len(number.split(".")[1])
    (cells, ok), = _judge(base, {"memory": {key: rec}})["memory"].rows
    assert cells[1] == cells[2] == format_bytes(rec["peak"], 4)
    assert memory.amounts(68_757_504, 68_758_016) == ("68.7575 MB", "68.7580 MB")
    assert memory.amounts(999, 1_000, 6_088_090_112) == ("999 B", "1.000 KB", "6.088 GB")


@pytest.mark.parametrize("text, message", [
    ("", "not a readable baseline"),
    ('{"recorded_with": {"torch": "2.14.1"', "not a readable baseline"),
    ("[]", "not a hookbench baseline"),
    ('{"hooks": {}}', "not a hookbench baseline"),
    ('{"recorded_with": {"torch": "2.14.1", "cpu_capability": "AVX2"}, "memory": 3}',
     "sections ['memory'] are not tables"),
    # a schema this hookbench does not read: refused, never compared as if it were its own
    ('{"recorded_with": {"torch": "2.14.1", "cpu_capability": "AVX2", "schema": 3, '
     '"hookbench": "9.0"}, "memory": {}}',
     "a baseline of hookbench's schema 3 (written by hookbench 9.0); this hookbench reads "
     "schema 2 and older"),
])
def test_a_corrupt_baseline_is_one_line_naming_the_file_and_exit_2(tmp_path, capsys, text,
                                                                    message):
    bad = tmp_path / "gate.json"
    bad.write_text(text)
    for command in ("gate", "selfcheck"):
        assert main([command, "--baseline", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(bad) in err[0] and message in err[0], err
    assert bad.read_text() == text


def test_record_writes_a_failure_as_known_and_the_gate_compares_it_like_with_like(
        tmp_path, capsys, monkeypatch):
    # On a torch with a real bug nothing could be recorded, and nothing gated: the failing row
    # is written with its words, and a later torch is held to the same failure.
    target = tmp_path / "gate.json"
    argv = ["--baseline", str(target), "--sections", "memory", "--models", "transformer"]
    monkeypatch.chdir(tmp_path)  # a failed gate draws its rows into ./hookbench-out
    record = gate.record

    def broken(*args, **kwargs):
        with inject("private_module_missing"):
            return record(*args, **kwargs)

    monkeypatch.setattr(gate, "record", broken)
    assert main(["record", *argv]) == 0
    out = capsys.readouterr().out
    assert "1 known failures on this torch" in out and "memory/transformer/zero2: " in out
    known = json.loads(target.read_text())["known_failures"]
    assert list(known) == ["memory"] and list(known["memory"]) == ["transformer/zero2"]

    def row(out: str) -> str:
        return next(line for line in out.splitlines() if "transformer/zero2" in line)

    # the same failure: quiet
    assert main(["gate", *argv, "--fault", "private_module_missing"]) == 0
    assert "known failure, unchanged since the baseline" in row(capsys.readouterr().out)
    # fixed: holds, and said
    assert main(["gate", *argv]) == 0
    assert "FIXED since the baseline" in row(capsys.readouterr().out)
    # another failure of the same row than the one recorded: reported, and the gate fails
    data = json.loads(target.read_text())
    data["known_failures"]["memory"]["transformer/zero2"] = "ValueError: another failure"
    target.write_text(json.dumps(data))
    assert main(["gate", *argv, "--fault", "private_module_missing"]) == 1
    assert row(capsys.readouterr().out).startswith("! transformer/zero2")


def test_a_collectives_wrong_result_is_a_known_failure():
    # gloo's reduce-scatter on torch 2.4.1: a row of outcome words, not a dict
    wrong = "WRONG: rank 0 holds [3.0, 6.0, 9.0], expected [2.0, 4.0, 6.0]"
    assert known_failures.of({"collectives": {"2 ranks/reduce_scatter_tensor/MAX": wrong,
                                              "2 ranks/all_reduce/SUM": "correct"}}) == {
        "collectives": {"2 ranks/reduce_scatter_tensor/MAX": wrong}}


def test_a_known_failure_is_the_same_one_numbers_aside():
    was = "vs DDP: MISMATCH max |diff| 5.44e-07 at step 0, conv_in.weight"
    assert known_failures.same(was, was.replace("5.44e-07", "6.1e-07").replace("0,", "2,"))
    assert not known_failures.same(was, was.replace("conv_in", "conv_out"))
    assert known_failures.same(was, was.replace("5.44e-07", "inf"))
    # pytorch#143580's assert as 2.14.1's build and 2.9.1's name it: the same failure
    a, b = (f'rank 0: RuntimeError: expect_autograd_hooks_ INTERNAL ASSERT FAILED at '
            f'"{tree}torch/csrc/distributed/c10d/reducer.cpp":{line}, please report a bug to '
            f'PyTorch.' for tree, line in (("/__w/pytorch/pytorch/", 1732), ("/pytorch/", 1634)))
    assert known_failures.same(a, b)
    assert known_failures.same(a, b.replace('"/pytorch/torch', '"../torch'))  # 2.5.1's build
    assert not known_failures.same(a, b.replace("reducer.cpp", "logger.cpp"))
    rows = known_failures.judge({"a": was, "b": was, "c": was, "d": was},
                                {"a": {"problems": [was.replace("5.44", "3.2")]},
                                 "b": {"problems": []}, "c": {"error": "ValueError: no"}})
    assert [(key, ok) for key, ok, _ in rows] == [("a", True), ("b", True), ("c", False),
                                                  ("d", False)]


@pytest.mark.parametrize("argv, message", [
    (["record", "--baseline", "{dir}"], "--baseline {dir}: is a folder, not a file"),
    (["report", "--out", "{file}"], "--out {file}: exists and is not a folder"),
    # /sys: read-only even for root (CI runs as root, where permission bits stop nothing).
    (["report", "--out", "/sys/hookbench-test"], "--out /sys/hookbench-test: cannot write there"),
    (["record", "--baseline", "/sys/hookbench/gate.json"], "--baseline /sys/hookbench: cannot "
                                                            "write there"),
    (["coord-check", "--out", "{file}"], "--out {file}: exists and is not a folder"),
    (["zero2", "--bucket-numel", "0"], "--bucket-numel must be >= 1"),
    (["gate", "--baseline", str(BASELINE), "--models", "resnet19"], "unknown models ['resnet19']"),
])
def test_bad_input_is_one_line_and_exit_2_before_measuring(tmp_path, capsys, argv, message):
    file = tmp_path / "file"
    file.write_text("keep")
    names = {"dir": tmp_path, "file": file}
    with pytest.raises(SystemExit) as exit_:  # argparse's errors exit; the others return 2
        sys.exit(main([a.format(**names) for a in argv]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(**names) in err[0], err
    assert file.read_text() == "keep" and sorted(tmp_path.iterdir()) == [file]


# -- recording is explicit; the command line -------------------------------------------------------


def test_gate_never_writes_the_baseline_and_record_writes_where_told(tmp_path, capsys):
    before = BASELINE.read_bytes()
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "hooks"]) == 0
    assert "GATE PASSED" in capsys.readouterr().out
    assert BASELINE.read_bytes() == before
    fresh = tmp_path / "gate.json"
    assert main(["record", "--baseline", str(fresh), "--sections", "hooks,numerics"]) == 0
    assert set(json.loads(fresh.read_text())) == {"recorded_with", "hooks", "numerics"}
    assert fresh.stat().st_mode & 0o777 == 0o644  # readable by the team, not mkstemp's 0600
    fresh.chmod(0o664)  # and recorded again, the mode the team gave it stays
    assert main(["record", "--baseline", str(fresh), "--sections", "hooks"]) == 0
    assert fresh.stat().st_mode & 0o777 == 0o664
    assert main(["gate", "--baseline", str(fresh), "--sections", "hooks"]) == 0


def test_gate_exits_1_on_a_regression(capsys):
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "numerics",
                 "--fault", "optimizer_arithmetic_changed"]) == 1
    assert "GATE FAILED in numerics" in capsys.readouterr().out


def test_gate_parity_compares_each_implementation_with_the_forloop_and_fails_a_broken_kernel(
        monkeypatch, capsys):
    # Live rows, recorded nowhere: a foreach Adam kernel whose updates come out 0.1% larger
    # fails exactly the foreach rows of Adam and AdamW, in both dtypes, and every other row
    # holds. The optimizer-in-backward rows (checks) are left out here, for time.
    monkeypatch.setattr(checks, "optimizer_in_backward_section", lambda: checks.Section(
        "in backward", ("family", "comparison", "verdict")))
    adam = importlib.import_module("torch.optim.adam")  # torch.optim deletes the name
    kernel = adam._multi_tensor_adam
    monkeypatch.setattr(adam, "_multi_tensor_adam",
                        lambda *args, lr, **kwargs: kernel(*args, lr=lr * 1.001, **kwargs))
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "parity"]) == 1
    out = capsys.readouterr().out
    rows = [(line[0], *line[2:].split(maxsplit=1)) for line in out.splitlines()
            if " step vs for-loop step" in line]  # mark, case, comparison and verdict
    capturable = [f for f, (cls, _) in FAMILIES.items() if accepts(cls, "capturable")]
    assert len(rows) == (len(IMPLEMENTATION_CASES) * 2 * len(parity.IMPLEMENTATION_DTYPES)
                         + len(capturable))
    assert {(case, rest.split("  ")[0]) for mark, case, rest in rows if mark == "!"} == {
        (case, f"foreach step vs for-loop step{dtype}") for case in IMPLEMENTATION_CASES
        if case.startswith("adam") for dtype in ("", ", float64")}, out
    assert "GATE FAILED in parity" in out


def test_gate_without_a_baseline_says_how_to_record_one(tmp_path, capsys):
    assert main(["gate", "--baseline", str(tmp_path / "none.json")]) == 2
    assert "hookbench record" in capsys.readouterr().err


def test_unknown_section_is_refused(capsys):
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "hooks,speed"]) == 2
    assert "unknown gate sections ['speed']" in capsys.readouterr().err


# -- the gate's power ------------------------------------------------------------------------------

# Which sections must catch each fault. Parity is absent from optimizer_arithmetic_changed on
# purpose: both sides change alike, and only the stored baseline sees it.
CAUGHT_BY = {
    "fires_twice": {"hooks", "parity", "numerics", "zero2", "engines"},
    "stops_after_first_backward": {"hooks", "parity", "numerics", "zero2"},
    "never_fires": {"hooks", "parity", "numerics", "zero2"},
    "fires_before_accumulation": {"hooks", "numerics", "zero2", "memory"},
    "keeps_gradients_alive": {"hooks", "memory"},
    "fires_late": {"hooks", "memory"},
    "removal_does_nothing": {"hooks"},
    "optimizer_arithmetic_changed": {"numerics", "zero2"},
    "collective_wrong_slice": {"zero2"},
    "collective_low_precision": {"zero2"},
    "private_module_missing": {"memory"},
    "private_api_changed": {"memory"},
    "tracker_misses_allocations": {"memory"},
    "reduce_scatter_ignores_op": {"collectives"},
    "step_dtype_changed": {"checkpoints"},
    "checkpoint_key_renamed": {"checkpoints"},
    "compiled_module_skips_forward_hooks": {"compile"},
    "new_warning": {"warnings"},
    "pack_called_twice": {"offload"},
    "unpack_returns_stale": {"offload"},
    "offload_keeps_device_copy": {"offload"},
    "compression_on_exact_tensor": {"offload"},
    "fsdp2_forgets_shard_hooks": {"engines"},
    "reduce_scatter_wrong_slice": {"engines"},
    "ddp_bucket_reduced_twice": {"engines"},
    "ddp_drops_settings": {"engines"},
    "ddp_ignores_comm_hook": {"engines"},
    "deepspeed_drops_settings": set(),  # the DeepSpeed row is outside the gate (PEER_FAULTS)
    "fsdp2_drops_settings": {"engines"},
    "fsdp2_reduces_in_bf16": {"engines"},
    "implementation_flag_ignored": {"parity", "numerics"},
    "capturable_ignored": {"parity"},
    "kernel_ignores_maximize": {"parity"},
    "fused_sgd_skips_low_precision": {"parity"},
    "checkpoint_forgets_rng_state": {"offload"},
    # a workload's draws row (DRAW_FAULTS): the zoo's gate replays no draws
    "dropout_drops_half": set(),
    "dropout_ignores_seed": set(),
}


def test_the_expectations_cover_the_catalogue():
    assert set(CAUGHT_BY) == set(FAULTS)


@pytest.mark.slow
@pytest.mark.distributed
def test_selfcheck_catches_every_fault_and_passes_clean(tmp_path):
    # In a subprocess: a fault that leaves hooks registered (removal_does_nothing) must not
    # meet this process's leak guard, and the command itself is what users run. ~1 min.
    out, baseline = tmp_path / "selfcheck.json", BASELINE
    if baselines.load(BASELINE)["recorded_with"]["torch"] != torch.__version__:
        # Another torch than the baseline's (tox -e torch24 ...): its real differences (the
        # docs/releases.md) would fail the clean run, so the gate's power is shown against a
        # baseline recorded on this torch. ~2 min more. On CPU ranks of 2.4.1 to 2.8.0 record
        # refuses, as it must: FSDP2's engine rows fail there (docs/releases.md, engines).
        baseline = tmp_path / "gate.json"
        assert main(["record", "--baseline", str(baseline), "--models", "transformer",
                     "--sections", ",".join(s for s in gate.SECTIONS if s != "time")]) == 0
    proc = subprocess.run(
        [sys.executable, "-m", "hookbench", "selfcheck", "--baseline", str(baseline),
         "--models", "transformer", "--json", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    # A pair a torch computes wrongly fails whatever was recorded: gloo's reduce_scatter ignores
    # op before 2.9 (docs/releases.md), so a clean gate there fails on exactly those rows.
    wrong = {k for k, v in baselines.load(baseline)["collectives"].items()
             if v.startswith("WRONG")}
    assert proc.returncode == (1 if wrong else 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    caught = json.loads(out.read_text())
    clean = {section: set(rows) for section, rows in caught.pop("None").items()}
    assert clean == ({"collectives": wrong} if wrong else {})
    elsewhere = (*names.PEER_FAULTS, *names.DRAW_FAULTS)  # the peers tier, the draws tests
    for fault, sections in CAUGHT_BY.items():
        assert fault in elsewhere or sections <= set(caught[fault]), (fault, caught)
    assert not set(caught) & set(elsewhere)
    assert "parity" not in caught["optimizer_arithmetic_changed"]
    # each caught fault's failed rows say where it struck, and the first one is printed
    assert all(words for f in caught for rows in caught[f].values() for words in rows.values())
    assert proc.stdout.count("  struck ") == len(caught)
    run = len(FAULTS) - len(elsewhere)
    assert f"{run} of {run} faults caught ({len(elsewhere)} more target none of these " \
           f"sections); " + (
        "the CLEAN RUN FAILS" if wrong else "the clean run passes") in proc.stdout



def test_a_baseline_says_which_hookbench_wrote_it_and_an_older_schema_is_migrated(tmp_path):
    import importlib.metadata

    recorded = gate.measure_all(("hooks",))["recorded_with"]
    assert recorded["schema"] == baselines.SCHEMA == 2
    assert recorded["hookbench"] == importlib.metadata.version("hookbench")
    assert recorded["threads"] == torch.get_num_threads()
    # schema 1 (no number): read as schema 2, what it did not record unknown, rows as stored
    old = tmp_path / "gate.json"
    old.write_text(json.dumps({"recorded_with": {"torch": "2.14.1", "cpu_capability": "AVX2"},
                               "hooks": {"a": None}}))
    data = baselines.load(old)
    assert data["recorded_with"] == {"torch": "2.14.1", "cpu_capability": "AVX2", "schema": 2,
                                     "hookbench": None, "threads": None}
    assert data["hooks"] == {"a": None}
    # which hookbench wrote it does not change the arithmetic; other threads do
    here = baselines.environment()
    assert baselines.same_kernels({**here, "hookbench": "0.0.1"}, here)
    assert baselines.same_kernels({**here, "threads": None}, here)
    assert not baselines.same_kernels({**here, "threads": here["threads"] + 1}, here)


def test_other_threads_are_named_where_the_bits_changed(base):
    # torch's intra-op threads split fp32 sums as another CPU does: a changed row says so
    key, rec = next((k, v) for k, v in base["numerics"].items() if "sha256" in v)
    changed = {**rec, "sha256": "0" * 64}
    now = {"recorded_with": {**base["recorded_with"], "threads": 7}, "numerics": {key: changed}}
    then = {**base, "recorded_with": {**base["recorded_with"], "threads": 2}}
    (cells, ok), = gate.check(then, now, parity=False)["numerics"].rows
    assert ok and "recorded on 2 threads, this run has 7" in cells[-1], cells


def test_a_change_toward_the_contract_is_a_fix_and_away_from_it_a_failure():
    # hooks' contract and compile's checks: violated -> holds passes, saying FIXED; the
    # other way round fails (the regression the gate is for)
    from hookbench.gate import compiled_hooks

    fixed = checks.contract_rows("t", {"c": "RuntimeError: fired twice"}, {"c": None})
    broken = checks.contract_rows("t", {"c": None}, {"c": "RuntimeError: fired twice"})
    assert fixed.ok and "FIXED since the baseline" in fixed.rows[0][0][-1]
    assert not broken.ok and "VIOLATED" in broken.rows[0][0][-1]
    fixed = compiled_hooks.judge({"inductor/x": "differs: 2 calls"}, {"inductor/x": None}, Run())
    broken = compiled_hooks.judge({"inductor/x": None}, {"inductor/x": "differs: 2 calls"}, Run())
    assert fixed.ok and fixed.rows[0][0][-1].startswith("FIXED since the baseline: equal to eager")
    assert not broken.ok


def test_another_difference_from_eager_is_judged_difference_by_difference():
    # recorded on 2.4.1, gated on 2.9.1 (docs/releases.md): per-module hooks that did not fire
    # under compile now do (gone: a fix), torch now warns about global hooks (a warning, not
    # a hook's calls), and a hook added after compiling stopped firing (changed: a failure)
    from hookbench.gate import compiled_hooks

    def judged(recorded: str, now: str) -> tuple[bool, str]:
        (cells, ok), = compiled_hooks.judge({"eager/x": recorded}, {"eager/x": now}, Run()).rows
        return bool(ok), cells[-1]

    wrapper = "fwd <OptimizedModule>: compiled 2, eager absent"
    recorded = f"fwd 0: compiled absent, eager 2; {wrapper}"
    ok, words = judged(recorded, wrapper)
    assert ok and words.startswith("FIXED in part since the baseline: 1 of 2 recorded "
                                   "differences from eager gone; gone, as in eager: fwd 0"), words
    ok, words = judged(recorded, f"{compiled_hooks.WARNED}: compiled True, eager False; {wrapper}")
    assert ok and f"now warned: {compiled_hooks.WARNED}" in words, words
    ok, words = judged(recorded, f"fwd 0: compiled 1, eager 2; {wrapper}")
    assert not ok and ("changed: fwd 0: compiled 1, eager 2 (recorded: compiled absent, "
                       "eager 2)") in words, words
    ok, words = judged(wrapper, f"{wrapper}; backward 1: compiled 'b a', eager 'a b'")
    assert not ok and "new: backward 1: compiled 'b a', eager 'a b'" in words, words
    ok, words = judged(wrapper, "raised RuntimeError: gone wrong")  # not a list: all changed
    assert not ok and "new: raised RuntimeError: gone wrong" in words, words
    assert compiled_hooks.differences(None) == {}
