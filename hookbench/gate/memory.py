"""The gate's ``memory`` section: per model and strategy, one training step's peak, each
category (``hookbench.measure.memory``) and the gradients alive at once, at most 1% above the
stored bytes on the fake backend (which counts exactly, so a drop fails too), the peak within
5% on CUDA. ``memory_verdict`` and ``amount`` serve the offload and workloads sections too."""

from __future__ import annotations

from typing import Any

from hookbench.core.prerequisites import attempt
from hookbench.gate.checks import Run, Section
from hookbench.measure.bounds import CUDA_SLACK, MEMORY_SLACK
from hookbench.measure.memory import format_bytes, measure as measure_step
from hookbench.models.zoo import workload as zoo_workload

# The faults selfcheck runs it under: a gradient kept or freed late, a tracker that cannot run
# or misses allocations
FAULTS = ("fires_before_accumulation", "keeps_gradients_alive", "fires_late",
          "private_module_missing", "private_api_changed", "tracker_misses_allocations")
STRATEGIES = ("foreach", "forloop", "in_backward", "in_backward_grouped_foreach", "zero2")
ZERO2_WORLD, ZERO2_BUCKET = 8, 2**22  # rank 0 of 8 simulated ranks, 16 MB buckets


def measure(run: Run) -> dict[str, Any]:
    def one(model: str, strategy: str) -> dict[str, Any]:
        r = measure_step(zoo_workload(model), strategy, backend=run.device,
                         world_size=ZERO2_WORLD, optimizer_kwargs={
                             "lr": 1e-3, "bucket_numel": ZERO2_BUCKET}
                         if strategy == "zero2" else None)
        return {"peak": r.peak, "breakdown": r.peak_breakdown,
                "gradients_alive_max": r.gradients_alive_max}

    return {f"{m}/{s}": attempt(lambda: one(m, s)) for m in run.models for s in STRATEGIES}


# Each amount in its own unit (712.2 KB, 68.76 MB, 6.088 GB) to 4 significant digits, 0.1% or
# finer: every difference the gate fails on (1% on the fake backend, 5% on CUDA) shows in the
# verdict's pair. The recorded and now columns may differ by less (a row that passes as
# "changed"): there ``amounts`` adds the digits that tell the two apart, down to the byte.
def amount(n: int) -> str:
    return format_bytes(n, 4)


def amounts(*ns: int) -> tuple[str, ...]:
    """``ns`` to 4 significant digits, or as many more as make different amounts print
    differently."""
    for digits in range(4, 17):  # 16 digits: any byte count below 10^16 B exactly
        printed = tuple(format_bytes(n, digits) for n in ns)
        if len(set(printed)) == len(set(ns)):
            break
    return printed


def slack_of(device: str) -> float:
    """How far a peak may move from its recorded bytes on ``device``'s backend."""
    return MEMORY_SLACK if device == "fake" else CUDA_SLACK


def category_pairs(rec: dict, value: dict) -> list[tuple[str, int, int]]:
    """(category, recorded, now) for every category of either breakdown: hookbench's
    CATEGORIES, or FSDPMemTracker's (the engines' rows); one that appears or vanishes counts
    as 0 B on the other side."""
    was, new = rec.get("breakdown", {}), value.get("breakdown", {})
    return [(c, was.get(c, 0), new.get(c, 0)) for c in dict.fromkeys([*new, *was])]


def memory_verdict(rec: dict | None, value: dict, device: str) -> tuple[bool, str]:
    """One measured step's memory against its recorded bytes."""
    slack = slack_of(device)
    if rec is None:
        return False, "no baseline recorded"
    pairs = [("peak", rec["peak"], value["peak"])]
    if device == "fake":  # the CUDA backend's categories come from the same tracker
        pairs += category_pairs(rec, value)
        if "gradients_alive_max" in value:
            pairs.append(("gradients alive", rec.get("gradients_alive_max", 0),
                          value["gradients_alive_max"]))
        # FSDP2's rows: what was live when backward ended (``engines.memory.rank_peak``); what
        # activations and temporaries stay live then has no formula, the baseline holds it
        pairs += [(what, rec[key], value[key]) for key, what in (
            ("states", "model states when backward ended"),
            ("left", "activations and temporaries when backward ended"))
            if key in rec and key in value]
    over = [f"{what} {amount(n)} > recorded {amount(r)}" + (f" ({n / r - 1:+.1%})" if r else "")
            for what, r, n in pairs if n > r * (1 + slack) + (0 if r else 512)]
    # Exact counting makes a drop as telling as a rise: memory that vanished is a tracker
    # that stopped seeing allocations, or a real saving to re-record on purpose.
    under = [f"{what} {amount(n)} < recorded {amount(r)} ({n / r - 1:+.1%})"
             for what, r, n in pairs if device == "fake" and n < r * (1 - slack)]
    if device != "fake" and value["peak"] < rec["peak"] * (1 - slack):
        under.append(f"peak {amount(value['peak'])} < fake estimate {amount(rec['peak'])}")
    changed = [what for what, r, n in pairs if n != r]
    verdict = ("; ".join(
        (["EXCEEDED: " + "; ".join(over)] if over else [])
        + (["DROPPED: " + "; ".join(under) + " (if intended, re-record on purpose with "
            "`hookbench record`)"] if under else []))
        or (f"changed: {', '.join(changed)}" if changed else "identical"))
    return not over and not under, verdict


def judge(base: dict, now: dict, run: Run) -> Section:
    device = run.device
    slack = slack_of(device)
    section = Section(
        f"Peak memory per model and strategy (Adam, batch 1, backend {device}) against the "
        f"baseline; fails {slack:.0%} above it" + (" or below it (the fake backend counts "
                                                  "exactly)" if device == "fake" else ""),
        ("model/strategy", "recorded", "now", "verdict"))
    for key, value in now.items():
        if section.add_stopped(value, key):
            continue
        ok, verdict = memory_verdict(base.get(key), value, device)
        recorded, peak = (amounts(base[key]["peak"], value["peak"]) if key in base
                          else ("", amount(value["peak"])))
        section.add(ok, key, recorded, peak, verdict)
    return section
