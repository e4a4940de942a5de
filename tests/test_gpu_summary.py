""".ci/gpu's last step (.ci/gpu_summary.py): every number of the GPU tier in one file under
baselines/, one line per check, exit 1 when any failed. Fed here with what the tier's steps
write, made the same way: a real pytest run's JUnit XML (passed, failed, skipped, printed
peaks), the gate's own JSON rows, a pytest-benchmark file; and each way a check fails (a test,
a row, a step that ran past its budget) shown to fail the tier."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hookbench.gate.checks import Section
from hookbench.gate.export import write_json

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / ".ci" / "gpu_summary.py")
gpu_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_summary)

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0", "total_memory": 85_045_510_144,
          "torch": "2.14.1+cu130", "cuda": "13.0", "driver": "580.65.06"}
TESTS = '''
    import pytest

    def test_peaks():
        print("foreach: max_memory_allocated 6.103 GB")

    def test_offload():
        {body}

    def test_two_gpus():
        pytest.skip("needs 2 CUDA device(s), found 1")
'''


def tier(out: Path, *, test_fails: bool = False, row_fails: bool = False,
         step_exit: int = 0) -> Path:
    """An $OUT as .ci/gpu's steps leave it."""
    out.mkdir()
    (out / "device.json").write_text(json.dumps(DEVICE))
    (out / "steps.tsv").write_text(f"pytest-gpu\t{int(test_fails)}\t41\t210\n"
                                   f"report\t{step_exit}\t30\t75\n")
    module = out / "test_tier.py"
    module.write_text(textwrap.dedent(TESTS).format(
        body="assert 38e6 < 134e6, 'offload saved nothing'" if not test_fails
        else "assert 134e6 < 38e6, 'offload saved nothing'"))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(module),
                    f"--junitxml={out / 'pytest-gpu.xml'}", "-o", "junit_logging=system-out",
                    "-p", "no:randomly"], cwd=out, capture_output=True, timeout=120)
    section = Section("Memory on cuda", ("model/strategy", "recorded", "now", "verdict"))
    section.add(True, "transformer/foreach", "29.1 MB", "29.3 MB", "ok: 1.01x")
    section.add(not row_fails, "transformer/in_backward", "21.0 MB", "24.9 MB",
                "FAILED: 1.19x of the recorded peak" if row_fails else "ok: 1.00x")
    write_json(out / "gate-cuda.json", "gate", {"memory": section})
    bench = out / "benchmarks" / "Linux-CPython-3.11-64bit"
    bench.mkdir(parents=True)
    (bench / "0001_gpu.json").write_text(json.dumps({"benchmarks": [{
        "fullname": "tests/x.py::test_benchmark_whole_step[vit_l_16-cuda]", "group": "whole-step",
        "params": {"device": "cuda"}, "stats": {"min": 0.081, "max": 0.09, "mean": 0.084,
                                                "median": 0.083, "stddev": 0.002, "rounds": 12,
                                                "iterations": 1}}]}))
    return out


def summarize(out: Path, baselines: Path) -> tuple[int, str, dict]:
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "gpu_summary.py"), str(out),
                           str(baselines)], capture_output=True, text=True, timeout=60)
    path = baselines / "gpu" / "nvidia-h100-80gb-hbm3.json"
    return done.returncode, done.stdout, json.loads(path.read_text())


def test_every_number_goes_into_one_file_and_each_check_into_one_line(tmp_path):
    code, printed, data = summarize(tier(tmp_path / "out"), tmp_path / "baselines")
    assert code == 0, printed
    assert [p.name for p in (tmp_path / "baselines").rglob("*") if p.is_file()] == [
        "nvidia-h100-80gb-hbm3.json"]
    lines = printed.splitlines()
    assert lines[:2] == ["PASSED  step pytest-gpu: exit 0 in 41 s (budget 210 s)",
                         "PASSED  step report: exit 0 in 30 s (budget 75 s)"]
    assert any(l.startswith("PASSED  test_tier::test_peaks: ") for l in lines), printed
    assert "SKIPPED test_tier::test_two_gpus: " in printed and "found 1" in printed
    assert "PASSED  gate memory: transformer/in_backward: ok: 1.00x" in lines
    assert lines[-1].startswith("7 of 7 checks did not fail; every number: ")
    # the numbers: the device, the steps' seconds, what a test printed, a row's cells, a timing
    assert data["device"] == DEVICE
    assert data["steps"][0] == {"step": "pytest-gpu", "exit": 0, "seconds": 41, "budget_s": 210}
    peaks = next(t for t in data["tests"] if t["test"].endswith("test_peaks"))
    assert "max_memory_allocated 6.103 GB" in peaks["printed"]
    assert data["gate"]["rows"][1]["cells"]["now"] == "24.9 MB"
    assert data["benchmarks"][0]["stats"]["median"] == 0.083


@pytest.mark.parametrize("fault, failed", [
    ({"test_fails": True}, ["step pytest-gpu: exit 1", "test_tier::test_offload: ",
                            "offload saved nothing"]),
    ({"row_fails": True}, ["gate memory: transformer/in_backward: FAILED: 1.19x"]),
    ({"step_exit": 124}, ["step report: ran past its 75 s budget and was stopped"]),
    ({"step_exit": 137}, ["step report: ran past its 75 s budget and was stopped"]),
])
def test_each_way_a_check_fails_fails_the_tier(tmp_path, fault, failed):
    code, printed, data = summarize(tier(tmp_path / "out", **fault), tmp_path / "baselines")
    assert code == 1, printed
    failures = [line for line in printed.splitlines() if line.startswith("FAILED  ")]
    for words in failed:
        assert any(words in line for line in failures), printed
    assert len(data["checks"]) == 7 and printed.splitlines()[-1].startswith(
        f"{7 - len(failures)} of 7 checks did not fail")


def test_a_tier_that_ran_nothing_fails(tmp_path):
    (tmp_path / "out").mkdir()
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "gpu_summary.py"),
                           str(tmp_path / "out"), str(tmp_path / "b")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and "0 of 0 checks" in done.stdout
    assert (tmp_path / "b" / "gpu" / "unknown-gpu.json").exists()


def test_usage_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "gpu_summary.py")],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr.strip()) == (2, "usage: gpu_summary.py OUT BASELINES")
