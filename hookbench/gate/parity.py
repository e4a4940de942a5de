"""The gate's ``parity`` section, live: nothing is recorded, each row compares two strategies
on the installed torch. The optimizer in backward against ``optimizer.step()`` per family
(``checks.optimizer_in_backward_section``: bit-exact where the arithmetic is identical, within
the per-dtype tolerance where it is not), and the standard foreach and fused steps against the
for-loop step, per family and option variant (``parity.IMPLEMENTATION_CASES``), in float32 and
float64. Another torch release is so checked against its own for-loop."""

from __future__ import annotations

import dataclasses
import functools

import torch

from hookbench.gate.checks import (ACCUMULATION, REPORT_SPEC, STEPS, Run, Section,
                                   optimizer_in_backward_section)
from hookbench.measure.parity import (AGAINST_FORLOOP, IMPLEMENTATION_CASES, against_forloop,
                                      missing_implementation)

FAULTS = None
measure = None  # live: judged on the installed torch alone
# The float64 rows hold PyTorch's own foreach test's precision (parity.tolerance).
IMPLEMENTATION_DTYPES = (torch.float32, torch.float64)


def _against_forloop(cls: type, kwargs: dict, implementation: str,
                     dtype: torch.dtype) -> tuple[bool, str]:
    missing = missing_implementation(cls, implementation)  # torch must refuse, not ignore, it
    if missing is not None:
        return True, missing
    result = against_forloop(dataclasses.replace(REPORT_SPEC, dtype=dtype), cls, kwargs,
                             implementation, steps=STEPS, accumulation=ACCUMULATION)
    return result.ok, result.verdict()


def judge(base: dict, now: dict, run: Run) -> Section:
    section = optimizer_in_backward_section()
    for case, (cls, kw) in IMPLEMENTATION_CASES.items():
        for implementation in AGAINST_FORLOOP:
            for dtype in IMPLEMENTATION_DTYPES:
                named = ("" if dtype == REPORT_SPEC.dtype
                         else f", {str(dtype).removeprefix('torch.')}")
                section.attempt(case, f"{implementation} step vs for-loop step{named}",
                                check=functools.partial(_against_forloop, cls, kw,
                                                        implementation, dtype))
    return section
