"""``hookbench.core.orphans``: a process that hookbench spawned as a rank ties itself to its
parent at its first import of hookbench, before it imports torch; the tie is taken out of its
environment so that what it starts is not tied by mistake. (That a tied rank dies with a parent
killed with SIGKILL, mid-run, is tests/cli/test_interrupts.py's.)"""

from __future__ import annotations

import os
import subprocess
import sys

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
