"""A training step described as data: the one description every part of hookbench reads.

A ``Workload`` says what one step of a training loop is: which model, which data, which loss,
which optimizer, and the settings a real stack runs with (mixed precision, activation
checkpointing, ``torch.compile``). The report, ``record``, ``gate``, ``capture``, the pytest
plugin and the tests all train from it, so a user's own model is checked exactly like the zoo's,
which is itself a set of built-in workloads (``hookbench.zoo.workload``)::

    from hookbench import Workload

    WORKLOAD = Workload(
        name="charlm",
        model=CharLM,                                   # zero-argument factory -> nn.Module
        batch=lambda g: make_batch(g),                  # torch.Generator -> (inputs, target)
        loss=lambda output, target: F.cross_entropy(output.flatten(0, 1), target.flatten()),
        optimizer=(torch.optim.AdamW, {"lr": 1e-3}),
        precision="bf16",
    )

Named on the command line by import path (``--workload mypkg.workloads:WORKLOAD``): a
``Workload``, a zero-argument function returning one, or a list of them. ``model()`` must also
build under ``torch.device("meta")`` (the fake memory backend, parameter counts and dtypes are
read from that), and the ZeRO-2 checks pickle the workload into spawned ranks: use
module-level functions there, not lambdas.

Options (one field each):
    precision      "fp32"; "bf16": forward and loss under ``torch.autocast(dtype=bfloat16)``;
                   "fp16": under float16 autocast with a ``torch.amp.GradScaler``, where the
                   strategy supports it (the optimizer in backward refuses fp16, in words)
    checkpointing  "none"; "blocks": every top-level child of the model runs under
                   ``torch.utils.checkpoint(use_reentrant=False)``
    compile        None, or a ``torch.compile`` backend name ("eager", "inductor"), compiled in
                   place (``Module.compile``) so that parameter names do not change
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["CHECKPOINTING", "PRECISIONS", "Workload", "configured", "load", "of", "to_device"]

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "blocks")
_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, eq=False)
class Workload:
    """One training step: model, data, loss, optimizer and the stack's settings."""

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[Any, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: tuple[type[torch.optim.Optimizer], dict[str, Any]] = (torch.optim.Adam,
                                                                      {"lr": 1e-3})
    precision: str = "fp32"
    checkpointing: str = "none"
    compile: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            # Baseline rows are keyed "name/what"; a slash would make two workloads collide.
            raise ValueError(f"Workload name must be a non-empty string without '/', "
                             f"got {self.name!r}")
        for field in ("model", "batch", "loss"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Workload {self.name!r}: {field} must be callable, got "
                                f"{type(getattr(self, field)).__name__}")
        cls, kwargs = _pair(self.optimizer, self.name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"Workload {self.name!r}: optimizer must be (a torch.optim."
                            f"Optimizer class, a dict of its options), got {cls!r}")
        if not isinstance(kwargs, dict):
            raise TypeError(f"Workload {self.name!r}: the optimizer's options must be a dict, "
                            f"got {type(kwargs).__name__}")
        for field, allowed in (("precision", PRECISIONS), ("checkpointing", CHECKPOINTING)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"Workload {self.name!r}: {field} must be one of {allowed}, "
                                 f"got {getattr(self, field)!r}")
        if self.compile is not None and not (isinstance(self.compile, str) and self.compile):
            raise TypeError(f"Workload {self.name!r}: compile must be None or a torch.compile "
                            f"backend name, got {self.compile!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Workload {self.name!r}: seed must be an int >= 0")

    def replace(self, **changes: Any) -> Workload:
        """This workload with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def build(self) -> nn.Module:
        """A new model, the same on every call: built from ``seed`` with the global RNG left
        as it was, with activation checkpointing and compilation applied."""
        state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)
        try:
            model = self.model()
        finally:
            torch.random.set_rng_state(state)
        if not isinstance(model, nn.Module):
            raise TypeError(f"Workload {self.name!r}: model() must return an nn.Module, got "
                            f"{type(model).__name__}")
        if self.checkpointing == "blocks":
            children = list(model.children())
            if not children:
                raise ValueError(f"Workload {self.name!r}: checkpointing='blocks' wraps the "
                                 f"model's top-level children, and {type(model).__name__} has "
                                 f"none")
            for child in children:
                # An instance attribute: Module.__call__ (and its hooks) run as before, only
                # the block's own forward is recomputed in backward.
                child.forward = functools.partial(checkpoint, child.forward, use_reentrant=False)
        if self.compile is not None:
            model.compile(backend=self.compile)  # in place: parameter names stay as they are
        return model

    def data(self, index: int) -> tuple[Any, torch.Tensor]:
        """The ``index``-th (inputs, target), the same on every call."""
        g = torch.Generator().manual_seed(self.seed * 100_003 + index)
        got = self.batch(g)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise TypeError(f"Workload {self.name!r}: batch(generator) must return "
                            f"(inputs, target), got {type(got).__name__}")
        inputs, target = got
        tensors = inputs if isinstance(inputs, tuple) else (inputs,)
        if not all(torch.is_tensor(t) for t in (*tensors, target)):
            raise TypeError(f"Workload {self.name!r}: inputs must be a tensor or a tuple of "
                            f"tensors, and target a tensor")
        return inputs, target

    @property
    def batch_size(self) -> int:
        inputs, _ = self.data(0)
        return len(inputs[0] if isinstance(inputs, tuple) else inputs)

    @property
    def parameter_dtype(self) -> torch.dtype:
        """The dtype of the model's first parameter (parity tolerances are per dtype)."""
        with torch.device("meta"):
            return next(self.model().parameters()).dtype

    def autocast(self, device: str | torch.device) -> contextlib.AbstractContextManager:
        """The precision's autocast region for forward and loss (nothing for fp32)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=_AUTOCAST[self.precision])

    def grad_scaler(self, device: str | torch.device) -> torch.amp.GradScaler | None:
        """A fresh GradScaler for fp16, else None."""
        if self.precision != "fp16":
            return None
        return torch.amp.GradScaler(torch.device(device).type)

    def compute_loss(self, model: nn.Module, inputs: Any, target: torch.Tensor) -> torch.Tensor:
        """Forward and loss under the precision's autocast."""
        device = target.device
        with self.autocast(device):
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            return self.loss(output, target)


def _pair(optimizer: Any, name: str) -> tuple[Any, Any]:
    if not (isinstance(optimizer, tuple) and len(optimizer) == 2):
        raise TypeError(f"Workload {name!r}: optimizer must be a (class, kwargs) pair, e.g. "
                        f"(torch.optim.AdamW, {{'lr': 1e-3}}), got {optimizer!r}")
    return optimizer


def to_device(inputs: Any, device: str | torch.device) -> Any:
    """Inputs (a tensor or a tuple of tensors) on ``device``."""
    if isinstance(inputs, tuple):
        return tuple(t.to(device) for t in inputs)
    return inputs.to(device)


def of(spec: Any) -> Workload:
    """``spec`` as a Workload: a Workload itself, or anything with ``workload()`` (TinySpec)."""
    if isinstance(spec, Workload):
        return spec
    if callable(getattr(spec, "workload", None)):
        return spec.workload()
    raise TypeError(f"expected a hookbench.Workload, got {type(spec).__name__}")


def load(path: str, root: str | Path = ".") -> list[Workload]:
    """The workloads named by ``package.module:attribute``: a Workload, a list or tuple of
    them, or a zero-argument function returning either. ``root`` (the user's project) goes on
    ``sys.path`` first, as the current folder does for ``python -m``; it stays there, so that
    spawned ZeRO-2 ranks can import the workload's functions too."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--workload {path!r}: expected package.module:attribute")
    root = str(Path(root).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--workload {path}: cannot import {module_name} ({e})") from None
    try:
        found = functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        raise ValueError(f"--workload {path}: {module_name} has no attribute "
                         f"{attribute!r}") from None
    if callable(found) and not isinstance(found, Workload):
        found = found()
    found = list(found) if isinstance(found, (list, tuple)) else [found]
    if not found or not all(isinstance(w, Workload) for w in found):
        raise TypeError(f"--workload {path}: expected a hookbench.Workload, a list of them or "
                        f"a function returning either, got "
                        f"{', '.join(sorted({type(w).__name__ for w in found})) or 'nothing'}")
    return found


def configured(start: str | Path = ".") -> dict[str, Any]:
    """The ``[tool.hookbench]`` table of the nearest pyproject.toml at or above ``start``:
    ``workloads`` (import paths) and ``baseline`` (a path, relative to that file), or {}."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    for folder in (Path(start).resolve(), *Path(start).resolve().parents):
        pyproject = folder / "pyproject.toml"
        if not pyproject.is_file():
            continue
        try:
            table = tomllib.loads(pyproject.read_text()).get("tool", {}).get("hookbench", {})
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{pyproject}: {e}") from None
        unknown = set(table) - {"workloads", "baseline"}
        if unknown:
            raise ValueError(f"{pyproject}: [tool.hookbench] has unknown keys {sorted(unknown)}; "
                             f"it takes workloads and baseline")
        workloads = table.get("workloads", [])
        if not (isinstance(workloads, list) and all(isinstance(w, str) for w in workloads)):
            raise ValueError(f"{pyproject}: [tool.hookbench] workloads must be a list of "
                             f"import paths (package.module:attribute)")
        out: dict[str, Any] = {"workloads": workloads, "root": folder}
        if "baseline" in table:
            out["baseline"] = str(folder / table["baseline"])
        return out if table else {}
    return {}

