"""``hookbench record``: the upgrade gate's baseline of the installed torch, written on purpose,
and only when every measurement ran."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from hookbench import gate
from hookbench.cli import common
from hookbench.gate import baselines
from hookbench.models.zoo import ZOO


def run(args: argparse.Namespace) -> int:
    models = common.chosen(args.models, tuple(ZOO), "models")
    workloads, sections, baseline = common.gated(args)
    target = common.writable_file(baseline, "--baseline")
    common.progress(f"recording the gate's baseline on torch {torch.__version__} ("
              + (f"workloads {', '.join(w.name for w in workloads)}" if workloads else
                 f"models {', '.join(models)}; a few minutes") + ") ...")
    with tempfile.TemporaryDirectory() as staging:  # files land only with a good baseline
        data = gate.record(models, sections, staging, workloads)
        failed = gate.failures(data)
        if failed:  # a baseline is what the next torch must reproduce: never one with failures
            print(f"hookbench record: NOT written: {len(failed)} measurements failed on torch "
                  f"{torch.__version__}:\n  " + "\n  ".join(failed))
            return 1
        if "checkpoints" in sections:
            folder = baselines.checkpoint_folder(target)
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("*.pt"):
                old.unlink()
            for new in Path(staging).glob("*.pt"):
                (folder / new.name).write_bytes(new.read_bytes())
    path = baselines.save(data, target)
    print(f"wrote {path}: torch {data['recorded_with']['torch']} on "
          f"{data['recorded_with']['cpu_capability']}; " + ", ".join(
              f"{section} {len(data[section])}" for section in gate.SECTIONS if section in data))
    return 0
