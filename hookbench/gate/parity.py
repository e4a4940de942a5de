"""The gate's ``parity`` section, live: nothing is recorded, each row compares two strategies
on the installed torch. The optimizer in backward against ``optimizer.step()`` per family
(``checks.optimizer_in_backward_section``: bit-exact where the arithmetic is identical, within
the per-dtype tolerance where it is not), and the standard foreach and fused steps against the
for-loop step, per family and option variant (``parity.IMPLEMENTATION_CASES``), in float32 and
float64 over whole trajectories, and in bfloat16 one step at a time from the for-loop's state
(``parity.stepwise``: in 8 bits a rounding is as large as a small update, so trajectories part
for no fault of either side); and ``capturable=True`` per family that takes it, or torch's
refusal of it on the CPU. Another torch release is so checked against its own for-loop:
the bf16 rows find pytorch#191763 (CPU fused SGD leaving bf16 parameters unchanged, torch 2.12
and 2.13)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from hookbench.gate.checks import (ACCUMULATION, REPORT_SPEC, STEPS, Run, Section,
                                   optimizer_in_backward_section)
from hookbench.measure.parity import (AGAINST_FORLOOP, FAMILIES, IMPLEMENTATION_CASES,
                                      accepts, against_forloop, missing_implementation,
                                      refused_here, stepwise)

# The faults selfcheck runs it under (a few seconds each): the hook faults that stop or double
# the optimizer in backward's step, and those that break an implementation's kernel or flag
FAULTS = ("fires_twice", "stops_after_first_backward", "never_fires",
          "implementation_flag_ignored", "capturable_ignored", "kernel_ignores_maximize",
          "fused_sgd_skips_low_precision")
measure = None  # live: judged on the installed torch alone
# The float64 rows hold PyTorch's own foreach test's precision (parity.tolerance); bfloat16 is
# torchtune's default training dtype (pure, no fp32 masters). No float16 rows: the families'
# settings make non-finite values in pure fp16 on the for-loop itself (Adam's eps 1e-8 is 0 in
# fp16), which ``stepwise`` refuses, as it must.
IMPLEMENTATION_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _against_forloop(cls: type, kwargs: dict, implementation: str,
                     dtype: torch.dtype) -> tuple[bool, str]:
    missing = missing_implementation(cls, implementation)  # torch must refuse, not ignore, it
    if missing is not None:
        return True, missing
    compared = stepwise if dtype == torch.bfloat16 else against_forloop
    result = compared(dataclasses.replace(REPORT_SPEC, dtype=dtype), cls, kwargs,
                      implementation, steps=STEPS, accumulation=ACCUMULATION)
    return result.ok, result.verdict()


def _capturable(cls: type, kwargs: dict) -> tuple[bool, str]:
    # Where torch refuses capturable=True (the CPU), its words are the row, measured each time:
    # a torch that ignored the flag would take it, step, and read its count back to the host.
    refused = refused_here(cls, {**kwargs, "capturable": True})
    if refused is not None:
        return True, f"torch refuses it on the CPU, in its words: {refused}"
    result = against_forloop(REPORT_SPEC, cls, kwargs, "capturable", steps=STEPS,
                             accumulation=ACCUMULATION)
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
    for family, (cls, kw) in FAMILIES.items():
        if accepts(cls, "capturable"):
            section.attempt(family, "capturable step vs for-loop step",
                            check=functools.partial(_capturable, cls, kw))
    return section
