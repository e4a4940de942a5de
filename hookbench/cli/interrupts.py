"""Ctrl-C and SIGTERM on the command line: the command stops where it is, writes nothing, says so
in one line and exits 128 + the signal's number (130, 143), as a shell's own commands do.

Without this, SIGTERM (a CI runner cancelling a job) ends the process at once, past every
``finally`` that stops the spawned ranks (``hookbench.core.launch``) and removes a staged file;
and a Ctrl-C that reached the ranks first read as a rank that failed, which a section records as
a failed row and ``record`` then wrote into the baseline as a known failure. Here both signals
raise ``Interrupted`` in the main thread, which no ``except Exception`` catches, and the ranks
leave both to this process (they die with it, ``launch``).

A command's final writes (a baseline and its checkpoint files) run under ``deferred()``: a
signal then waits until they are complete, so that what is on disk is the old baseline or the
new one, never half of each, and the line says which.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

__all__ = ["Interrupted", "deferred", "handled"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (``signum``); ``written``: only after the final writes."""

    def __init__(self, signum: int, written: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.written = signum, written

    @property
    def code(self) -> int:
        return 128 + self.signum

    def said(self, command: str) -> str:
        """The one line the command line prints."""
        return (f"hookbench {command}: interrupted by {signal.Signals(self.signum).name}; "
                + ("it came while the results were being written, so they were written in "
                   "full first" if self.written else "stopped, nothing written"))


_deferring: list[int] = []  # a stack: how many deferred() blocks are open
_pending: list[int] = []  # the signals that came during one


def _raise(signum: int, frame: Any) -> None:
    if _deferring:
        _pending.append(signum)
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` within the block (the main thread's only:
    Python runs signal handlers there), the previous handlers back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A signal during the block waits for its end, then raises ``Interrupted(written=True)``."""
    _deferring.append(1)
    try:
        yield
    finally:
        _deferring.pop()
    if _pending and not _deferring:
        raise Interrupted(_pending.pop(0), written=True)
