"""The one reason a check may be SKIPPED: a declared optional prerequisite that is absent.

A check raises ``MissingPrerequisite`` naming what it needs (CUDA, a number of GPUs, a torch
release that has an API, an optional package); the report and the gate show that row as
SKIPPED with the message. Anything else that stops a check, an ``ImportError`` of a torch module
included, is a failure that names the exception: an upgrade that removes what hookbench relies
on must never read as a pass.
"""

from __future__ import annotations

import re

import torch

__all__ = ["MissingPrerequisite", "require_torch", "torch_release"]


class MissingPrerequisite(Exception):
    """A declared optional prerequisite is absent; the message says which."""


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.14.1+cu130' or '2.15.0a0+git1'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match[1]), int(match[2])


def require_torch(release: str, what: str) -> None:
    """Raise ``MissingPrerequisite`` unless the installed torch is at least ``release``."""
    if torch_release() < torch_release(release):
        raise MissingPrerequisite(f"{what} needs torch >= {release}; this is "
                                  f"{torch.__version__}")
