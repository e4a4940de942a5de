"""hookbench: regression and verification suite for the PyTorch hooks behind memory-saving
training (optimizer in backward, activation capture, sharded gradient release)."""

__version__ = "0.1.0"
