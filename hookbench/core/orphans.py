"""No spawned rank outlives the process that started it.

``hookbench.core.launch`` names its own pid in ``ENV`` while it spawns ranks. A rank's first
import of hookbench (its package ``__init__``, which needs no torch) calls ``tie_if_spawned``,
so the rank is tied within a fraction of a second of its start, not only once it has imported
torch and unpickled its function, seconds later on a loaded machine (a rank that was still
importing when its parent got SIGKILL went on for up to 5 s). Tied, it leaves Ctrl-C and SIGTERM
to its parent, which stops it, and dies with it, also when the parent is killed with SIGKILL and
runs no ``finally``: on Linux by the kernel's parent-death signal, elsewhere by a thread that
watches the parent. Torch-free on purpose.

``run`` is a rank's entry point, in this torch-free module so that unpickling it is what first
imports hookbench in the new process, and with it the tie. torch's own entry point
(``torch.multiprocessing.start_processes``' ``_wrap``) does not do for this: unpickling it
imports torch first (1 to 5 s), and it sets the parent-death signal to SIGINT, which a tied
rank ignores, so its ranks outlived a parent killed with SIGKILL for as long as their work ran.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import threading
import time

ENV = "HOOKBENCH_RANK_OF"
LEFT_TO_PARENT = {signal.SIGINT, signal.SIGTERM}


def tie_if_spawned() -> None:
    """Tie this process to its parent if hookbench spawned it as a rank. The variable is taken
    out of the environment, so that what the rank starts in turn (compile workers, its own
    ranks) is not tied to it by mistake."""
    parent = os.environ.pop(ENV, None)
    if parent is not None:
        tie_to(int(parent))


def tie_to(parent: int) -> None:
    """This process's life tied to ``parent``, which started it: see the module's docstring."""
    # Blocked since the spawn (launch._spawn): ignoring them drops what is pending, unblocking
    # them after that delivers nothing.
    for s in LEFT_TO_PARENT:
        signal.signal(s, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, LEFT_TO_PARENT)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    else:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != parent:  # it died before the signal was asked for
        os._exit(1)


def run(payload: bytes) -> None:
    """A spawned rank's entry point: ``fn(*args)``, ``payload`` being their pickle. The process
    is tied already, by the import of this module (``tie_if_spawned``); unpickling ``fn`` comes
    after it, and imports torch."""
    fn, args = pickle.loads(payload)
    fn(*args)
