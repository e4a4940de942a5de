"""hookbench: regression and verification suite for the PyTorch hooks behind memory-saving
training: the optimizer step in backward, ZeRO-2 (sharded gradient release), activation capture
and activation offload through saved-tensor hooks.

The mechanisms are importable from the top (``from hookbench import OptimizerInBackward, Zero2,
ActivationCapture, ActivationOffload``), each one file that imports only torch.
``hookbench.Workload`` describes a training step (model, data, loss, optimizer, precision,
checkpointing, offload, compile); ``hookbench report``, ``record`` and ``gate`` take one by
import path (``--workload package.module:attribute``), and the pytest plugin checks one in a
user's suite.
"""

import importlib

from hookbench.core import orphans

# A rank that hookbench spawned is tied to its parent here, at its first import of hookbench,
# before the seconds it spends importing torch (hookbench.core.orphans).
orphans.tie_if_spawned()

# Each public name and its module, imported on first use, so that the pytest plugin's entry
# point does not import torch into every pytest run of an environment where hookbench is
# installed.
_PUBLIC = {
    "ActivationCapture": "hookbench.mechanisms.activation_capture",
    "ActivationOffload": "hookbench.mechanisms.activation_offload",
    "OptimizerInBackward": "hookbench.mechanisms.optimizer_in_backward",
    "Workload": "hookbench.core.workload",
    "Zero2": "hookbench.mechanisms.zero2",
}
__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'hookbench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
