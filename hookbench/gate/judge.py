"""The one judge of the rows trained on ranks (``zero2``, ``engines/*``): each row read from its
entry in ``hookbench.gate.rows``, in one fixed order.

    1. designed outcome  torch would not wrap the model: recorded in its words. A refusal the
                         entry declares must happen, in words, before anything is stepped; one
                         it does not declare fails the row, and so does training where the
                         entry says the row must refuse
    2. errors            a rank that raised fails the row, naming it
    3. checks            the entry's ``checker``: the engine's hooks, buckets and settings, and
                         every rank's parameters equal
    4. references        in the entry's order, each found by name among what was measured
                         before anything was judged (``Runs``): bit for bit where declared
                         exact, else within the row's bound; where the bound fails, the
                         noise-floor fallback the reference declares (``floor_of``,
                         ``confirmed_by``)
    5. the words         what each comparison found, then what the checks say ran

A reference that could not be measured (its run failed, and its own row says why) is said in
words; a row that was compared with nothing fails. Nothing here names an engine to decide what
a row is compared with: that is its entry's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hookbench.core.workload import Workload
from hookbench.engines import ddp, references
from hookbench.engines.verdicts import Checked
from hookbench.gate.rows import Reference, Row
from hookbench.measure.parity import Snapshot, Tolerance, compare

__all__ = ["Runs", "judge_row", "refused_words", "trained"]


def refused_words(error: str) -> str:
    """A refusal as a row shows it: the exception's type and the message's first clause."""
    return ": ".join(error.split(": ")[:2])


def trained(ranks: list[dict[str, Any]]) -> bool:
    """Every rank ran to the end: no error, no refusal (hookbench's or torch's)."""
    return not any(r.get("error") or "refused" in r or "torch_refuses" in r for r in ranks)


@dataclass(frozen=True)
class Runs:
    """What one launch's rows of a workload are judged from, all measured before any is
    judged: each run's per-rank results by row name (and "DDP on the same shares" beside
    ZeRO-2), the references measured in this process, and the row's bound."""
    workload: Workload
    results: dict[str, list[dict[str, Any]]]
    measured: references.Measured
    tol: Tolerance
    world: int

    def snapshots(self, name: str) -> list[Snapshot] | str:
        """The parameters after every step of the run ``name`` (a row's, or DDP's: without
        the team's comm hook, the arithmetic every other engine shares), or why there are
        none."""
        ranks = self.results.get(name) or self.results.get(
            "engines/ddp" if name == "DDP on the same shares" else "")
        if ranks is None:
            return f"no {_SHORT.get(name, name)} run"
        if not trained(ranks):
            return f"{_SHORT.get(name, name)} did not train the workload: its row says why"
        return ranks[0].get("plain", ranks[0]["snapshots"])


# The runs a row may be held to by name, as the words call them
_SHORT = {"DDP on the same shares": "DDP", "engines/fsdp2_zero2": "FSDP2 ZeRO-2",
          "engines/fsdp2_zero3": "FSDP2 ZeRO-3"}
# The references measured in this process, before any row is judged: always there
_MEASURED = ("one process on the ranks' shares", "the mixed-precision reference")


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype))


def _held(ref: Reference, run: list[Snapshot], runs: Runs) -> references.Held:
    """``run`` against reference ``ref``, within ``runs.tol`` unless ``ref`` is exact."""
    w, m, tol = runs.workload, runs.measured, runs.tol
    if ref.run == "DDP on the same shares":
        return references.against_ddp(w, run, runs.snapshots(ref.run), m.single, m.rounding,
                                      tol, runs.world, ref.exact, "" if ref.exact
                                      else ref.said(w), m.floor)
    if ref.run == "one process on the ranks' shares":
        if ref.floor_of:
            floor_of = runs.snapshots(ref.floor_of)
            return references.against_single(run, m.single, m.rounding, m.why, tol,
                                             floor_of if isinstance(floor_of, list) else None,
                                             references.arithmetic_differs(w, runs.world),
                                             m.floor)
        peer = runs.snapshots(ref.confirmed_by) if ref.confirmed_by else None
        return references.confirmed(run, peer if isinstance(peer, list) else None, m.single,
                                    m.rounding, tol, _short(w.parameter_dtype), m.ddp_order,
                                    m.floor if w.compile is not None else None)
    if ref.run == "the mixed-precision reference":
        dtypes = ref.dtypes(w)
        result = compare(run, m.mixed[dtypes], tol, m.rounding)
        reduced = "" if dtypes[1] == torch.float32 else f", {_short(dtypes[1])} reductions"
        return references.Held(f"fp32 shards vs one process with {_short(dtypes[0])} "
                               f"parameters{reduced} and fp32 masters: {result.verdict()}",
                               result.ok)
    assert ref.exact, f"{ref.run}: only another row's run is held bit for bit by name"
    result = compare(run, runs.snapshots(ref.run))
    name = f"{_SHORT[ref.run]} with a standard step" if ref.run in _SHORT else ref.run
    return references.Held(f"vs {name}: {result.verdict()}", result.ok)


