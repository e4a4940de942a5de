"""The warnings each mechanism's standard run emits, recorded so that an upgrade's new ones show.

A release announces what it will break as a warning first: the ``use_reentrant`` deprecation of
activation checkpointing went from a warning to an error and back through several releases
(pytorch#100551, #115868, #116710, #160534); module full backward hooks gained one for an input
that needs no grad (#155339). ``run_all()`` runs each mechanism once, as a training loop would,
with every warning recorded (none filtered, none turned into an error) and returns, per run, the
sorted set of warnings as ``Category: message (where)``: numbers and addresses in the message
masked as ``#``, ``where`` the emitting file relative to its package (``torch/utils/
checkpoint.py``), without the line number, so that an unrelated edit does not show as a change.
``hookbench gate`` lists new and vanished warnings against the baseline and fails on them only
under ``--strict-warnings``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hookbench.core.prerequisites import attempt
from hookbench.gate.checks import Run, Section
from hookbench.mechanisms.activation_capture import ActivationCapture
from hookbench.mechanisms.optimizer_in_backward import OptimizerInBackward
from hookbench.mechanisms.zero2 import Zero2
from hookbench.models.zoo import TinySpec

__all__ = ["RUNS", "describe", "run_all"]

# The standard runs take seconds: selfcheck runs the section clean and under its own fault.
FAULTS = ("new_warning",)

SPEC = TinySpec(depth=3, width=8, tied=True, frozen=True)
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_ROOTS = [Path(torch.__file__).parent.parent, Path(__file__).parents[2]]


def describe(w: warnings.WarningMessage) -> str:
    """``Category: message (file)``, stable across line numbers and run-dependent numbers."""
    message = _NUMBER.sub("#", " ".join(str(w.message).split()))
    path = Path(w.filename)
    where = next((str(path.relative_to(root)) for root in _ROOTS
                  if path.is_relative_to(root)), path.name)
    return f"{w.category.__name__}: {message[:300]} ({where})"


def _train(model: torch.nn.Module, step: Callable[[], None], forward=None) -> None:
    for i in range(2):
        x, y = SPEC.batch(i)
        SPEC.loss((forward or model)(x), y).backward()
        step()


def _activation_capture() -> None:
    model = SPEC.build()
    with ActivationCapture(model, stats=("rms", "mean_abs"), grads=True) as cap:
        _train(model, lambda: cap.clear())


def _optimizer_in_backward(grouped: bool) -> Callable[[], None]:
    def run() -> None:
        model = SPEC.build()
        with OptimizerInBackward(model, torch.optim.Adam, lr=1e-2, foreach=grouped,
                                 grouped=grouped):
            _train(model, lambda: None)
    return run


def _checkpointed(use_reentrant: bool | None) -> Callable[[], None]:
    # None: the call most code still makes, without use_reentrant, where the warnings live.
    def run() -> None:
        model = SPEC.build()
        kwargs = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        _train(model, lambda: (optimizer.step(), optimizer.zero_grad()),
               # an input that needs grad: reentrant checkpointing needs one to reach the weights
               lambda x: checkpoint(model, x.requires_grad_(), **kwargs))
    return run


def _zero2() -> None:
    if dist.is_initialized():
        raise ValueError("this process is already in a process group; run hookbench's "
                         "warnings section in a process of its own")
    # One gloo rank in this process: the mechanism's whole path, collectives included.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = SPEC.build()
        with Zero2(model, torch.optim.Adam, lr=1e-2, foreach=False, bucket_numel=50) as zero:
            _train(model, lambda: (zero.step(), zero.zero_grad()))
            zero.full_state_dict()
    finally:
        dist.destroy_process_group()


RUNS: dict[str, Callable[[], None]] = {
    "activation_capture": _activation_capture,
    "optimizer_in_backward": _optimizer_in_backward(grouped=False),
    "optimizer_in_backward_grouped_foreach": _optimizer_in_backward(grouped=True),
    "checkpoint_use_reentrant_unset": _checkpointed(None),
    "checkpoint_use_reentrant_false": _checkpointed(False),
    "zero2_one_rank": _zero2,
}


def run_all() -> dict[str, Any]:
    """Per run: the sorted warnings it emitted, or what stopped it (``prerequisites.attempt``)."""
    out: dict[str, Any] = {}
    for name, run in RUNS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stopped = attempt(lambda: run() or {})  # {} when it ran, else what stopped it
        out[name] = stopped or sorted({describe(w) for w in caught})
    return out


def measure(run: Run) -> dict[str, Any]:
    return run_all()


def judge(base: dict, now: dict, run: Run) -> Section:
    strict = run.strict_warnings
    section = Section("Warnings of each mechanism's standard run against the baseline"
                      + ("; new or vanished ones fail (--strict-warnings)" if strict else
                         "; new or vanished ones are listed, and fail with --strict-warnings"),
                      ("run", "warning", "verdict"))
    for name, emitted in now.items():
        if section.add_stopped(emitted, name):
            continue
        recorded = base.get(name)
        if not isinstance(recorded, list):
            section.add(False, name, "", "no baseline recorded; record with `hookbench record`")
            continue
        changes = [(w, "NEW") for w in emitted if w not in recorded] + [
            (w, "VANISHED") for w in recorded if w not in emitted]
        for warning, change in changes:
            section.add(not strict, name, warning, change)
        if not changes:
            section.add(True, name, f"{len(emitted)} warning{'' if len(emitted) == 1 else 's'}",
                        "as recorded")
    return section
