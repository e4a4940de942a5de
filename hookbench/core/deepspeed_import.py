"""Importing DeepSpeed on a gloo rank, or saying why it cannot be: the one place that imports it.

It sits below everything that runs DeepSpeed (the peer in ``measure.peers``, the engine row,
the fault that breaks ``deepspeed.initialize``), so none of them imports another for it.
DeepSpeed picks its accelerator for the whole process when it is first imported, so nothing
imports it outside a rank that is about to run it.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from hookbench.core.prerequisites import DEEPSPEED_INSTALL, MissingPrerequisite

__all__ = ["MISSING", "load"]

MISSING = f"deepspeed is not installed ({DEEPSPEED_INSTALL}; the peers extra)"


def load() -> Any:
    """Import deepspeed for a gloo (CPU) rank, or raise ``MissingPrerequisite``.

    On a rank (torch.distributed initialised) DeepSpeed gets what its launcher would set:
    ``DS_ACCELERATOR=cpu`` (its CPU accelerator, whose communication backend falls back to gloo
    where oneCCL's bindings are absent) and RANK/LOCAL_RANK/WORLD_SIZE; the CPU accelerator
    reads LOCAL_RANK. Outside a rank nothing is set, so a caller's environment is untouched.
    """
    if dist.is_initialized():
        if dist.get_backend() != "gloo":
            raise ValueError(f"the DeepSpeed peer runs on gloo ranks (DS_ACCELERATOR=cpu); "
                             f"this group is {dist.get_backend()}")
        os.environ["DS_ACCELERATOR"] = "cpu"
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    try:
        import deepspeed
    except ImportError as e:
        if e.name == "deepspeed":
            raise MissingPrerequisite(MISSING) from e
        raise MissingPrerequisite(f"deepspeed does not import: {type(e).__name__}: {e}") from e
    if dist.is_initialized():
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":  # chosen at import, before we could
            raise ValueError(f"deepspeed was imported in this process with the "
                             f"{get_accelerator().device_name()} accelerator; the peer needs "
                             f"DS_ACCELERATOR=cpu before deepspeed is first imported")
    return deepspeed
