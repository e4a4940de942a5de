"""``hookbench record``: the upgrade gate's baseline of the installed torch, written on purpose.
A row that fails on this torch is written as a known failure with its words, and listed
(``hookbench.gate.known_failures``); a broken workload is one line, exit 2, nothing written."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from hookbench import gate
from hookbench.cli import common, interrupts, say
from hookbench.gate import baselines, known_failures
from hookbench.models.zoo import ZOO


def land(data: dict, staging: Path, target: Path, checkpoints: bool) -> Path:
    """``data`` as the baseline ``target``, with the checkpoint files (``checkpoints``) and the
    replay file ``gate.record`` wrote into ``staging`` beside it, replacing the old ones: each
    staged beside its place, then renamed there, the baseline last. An ``OSError`` while
    staging (a full disk) leaves every old file as it was."""
    folder, kept = baselines.checkpoint_folder(target), baselines.replay_file(target)
    drawn = staging / gate.REPLAY
    places = [*((folder / new.name, new) for new in sorted(staging.glob("*.pt"))
                if checkpoints and new != drawn), *([(kept, drawn)] if drawn.is_file() else [])]
    staged: list[tuple[Path, Path]] = []
    try:
        if checkpoints:
            folder.mkdir(parents=True, exist_ok=True)
        for place, new in places:
            staged.append((baselines.stage_beside(place, new.read_bytes()), place))
        staged.append((baselines.stage_beside(target, baselines.serialised(data)), target))
    except BaseException:
        for name, _ in staged:
            name.unlink(missing_ok=True)
        raise
    # what the new baseline does not have goes: old checkpoint files, a replay file
    landing = {place for place, _ in places}
    gone = [*(old for old in folder.glob("*.pt") if checkpoints and old not in landing),
            *([kept] if kept.is_file() and not drawn.is_file() else [])]
    for old in gone:
        old.unlink()
    for name, place in staged:
        os.replace(name, place)
    return target


def run(args: argparse.Namespace) -> int:
    models = common.chosen(args.models, tuple(ZOO), "models")
    workloads, sections, baseline = common.gated(args)
    target = common.writable_file(baseline, "--baseline")
    common.progress(f"recording the gate's baseline on torch {torch.__version__} ("
              + (f"workloads {', '.join(w.name for w in workloads)}" if workloads else
                 f"models {', '.join(models)}; a few minutes") + ") ...")
    with tempfile.TemporaryDirectory() as staging:  # files land only with a good baseline
        # The checkpoint files, the replay file and the baseline land together or not at all:
        # an interrupt waits for them (interrupts.deferred); every file is staged, first in
        # a folder of its own (the replay file, the checkpoints) and then beside its place, so
        # that a full disk fails before anything is replaced, then renamed into place, the
        # baseline last.
        try:
            data = gate.record(models, sections, staging, workloads)
            with interrupts.deferred():
                path = land(data, Path(staging), target, "checkpoints" in sections)
        except OSError as e:
            say(f"hookbench record: error: cannot write {e.filename or target}: "
                f"{e.strerror or e}; the baseline {target} and its files are unchanged")
            return 1
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
