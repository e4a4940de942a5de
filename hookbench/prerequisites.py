"""The one reason a check may be SKIPPED: a declared optional prerequisite that is absent.

A check raises ``MissingPrerequisite`` naming what it needs (CUDA, a number of GPUs, a torch
release that has an API, an optional package); the report and the gate show that row as
SKIPPED with the message. Anything else that stops a check, an ``ImportError`` of a torch module
included, is a failure that names the exception: an upgrade that removes what hookbench relies
on must never read as a pass.
"""

from __future__ import annotations

__all__ = ["MissingPrerequisite"]


class MissingPrerequisite(Exception):
    """A declared optional prerequisite is absent; the message says which."""
