"""``hookbench speed``: the whole-step table, each mode of the optimizer in backward over the
standard step of the same implementation, timed interleaved (``gate.step_time.whole_step``)."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from hookbench.cli import common
from hookbench.gate import baselines, step_time


_IMPLEMENTATION_NAMES = {"forloop": "for-loop", "foreach": "foreach", "fused": "fused"}
_MODE_NAMES = {"per_parameter": "per parameter", "grouped": "grouped by module",
               "grouped_foreach": "grouped by module", "bucketed": "bucketed 25 MiB"}


def run(args: argparse.Namespace) -> int:
    if args.model == "mlp" and args.batch_size is not None:
        raise ValueError(f"--batch-size is for zoo models; the benchmarks' MLP has its own "
                         f"batch of {step_time.BENCHMARK_MLP.batch_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available here")
    json_path = common.writable_file(args.json, "--json") if args.json else None
    batch = step_time.BENCHMARK_MLP.batch_size if args.model == "mlp" else args.batch_size or 2
    what = (f"the benchmarks' MLP (0.8M parameters, batch {batch})" if args.model == "mlp" else
            f"{args.model}, batch {batch}")
    print(f"Whole training step (forward, backward, Adam step) of {what}: the optimizer in "
          f"backward over the standard step of the same implementation, {args.runs} runs of "
          f"{args.rounds} interleaved rounds (each run's fastest round); median (min-max) over "
          f"the runs, torch {torch.__version__}, " + (
              torch.cuda.get_device_name() if args.device == "cuda" else
              f"CPU, {torch.get_num_threads()} threads"))
    table = step_time.whole_step(args.model, rounds=args.rounds, runs=args.runs,
                                 batch_size=batch, device=args.device, progress=common.progress)
    columns = list(dict.fromkeys(_MODE_NAMES[m] for modes in step_time.WHOLE_STEP_PAIRS.values()
                                 for m in modes))
    print(f"  {'implementation':15} {'standard (ms)':>14}  "
          + "  ".join(f"{c:22}" for c in columns))
    for impl, row in table.items():
        cells = dict.fromkeys(columns, "-")
        for mode, values in row.items():
            if mode != "standard":
                cells[_MODE_NAMES[mode]] = (f"{statistics.median(values):.2f}x "
                                            f"({min(values):.2f}-{max(values):.2f})")
        standard_ms = statistics.median(row["standard"]) * 1e3
        print(f"  {_IMPLEMENTATION_NAMES[impl]:15} {standard_ms:14.1f}  "
              + "  ".join(f"{c:22}" for c in cells.values()))
    if json_path:
        json_path.write_text(json.dumps({"model": args.model, "batch_size": batch,
                                         "device": args.device,
                                         "runs": args.runs, "rounds": args.rounds,
                                         "environment": baselines.environment(),
                                         "table": table}, indent=1))
    return 0
