"""``hookbench.core.orphans``: a process that hookbench spawned as a rank ties itself to its
parent at its first import of hookbench, before it imports torch; the tie is taken out of its
environment so that what it starts is not tied by mistake. A rank ``hookbench.core.launch``
spawns is tied so, also where its parent is ``python -m ...`` or ``-c`` (no main module for the
rank to import first), keeps SIGKILL as its parent-death signal while its function runs, and
dies at once with a parent killed with SIGKILL. (The same mid-run, through the command line, is
tests/cli/test_interrupts.py's.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hookbench.core import orphans

# What the child prints: whether torch was imported when hookbench's import returned, and what
# is left of the variable for the processes it would start.
PROBE = "import sys, os, hookbench; print('torch' in sys.modules, os.environ.get(%r))" % orphans.ENV


def _python(env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != orphans.ENV}
    if env_value is not None:
        env[orphans.ENV] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_rank_whose_parent_is_alive_is_tied_before_torch_and_passes_no_tie_on():
    done = _python(str(os.getpid()))  # this process is the child's parent
    assert (done.returncode, done.stdout.split()) == (0, ["False", "None"]), done.stderr


def test_a_rank_whose_parent_died_before_it_was_tied_exits_at_once():
    # A pid that is not the child's parent reads to it as a parent gone (reparented).
    done = _python(str(os.getpid() + 1 if os.getpid() + 1 != os.getppid() else os.getpid() + 2))
    assert (done.returncode, done.stdout) == (1, ""), done.stderr


def test_a_process_hookbench_did_not_spawn_is_left_alone():
    done = _python(None)
    assert (done.returncode, done.stdout.split()) == (0, ["False", "None"]), done.stderr


# A module of the ranks' functions, written where the parent below finds it: a test module
# itself cannot be imported by name in the spawned ranks.
RANKS = textwrap.dedent("""
    import ctypes, pathlib, sys, threading

    def tie(rank, world):
        sig = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
        order = list(sys.modules)  # in the order of their first import
        return sig.value, order.index("hookbench") < order.index("torch")

    def wait(rank, world, started):
        pathlib.Path(started, str(rank)).touch()
        threading.Event().wait()  # never set: only its parent's end ends it
""")


def _parent(tmp_path: Path, call: str) -> subprocess.Popen:
    """``python -c`` running ``launch.run(...)`` as ``call`` says, the ranks' functions
    importable; what it prints comes back on its stdout."""
    (tmp_path / "ranks.py").write_text(RANKS)
    code = f"import ranks; from hookbench.core import launch; print({call})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_GET_PDEATHSIG is Linux's")
@pytest.mark.distributed
def test_a_spawned_rank_is_tied_before_torch_and_keeps_sigkill_while_it_runs(tmp_path):
    # torch's own entry point (start_processes) imported torch first and then set SIGINT,
    # which a tied rank ignores: [(2, False), (2, False)]
    parent = _parent(tmp_path, "launch.run(ranks.tie, 2, timeout=120)")
    out, _ = parent.communicate(timeout=180)
    assert (parent.returncode, out.strip()) == (0, str([(signal.SIGKILL.value, True)] * 2)), out


def _ranks_of(parent: int) -> list[int]:
    """The pids of ``parent``'s spawned ranks (not its resource tracker)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"spawn_main" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except (OSError, ValueError, IndexError):  # not a process, or gone
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; it waits only for its new parent to reap it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.distributed
def test_spawned_ranks_end_with_a_parent_killed_with_sigkill(tmp_path):
    started = tmp_path / "started"
    started.mkdir()
    ranks: list[int] = []
    parent = _parent(tmp_path, f"launch.run(ranks.wait, 2, {str(started)!r}, timeout=300)")
    try:
        deadline = time.monotonic() + 120
        while len(list(started.iterdir())) < 2:  # both ranks in their function
            assert parent.poll() is None and time.monotonic() < deadline, parent.communicate()
            time.sleep(0.05)
        ranks += _ranks_of(parent.pid)
        assert len(ranks) == 2, ranks
        parent.kill()
        parent.wait(timeout=60)
        # The kernel's parent-death signal is sent as the parent ends; 3 s bounds the polling.
        deadline = time.monotonic() + 3
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in ranks if _alive(pid)], "ranks outlived their parent"
    finally:
        parent.kill()
        for pid in ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
