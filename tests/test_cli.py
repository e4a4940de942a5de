"""The command line: `hookbench report` prints every check and fails when one fails."""

import subprocess
import sys
from pathlib import Path

from hookbench.cli import main
from hookbench.faults import inject
from hookbench.parity import FAMILIES


def test_report_prints_each_family_and_passes(capsys):
    assert main(["report"]) == 0
    out = capsys.readouterr().out
    assert "torch " + __import__("torch").__version__ in out
    for family in FAMILIES:
        assert f"{family} " in out
    assert "bit-exact" in out and "FAILED" not in out


def test_report_exits_non_zero_when_a_check_fails(capsys):
    with inject("stops_after_first_backward"):
        assert main(["report"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATED" in out and "FAILED (marked !)" in out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "hookbench"  # installed beside this interpreter
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "report" in proc.stdout
