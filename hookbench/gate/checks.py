"""Verdict rows, and the live checks that both ``hookbench report`` and ``hookbench gate`` show.

A ``Section`` is a titled list of rows (what was checked, the verdict); a row is PASS, FAILED
or SKIPPED, and SKIPPED only for a declared optional prerequisite that is absent
(``hookbench.core.prerequisites``). ``contract_section`` runs the hook contract;
``optimizer_in_backward_section`` compares the optimizer in backward with ``optimizer.step()``
for every optimizer family on ``REPORT_SPEC``, live.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hookbench.core.prerequisites import MissingPrerequisite, attempt
from hookbench.measure import hook_contract
from hookbench.measure.parity import FAMILIES, compare, live_gradients, tolerance, trajectory
from hookbench.models.zoo import TinySpec

__all__ = ["ACCUMULATION", "REPORT_SPEC", "STEPS", "Section", "Verdict", "contract_section",
           "optimizer_in_backward_section"]


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
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[tuple[str, ...], Verdict]] = field(default_factory=list)

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
        ("family", "comparison", "verdict"),
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
