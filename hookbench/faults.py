"""Injected PyTorch faults: how hookbench proves that its checks can fail.

Each fault is a context manager that makes PyTorch misbehave the way a regression would, by
swapping ``torch.Tensor.register_post_accumulate_grad_hook`` for a broken one and restoring it in
``finally``. The fault tests (and ``pytest --hookbench-fault NAME``) run the suite's own checks
under each fault and require that they fail.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["FAULTS", "inject"]

_Register = Callable[[torch.Tensor, Callable[[torch.Tensor], None]], object]


def _fires_twice(original: _Register) -> _Register:
    def register(self, hook):
        def twice(t):
            hook(t)
            hook(t)

        return original(self, twice)

    return register


def _stops_after_first_backward(original: _Register) -> _Register:
    def register(self, hook):
        calls = []

        def first_only(t):
            if not calls:
                calls.append(1)
                hook(t)

        return original(self, first_only)

    return register


def _fires_before_accumulation(original: _Register) -> _Register:
    # A tensor hook runs before AccumulateGrad: .grad does not yet hold this backward's gradient.
    def register(self, hook):
        return self.register_hook(lambda grad: hook(self))

    return register


def _keeps_gradients_alive(original: _Register) -> _Register:
    # Something holds every gradient the hook sees, so freeing .grad in the hook frees nothing.
    kept: list[torch.Tensor] = []

    def register(self, hook):
        def keep(t):
            kept.append(t.grad)
            hook(t)

        return original(self, keep)

    return register


FAULTS: dict[str, Callable[[_Register], _Register]] = {
    "fires_twice": _fires_twice,
    "stops_after_first_backward": _stops_after_first_backward,
    "fires_before_accumulation": _fires_before_accumulation,
    "keeps_gradients_alive": _keeps_gradients_alive,
}


@contextlib.contextmanager
def inject(name: str) -> Iterator[None]:
    """Run the block with fault ``name`` injected into PyTorch's hook registration."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose from {sorted(FAULTS)}")
    original = torch.Tensor.register_post_accumulate_grad_hook
    torch.Tensor.register_post_accumulate_grad_hook = FAULTS[name](original)
    try:
        yield
    finally:
        torch.Tensor.register_post_accumulate_grad_hook = original
