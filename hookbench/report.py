"""``hookbench report``: what hookbench verifies, run on the installed torch, as a table.

Each section is a list of rows (what was checked, the verdict, whether it holds); a failed row
makes ``hookbench report`` exit non-zero, so the report doubles as a CI check.
"""

from __future__ import annotations

import inspect
import platform
from dataclasses import dataclass, field
from typing import Callable

import torch

from hookbench import hook_contract
from hookbench.memory import CATEGORIES, MemoryResult, measure
from hookbench.parity import (
    FAMILIES,
    compare,
    live_gradients,
    parameters_only,
    tolerance,
    trajectory,
)
from hookbench.zoo import TinySpec, ZooSpec

__all__ = [
    "MEMORY_STRATEGIES",
    "Section",
    "contract_section",
    "memory_section",
    "optimizer_in_backward_section",
    "render",
    "zero2_section",
]


@dataclass
class Section:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[tuple[str, ...], bool]] = field(default_factory=list)

    def add(self, ok: bool, *cells: str) -> None:
        self.rows.append((cells, ok))

    @property
    def ok(self) -> bool:
        return all(ok for _, ok in self.rows)


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
                runs[strategy, k] = trajectory(spec, cls, kw, strategy, steps=STEPS,
                                               accumulation=k)
            return runs[strategy, k]

        comparisons = [
            ("per-parameter vs for-loop step", "in_backward", "forloop", 2),
            ("grouped vs for-loop step", "in_backward_grouped", "forloop", 2),
            ("grouped foreach vs foreach step", "in_backward_grouped_foreach", "foreach", 2),
            ("per-parameter vs foreach step", "in_backward", "foreach", 2),
            ("per-parameter vs fused step", "in_backward", "fused", 2),
            ("torch _apply_optimizer_in_backward", "peer", "in_backward", 1),
        ]
        for label, actual, expected, k in comparisons:
            if expected == "fused" and "fused" not in inspect.signature(cls).parameters:
                section.add(True, family, label, f"skipped: {cls.__name__} has no fused kernel")
                continue
            try:
                result = compare(run(actual, k), run(expected, k),
                                 tolerance(expected if actual == "in_backward" else actual,
                                           spec.dtype))
                section.add(result.ok, family, label, result.verdict())
            except RuntimeError as e:  # e.g. a hook that fires twice is refused
                section.add(False, family, label, f"ERROR: {e}")
        try:
            standard, _ = live_gradients(spec, cls, kw, "forloop")
            alive, after = live_gradients(spec, cls, kw, "in_backward")
            section.add(alive == 1 and after == 0, family, "gradients alive at once",
                        f"{alive} in backward, {after} after (standard step: {standard})")
        except RuntimeError as e:
            section.add(False, family, "gradients alive at once", f"ERROR: {e}")
    return section


MEMORY_STRATEGIES = ("foreach", "forloop", "fused", "in_backward", "in_backward_grouped_foreach")


def memory_section(results: list[MemoryResult]) -> Section:
    """Peak and breakdown per strategy, the distance to the floor and the saving against the
    standard foreach step. A row fails when an in-backward strategy does not beat the standard
    step or ever holds every gradient at once."""
    first = results[0]
    section = Section(
        f"Peak memory of one training step ({first.model}, batch {first.batch_size}, Adam, "
        f"backend {first.backend}; GB)",
        ("strategy", "peak", "params", "grads", "opt state", "activations", "temporaries",
         "floor", "vs floor", "vs foreach", "grads alive at once"),
    )
    standard = next(r for r in results if r.strategy == "foreach")
    for r in results:
        in_backward = r.strategy.startswith("in_backward")
        ok = not in_backward or (r.peak < standard.peak
                                 and r.gradients_alive_max < r.all_gradients)
        section.add(
            ok, r.strategy, f"{r.peak / 1e9:.3f}",
            *(f"{r.peak_breakdown[c] / 1e9:.3f}" for c in CATEGORIES),
            f"{r.floor / 1e9:.3f}", f"{r.above_floor:+.1%}",
            f"{r.peak / standard.peak - 1:+.1%}",
            f"{r.gradients_alive_max / 1e9:.3f} of {r.all_gradients / 1e9:.3f}",
        )
    return section


ZERO2_RANKS = (2, 8, 64)
ZERO2_BUCKET = 2**22  # gradient elements per bucket


def zero2_section(spec: ZooSpec, backend: str, standard: MemoryResult | None,
                  fused: MemoryResult | None,
                  progress: Callable[[str], None] = lambda message: None) -> Section:
    """Parity of ZeRO-2 on 2 spawned gloo ranks against single-process training, and rank 0's
    peak for N ranks against the ZeRO formula, beside the single-device strategies (where
    measured)."""
    from hookbench import launch, zero2  # spawning ranks; only this section needs it

    section = Section("ZeRO-2 (sharded gradient release): parity on gloo, and memory per rank "
                      "(GB) against 4 Psi + 12 Psi / N", ("check", "verdict"))
    progress("ZeRO-2: parity on 2 gloo ranks ...")
    cases = zero2.parity_cases()
    ranks = launch.run(zero2.trajectories, 2, cases)
    for i, case in enumerate(cases):
        ref = parameters_only(trajectory(case["spec"], case["optimizer_class"], case["kwargs"],
                                         "forloop", steps=case["steps"]))
        for rank, got in enumerate(ranks):
            result = compare(got[i]["snapshots"], ref, zero2.TOLERANCE)
            section.add(result.ok, f"{case['optimizer_class'].__name__}, gloo rank {rank} of 2",
                        result.verdict())
    for n in ZERO2_RANKS:
        progress(f"ZeRO-2: {spec.name} rank 0 of {n}, backend {backend} ...")
        r = measure(spec, "zero2", backend=backend, world_size=n,
                    optimizer_kwargs={"lr": 1e-3, "bucket_numel": ZERO2_BUCKET})
        formula = r.parameters * (1 + 3 / n)
        ok = r.gradients_alive_max < r.all_gradients and (standard is None
                                                          or r.peak < standard.peak)
        beside = "" if standard is None or fused is None else (
            f"; one device: foreach {standard.peak / 1e9:.3f}, in backward {fused.peak / 1e9:.3f}")
        section.add(ok, f"{r.model} rank 0 of {n}",
                    f"peak {r.peak / 1e9:.3f}; formula {formula / 1e9:.3f} + activations "
                    f"{r.activations_peak / 1e9:.3f} + bucket {4 * ZERO2_BUCKET / 1e9:.3f}"
                    + beside)
    return section


def render(sections: list[Section], title: str = "hookbench report") -> str:
    lines = [
        f"{title}: torch {torch.__version__}, "
        f"CUDA {torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}"
        f", Python {platform.python_version()}",
    ]
    for section in sections:
        widths = [max(len(c), *(len(cells[i]) for cells, _ in section.rows))
                  for i, c in enumerate(section.columns[:-1])]
        lines += ["", section.title]
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(section.columns, widths))
                     + "  " + section.columns[-1])
        for cells, ok in section.rows:
            mark = " " if ok else "!"
            lines.append(mark + " " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))
                         + "  " + cells[-1])
    failed = sum(not ok for s in sections for _, ok in s.rows)
    total = sum(len(s.rows) for s in sections)
    lines += ["", f"{total - failed} of {total} checks hold" + ("" if not failed else
              f"; {failed} FAILED (marked !)")]
    return "\n".join(lines)
