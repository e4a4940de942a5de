"""The one reason a check may be SKIPPED: a declared optional prerequisite that is absent.

A check raises ``MissingPrerequisite`` naming what it needs (CUDA, a number of GPUs, a torch
release that has an API, an optional package); the report and the gate show that row as
SKIPPED with the message. Anything else that stops a check, an ``ImportError`` of a torch module
included, is a failure that names the exception: an upgrade that removes what hookbench relies
on must never read as a pass. But not the file system failing under hookbench's own files (a
full disk, a file too large: ``StorageFailed``, from ``write_bytes``): that stops the command,
never reads as a failure of torch's.
"""

from __future__ import annotations

import contextlib
import logging
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["DEEPSPEED_INSTALL", "MissingPrerequisite", "StorageFailed", "attempt", "one_line",
           "warnings_kept", "write_bytes"]

# The one command that installs DeepSpeed (the peers extra) as hookbench runs it, which every
# message naming the install gives: beside the installed torch, which its build imports, and
# without CUDA ops (pyproject.toml's peers extra and .ci/run run the same).
DEEPSPEED_INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed==0.19.8'"


class MissingPrerequisite(Exception):
    """A declared optional prerequisite is absent; the message says which."""


class StorageFailed(OSError):
    """The file system failed while hookbench wrote a file of its own (a rank's result, the
    replay file): the command stops in one line naming the file, and no check records it."""


def write_bytes(path: str | Path, data: bytes | memoryview) -> None:
    """``data`` into ``path`` by Python: a failing file system is ``StorageFailed`` naming the
    file (torch's own writer raises a RuntimeError, "unexpected pos", and a write that fails
    names no file)."""
    try:
        Path(path).write_bytes(data)
    except OSError as e:
        raise StorageFailed(e.errno, e.strerror, str(path)) from None


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A measurement, or what stopped it: ``{"skipped": reason}`` for a declared prerequisite
    that is absent; ``{"error": "Type: message"}`` for anything else (an ImportError of a torch
    module included)."""
    try:
        return fn()
    except MissingPrerequisite as e:
        return {"skipped": str(e)}
    except StorageFailed:
        raise  # the file system failing stops the command: no row of torch's
    except Exception as e:  # noqa: BLE001 - a failed row that says why, e.g. a hook that
        return {"error": one_line(e)}  # fired twice, refused


def one_line(e: BaseException) -> str:
    """``Type: message`` in one line, as a row shows an exception: no traceback (a failed
    rank's is summed up by its ``summary``: which rank, and its exception), the message's
    first line."""
    said = getattr(e, "summary", None) or _first_line(str(e))
    if not said and e.__traceback__ is not None:
        # a bare ``raise AssertionError`` (torch's batched PowerSGD hook on a 2-D matrix):
        # where it was raised is all there is to say
        frame = traceback.extract_tb(e.__traceback__)[-1]
        path = Path(frame.filename).parts
        where = "/".join(path[path.index("torch"):] if "torch" in path else path[-1:])
        said = f"(no message) raised in {frame.name}, {where}:{frame.lineno}"
    return f"{type(e).__name__}: {said}"


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


@contextlib.contextmanager
def warnings_kept(said: list[str]) -> Iterator[None]:
    """The warnings raised in the block (torch's own, such as FSDP2's "returned a view tensor",
    or the model's) and torch's log records of level WARNING and above (``torch.*`` loggers:
    "Terminating process ... via signal SIGTERM", "No CUDA runtime is found") appended to
    ``said`` as ``Category: first line`` (``torch log: first line``), each once, instead of
    printed raw on the terminal (once per rank): a row says them in its detail."""
    torch_log = logging.getLogger("torch")
    kept = _Kept(said)
    handlers, propagate = torch_log.handlers[:], torch_log.propagate
    for handler in handlers:
        torch_log.removeHandler(handler)
    torch_log.addHandler(kept)
    torch_log.propagate = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            torch_log.removeHandler(kept)
            for handler in handlers:
                torch_log.addHandler(handler)
            torch_log.propagate = propagate
            for w in caught:
                words = f"{w.category.__name__}: {_first_line(str(w.message))}"
                if words not in said:
                    said.append(words)


class _Kept(logging.Handler):
    """torch's log records of level WARNING and above, into ``said``."""

    def __init__(self, said: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.said = said

    def emit(self, record: logging.LogRecord) -> None:
        words = f"torch log: {_first_line(record.getMessage())}"
        if words not in self.said:
            self.said.append(words)
