"""``hookbench gate``: the installed torch against the stored baseline, section by section;
exit 1 when a check regressed (the CI job that blocks a PyTorch upgrade). With
``--junit-xml`` and ``--json`` it also writes the rows for CI; when a memory or time row
fails, a figure of it, recorded against now, in ``--out``."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from hookbench import gate, report
from hookbench.cli import common
from hookbench.gate import baselines, memory, step_time
from hookbench.gate.checks import Section
from hookbench.measure import plot
from hookbench.measure.memory import byte_unit
from hookbench.models.zoo import ZOO


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    workloads, sections, baseline = common.gated(args)
    files = common.verdict_files(args)
    base = baselines.load(baseline)
    models = common.chosen(args.models, tuple(ZOO), "models")
    device = common.backend(args.device)
    common.progress(f"gate: torch {torch.__version__} against the baseline of torch "
              f"{base['recorded_with']['torch']} ({baseline}) ...")
    result, now = gate.gate(base, sections, models, args.fault, device,
                            time_slack=args.time_slack,
                            checkpoint_dir=baselines.checkpoint_folder(baseline),
                            strict_warnings=args.strict_warnings, workloads=workloads,
                            replay=baselines.replay_file(baseline),
                            repro=Path(args.out) / "repro")
    print(report.render(list(result.values()), title="hookbench gate"))
    failed = [name for name, s in result.items() if not s.ok]
    skipped = sum(s.skipped for s in result.values())
    written = common.write_verdicts(
        files, "hookbench gate", result, time.perf_counter() - started, base, now,
        baseline=str(baseline), baseline_torch=base["recorded_with"]["torch"],
        **({"fault": args.fault} if args.fault else {}))
    panels = failed_panels(result, base, now, device, args.time_slack)
    if panels:
        written.append(plot.recorded_against_now(
            panels, common.output_dir(args.out) / "gate-failed.png",
            f"hookbench gate: torch {torch.__version__} against the baseline of torch "
            f"{base['recorded_with']['torch']}, the failed memory and time rows"))
    elif (stale := Path(args.out) / "gate-failed.png").is_file():
        # An earlier run's failures beside this run's verdicts would read as this run's (a CI
        # job that keeps its out folder, a user who gates again after a fix). Only looked
        # for: a gate that writes nothing makes no folder.
        stale.unlink()
        print(f"removed {stale}: an earlier gate's failed rows; none failed this time")
    if written:
        print(f"wrote {' and '.join(map(str, written))}")
    print(f"baseline: torch {base['recorded_with']['torch']} on "
          f"{base['recorded_with']['cpu_capability']}; GATE "
          + (f"FAILED in {', '.join(failed)}" if failed else "PASSED")
          + (f" ({skipped} rows SKIPPED, not compared)" if skipped else ""))
    return 1 if failed else 0


def failed_panels(result: dict[str, Section], base: dict[str, Any], now: dict[str, Any],
                  device: str, time_slack: float) -> list[dict]:
    """A panel (``plot.recorded_against_now``) per failed row that has a recorded and a
    measured peak (memory, the workloads' and engines' memory rows) or ratio (time)."""
    panels = []
    for section, verdicts in result.items():
        for cells, verdict in verdicts.rows:
            rec, value = (d.get(section, {}).get(cells[0]) for d in (base, now))
            if verdict or rec is None or value is None:
                continue
            if isinstance(value, dict) and "peak" in value and "peak" in rec:
                # the peak, and the categories that changed: what moved, not every category
                # of the tracker
                quantities = {"peak": (rec["peak"], value["peak"])} | {
                    c: (r, n) for c, r, n in memory.category_pairs(rec, value) if r != n}
                unit, size = byte_unit(max(max(pair) for pair in quantities.values()))
                slack = memory.slack_of(value.get("backend", device))
                panels.append({
                    "title": f"{section}: {cells[0]}", "unit": unit,
                    "bars": {q: (r / size, n / size) for q, (r, n) in quantities.items()},
                    "limits": {q: r * (1 + slack) / size for q, (r, _) in quantities.items()}})
            elif section == "time" and isinstance(value, float) and isinstance(rec, float):
                panels.append({
                    "title": f"time: {cells[0]} (target {step_time.TIME_TARGETS[cells[0]]:.2f}x)",
                    "unit": "ratio", "bars": {"ratio": (rec, value)},
                    "limits": {"ratio": rec * (1 + time_slack)}})
    return panels
