"""``hookbench selfcheck``: the gate under every injected fault (``hookbench.measure.faults``);
exit 1 unless each is caught and the clean run passes."""

from __future__ import annotations

import argparse
import json

import torch

from hookbench import gate
from hookbench.cli import common
from hookbench.gate import baselines
from hookbench.measure.faults import FAULTS
from hookbench.models.zoo import ZOO


def run(args: argparse.Namespace) -> int:
    base = baselines.load(args.baseline or baselines.DEFAULT)
    sections = common.chosen(args.sections or ",".join(gate.SECTIONS), gate.SECTIONS,
                             "gate sections")
    models = common.chosen(args.models, tuple(ZOO), "models")
    json_path = common.writable_file(args.json, "--json") if args.json else None
    caught = gate.selfcheck(base, sections, models, common.progress,
                            baselines.checkpoint_folder(args.baseline or baselines.DEFAULT))
    width = max(map(len, FAULTS))
    print(f"hookbench selfcheck: the gate under each injected fault, torch {torch.__version__}")
    for fault, failed in caught.items():
        if fault is None:
            print(f"  {'no fault':{width}}  " + (
                "passes" if not failed else "FAILS (it must pass): " + "; ".join(
                    f"{name} ({', '.join(rows)})" for name, rows in failed.items())))
        elif not failed:
            print(f"  {fault:{width}}  MISSED")
        else:
            print(f"  {fault:{width}}  CAUGHT by " + "; ".join(
                f"{name} ({', '.join(list(rows)[:3])}{', ...' if len(rows) > 3 else ''})"
                for name, rows in failed.items()))
            row, words = next(iter(next(iter(failed.values())).items()))
            words = words if len(words) <= 240 else words[:237] + "..."
            print(f"  {'':{width}}  struck {row}: {words}")
    if json_path:
        json_path.write_text(json.dumps({str(k): v for k, v in caught.items()}, indent=1))
    missed = [f for f, failed in caught.items() if f is not None and not failed]
    ok = not caught[None] and not missed
    print(f"{sum(bool(v) for f, v in caught.items() if f)} of {len(caught) - 1} faults caught"
          + (f" ({len(FAULTS) - len(caught) + 1} more target none of these sections)"
             if len(caught) - 1 < len(FAULTS) else "")
          + ("; the clean run passes" if not caught[None] else "; the CLEAN RUN FAILS")
          + (f"; MISSED: {', '.join(missed)}" if missed else ""))
    return 0 if ok else 1
