"""Finds hooks that code left registered: the check behind the test suite's leak guard.

A hook left on a module keeps running in every later forward or backward and keeps what it
captured alive; in a test suite it also makes the next test measure the wrong thing. While a
``HookLeakGuard`` is active it records every module and parameter that gets built (through
PyTorch's own global registration hooks, so nothing is patched), and ``leaks()`` names each of
them that still carries a forward, forward-pre, backward, backward-pre, tensor or
post-accumulate-grad hook, plus any global module hook added meanwhile. Modules made without
``__setattr__`` (``copy.deepcopy``) and plain tensors are not seen.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as module_mod

__all__ = ["HookLeakGuard"]

_MODULE_HOOKS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward-pre hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward-pre hook",
}
_GLOBAL_HOOKS = {
    "_global_forward_hooks": "global forward hook",
    "_global_forward_pre_hooks": "global forward-pre hook",
    "_global_backward_hooks": "global backward hook",
    "_global_backward_pre_hooks": "global backward-pre hook",
}
_TENSOR_HOOKS = {
    "_post_accumulate_grad_hooks": "post-accumulate-grad hook",
    "_backward_hooks": "tensor (grad) hook",
}


class HookLeakGuard:
    """Context manager; ``leaks()`` after it exits lists what is still hooked."""

    def __init__(self) -> None:
        self._modules: dict[int, tuple[nn.Module, str]] = {}
        self._params: dict[int, tuple[nn.Parameter, str]] = {}
        self._globals_before: dict[str, set[int]] = {}
        self._handles: list = []

    def __enter__(self) -> HookLeakGuard:
        self._globals_before = {k: set(getattr(module_mod, k)) for k in _GLOBAL_HOOKS}

        def on_module(parent: nn.Module, name: str, child: nn.Module | None) -> None:
            self._modules.setdefault(id(parent), (parent, type(parent).__name__))
            if child is not None:
                self._modules[id(child)] = (child, f"{type(child).__name__} '{name}'")

        def on_param(owner: nn.Module, name: str, param: nn.Parameter | None) -> None:
            self._modules.setdefault(id(owner), (owner, type(owner).__name__))
            if param is not None:
                self._params[id(param)] = (param, f"parameter '{name}' of {type(owner).__name__}")

        self._handles = [
            module_mod.register_module_module_registration_hook(on_module),
            module_mod.register_module_parameter_registration_hook(on_param),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def leaks(self) -> list[str]:
        """One line per leaked hook kind per object; empty when everything was removed."""
        found = []
        for module, label in self._modules.values():
            for attr, kind in _MODULE_HOOKS.items():
                if getattr(module, attr, None):
                    found.append(f"{len(getattr(module, attr))} {kind}(s) on {label}")
        for param, label in self._params.values():
            for attr, kind in _TENSOR_HOOKS.items():
                if getattr(param, attr, None):
                    found.append(f"{len(getattr(param, attr))} {kind}(s) on {label}")
        for attr, kind in _GLOBAL_HOOKS.items():
            added = set(getattr(module_mod, attr)) - self._globals_before[attr]
            if added:
                found.append(f"{len(added)} {kind}(s)")
        return found

    def release(self) -> None:
        """Drop the references that kept the tracked modules alive for the check."""
        self._modules.clear()
        self._params.clear()
