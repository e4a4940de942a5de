"""The command line: `hookbench report` prints every check, writes its PNG and JSON, and fails
when a check fails."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hookbench.cli import main
from hookbench.faults import inject
from hookbench.parity import FAMILIES
from hookbench.report import MEMORY_STRATEGIES

# The small transformer keeps the memory section to about a second per strategy.
ARGS = ["report", "--model", "transformer", "--device", "fake"]


def test_report_prints_writes_and_passes(capsys, tmp_path):
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert f"torch {torch.__version__}" in out
    for family in FAMILIES:
        assert f"{family} " in out
    assert "bit-exact" in out and "FAILED" not in out
    assert "Peak memory of one training step (transformer, batch 1, Adam, backend fake" in out
    assert "measuring transformer batch 1, in_backward" in captured.err  # progress
    assert (tmp_path / "memory.png").read_bytes().startswith(b"\x89PNG")
    data = json.loads((tmp_path / "report.json").read_text())
    assert [m["strategy"] for m in data["memory"]] == list(MEMORY_STRATEGIES)
    by = {m["strategy"]: m for m in data["memory"]}
    assert by["in_backward"]["peak"] < by["foreach"]["peak"]
    assert all(c["ok"] for c in data["checks"])


def test_report_exits_non_zero_when_a_check_fails(capsys, tmp_path):
    with inject("stops_after_first_backward"):
        assert main([*ARGS, "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "VIOLATED" in out and "FAILED (marked !)" in out


def test_report_refuses_a_cuda_measurement_without_cuda(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    assert main([*ARGS[:3], "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "the cuda backend needs CUDA" in capsys.readouterr().err


def test_bad_arguments_are_refused(capsys):
    for argv in ([*ARGS, "--batch-size", "0"], ["report", "--model", "vgg"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-size must be >= 1" in err and "invalid choice: 'vgg'" in err


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "hookbench"  # installed beside this interpreter
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "report" in proc.stdout
