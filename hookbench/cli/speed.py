"""``hookbench speed``: the whole-step table, each mode of the optimizer in backward over the
standard step of the same implementation, timed interleaved (``gate.step_time.whole_step``), on
a zoo model, the benchmarks' MLP or a user's workload (``--workload``: its own optimizer and
batch; a cell it cannot have says why beneath the table)."""

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


def _subject(args: argparse.Namespace) -> tuple[object, str, int, str]:
    """What is timed (a zoo name, "mlp" or a Workload), its name, batch and optimizer."""
    if args.workload:
        if args.batch_size is not None:
            raise ValueError("--batch-size is for zoo models; a workload has its own batch")
        spec = common.one_workload(args)
        spec.check()  # a broken workload: one line, exit 2, before anything is timed
        return spec, spec.name, spec.batch_size, spec.optimizer[0].__name__
    if args.model == "mlp":
        if args.batch_size is not None:
            raise ValueError(f"--batch-size is for zoo models; the benchmarks' MLP has its own "
                             f"batch of {step_time.BENCHMARK_MLP.batch_size}")
        return ("mlp", "the benchmarks' MLP (0.8M parameters)",
                step_time.BENCHMARK_MLP.batch_size, "Adam")
    return args.model, args.model, args.batch_size or 2, "Adam"


# (label, ratio, floor) of step_time's targets
_TARGETS = (("grouped in backward / foreach step (MLP)", "in_backward_grouped_vs_foreach",
             "grouped_floor_vs_foreach"),
            ("capture rms+mean_abs / plain (ResNet-18)", "capture_stats_vs_plain",
             "capture_floor_vs_plain"))


def _targets(args: argparse.Namespace, rounds: int) -> int:
    if args.workload or args.batch_size is not None or args.device != "cpu":
        raise ValueError("--targets times the benchmarks' MLP and ResNet-18 on the CPU; it "
                         "takes no --workload, --batch-size or --device")
    json_path = common.writable_file(args.json, "--json") if args.json else None
    runs = []
    for run in range(args.runs):
        common.progress(f"run {run + 1} of {args.runs} ...")
        runs.append({**step_time.grouped_targets(rounds), **step_time.capture_targets(rounds)})
    print(f"The speed targets, timed interleaved as the gate times them: {args.runs} runs of "
          f"{rounds} rounds, median (min-max); the floor: what the extra reads, writes and "
          f"launches cost by themselves (gate.step_time), torch {torch.__version__}, CPU, "
          f"{torch.get_num_threads()} threads")
    print(f"  {'ratio':42} {'median (min-max)':19} {'target':13} {'floor':19} {'vs floor':>8}")
    table = {}
    for label, key, floor_key in _TARGETS:
        values, floors = [r[key] for r in runs], [r[floor_key] for r in runs]
        median, floor = statistics.median(values), statistics.median(floors)
        target = step_time.TIME_TARGETS[key]
        table[key], table[floor_key] = values, floors
        print(f"  {label:42} {median:.2f}x ({min(values):.2f}-{max(values):.2f})  "
              f"{target:.2f}x {'met' if median <= target else 'missed':6} "
              f"{floor:.2f}x ({min(floors):.2f}-{max(floors):.2f})  {median / floor:7.2f}x")
    if json_path:
        json_path.write_text(json.dumps({"runs": args.runs, "rounds": rounds,
                                         "environment": baselines.environment(),
                                         "targets": table}, indent=1))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.targets:
        return _targets(args, args.rounds or 15)
    rounds = args.rounds or 3
    subject, name, batch, optimizer = _subject(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available here")
    json_path = common.writable_file(args.json, "--json") if args.json else None
    print(f"Whole training step (forward, backward, {optimizer} step) of {name}, batch "
          f"{batch}: the optimizer in backward over the standard step of the same "
          f"implementation, {args.runs} runs of {rounds} interleaved rounds (each run's "
          f"fastest round); median (min-max) over the runs, torch {torch.__version__}, " + (
              torch.cuda.get_device_name() if args.device == "cuda" else
              f"CPU, {torch.get_num_threads()} threads"))
    table = step_time.whole_step(subject, rounds=rounds, runs=args.runs,
                                 batch_size=batch, device=args.device,
                                 progress=common.progress)
    columns = list(dict.fromkeys(_MODE_NAMES[m] for modes in step_time.WHOLE_STEP_PAIRS.values()
                                 for m in modes))
    print(f"  {'implementation':15} {'standard (ms)':>14}  "
          + "  ".join(f"{c:22}" for c in columns))
    notes: dict[str, int] = {}  # why a cell has no values -> its footnote's number

    def note(words: str) -> str:
        return f"({notes.setdefault(words, len(notes) + 1)})"

    for impl, row in table.items():
        if isinstance(row, str):  # the optimizer has no such implementation
            print(f"  {_IMPLEMENTATION_NAMES[impl]:15} {'none ' + note(row):>14}")
            continue
        cells = dict.fromkeys(columns, "-")
        for mode, values in row.items():
            if mode != "standard":
                cells[_MODE_NAMES[mode]] = (
                    f"refused {note(values)}" if isinstance(values, str) else
                    f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})")
        standard_ms = statistics.median(row["standard"]) * 1e3
        print(f"  {_IMPLEMENTATION_NAMES[impl]:15} {standard_ms:14.1f}  "
              + "  ".join(f"{c:22}" for c in cells.values()))
    for words, number in notes.items():
        print(f"  ({number}) {words}")
    if json_path:
        json_path.write_text(json.dumps({"model": name, "batch_size": batch,
                                         "device": args.device,
                                         "runs": args.runs, "rounds": rounds,
                                         "environment": baselines.environment(),
                                         "table": table}, indent=1))
    return 0