def judge_row(entry: Row, runs: Runs) -> dict[str, Any]:
    """Row ``entry`` of ``runs.workload`` from its ranks' results: a designed outcome
    (``refused``, ``torch_refuses``), or ``problems``, ``parity`` (what it was compared with,
    in words), ``snapshots`` (rank 0's) and what its checks and yardstick keep."""
    w, ranks = runs.workload, runs.results[entry.name]
    must_refuse = entry.refuses(w)
    # 1. the designed outcome
    if "torch_refuses" in ranks[0]:  # torch itself would not wrap the model: nothing stepped
        return {"torch_refuses": ranks[0]["torch_refuses"]}
    refused = next((r["refused"] for r in ranks if "refused" in r), None)
    if refused is not None:
        return ({"refused": refused_words(refused)} if must_refuse
                else {"problems": [f"refused: {refused}"]})
    # 2. errors: a row that must refuse and stopped otherwise did not train either
    errors = [f"rank {i}: {r['error']}" for i, r in enumerate(ranks) if r.get("error")]
    if errors:
        return {"problems": errors + ([f"it must refuse ({must_refuse})"] if must_refuse
                                      else [])}
    if must_refuse:
        return {"problems": [f"trained the workload; it must refuse ({must_refuse})"]}
    # 3. the row's own checks
    checked = entry.checker(w, ranks, runs.results) if entry.checker else Checked()
    problems, words = list(checked.problems), []
    # 4. the references, in the entry's order
    held_to = entry.references_for(w)
    run, prefix = ranks[0]["snapshots"], ""
    for ref in held_to:
        if ref.run == "the team's comm hook applied by hand":
            # the team's hook is its own arithmetic (lossy compression, low rank): held bit for
            # bit to itself applied by hand; the references after it hold DDP without it, the
            # arithmetic the other engines share, and what the hook changes is said
            hook = w.ddp["comm_hook"]
            by_hand = compare(run, ranks[0]["by_hand"])
            words.append(f"comm hook {ddp.in_words(hook)}: vs the hook applied by hand to each "
                         f"rank's accumulated gradients in DDP's buckets: {by_hand.verdict()}")
            if not by_hand.ok:
                problems.append(words[-1])
            moved = compare(run, ranks[0]["plain"])
            words.append("the hook changes nothing against DDP without it" if moved.bit_exact
                         else f"the hook moves the parameters up to {moved.max_abs:.3g} from "
                              f"DDP without it ({moved.where})")
            run, prefix = ranks[0]["plain"], "DDP without the hook "
            continue
        against = None if ref.run in _MEASURED else runs.snapshots(ref.run)
        if isinstance(against, str):  # its run failed: its own row says why
            name = _SHORT.get(ref.run, ref.run)
            words.append(f"vs {name}: not compared ({against})")
            if len(held_to) == 1:  # compared with nothing
                problems.append(f"no {name} run to compare with")
            continue
        held = _held(ref, run, runs)
        words.append(prefix + held.words)
        if not held.ok:
            problems.append(words[-1])
    out: dict[str, Any] = {"problems": problems, "snapshots": ranks[0]["snapshots"],
                           **checked.fields}
    if any(ref.run == "one process on the ranks' shares" for ref in held_to):
        # whether the row is, step by step, the standard step on the ranks' shares to the bit:
        # where it is, on the trusted torch and on a later one, what moved it between the two
        # is the standard step's own arithmetic, not the row's (``replay.within_rounding``)
        out["standard_on_shares"] = compare(ranks[0]["snapshots"],
                                            runs.measured.single).bit_exact
    if any(ref.yardstick for ref in held_to):
        # the yardstick the baseline keeps: how far two legal references, DDP and the single
        # process, drift apart on this workload, step by step (a later torch is held to it)
        yard = runs.snapshots("DDP on the same shares")
        out["noise_floor"] = (references.largest(references.noise_floor(
            yard, runs.measured.single)) if isinstance(yard, list) else None)
        # and, where that distance is beyond the atol (the only place it can grow past the
        # recorded one and the atol), whether DDP is one process in DDP's order to the bit: its
        # reduction proven exact on this torch, whatever the two orders' distance (cached: a
        # DDP row further than its tolerance measured it already)
        ordered = runs.measured.ddp_order
        if ordered is not None and max(out["noise_floor"] or [0.0]) > runs.tol.atol:
            out["ddp_order"] = compare(yard, ordered()).bit_exact
    # 5. the words
    out["parity"] = "; ".join(words + checked.words)
    return out
