"""``hookbench gate``: the installed torch against the stored baseline, section by section;
exit 1 when a check regressed (the CI job that blocks a PyTorch upgrade)."""

from __future__ import annotations

import argparse

import torch

from hookbench import gate, report
from hookbench.cli import common
from hookbench.gate import baselines
from hookbench.models.zoo import ZOO


def run(args: argparse.Namespace) -> int:
    workloads, sections, baseline = common.gated(args)
    base = baselines.load(baseline)
    models = common.chosen(args.models, tuple(ZOO), "models")
    device = common.backend(args.device)
    common.progress(f"gate: torch {torch.__version__} against the baseline of torch "
              f"{base['recorded_with']['torch']} ({baseline}) ...")
    result = gate.gate(base, sections, models, args.fault, device, time_slack=args.time_slack,
                       checkpoint_dir=baselines.checkpoint_folder(baseline),
                       strict_warnings=args.strict_warnings, workloads=workloads)
    print(report.render(list(result.values()), title="hookbench gate"))
    failed = [name for name, s in result.items() if not s.ok]
    skipped = sum(s.skipped for s in result.values())
    print(f"baseline: torch {base['recorded_with']['torch']} on "
          f"{base['recorded_with']['cpu_capability']}; GATE "
          + (f"FAILED in {', '.join(failed)}" if failed else "PASSED")
          + (f" ({skipped} rows SKIPPED, not compared)" if skipped else ""))
    return 1 if failed else 0
