"""hookbench: regression and verification suite for the PyTorch hooks behind memory-saving
training (optimizer in backward, activation capture, sharded gradient release).

``hookbench.Workload`` describes a training step (model, data, loss, optimizer, precision,
checkpointing, compile); ``hookbench report``, ``record`` and ``gate`` take one by import path
(``--workload package.module:attribute``), and the pytest plugin checks one in a user's suite.
"""

__all__ = ["Workload"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazily, so that the pytest plugin's entry point does not import torch into every pytest
    # run of an environment where hookbench is installed.
    if name == "Workload":
        from hookbench.workload import Workload

        return Workload
    raise AttributeError(f"module 'hookbench' has no attribute {name!r}")
