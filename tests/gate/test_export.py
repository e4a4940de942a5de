"""The verdicts as files for CI (``hookbench.gate.export``): JUnit XML valid against the schema
CI tools read (tests/gate/junit.xsd), a failed row a failure carrying its words, a SKIPPED row
skipped with its reason; JSON with every row; ``hookbench gate`` and ``report`` writing both,
the gate's figure of its failed memory rows, and bad paths refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import xmlschema

from hookbench.cli import main
from hookbench.cli.gate import failed_panels
from hookbench.gate import export
from hookbench.gate.checks import Section

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "baselines" / "gate.json"
SCHEMA = xmlschema.XMLSchema(Path(__file__).with_name("junit.xsd"))


def sections() -> dict[str, Section]:
    memory = Section("Peak memory", ("model/strategy", "recorded", "now", "verdict"))
    memory.add(True, "mlp/foreach", "1.0 KB", "1.0 KB", "identical")
    memory.add(False, "mlp/in_backward", "1.0 KB", "2.0 KB", "EXCEEDED: peak 2.0 KB > 1.0 KB")
    memory.skip("diffusers is not installed (the unet extra)", "unet/foreach", "", "")
    hooks = Section("Hook contract", ("check", "verdict"))
    hooks.add(True, "leaf_only", "holds")
    return {"memory": memory, "hooks": hooks}


def test_junit_has_a_suite_per_section_and_a_case_per_row_valid_against_the_schema(tmp_path):
    path = export.write_junit(tmp_path / "gate.xml", "hookbench gate", sections(), 1.5,
                              baseline_torch="2.14.1")
    SCHEMA.validate(str(path))
    root = ET.parse(path).getroot()
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("4", "1", "0")
    memory, hooks = root.findall("testsuite")
    assert (memory.get("name"), memory.get("tests"), memory.get("failures"),
            memory.get("skipped")) == ("memory", "3", "1", "1")
    assert hooks.get("failures") == "0" and hooks.get("skipped") == "0"
    cases = {c.get("name"): c for c in memory.findall("testcase")}
    assert list(cases) == ["mlp/foreach", "mlp/in_backward", "unet/foreach"]
    assert len(cases["mlp/foreach"]) == 0  # passed: nothing inside
    failure = cases["mlp/in_backward"].find("failure")
    assert failure.get("message") == ("recorded 1.0 KB; now 2.0 KB: "
                                      "EXCEEDED: peak 2.0 KB > 1.0 KB")
    assert "model/strategy: mlp/in_backward" in failure.text
    assert cases["unet/foreach"].find("skipped").get("message") == (
        "diffusers is not installed (the unet extra)")
    assert cases["mlp/foreach"].get("classname") == "hookbench.gate.memory"
    properties = {p.get("name"): p.get("value") for p in memory.iter("property")}
    assert properties["baseline_torch"] == "2.14.1" and properties["title"] == "Peak memory"


def test_json_has_every_row_with_its_recorded_and_new_measurement(tmp_path):
    base = {"memory": {"mlp/in_backward": {"peak": 1024, "final": {"w": [1.0] * 10}}}}
    now = {"memory": {"mlp/in_backward": {"peak": 2048, "final": {"w": [2.0] * 10}}}}
    data = json.loads(export.write_json(tmp_path / "gate.json", "hookbench gate", sections(),
                                        base, now).read_text())
    assert data["ok"] is False and data["command"] == "hookbench gate"
    rows = {(r["section"], r["name"]): r for r in data["rows"]}
    assert len(rows) == 4
    failed = rows["memory", "mlp/in_backward"]
    assert (failed["verdict"], failed["recorded"], failed["now"]) == (
        "fail", {"peak": 1024}, {"peak": 2048})  # final parameters: in the baseline file
    assert failed["detail"] == "EXCEEDED: peak 2.0 KB > 1.0 KB"
    assert failed["cells"]["now"] == "2.0 KB"
    assert rows["memory", "unet/foreach"]["verdict"] == "skipped"
    assert rows["hooks", "leaf_only"] == {
        "section": "hooks", "title": "Hook contract", "name": "leaf_only", "verdict": "pass",
        "recorded": None, "now": None, "detail": "holds",
        "cells": {"check": "leaf_only", "verdict": "holds"}}


@pytest.mark.parametrize("broken, why", [
    (lambda root: root.find("testsuite").attrib.pop("tests"), "a suite without its count"),
    (lambda root: root.set("skipped", "1"), "a count the schema has not on <testsuites>"),
    (lambda root: root.find("testsuite").set("failures", "one"), "a count that is no number"),
    (lambda root: root.find("testsuite/testcase").attrib.pop("name"), "a case without a name"),
    (lambda root: ET.SubElement(root.find("testsuite/testcase"), "failed"), "no such outcome"),
])
def test_the_schema_rejects_what_ci_tools_cannot_read(tmp_path, broken, why):
    path = export.write_junit(tmp_path / "gate.xml", "hookbench gate", sections(), 1.5)
    tree = ET.parse(path)
    broken(tree.getroot())
    tree.write(path)
    assert not SCHEMA.is_valid(str(path)), why


def test_the_schema_accepts_the_junit_xml_pytest_writes(tmp_path):
    """The schema is the format CI tools read: what pytest's own --junit-xml writes for a
    passed, a failed and a skipped test (the file every CI already ingests) is valid."""
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_passes():\n    pass\n\ndef test_fails():\n    assert 0\n\n"
        "@pytest.mark.skip(reason='absent')\ndef test_skipped():\n    pass\n")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                    "no:hookbench.pytest_plugin", "--junit-xml", "pytest.xml",
                    "test_three.py"], cwd=tmp_path, capture_output=True, check=False)
    SCHEMA.validate(str(tmp_path / "pytest.xml"))
    assert ET.parse(tmp_path / "pytest.xml").getroot().find("testsuite").get("failures") == "1"


def test_the_gate_under_a_fault_writes_its_failed_rows_as_junit_failures(capsys, tmp_path):
    junit, rows = tmp_path / "gate.xml", tmp_path / "gate.json"
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "hooks,memory", "--models",
                 "transformer", "--fault", "keeps_gradients_alive", "--junit-xml", str(junit),
                 "--json", str(rows), "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    SCHEMA.validate(str(junit))
    printed_failed = {line.split()[1] for line in out.splitlines() if line.startswith("! ")}
    failures = {case.get("name") for case in ET.parse(junit).getroot().iter("testcase")
                if case.find("failure") is not None}
    assert failures == printed_failed and "free_grad_in_hook" in failures
    assert "transformer/in_backward" in failures
    data = json.loads(rows.read_text())
    assert {r["name"] for r in data["rows"] if r["verdict"] == "fail"} == failures
    row = next(r for r in data["rows"] if r["name"] == "transformer/in_backward")
    assert row["now"]["peak"] > row["recorded"]["peak"]
    # the failed memory rows, recorded against now
    assert (tmp_path / "gate-failed.png").read_bytes().startswith(b"\x89PNG")
    assert f"wrote {junit} and {rows} and {tmp_path / 'gate-failed.png'}" in out


def test_a_clean_gate_writes_passing_rows_and_no_figure(capsys, tmp_path):
    junit, stale = tmp_path / "gate.xml", tmp_path / "gate-failed.png"
    stale.write_bytes(b"\x89PNG an earlier gate's failed rows")
    assert main(["gate", "--baseline", str(BASELINE), "--sections", "hooks", "--junit-xml",
                 str(junit), "--out", str(tmp_path)]) == 0
    root = ET.parse(junit).getroot()
    assert root.get("failures") == "0" and int(root.get("tests")) > 5
    assert not stale.exists()
    assert f"removed {stale}: an earlier gate's failed rows" in capsys.readouterr().out


def test_failed_panels_show_the_peak_and_the_categories_that_moved():
    memory = Section("m", ("model/strategy", "recorded", "now", "verdict"))
    memory.add(False, "mlp/foreach", "", "", "EXCEEDED")
    memory.add(True, "mlp/forloop", "", "", "identical")  # passed: no panel
    times = Section("t", ("ratio", "recorded", "now", "verdict"))
    times.add(False, "capture_stats_vs_plain", "1.30x", "2.00x", "SLOWER")
    step = {"peak": 100, "breakdown": {"parameters": 40, "gradients": 60}}
    base = {"memory": {"mlp/foreach": step, "mlp/forloop": step},
            "time": {"capture_stats_vs_plain": 1.3}}
    now = {"memory": {"mlp/foreach": {"peak": 130, "breakdown": {"parameters": 40,
                                                                 "gradients": 90}},
                      "mlp/forloop": step}, "time": {"capture_stats_vs_plain": 2.0}}
    memory_panel, time_panel = failed_panels({"memory": memory, "time": times}, base, now,
                                             "fake", 0.5)
    assert memory_panel["bars"] == {"peak": (100, 130), "gradients": (60, 90)}  # bytes: B
    assert memory_panel["limits"]["peak"] == pytest.approx(101)  # the fake backend's 1%
    assert time_panel["bars"] == {"ratio": (1.3, 2.0)}
    assert time_panel["limits"] == {"ratio": pytest.approx(1.95)}  # --time-slack 0.5


def test_report_writes_both_files(capsys, tmp_path):
    junit, rows = tmp_path / "report.xml", tmp_path / "rows.json"
    assert main(["report", "--model", "transformer", "--sections", "contract", "--out",
                 str(tmp_path), "--junit-xml", str(junit), "--json", str(rows)]) == 0
    SCHEMA.validate(str(junit))
    assert [s.get("name") for s in ET.parse(junit).getroot()] == ["contract"]
    data = json.loads(rows.read_text())
    assert data["ok"] and data["model"] == "transformer" and len(data["rows"]) > 5


@pytest.mark.parametrize("option", ["--junit-xml", "--json"])
def test_an_unwritable_path_is_refused_before_anything_runs(capsys, tmp_path, option):
    (tmp_path / "taken").mkdir()
    for command in (["gate", "--baseline", str(BASELINE), "--sections", "hooks"],
                    ["report", "--sections", "contract", "--out", str(tmp_path)]):
        assert main([*command, option, str(tmp_path / "taken")]) == 2
        err = capsys.readouterr().err
        assert f"{option} {tmp_path / 'taken'}: is a folder, not a file" in err
        assert err.count("\n") == 1  # one line: refused before the progress of measuring
