"""A user's workloads through the gate on the baseline's replay file (``<name>.replay.pt``
beside its json, ``hookbench.gate.baselines.replay_file``): their random draws
(``hookbench.core.draws``) and their standard steps' traces (``hookbench.measure.trace``),
recorded with the baseline and replayed on the gate, in this process and on the spawned ranks.

    measured      the workloads' rows, measured in a recording or a replaying session; per
                  workload a ``name/draws`` row (what the draws showed), and on the gate each
                  row's ``located``: where its step first changed against the recorded trace,
                  with a script reproducing a change in one module or one optimizer step
    located       a row's location in words (kernel rounding named where the baseline is
                  another machine's)
    within_rounding  a row beyond its tolerance whose first change was a kernel's rounding,
                  held to the workload's rounding floor
    drawn         a draws row in words
    say_replayed  every row of a workload whose draws differ from the baseline's says they
                  were replayed
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

import torch

from hookbench.core import draws
from hookbench.core.prerequisites import one_line
from hookbench.core.workload import Workload
from hookbench.engines import references
from hookbench.gate import baselines, rows
from hookbench.gate.checks import Run, Section
from hookbench.measure import bounds, trace
from hookbench.measure.bounds import FLOOR_FACTOR, KERNEL_ROUNDING_ULPS, Tolerance
from hookbench.measure.parity import compare

__all__ = ["drawn", "located", "measured", "say_replayed", "within_rounding"]


def measured(run: Run, measure_all: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure_all()``'s rows of ``run.workloads``: as recorded where the baseline has no
    replay file; else in a session recording into it (``run.recording``) or replaying it."""
    workloads = list(run.workloads)
    if run.replay is None or not (run.recording or run.replay.is_file()):
        got = measure_all()  # a baseline without a replay file
        _ranks_traces(got)
        return got
    if run.recording:
        with draws.recording() as session:
            got = measure_all()
            traces = {w.name: _traces(w) for w in workloads}
        draws.save(run.replay, session.draws, traces=traces, ranks=_ranks_traces(got),
                   torch=str(torch.__version__))
    else:
        recorded = draws.load(run.replay)
        os.environ[draws.ENV] = str(run.replay)  # the ranks replay the same file
        try:
            with draws.replaying(recorded["draws"]) as session:
                got = measure_all()
                ranks = {"was": recorded.get("ranks", {}), "now": _ranks_traces(got)}
                for w in workloads:  # on the recorded draws too: a repro, a rounding floor
                    _locate(w, got, recorded["traces"].get(w.name, {}), _traces(w),
                            run.repro, recorded.get("torch", "the baseline's"), ranks)
        finally:
            del os.environ[draws.ENV]
    return {**got, **{f"{w.name}/draws": session.report(w.name) for w in workloads}}


def _ranks_traces(got: dict[str, Any]) -> dict[str, Any]:
    """Each ranks row's trace of rank 0's steps (``trace.RankTrace``), taken out of its row:
    it goes into the replay file, not into the baseline."""
    return {key: value.pop("ranks_trace") for key, value in got.items()
            if isinstance(value, dict) and "ranks_trace" in value}


def _implementation(workload: Workload, row: str) -> str:
    """The standard step whose trace locates a change in ``row``: the implementation it steps
    with, or is held to (the optimizer in backward, ZeRO-2 and the engines: the for-loop)."""
    if row in ("foreach", "fused"):
        return row
    if row == "in_backward_bucketed" or row.endswith("_foreach"):
        return rows.ROWS[row].references_for(workload)[0].run
    return "forloop"


def _traces(workload: Workload) -> dict[str, Any]:
    """The traces of ``workload``'s standard steps, one per implementation its rows use (what
    stopped one, as its ``error``)."""
    wanted = {_implementation(workload, r.name) for r in rows.STRATEGY_ROWS
              if r.only_if(workload) and not r.not_applicable(workload)}
    out = {}
    for implementation in sorted(wanted):
        try:
            out[implementation] = trace.trace(workload, implementation, rows.STEPS)
        except Exception as e:  # noqa: BLE001 - no location, and the words say why
            out[implementation] = {"error": one_line(e)}
    return out


