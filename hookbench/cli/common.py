"""What several subcommands share: progress on stderr, the checks of their arguments (each a
``ValueError`` naming the option, raised before anything is measured), and the workloads and
baseline that ``--workload`` or ``[tool.hookbench]`` name."""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

import hookbench
from hookbench import gate
from hookbench.cli import say
from hookbench.core.workload import Workload, configured, load
from hookbench.gate import baselines, export
from hookbench.models.zoo import ZOO
from hookbench.models.zoo import workload as zoo_workload


def progress(message: str) -> None:
    say(message)



def chosen(value: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    chosen = tuple(value.split(","))
    unknown = set(chosen) - set(known)
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}; choose from {known}")
    return chosen


def output_dir(path: str, option: str = "--out") -> Path:
    """The folder for a command's files, made and proven writable before anything is measured."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {path}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write there ({e.strerror or e})") from None
    return out


def writable_file(path: str, option: str) -> Path:
    """A file a command will write at its end, checked before the minutes of measuring."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder, not a file")
    output_dir(str(target.parent), option)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{option} {path}: cannot write there (read-only)")
    return target


def verdict_files(args: argparse.Namespace) -> dict[str, Path]:
    """``--junit-xml`` and ``--json``, where given, checked before anything is measured."""
    return {kind: writable_file(path, f"--{kind.replace('_', '-')}") for kind in
            ("junit_xml", "json") if (path := getattr(args, kind, None))}


def write_verdicts(files: dict[str, Path], command: str, sections: dict[str, Any],
                   seconds: float, base: dict | None = None, now: dict | None = None,
                   **about: str) -> list[Path]:
    """The JUnit XML and JSON files ``verdict_files`` checked (``hookbench.gate.export``)."""
    written = []
    if "junit_xml" in files:
        written.append(export.write_junit(files["junit_xml"], command, sections, seconds,
                                          **about))
    if "json" in files:
        written.append(export.write_json(files["json"], command, sections, base, now, **about))
    return written


def named_workloads(args: argparse.Namespace) -> tuple[list[Workload], dict]:
    """The workloads ``--workload`` names (an import path, or a zoo model's name), else those
    of ``[tool.hookbench]`` in the nearest pyproject.toml; and that table."""
    config = configured()
    root = config.get("root", ".")
    paths = getattr(args, "workload", None) or config.get("workloads", [])
    return [w for path in paths
            for w in ([zoo_workload(path)] if path in ZOO else load(path, root))], config


def one_workload(args: argparse.Namespace) -> Workload:
    """``--workload`` if given (it must name one), else the zoo's ``--model``."""
    if not args.workload:
        return zoo_workload(args.model, batch_size=args.batch_size)
    found, _ = named_workloads(args)
    if len(found) != 1:
        raise ValueError(f"--workload names {len(found)} workloads "
                         f"({', '.join(w.name for w in found)}); {args.command} takes one")
    return found[0]


def what_runs(workloads: list[Workload], fault: str | None = None) -> dict[str, Any]:
    """What every rank under torchrun must run alike (``launch.on_torchrun`` compares it)."""
    return {"torch": torch.__version__, "hookbench": hookbench.__version__,
            "python": platform.python_version(), "fault": fault,
            "workloads": [(w.name, w.optimizer[0].__name__, w.batch_size, w.precision)
                          for w in workloads]}


def gated(args: argparse.Namespace) -> tuple[list[Workload], tuple[str, ...], str]:
    """What record and gate cover: the user's workloads (from --workload or pyproject.toml)
    with the hooks and workloads sections and their baseline, or the zoo's sections."""
    workloads, config = named_workloads(args)
    default = gate.WORKLOAD_SECTIONS if workloads else gate.SECTIONS
    sections = chosen(args.sections or ",".join(default), gate.SECTIONS, "gate sections")
    if "workloads" in sections and not workloads and args.sections:
        raise ValueError("the workloads section needs --workload package.module:attribute, or "
                         "workloads in [tool.hookbench] of pyproject.toml")
    for w in workloads:  # a broken workload: one line, exit 2, before anything is measured
        w.check(shares=gate.workload_checks.ZERO2_RANKS, batches=gate.workload_checks.BATCHES)
    baseline = args.baseline or config.get("baseline")
    if baseline is None and workloads:
        raise ValueError("name the baseline of your workloads: --baseline PATH, or baseline "
                         "in [tool.hookbench] of pyproject.toml")
    return workloads, sections, baseline or str(baselines.DEFAULT)


def backend(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: the cuda backend needs CUDA, and "
                         "torch.cuda.is_available() is False; use --device fake")
    return ("cuda" if torch.cuda.is_available() else "fake") if device == "auto" else device
