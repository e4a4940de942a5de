"""``hookbench record``: the upgrade gate's baseline of the installed torch, written on purpose.
A row that fails on this torch is written as a known failure with its words, and listed
(``hookbench.gate.known_failures``); a broken workload is one line, exit 2, nothing written."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from hookbench import gate
from hookbench.cli import common, interrupts
from hookbench.gate import baselines, known_failures
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
        # The checkpoint files and the baseline land together or not at all: an interrupt
        # waits for both (interrupts.deferred), and the baseline is renamed into place.
        with interrupts.deferred():
            if "checkpoints" in sections:
                folder = baselines.checkpoint_folder(target)
                folder.mkdir(parents=True, exist_ok=True)
                for old in folder.glob("*.pt"):
                    old.unlink()
                for new in Path(staging).glob("*.pt"):
                    (folder / new.name).write_bytes(new.read_bytes())
            path = baselines.save(data, target)
            # the workloads' draws and traces beside it (none recorded: an older file goes)
            drawn, kept = Path(staging) / gate.REPLAY, baselines.replay_file(target)
            if drawn.is_file():
                kept.write_bytes(drawn.read_bytes())
            elif kept.is_file():
                kept.unlink()
    known = known_failures.listed(data.get(known_failures.KEY, {}))
    drawn = baselines.replay_file(target)
    print(f"wrote {path}" + (f" and {drawn} ({drawn.stat().st_size:,} B)" if drawn.is_file()
                             else "") + f": torch {data['recorded_with']['torch']} on "
          f"{data['recorded_with']['cpu_capability']}; " + ", ".join(
              f"{section} {len(data[section])}" for section in gate.SECTIONS if section in data)
          + (f"; {len(known)} known failures on this torch, recorded with their words (the "
             f"gate holds a later torch to the same failure and reports one fixed):\n  "
             + "\n  ".join(known) if known else ""))
    return 0
