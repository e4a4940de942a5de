"""Finds hooks that code left registered: the check behind the test suite's leak guard.

A hook left on a module keeps running in every later forward or backward and keeps what it
captured alive; in a test suite it also makes the next test measure the wrong thing.

A ``HookTracker``, installed for a whole test session, records every module and parameter that
gets built (through PyTorch's own global registration hooks, so nothing is patched), holding
each only weakly: tracking never keeps a model alive. A ``HookLeakGuard`` is one scope (a test,
a fixture's setup): it notes which hooks exist when it opens, and ``leaks()`` names each hook
added while it was open that is still registered, on any tracked object still alive or on one
built inside the scope (those it holds until ``release()``, so that a leak on a model the test
already dropped is still reported), plus the global module hooks. Hooks are compared by id, so
replacing one hook by another is a leak too. Hooks a nested guard saw added are its own, not the
enclosing guard's (a module fixture set up in the middle of a test answers for its own hooks).
Without a tracker a guard brings its own, installed while it is open, and sees only what is
built inside it.

Kinds: module forward, forward-pre, backward and backward-pre hooks; tensor (grad) and
post-accumulate-grad hooks on parameters; the four global module hooks. Not seen: objects built
before tracking started or while it was paused (``untracked()``); modules and parameters made
without registration (``copy.deepcopy``, pickling, ``Module._apply`` replacing a parameter whose
new device cannot share its storage, e.g. meta to CPU) unless they sit on a tracked module;
leaf modules with no parameter and no parent (a lone ``nn.ReLU()``); plain tensors; hooks that
died with their object before the check, when that object was built outside the guard's scope.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

from torch import nn
from torch.nn.modules import module as module_mod
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HookLeakGuard", "HookTracker", "untracked"]

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

_installed: list[HookTracker] = []

# One registered hook: (id of the object or 0 for the global dicts, hook dict's name, hook id).
HookKey = tuple[int, str, int]


class HookTracker:
    """Weakly records each module and parameter registered while installed."""

    def __init__(self) -> None:
        self._labels = WeakIdKeyDictionary()  # module or parameter -> how to name it
        self._open: list[HookLeakGuard] = []  # open guards, innermost last
        self._handles: list = []
        self.paused = False

    def install(self) -> HookTracker:
        self._handles = [module_mod.register_module_module_registration_hook(self._on_module),
                         module_mod.register_module_parameter_registration_hook(self._on_param)]
        _installed.append(self)
        return self

    def uninstall(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self in _installed:
            _installed.remove(self)

    def _record(self, obj: object, label: str, rename: bool) -> None:
        if self.paused:
            return
        if rename or obj not in self._labels:
            self._labels[obj] = label
        if self._open:  # built inside a scope: it holds the object until its check
            self._open[-1]._born.setdefault(id(obj), obj)

    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        self._record(parent, type(parent).__name__, rename=False)
        if child is not None:
            self._record(child, f"{type(child).__name__} '{name}'", rename=True)

    def _on_param(self, owner: nn.Module, name: str, param: nn.Parameter | None) -> None:
        self._record(owner, type(owner).__name__, rename=False)
        if param is not None:
            self._record(param, f"parameter '{name}' of {type(owner).__name__}", rename=True)

    def hooks(self) -> dict[HookKey, str]:
        """Every hook now on a live tracked object or in the global dicts, and what it is."""
        found = {(0, attr, key): f"{kind}(s)"
                 for attr, kind in _GLOBAL_HOOKS.items() for key in getattr(module_mod, attr)}
        seen: set[int] = set()

        def add(obj: object, kinds: dict[str, str], label: str) -> None:
            if id(obj) not in seen:
                seen.add(id(obj))
                for attr, kind in kinds.items():
                    for key in getattr(obj, attr, None) or ():
                        found[id(obj), attr, key] = f"{kind}(s) on {label}"

        for obj, label in list(self._labels.items()):
            if isinstance(obj, nn.Module):
                add(obj, _MODULE_HOOKS, label)
                for name, param in obj._parameters.items():  # also ones set without registering
                    if param is not None:
                        add(param, _TENSOR_HOOKS, f"parameter '{name}' of {label}")
            else:
                add(obj, _TENSOR_HOOKS, label)
        return found


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Pause every installed tracker: what is built meanwhile is nobody's (a nested session)."""
    trackers = [(t, t.paused) for t in _installed]
    for t, _ in trackers:
        t.paused = True
    try:
        yield
    finally:
        for t, was in trackers:
            t.paused = was


class HookLeakGuard:
    """Context manager; ``leaks()`` lists the hooks added while it was open and still there."""

    def __init__(self, tracker: HookTracker | None = None) -> None:
        self._tracker = tracker
        self._own = tracker is None
        self._born: dict[int, object] = {}
        self._before: set[HookKey] = set()
        self._added: set[HookKey] | None = None  # fixed when the guard closes

    def __enter__(self) -> HookLeakGuard:
        if self._own:
            self._tracker = HookTracker().install()
        self._before = set(self._tracker.hooks())
        self._tracker._open.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        tracker = self._tracker
        tracker._open.remove(self)
        self._added = set(tracker.hooks()) - self._before
        for outer in tracker._open:  # a nested scope answers for its own hooks
            outer._before |= self._added
        if self._own:
            tracker.uninstall()

    def leaks(self) -> list[str]:
        """One line per leaked hook kind per object; empty when everything was removed."""
        now = self._tracker.hooks()
        keys = now.keys() - self._before if self._added is None else now.keys() & self._added
        return [f"{n} {what}" for what, n in Counter(now[k] for k in now if k in keys).items()]

    def release(self) -> None:
        """Drop the references that kept the objects built inside alive for the check."""
        self._born.clear()
