"""Where this torch keeps FSDP2: ``torch.distributed.fsdp``, or, on torch 2.4 and 2.5,
``torch.distributed._composable.fsdp``. One lookup for the layers that need it (the Workload's
validation of ``fsdp2``, the faults, the FSDP2 engine)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["api"]


def api() -> Any:
    """The module that has ``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy``."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        module = importlib.import_module(name)
        if hasattr(module, "fully_shard") and hasattr(module, "MixedPrecisionPolicy"):
            return module
    raise ImportError("this torch has no FSDP2 (fully_shard)")
