"""The sweep's architectures (``sweep.architectures``), run by ``examples/sweep/run.py``."""