def _locate(workload: Workload, got: dict[str, Any], was: dict[str, Any],
            now: dict[str, Any], folder: Path | None = None, torch_was: str = "",
            ranks: dict[str, dict[str, Any]] | None = None) -> None:
    """Each row of ``workload`` that ran gets ``located``: where its step first changed
    (``trace.locate``), or that the standard step is as recorded; with ``folder``, a change
    in one module or one optimizer step also gets a script reproducing it (``trace.repro``),
    named in the words. Where the standard step is as recorded, a ranks row's change is
    looked for in rank 0's steps (``ranks``: the recorded and the new ``trace.RankTrace`` of
    each row, ``trace.locate_ranks``). A change in arithmetic also gets ``rounding``: whether
    it was as small as a kernel's rounding where it first happened (``bounds.rounding``), and
    then the workload's rounding floor (``trace.rounding_floor``), which ``within_rounding``
    judges."""
    scripts: dict[str, str] = {}
    floors: dict[str, dict[str, float]] = {}
    for key, value in got.items():
        name, _, row = key.partition("/")
        if name != workload.name or rows.ROWS.get(row) is None or rows.ROWS[row].kind not in (
                "trajectory", "ranks") or not ({"sha256", "problems"} & set(value)):
            continue
        implementation = _implementation(workload, row)
        a, b = was.get(implementation), now.get(implementation)
        if a is None or b is None or "error" in a or "error" in b:
            why = (a or b or {}).get("error") or "no trace recorded"
            value["located"] = f"not located: the {implementation} step's trace ({why})"
            continue
        found = trace.locate(a, b)
        on_ranks = [(ranks or {}).get(side, {}).get(key) for side in ("was", "now")]
        if found is None and None not in on_ranks:
            found = trace.locate_ranks(*on_ranks)
        if found is None:
            value["located"] = (f"the standard {implementation} step is as recorded over "
                                f"{rows.STEPS} steps (data, forward, loss, backward, step)"
                                + (", and so are rank 0's steps (data, loss, what reached "
                                   "each collective, the synced gradients, the step)"
                                   if None not in on_ranks else "")
                                + ": the change is in this row's own path")
            continue
        place = found["words"]  # one script per place, whichever implementation found it
        if folder is not None and place not in scripts:
            try:
                script = trace.repro(workload, implementation, found, a, folder,
                                     implementation, torch_was)
            except Exception as e:  # noqa: BLE001 - the location stands; the words say why
                script = f"no repro ({one_line(e)})"
            scripts[place] = f"; repro: {script}" if script else ""
        value["located"] = place + scripts.get(place, "")
        if found["kind"].startswith("arithmetic") and None not in found["norms"]:
            small, relative, limit = bounds.rounding(workload, *found["norms"])
            value["rounding"] = {"relative": relative, "limit": limit}
            if small:
                shares = _shares(rows.ROWS[row])
                if (implementation, shares) not in floors:
                    floors[implementation, shares] = _floor(workload, implementation, *shares)
                value["rounding"]["floor"] = floors[implementation, shares]


def _shares(row: rows.Row) -> tuple[int, int]:
    """The ranks a row trains on and its micro-batches per step ((1, 1): one process)."""
    return (rows.ZERO2_RANKS, row.accumulation) if row.kind == "ranks" else (1, 1)


def _floor(workload: Workload, implementation: str, world: int,
           accumulation: int) -> dict[str, float]:
    """The workload's rounding floor as the row trains: a ranks row's on the ranks' shares
    (``references.shares_floor``), else the whole batch's."""
    if world == 1:
        return trace.rounding_floor(workload, implementation, rows.STEPS)
    return references.shares_floor(workload, rows.STEPS, world, accumulation)


