"""The PyTorch-upgrade gate: the installed torch against the stored baseline.

    hookbench record      measure every section and write baselines/gate.json (on purpose)
    hookbench gate        measure again on the installed torch, print what changed, exit 1 when
                          a check regressed: the CI job that blocks a PyTorch upgrade
    hookbench selfcheck   the gate under each fault of ``hookbench.measure.faults``: every one must be
                          caught and the clean run must pass, or the gate proves nothing

One module per section, registered in ``REGISTRY`` in the order the gate prints them; its
docstring says what the section checks. A section module has

    measure(run)            its rows on the installed torch (``checks.Run`` says under what), or
                            None when there is nothing to measure; ``measure = None`` for a live
                            section (parity), which records nothing and is judged on the spot
    judge(base, now, run)   a ``checks.Section``: ``now`` against the recorded ``base``
    FAULTS                  the faults ``selfcheck`` runs it under besides the clean run: None
                            for every fault, a tuple for those only (sections that start ranks
                            or compile take seconds), () for none (no fault targets it)

A new section is a new module, its line in ``REGISTRY`` and its name in
``hookbench.core.names.GATE_SECTIONS`` (the command line reads that without importing torch).
A section whose measurement raises is one failed row naming the exception, never a crash.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from hookbench.core import names
from hookbench.core.prerequisites import StorageFailed, one_line
from hookbench.core.workload import Workload
from hookbench.gate import (baselines, checkpoints, collectives, compiled_hooks, emitted_warnings,
                            engines, hooks, known_failures, memory, numerics, offload,
                            parity, step_time, workload_checks, zero2)
from hookbench.gate.checks import Run, Section
from hookbench.measure.faults import FAULTS, inject

__all__ = ["MODELS", "REGISTRY", "SECTIONS", "WORKLOAD_SECTIONS", "check", "failures", "gate",
           "measure_all", "record", "selfcheck"]

REGISTRY = {"hooks": hooks, "parity": parity, "numerics": numerics, "zero2": zero2,
            "engines": engines, "collectives": collectives, "checkpoints": checkpoints, "compile": compiled_hooks,
            "warnings": emitted_warnings, "memory": memory, "offload": offload,
            "workloads": workload_checks, "time": step_time}
SECTIONS = names.GATE_SECTIONS
assert tuple(REGISTRY) == SECTIONS, "hookbench.core.names.GATE_SECTIONS lists REGISTRY's names"
WORKLOAD_SECTIONS = names.GATE_WORKLOAD_SECTIONS  # the hook contract and the workloads' rows
MODELS = names.GATE_MODELS  # the gate's default
RECORD_MODELS = names.GATE_RECORD_MODELS  # recorded, so that --models vit_l_16 can be gated
CRASHED = known_failures.CRASHED  # the key of a section whose measurement as a whole raised
REPLAY = "replay.pt"  # what ``record`` writes the workloads' replay file to, in its checkpoint_dir


def measure_all(sections: tuple[str, ...] = SECTIONS, models: tuple[str, ...] = MODELS,
                fault: str | None = None, device: str = "fake",
                zero2_ranks: list | BaseException | None = None,
                checkpoint_dir: str | Path | None = None, workloads: list[Workload] = (),
                recording: bool = False, replay: str | Path | None = None,
                repro: str | Path | None = None) -> dict[str, Any]:
    """Everything the baseline holds, measured on the installed torch (under ``fault``).
    ``zero2_ranks``: the ranks' results if already run (``selfcheck`` runs all at once).
    ``checkpoint_dir``: where the baseline's checkpoint files are (default: checkpoints/
    beside ``baselines.DEFAULT``). ``replay``: the file of the workloads' random draws and
    traces, written when recording, replayed where it exists (``Run.replay``); ``repro``:
    where scripts reproducing a located change go (``Run.repro``)."""
    run = Run(fault=fault, models=models, device=device, zero2_ranks=zero2_ranks,
              checkpoint_dir=Path(checkpoint_dir or baselines.checkpoint_folder()),
              workloads=tuple(workloads), recording=recording,
              replay=Path(replay) if replay else None, repro=Path(repro) if repro else None)
    out: dict[str, Any] = {"recorded_with": baselines.environment()}
    with inject(fault):
        for name, section in REGISTRY.items():
            if name in sections and section.measure is not None:
                try:
                    rows = section.measure(run)
                except StorageFailed:
                    raise  # the file system failing (a full disk) is not a failure of torch's
                except Exception as e:  # noqa: BLE001 - named in the section's one failed row
                    rows = {CRASHED: one_line(e)}
                if rows is not None:
                    out[name] = rows
    return out


def failures(measured: dict[str, Any]) -> list[str]:
    """What failed in a measurement (``measure_all``), ``section/key: words`` each: a crashed
    section, a row that raised or found a problem (``known_failures.of``)."""
    return known_failures.listed(known_failures.of(measured))


def record(models: tuple[str, ...] = RECORD_MODELS, sections: tuple[str, ...] = SECTIONS,
           checkpoint_dir: str | Path | None = None,
           workloads: list[Workload] = ()) -> dict[str, Any]:
    """The baseline of the installed torch (``hookbench record`` saves it); a live section
    (parity) compares two strategies now and stores nothing. The checkpoint files are written
    into ``checkpoint_dir`` first, then resumed like the gate resumes them. A row that fails
    on this torch is kept as it is and listed, with its words, as a known failure
    (``known_failures``): the gate holds a later torch to the same failure."""
    data = measure_all(sections, models, checkpoint_dir=checkpoint_dir, workloads=workloads,
                       recording=True, replay=checkpoint_dir and Path(checkpoint_dir) / REPLAY)
    known = known_failures.of(data)
    return {**data, known_failures.KEY: known} if known else data


def check(base: dict[str, Any], now: dict[str, Any], parity: bool = True,
          time_slack: float = step_time.SLACK, strict_warnings: bool = False
          ) -> dict[str, Section]:
    """The gate's verdict by section: ``now`` (``measure_all``) against the baseline ``base``;
    ``parity``: judge the live sections too. A section whose measurement crashed is one failed
    row naming the exception."""
    was, here = (" ".join(filter(None, (env.get("cpu"), env["cpu_capability"])))
                 for env in (base["recorded_with"], now["recorded_with"]))
    # torch's intra-op threads split fp32 sums, so they change the bits as a CPU does (None:
    # a baseline of schema 1, which did not record them)
    threads = (base["recorded_with"].get("threads"), now["recorded_with"].get("threads"))
    notes = ([f"recorded on {was}, this CPU is {here}"] if was != here else []) + (
        [f"recorded on {threads[0]} threads, this run has {threads[1]}"]
        if None not in threads and threads[0] != threads[1] else [])
    run = Run(device=now.get("device", "fake"), time_slack=time_slack,
              strict_warnings=strict_warnings,
              machine_note=f" ({'; '.join(notes)})" if notes else "")
    out = {}
    for name, section in REGISTRY.items():
        known = base.get(known_failures.KEY, {}).get(name, {})
        if section.measure is None:  # live: judged now, against nothing recorded
            if parity:
                out[name] = _crash_safe(name, lambda: section.judge({}, {}, run))
        elif name not in now:
            continue
        elif CRASHED in known or CRASHED in now[name]:
            out[name] = (_known(Section(f"{name}: the measurement as a whole", (
                "section", "verdict")), known_failures.judge({CRASHED: known[CRASHED]},
                                                               now[name]))
                         if CRASHED in known else _stopped(name, now[name][CRASHED]))
        else:
            # a recorded failure has no values to hold the row to: its judge sees none
            recorded = {k: v for k, v in base.get(name, {}).items() if k not in known}
            out[name] = _known(section.judge(recorded, now[name], run),
                               known_failures.judge(known, now[name]))
    return out


def _known(section: Section, rows: list[tuple[str, bool, str]]) -> Section:
    """``section`` with the known failures' rows (``known_failures.judge``) in place of what
    its judge said of them."""
    keys = {key for key, _, _ in rows}
    section.rows = [row for row in section.rows if row[0][0] not in keys]
    for key, ok, verdict in rows:
        section.add(ok, key, *[""] * (len(section.columns) - 2), verdict)
    return section


def _stopped(name: str, error: str) -> Section:
    section = Section(f"{name}: the measurement stopped", ("section", "verdict"))
    section.add(False, name, f"FAILED: {error}")
    return section


def _crash_safe(name: str, build: Callable[[], Section]) -> Section:
    try:
        return build()
    except Exception as e:  # noqa: BLE001 - one failed row naming it
        return _stopped(name, one_line(e))


def gate(base: dict[str, Any], sections: tuple[str, ...] = SECTIONS,
         models: tuple[str, ...] = MODELS, fault: str | None = None, device: str = "fake",
         zero2_ranks: list | None = None, time_slack: float = step_time.SLACK,
         checkpoint_dir: str | Path | None = None, strict_warnings: bool = False,
         workloads: list[Workload] = (), replay: str | Path | None = None,
         repro: str | Path | None = None) -> tuple[dict[str, Section], dict[str, Any]]:
    """Measure on the installed torch and judge against ``base``: the verdict by section, and
    what was measured (``measure_all``; the workloads on the recorded draws of ``replay``)."""
    now = measure_all(sections, models, fault, device, zero2_ranks, checkpoint_dir, workloads,
                      replay=replay, repro=repro)
    now["device"] = device
    with inject(fault):
        if isinstance(now.get("time"), dict) and CRASHED not in now["time"]:
            now["time"] = step_time.confirm(base.get("time", {}), now["time"], time_slack)
        return check(base, now, parity="parity" in sections, time_slack=time_slack,
                     strict_warnings=strict_warnings), now


def selfcheck(base: dict[str, Any], sections: tuple[str, ...] = SECTIONS,
              models: tuple[str, ...] = ("transformer",),
              progress: Callable[[str], None] = lambda message: None,
              checkpoint_dir: str | Path | None = None, replay: str | Path | None = None
              ) -> dict[str | None, dict[str, dict[str, str]]]:
    """The gate, clean and under every fault, with --strict-warnings (a new warning is a
    fault to catch): for each, the failed rows by section, each with its words (where the
    fault struck: the step and parameter, the module, the collective). A section no fault targets
    (``FAULTS == ()``) has nothing to prove here and is left out."""
    sections = tuple(s for s in sections if REGISTRY[s].FAULTS != ())
    # Only the faults some chosen section targets: a fault no chosen section is meant to
    # catch would otherwise run the gate on nothing and read as missed.
    runs = [None, *(f for f in FAULTS if f not in (*names.PEER_FAULTS, *names.DRAW_FAULTS) and any(
        REGISTRY[s].FAULTS is None or f in REGISTRY[s].FAULTS for s in sections))]
    progress("starting 2 gloo ranks for every fault's ZeRO-2 run ...")
    ranks = zero2.run_ranks(runs) if "zero2" in sections else dict.fromkeys(runs)
    caught = {}
    for fault in runs:
        progress(f"gate under {fault or 'no fault'} ...")
        here = tuple(s for s in sections
                     if fault is None or REGISTRY[s].FAULTS is None or fault in REGISTRY[s].FAULTS)
        result, _ = gate(base, here, models, fault, zero2_ranks=ranks[fault],
                         checkpoint_dir=checkpoint_dir, strict_warnings=True, replay=replay)
        # each failed row with its words: which row a fault struck, and where in it
        caught[fault] = {name: {cells[0]: cells[-1] for cells, ok in s.rows if not ok}
                         for name, s in result.items() if not s.ok}
    return caught
