"""Verdict rows, and the live checks that both ``hookbench report`` and ``hookbench gate`` show.

A ``Section`` is a titled list of rows (what was checked, the verdict); a row is PASS, FAILED
or SKIPPED, and SKIPPED only for a declared optional prerequisite that is absent
(``hookbench.core.prerequisites``). ``contract_section`` runs the hook contract;
``optimizer_in_backward_section`` compares the optimizer in backward with ``optimizer.step()``
for every optimizer family on ``REPORT_SPEC``, live. ``Run`` is what a gate section's
``measure`` and ``judge`` are told of the run; ``contract_rows`` and ``trajectory_rows`` are the
verdicts that several sections share.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hookbench.core import names
from hookbench.core.prerequisites import MissingPrerequisite, attempt
from hookbench.core.workload import Workload
from hookbench.gate.baselines import final_parameters
from hookbench.measure import hook_contract
from hookbench.measure.parity import (FAMILIES, Tolerance, compare, live_gradients, tolerance,
                                      trajectory)
from hookbench.models.zoo import TinySpec

__all__ = ["ACCUMULATION", "REPORT_SPEC", "STEPS", "Run", "Section", "Verdict", "contract_rows",
           "contract_section", "optimizer_in_backward_section", "trajectory_rows",
           "trajectory_verdict"]


class Verdict(enum.Enum):
    """A row's verdict. SKIPPED only for a declared optional prerequisite that is absent
    (``hookbench.core.prerequisites``); a row is falsy only when it FAILED."""

    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"

    def __bool__(self) -> bool:
        return self is not Verdict.FAIL


@dataclass
class Section:
    """``key_columns``: how many leading cells name a row (the rest are values and the
    verdict's words, last)."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[tuple[str, ...], Verdict]] = field(default_factory=list)
    key_columns: int = 1

    def add(self, ok: bool, *cells: str) -> None:
        self.rows.append((cells, Verdict.PASS if ok else Verdict.FAIL))

    def skip(self, reason: str, *cells: str) -> None:
        """A row not checked because a declared optional prerequisite is absent."""
        self.rows.append(((*cells, f"SKIPPED: {reason}"), Verdict.SKIPPED))

    def add_stopped(self, value: Any, *cells: str) -> bool:
        """The row of a measurement that did not run (``attempt`` returned ``{"skipped": ...}``
        or ``{"error": ...}``), blank in the columns between; False if ``value`` is a result."""
        if not isinstance(value, dict) or not {"skipped", "error"} & set(value):
            return False
        cells = (*cells, *[""] * (len(self.columns) - len(cells) - 1))
        if "skipped" in value:
            self.skip(value["skipped"], *cells)
        else:
            self.add(False, *cells, f"FAILED: {value['error']}")
        return True

    def attempt(self, *cells: str, check: Callable[[], tuple[bool, str]]) -> None:
        """A row whose verdict ``check`` computes: SKIPPED for a missing prerequisite, FAILED
        naming the exception for anything else that stops it."""
        value = attempt(lambda: dict(zip(("ok", "verdict"), check())))
        if not self.add_stopped(value, *cells):
            self.add(value["ok"], *cells, value["verdict"])

    @property
    def ok(self) -> bool:
        return all(verdict for _, verdict in self.rows)

    @property
    def skipped(self) -> int:
        return sum(verdict is Verdict.SKIPPED for _, verdict in self.rows)


@dataclass(frozen=True)
class Run:
    """What a gate section's ``measure(run)`` and ``judge(base, now, run)`` are told of the run.

    ``fault``: the fault injected (``hookbench.measure.faults``), for sections that run ranks and
    inject it there; ``zero2_ranks``: the ZeRO-2 ranks' results when already run (``selfcheck``
    runs every fault's at once); ``recording``: ``hookbench record`` is measuring, so sections
    that write files for the gate (the checkpoints) write them first; ``replay``: the file of
    the baseline's random draws (``hookbench.core.draws``) and step traces
    (``hookbench.measure.trace``), written when recording, replayed from where it exists;
    ``repro``: the folder for scripts reproducing a change the traces locate; ``machine_note``: says that the baseline was recorded on
    another CPU, empty when not."""

    fault: str | None = None
    models: tuple[str, ...] = names.GATE_MODELS
    device: str = "fake"
    zero2_ranks: Any = None
    checkpoint_dir: Path | None = None
    workloads: tuple[Workload, ...] = ()
    recording: bool = False
    replay: Path | None = None
    repro: Path | None = None  # where a change located in one module or step gets its script
    machine_note: str = ""
    time_slack: float = names.GATE_TIME_SLACK
    strict_warnings: bool = False


def contract_rows(title: str, base: dict, now: dict) -> Section:
    """Each named behaviour (``None``: it holds; else the error) against its recorded outcome.
    One recorded violated that holds now is a fix, toward the contract: it passes, and says
    so."""
    section = Section(title, ("check", "recorded", "verdict"))
    for name, error in now.items():
        recorded = base.get(name, "not recorded")
        same = (error is None) == (recorded is None)
        fixed = error is None and recorded not in (None, "not recorded")
        section.add(same or fixed, name, "holds" if recorded is None else "violated",
                    ("holds" if error is None else f"VIOLATED: {error}")
                    + ("" if same else f" (FIXED since the baseline, which recorded: "
                                       f"{recorded}; record again to hold it)" if fixed
                       else " (changed; re-record only if intended)"))
    return section


def trajectory_verdict(base: dict | None, now: dict, tol: Tolerance | None,
                       machine_note: str) -> tuple[bool, str]:
    """A fingerprinted trajectory (``fingerprint``) against the recorded one: the
    same checksum, or else the final parameters within ``tol``."""
    if now.get("problems"):
        return False, "; ".join(now["problems"])
    if base is None or "sha256" not in base:
        return False, "no baseline recorded; record with `hookbench record`"
    if base["sha256"] == now["sha256"]:
        return True, f"identical (sha256 {now['sha256'][:12]})"
    result = compare([final_parameters(now)], [final_parameters(base)], tol)
    # Another CPU model's kernels round reduced precision differently (bf16 autocast, Intel Xeon
    # against AMD EPYC: 6x its tolerance after 3 steps), and so do other intra-op threads: say
    # so, the fix is the machine's own.
    advice = ("; the baseline is another machine's: record one on this machine, with these "
              "threads, to gate torch here" if machine_note and not result.ok else "")
    return result.ok, f"CHANGED bits{machine_note}; final parameters {result.verdict()}{advice}"


def trajectory_rows(title: str, base: dict, now: dict, tol: Tolerance | None,
                    machine_note: str) -> Section:
    section = Section(title, ("trajectory", "verdict"))
    for key, value in now.items():
        if section.add_stopped(value, key):
            continue
        ok, verdict = trajectory_verdict(base.get(key), value, tol, machine_note)
        section.add(ok, key, verdict)
    return section


def contract_section() -> Section:
    section = Section("Hook contract (PyTorch behaviours the mechanisms rely on)",
                      ("check", "verdict"))
    for name, error in hook_contract.run_all().items():
        section.add(error is None, name, "holds" if error is None else f"VIOLATED: {error}")
    return section


# The report's model: tied hidden layers (one parameter in two modules, used twice) and a frozen
# first layer, trained 4 steps of 2 accumulated micro-batches, so every path of the mechanism runs.
REPORT_SPEC = TinySpec(kind="mlp", depth=4, width=8, tied=True, frozen=True)
STEPS, ACCUMULATION = 4, 2


def optimizer_in_backward_section(spec: TinySpec = REPORT_SPEC) -> Section:
    section = Section(
        f"Optimizer in backward vs optimizer.step() ({spec.kind}, depth {spec.depth}, tied and "
        f"frozen layers, {str(spec.dtype).removeprefix('torch.')}, {STEPS} steps x "
        f"{ACCUMULATION} micro-batches)",
        ("family", "comparison", "verdict"), key_columns=2,
    )
    for family, (cls, kw) in FAMILIES.items():
        runs: dict[tuple[str, int], list] = {}

        def run(strategy: str, k: int = ACCUMULATION) -> list:
            if (strategy, k) not in runs:
                # buckets of about 1 KiB, so that the small model is cut into several
                options = {**kw, "bucket_cap_mb": 2**-10} if "bucketed" in strategy else kw
                runs[strategy, k] = trajectory(spec, cls, options, strategy, steps=STEPS,
                                               accumulation=k)
            return runs[strategy, k]

        comparisons = [
            ("per-parameter vs for-loop step", "in_backward", "forloop", 2),
            ("grouped vs for-loop step", "in_backward_grouped", "forloop", 2),
            ("grouped foreach vs foreach step", "in_backward_grouped_foreach", "foreach", 2),
            ("bucketed vs foreach step", "in_backward_bucketed", "foreach", 2),
            ("per-parameter vs foreach step", "in_backward", "foreach", 2),
            ("per-parameter vs fused step", "in_backward", "fused", 2),
            ("torch _apply_optimizer_in_backward", "peer", "in_backward", 1),
        ]
        for label, actual, expected, k in comparisons:
            def check(actual=actual, expected=expected, k=k) -> tuple[bool, str]:
                if expected == "fused" and "fused" not in inspect.signature(cls).parameters:
                    raise MissingPrerequisite(f"{cls.__name__} has no fused kernel in torch "
                                              f"{torch.__version__}")
                # Each bucket is one foreach step: the standard foreach step's arithmetic.
                result = compare(run(actual, k), run(expected, k), None if "bucketed" in actual
                                 else tolerance(expected if actual == "in_backward" else actual,
                                                spec.dtype))
                return result.ok, result.verdict()

            section.attempt(family, label, check=check)

        def alive_at_once() -> tuple[bool, str]:
            standard, _ = live_gradients(spec, cls, kw, "forloop")
            alive, after = live_gradients(spec, cls, kw, "in_backward")
            return (alive == 1 and after == 0,
                    f"{alive} in backward, {after} after (standard step: {standard})")

        section.attempt(family, "gradients alive at once", check=alive_at_once)
    return section