def within_rounding(recorded: dict[str, Any], value: dict[str, Any], tol: Tolerance | None,
                    machine_note: str = "") -> tuple[bool, str]:
    """A row whose final parameters are beyond its tolerance from the recorded ones, where
    ``measured`` found the first change in arithmetic (``value["rounding"]``): it holds where
    that change was a kernel's rounding where it happened and the parameters are within
    ``FLOOR_FACTOR`` x the workload's rounding floor, tensor by tensor (training amplified a
    rounding, as it amplifies any); else it fails, saying which of the two it is not."""
    r = value["rounding"]
    now, was = baselines.final_parameters(value), baselines.final_parameters(recorded)
    changed = compare([now], [was], tol)
    beyond = changed.verdict()
    where = (f"where it first changed, its norm moved {r['relative']:.2g} relative, "
             + (f"a kernel's rounding (up to {r['limit']:.2g})" if "floor" in r else
                f"more than a kernel's rounding ({r['limit']:.2g}): what is computed changed"))
    if "floor" not in r:
        return False, f"CHANGED bits{machine_note}; final parameters {beyond}; {where}"
    floor = references.per_tensor_bounds([was], r["floor"])
    held = compare([now], [was], tol or Tolerance(rtol=0.0, atol=0.0), floor)
    held = dataclasses.replace(held, rounding_level=0, bound=(
        f"{FLOOR_FACTOR:g}x this workload's rounding floor per tensor: every module's output, "
        f"the gradient reaching it and every parameter's gradient moved {KERNEL_ROUNDING_ULPS} "
        f"ulps of its largest value"))
    amplified = (f"CHANGED bits{machine_note} by KERNEL ROUNDING: {where}; training amplified "
                 f"it to max |diff| {changed.max_abs:.3g} in the final parameters, beyond the "
                 f"row's tolerance")
    if held.ok:
        return True, f"{amplified} and within the rounding floor: {held.verdict()}"
    if recorded.get("standard_on_shares") and value.get("standard_on_shares"):
        # the row is the standard step on its ranks' shares to the bit, on the trusted torch
        # and on this one: its mechanism adds nothing to the distance, the standard step's
        # kernels made it. The floor is one draw of what training makes of a rounding; on a
        # share of one image BatchNorm makes it chaotic, and a draw may fall short
        # (torchvision's ShuffleNet, 2.9.1 -> 2.6.0: 1.75x the bound)
        return True, (f"{amplified} and beyond the rounding floor "
                      f"({held.verdict().removeprefix('FAIL: ')}), where "
                      f"this row is bit for bit the standard step on the ranks' shares, as "
                      f"recorded: the change is that step's own, the row's mechanism adds "
                      f"nothing to it")
    return False, (f"CHANGED bits{machine_note}; final parameters {beyond}; {where}, but "
                   f"the parameters moved further than rounding moves them: "
                   f"{held.verdict()}")




def located(value: dict[str, Any], machine_note: str) -> str | None:
    """Where a row that changed first changed (``measured``), and, where the baseline comes
    from another CPU or thread count, that kernel rounding is one kind of change it may be."""
    located = value.get("located")
    if located and machine_note:
        located += (" (or kernel rounding: recorded on another CPU or with other threads; "
                    "record on this machine to tell)")
    return located


def drawn(value: dict[str, Any]) -> str:
    """A workload's draws row in words (``hookbench.core.draws.Session.report``)."""
    differ = value.get("differ", 0)
    words = [f"{value['draws']} random draws " + (
        f"replayed: {differ} differ from the baseline's (this torch draws other numbers; "
        f"every row compared on the recorded ones), held to the recorded distribution"
        if differ else "as recorded")]
    for field, what in (("not_recorded", "not in the baseline, drawn anew"),
                        ("not_replayable", "not replayable (compared as drawn)")):
        if value.get(field):
            words.append(f"{what}: " + ", ".join(f"{op} x{n}" for op, n in
                                                 sorted(value[field].items())))
    return "; ".join(words)


def say_replayed(section: Section, now: dict[str, Any]) -> None:
    """A release that draws other random numbers: every row of the workload was compared on
    the recorded draws, and says so."""
    replayed = {key.split("/")[0] for key, value in now.items()
                if key.endswith("/draws") and value.get("differ")}
    for i, (cells, verdict) in enumerate(section.rows):
        name, _, row = cells[0].partition("/")
        if name in replayed and row in rows.ROWS and rows.ROWS[row].kind in (
                "trajectory", "ranks", "capture", "transform"):
            section.rows[i] = ((*cells[:-1], f"{cells[-1]}; random draws differ from the "
                                             f"baseline's: replayed"), verdict)
