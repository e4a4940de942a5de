"""``hookbench record``'s files land together or not at all: the baseline, the checkpoint files
beside it and the replay file are each staged beside their place, then renamed there, the
baseline last. A file system that fails while staging (a full disk, a file too large) is one
line, exit 1, and every old file as it was (issue 57: a 20-line traceback before)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from hookbench import gate
from hookbench.cli import main
from hookbench.gate import baselines


def fake_record(version: str, checkpoints: tuple[str, ...]):
    """``gate.record`` as far as the files go: what it leaves in its staging folder."""

    def record(models, sections, staging, workloads):
        for name in checkpoints:
            (Path(staging) / name).write_bytes(f"{name} {version}".encode())
        (Path(staging) / gate.REPLAY).write_bytes(f"draws {version}".encode())
        return {"recorded_with": baselines.environment(), "hooks": {"version": version}}

    return record


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def record(baseline: Path) -> int:
    return main(["record", "--sections", "hooks,checkpoints", "--baseline", str(baseline)])


def test_a_record_replaces_the_files_together_and_a_full_disk_replaces_none(
        tmp_path, monkeypatch, capsys):
    baseline = tmp_path / "b" / "hookbench.json"
    monkeypatch.setattr(gate, "record", fake_record("1", ("adam.pt", "sgd.pt")))
    assert record(baseline) == 0
    first = files(tmp_path)
    assert set(first) == {"b/hookbench.json", "b/hookbench.replay.pt", "b/checkpoints/adam.pt",
                          "b/checkpoints/sgd.pt"}

    # the disk fills while the baseline, the last file, is staged
    staged = baselines.stage_beside

    def full(path: Path, content: str | bytes) -> Path:
        if path == baseline:
            raise OSError(errno.EFBIG, "File too large", str(path))
        return staged(path, content)

    monkeypatch.setattr(gate, "record", fake_record("2", ("adam.pt",)))
    monkeypatch.setattr(baselines, "stage_beside", full)
    capsys.readouterr()
    assert record(baseline) == 1
    said = capsys.readouterr()
    assert said.err.splitlines()[-1] == (
        f"hookbench record: error: cannot write {baseline}: File too large; the baseline "
        f"{baseline} and its files are unchanged"), said
    assert "Traceback" not in said.err + said.out
    assert files(tmp_path) == first  # nothing replaced, nothing staged left behind

    # with room, the new set replaces the old one whole: sgd.pt, not recorded now, goes
    monkeypatch.setattr(baselines, "stage_beside", staged)
    assert record(baseline) == 0
    assert files(tmp_path) == {"b/checkpoints/adam.pt": b"adam.pt 2",
                               "b/hookbench.json": files(tmp_path)["b/hookbench.json"],
                               "b/hookbench.replay.pt": b"draws 2"}
    assert '"version": "2"' in (tmp_path / "b" / "hookbench.json").read_text()


@pytest.mark.parametrize("fails_on", ["adam.pt", "hookbench.replay.pt"])
def test_a_failure_on_any_file_leaves_the_old_ones(tmp_path, monkeypatch, fails_on):
    baseline = tmp_path / "hookbench.json"
    monkeypatch.setattr(gate, "record", fake_record("1", ("adam.pt",)))
    assert record(baseline) == 0
    first = files(tmp_path)
    staged = baselines.stage_beside

    def full(path: Path, content: str | bytes) -> Path:
        if path.name == fails_on:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return staged(path, content)

    monkeypatch.setattr(gate, "record", fake_record("2", ("adam.pt",)))
    monkeypatch.setattr(baselines, "stage_beside", full)
    assert record(baseline) == 1
    assert files(tmp_path) == first


TINY = '''
import torch
import torch.nn.functional as F
from torch import nn
from hookbench import Workload


def model():
    return nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.1), nn.Tanh(), nn.Linear(8, 3))


def batch(g):
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


W = Workload("tiny", model=model, batch=batch, loss=F.cross_entropy)
'''


def _limited(kib: int):
    """A child process whose files may grow to ``kib`` KiB: a disk that fills."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, kib * 1024))
    return limit


def test_a_ranks_result_the_file_system_cannot_hold_stops_the_run_naming_the_file():
    import subprocess
    import sys

    code = ("import torch\nfrom hookbench.core import launch\ntry:\n"
            "    launch.run(torch.ones, 2, 100_000)\n"  # rank 1's result: 800 KB
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=_limited(64), timeout=300)
    assert out.stdout.startswith("StorageFailed [Errno 27] File too large: "), out
    assert out.stdout.rstrip().endswith("rank1.pt'"), out
    assert "Terminating process" not in out.stderr, out.stderr  # torch's line, not said


def test_a_full_disk_while_recording_a_workload_is_one_line_and_no_known_failure(tmp_path):
    """The real path (issue 57): a rank's result and the replay file are written while the
    workloads are measured. A file system failing there was recorded as a known failure of
    torch's (RuntimeError "unexpected pos" from torch's writer) and replaced the baseline."""
    import os
    import subprocess
    import sys

    (tmp_path / "tiny.py").write_text(TINY)
    baseline = tmp_path / "b.json"
    baseline.write_text("the old baseline")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.getcwd()}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-m", "hookbench", "record", "--workload", "tiny:W",
                          "--baseline", str(baseline)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, preexec_fn=_limited(24), timeout=600)
    assert out.returncode == 1, out
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("hookbench record: error: cannot write ") and last.endswith(
        f": File too large; the baseline {baseline} and its files are unchanged"), out.stderr
    assert "Traceback" not in out.stderr + out.stdout and "known failure" not in out.stdout
    assert baseline.read_text() == "the old baseline"
