"""The gate's ``zero2`` section: ZeRO-2 on 2 gloo ranks (``hookbench.measure.zero2_runs``) per
optimizer: bit for bit torch's DDP on the same shares (``hookbench.engines.references``),
parity with single-process training, the stored checksum (or else the tolerance), no gradient
left on a parameter, every hook once per backward."""

from __future__ import annotations

from typing import Any

from hookbench.core import launch
from hookbench.gate.baselines import fingerprint
from hookbench.gate.checks import Run, Section, trajectory_rows
from hookbench.engines import references
from hookbench.measure import bounds, zero2_runs
from hookbench.measure.parity import compare, parameters_only, trajectory

FAULTS = None


def run_ranks(faults: list[str | None]) -> dict[str | None, list]:
    """Every rank's ZeRO-2 trajectories for each fault, and torch's DDP on the same cases (no
    fault: the reference), from one start of 2 gloo ranks (the fault is injected inside the
    ranks): per fault, per optimizer, (ZeRO-2's ranks, DDP's ranks)."""
    clean = [{**case, "key": (name, "zero2", "clean")}
             for name, case in zip(zero2_runs.PARITY_OPTIMIZERS, zero2_runs.parity_cases())]
    cases = [{**case, "key": (name, "zero2", str(fault))} for fault in faults
             for name, case in zip(zero2_runs.PARITY_OPTIMIZERS, zero2_runs.parity_cases(fault))]
    got = references.gathered(launch.run(references.ranks, 2,
                                         [*cases, *references.ddp_beside(clean)], timeout=300))
    return {fault: [(got[(name, "zero2", str(fault))], got[(name, "zero2", "ddp")])
                    for name in zero2_runs.PARITY_OPTIMIZERS] for fault in faults}


def measure(run: Run) -> dict[str, Any]:
    """Raises what stopped the ranks (crashed or late): the whole section fails, naming it."""
    runs = run.zero2_ranks
    if runs is None:
        runs = run_ranks([run.fault])[run.fault]
    if isinstance(runs, BaseException):  # ``selfcheck``'s ranks crashed or ran late
        raise runs
    out = {}
    for name, case, (ranks, ddp) in zip(zero2_runs.PARITY_OPTIMIZERS,
                                        zero2_runs.parity_cases(), runs):
        problems = zero2_runs.rank_problems(ranks)
        if any(got["error"] for got in ranks):
            out[name] = {"problems": problems}
            continue
        # fp32 on gloo, an elementwise optimizer, no clipping: DDP's arithmetic, bit for bit
        against = compare(ranks[0]["snapshots"], ddp[0]["snapshots"])
        if not against.ok:
            problems.append(f"vs DDP on the same shares: {against.verdict()}")
        reference = parameters_only(trajectory(case["spec"], case["optimizer_class"],
                                               case["kwargs"], "forloop", steps=case["steps"]))
        parity = compare(ranks[0]["snapshots"], reference, bounds.DATA_PARALLEL)
        if not parity.ok:
            problems.append(f"vs single-process training: {parity.verdict()}")
        out[name] = {**fingerprint(ranks[0]["snapshots"]), "problems": problems}
    return out


def judge(base: dict, now: dict, run: Run) -> Section:
    return trajectory_rows(
        "ZeRO-2 on 2 gloo ranks against DDP, single-process training and the stored checksum",
        base, now, bounds.DATA_PARALLEL, run.machine_note)
