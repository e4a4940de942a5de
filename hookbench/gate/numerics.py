"""The gate's ``numerics`` section: 6 optimizer families x 4 strategies, 4 steps of 2
micro-batches on a tied and frozen MLP (``checks.REPORT_SPEC``): each trajectory's stored
checksum, or else its final parameters within the foreach tolerance."""

from __future__ import annotations

from typing import Any

from hookbench.core.prerequisites import attempt
from hookbench.gate.baselines import fingerprint
from hookbench.gate.checks import (ACCUMULATION, REPORT_SPEC, STEPS, Run, Section,
                                   trajectory_rows)
from hookbench.measure.parity import FAMILIES, tolerance, trajectory

FAULTS = None
TRAJECTORY_STRATEGIES = ("forloop", "foreach", "in_backward", "in_backward_grouped_foreach")


def measure(run: Run) -> dict[str, Any]:
    spec, steps, k = REPORT_SPEC, STEPS, ACCUMULATION
    return {f"{family}/{strategy}": attempt(lambda: fingerprint(
                trajectory(spec, cls, kw, strategy, steps=steps, accumulation=k)))
            for family, (cls, kw) in FAMILIES.items() for strategy in TRAJECTORY_STRATEGIES}


def judge(base: dict, now: dict, run: Run) -> Section:
    return trajectory_rows("Training trajectories against their stored checksums", base, now,
                           tolerance("foreach", REPORT_SPEC.dtype), run.machine_note)
