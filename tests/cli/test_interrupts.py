"""Ctrl-C and SIGTERM stop a command (``hookbench.cli.interrupts``): one line, exit 130 or 143, the
baseline's bytes as they were, and no process left, at several points of a run, the spawned
ranks' included; and a rank dies with the process that started it, also one killed with SIGKILL
(``hookbench.core.launch``). Each command runs as users run it, in its own session, so that
``os.killpg`` sends a signal to its whole process group as a terminal's Ctrl-C does; it is
signalled when it reaches the point (its progress line, or its ranks running), never after a
sleep."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hookbench.cli import interrupts

TAG = "HOOKBENCH_INTERRUPT_TEST"
GONE_WITHIN = 15.0  # s: a bound on waiting; the command stops its ranks before it exits
# s: after a SIGKILL of their parent. The kernel's parent-death signal is at once; without it the
# ranks went on with their work for up to 10 s (the ZeRO-2 runs of this record: about 12 s).
ORPHANS_GONE_WITHIN = 3.0
OLD = b'{"an existing baseline": "its bytes must survive"}\n'


def tagged(tag: str) -> dict[int, bytes]:
    """pid -> command line of every live process started with ``tag`` in its environment: the
    command and all it started (spawned ranks inherit it)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        if f"{TAG}={tag}".encode() in env.split(b"\0"):
            found[int(proc.name)] = cmdline
    return found


def ranks(tag: str) -> list[int]:
    return [pid for pid, cmdline in tagged(tag).items() if b"spawn_main" in cmdline]


def until(condition, what: str, limit: float = 120.0, left=None) -> None:
    """Wait for ``condition()`` (polled), failing after ``limit`` seconds with ``what`` and
    what ``left()`` says is still there."""
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not seen in {limit:g} s: {what}"
                                 + (f"; still there: {left()}" if left else ""))
        time.sleep(0.05)


class Command:
    """``python -m hookbench ARGS`` in a session of its own, its output read line by line."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.tag = uuid.uuid4().hex
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hookbench", *args], cwd=cwd, text=True,
            env={**os.environ, TAG: self.tag}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.lines: list[str] = []

    def printed(self, pattern: str) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if re.search(pattern, line):
                return
        raise AssertionError(f"ended without printing {pattern!r}:\n{''.join(self.lines)}")

    def ranks_running(self) -> None:
        until(lambda: len(ranks(self.tag)) >= 2, "two spawned ranks")

    def finish(self, within: float = GONE_WITHIN) -> tuple[int, str]:
        code = self.proc.wait(timeout=120)
        until(lambda: not tagged(self.tag), "every process of the command gone", within,
              left=lambda: {pid: cmd.replace(b"\0", b" ").decode(errors="replace")[:120]
                            for pid, cmd in tagged(self.tag).items()})
        out, _ = self.proc.communicate(timeout=120)  # the ranks held the pipe open too
        return code, "".join(self.lines) + out

    def kill(self) -> None:  # whatever a failed test left
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in tagged(self.tag):
            os.kill(pid, signal.SIGKILL)


def record(tmp_path: Path) -> tuple[Command, Path]:
    baseline = tmp_path / "baseline.json"
    baseline.write_bytes(OLD)
    # the hook contract, then ZeRO-2 and the engines on 2 gloo ranks: about 20 s uninterrupted
    return Command(["record", "--baseline", str(baseline), "--models", "transformer",
                    "--sections", "hooks,zero2"], tmp_path), baseline


@pytest.mark.parametrize("point, sig, group", [
    # Ctrl-C in the terminal: the whole process group
    pytest.param("started", signal.SIGINT, True, marks=pytest.mark.slow),
    ("ranks", signal.SIGINT, True),
    pytest.param("started", signal.SIGTERM, False, marks=pytest.mark.slow),
    ("ranks", signal.SIGTERM, False),  # a runner cancelling the job: the command alone
    pytest.param("ranks", signal.SIGTERM, True, marks=pytest.mark.slow),
])
def test_an_interrupted_record_writes_nothing_and_leaves_no_process(tmp_path, point, sig, group):
    command, baseline = record(tmp_path)
    try:
        command.printed("recording the gate's baseline")
        if point == "ranks":
            command.ranks_running()
        (os.killpg if group else os.kill)(command.proc.pid, sig)
        code, out = command.finish()
    finally:
        command.kill()
    assert code == 128 + sig, out
    name = signal.Signals(sig).name
    assert f"hookbench record: interrupted by {name}; stopped, nothing written" in out, out
    assert "Traceback" not in out and "wrote" not in out, out
    assert baseline.read_bytes() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["baseline.json"]  # no staged file


@pytest.mark.distributed
def test_ranks_die_with_a_parent_killed_with_sigkill(tmp_path):
    command, baseline = record(tmp_path)
    try:
        command.printed("recording the gate's baseline")
        command.ranks_running()
        os.kill(command.proc.pid, signal.SIGKILL)  # no handler, no finally: the kernel's signal
        code, out = command.finish(within=ORPHANS_GONE_WITHIN)
    finally:
        command.kill()
    assert code == -signal.SIGKILL
    assert baseline.read_bytes() == OLD


@pytest.mark.slow
@pytest.mark.parametrize("args, point", [
    (["gate", "--models", "transformer", "--sections", "hooks,zero2"], "ranks"),
    (["report", "--model", "transformer"], "measuring transformer"),
    (["engines"], "ranks"),
    (["zero2"], "ranks"),
    (["speed", "--model", "mlp", "--runs", "2"], "run 1 of 2"),
    (["selfcheck", "--sections", "zero2,hooks"], "ranks"),
])
def test_every_long_command_stops_on_sigterm_in_one_line(tmp_path, args, point):
    command = Command(args + ["--out", str(tmp_path / "out")] if args[0] in ("gate", "report")
                      else args, Path.cwd())
    try:
        if point == "ranks":
            command.ranks_running()
        else:
            command.printed(point)
        os.killpg(command.proc.pid, signal.SIGTERM)
        code, out = command.finish()
    finally:
        command.kill()
    assert code == 143, out
    assert f"hookbench {args[0]}: interrupted by SIGTERM; stopped, nothing written" in out, out
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_signal_during_the_final_writes_waits_for_them_then_says_so():
    written, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(interrupts.Interrupted) as stopped:
        with interrupts.handled():
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                written.append("baseline")  # the block runs to its end
                written.append("checkpoints")
    assert written == ["baseline", "checkpoints"]
    assert stopped.value.written and stopped.value.code == 143
    assert "written in full first" in stopped.value.said("record")
    # outside a deferred block it stops at once, and the handlers are restored after
    with pytest.raises(interrupts.Interrupted) as stopped:
        with interrupts.handled():
            os.kill(os.getpid(), signal.SIGINT)
            written.append("never")
    assert written[-1] != "never" and stopped.value.code == 130
    assert signal.getsignal(signal.SIGTERM) == before
