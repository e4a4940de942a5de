"""The sample outputs in README.md and docs/, regenerated from the real commands.

    python docs/samples.py              # rewrite every sample from what its command prints now
    python docs/samples.py --check      # exit 1, with a diff, where a sample has drifted
    python docs/samples.py gate zero2   # only these samples

A sample is the fenced block right after a ``<!-- sample: NAME -->`` line; ``SAMPLES`` says
which command prints it, from which folder, and how it is trimmed (which sections, which rows;
rows left out show as one ``  ...`` line). The check compares rows, verdicts and counts, with
what varies from run to run or from CPU to CPU masked (``VOLATILE``). ``tests/test_samples.py`` runs
the check (slow tier) and shows that it fails on a drifted sample. In the slow tier each command
runs once (issue 55): the README's report is also what tests/cli/test_cli.py checks
(conftest.py's ``readme_report``, through ``ran``), and examples/charlm's samples are checked by
tests/test_ci_recipes.py against the CI recipe's run of the same commands (``less_written``).

Each command runs as ``python -m hookbench`` in its folder, with ``PYTHONPATH=.`` (what the
examples' READMEs say to set) and any folder it writes into (``{out}``) a temporary one, whose
path is taken out of the printed lines again; ``Sample.before`` runs first in the same folder
(a baseline recorded on this machine).
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hookbench.core.names import GATE_SECTIONS

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
MARKER = re.compile(r"^<!-- sample: ([\w-]+) -->$")
# What the check masks: numbers (timings, and the measured values that differ from one CPU
# to another: real-tensor peaks, rounding-level differences) and checksums. Rows, verdicts and
# the summary's counts ("63 of 63 checks hold") are compared as printed.
VOLATILE = r"\b[0-9a-f]{12}\b|\d+(?:[.,]\d+)*(?:e[-+]?\d+)?"
COUNTS = re.compile(r"^\d+ of \d+ checks hold")
ELIDED = "  ..."


@dataclass(frozen=True)
class Sample:
    argv: tuple[str, ...]  # hookbench's arguments; "{out}": a temporary folder
    cwd: str = "."  # relative to the repository
    exit: int = 0  # the exit code the sample shows
    sections: tuple[str, ...] | None = None  # the sections kept, by their title's start; None: all
    rows: int | str | None = None  # per section: the first N rows, or those matching this regex
    last: bool = False  # and each section's last row
    needs: str | None = None  # a module the command imports (an optional extra)
    before: tuple[str, ...] = ()  # a hookbench command run first, in the same folder


SAMPLES = {
    # README.md: the first command a newcomer runs, trimmed; docs/report.md: in full.
    "report": Sample(("report", "--out", "{out}"),
                     sections=("Hook contract", "Optimizer in backward", "Peak memory",
                               "ZeRO-2"),
                     rows=r"  (leaf_only|registration_order|sgd +(per-parameter vs for-loop|"
                          r"bucketed vs foreach|gradients alive)|(foreach|in_backward) +\d|"
                          r"SGD, gloo rank 0 of 2|Adam bf16|vit_l_16 rank 0 of 64 )"),
    "report-full": Sample(("report", "--out", "{out}")),
    # Every section but time: its ratios move with the load on a shared runner (the grouped
    # optimizer in backward measured 2.4x there, 1.5x on the same machine idle, 1.17x
    # recorded), which says nothing about whether this page is up to date.
    "gate": Sample(("gate", "--sections", ",".join(s for s in GATE_SECTIONS
                                                  if s not in ("time", "workloads")),
                    "--out", "{out}"), sections=("Peak memory per model",),
                   rows=r"  transformer/(foreach|in_backward) "),
    # examples/charlm's baseline holds the bits of the CPU it was recorded on, and its bf16 and
    # fp16 workloads round differently on another (check.sh says so too): the samples gate a
    # baseline recorded here first, as a team's CI runner does.
    "charlm-gate": Sample(
        ("gate", "--baseline", "{out}/baseline.json", "--out", "{out}"), cwd="examples/charlm",
        before=("record", "--baseline", "{out}/baseline.json"), sections=("Your workloads",),
        rows=r"  charlm(-bf16-ckpt|-fp16)?/(forloop|in_backward|capture|memory/in_backward) "),
    "charlm-gate-fault": Sample(
        ("gate", "--baseline", "{out}/baseline.json", "--fault", "keeps_gradients_alive",
         "--out", "{out}"), cwd="examples/charlm", exit=1,
        before=("record", "--baseline", "{out}/baseline.json"), rows=r"!"),
    "zero2": Sample(("zero2",)),
    "speed-adafactor": Sample(
        ("speed", "--workload", "hfstack.workloads:T5_ADAFACTOR", "--runs", "3"),
        cwd="examples/hf", needs="transformers"),
}


def runs() -> list[list[str]]:
    """The samples grouped by the run they share: the same command in the same folder (the
    README's report and docs/report.md's), or the same ``before`` (examples/charlm's two gate
    samples gate one recorded baseline). The cache that shares it is per process: a test per
    group keeps each group in one, also under pytest-xdist."""
    groups: dict[tuple, list[str]] = {}
    for name, s in SAMPLES.items():
        groups.setdefault((s.cwd, s.before or s.argv), []).append(name)
    return list(groups.values())


@dataclass(frozen=True)
class Ran:
    """What a sample's command did: what it printed on stdout and stderr, and the folder its
    ``{out}`` is in (``folder``/hookbench-out; a temporary one is removed at exit)."""
    stdout: str
    stderr: str
    folder: str

    @property
    def out(self) -> Path:  # what "{out}" stood for: the files the command wrote
        return Path(self.folder) / "hookbench-out"

    @property
    def printed(self) -> str:  # stdout as a sample shows it: the temporary folder's path taken out
        return self.stdout.replace(f"{self.folder}/", "")


def run(sample: Sample) -> str:
    """What ``sample``'s command prints on stdout; RuntimeError if it exits otherwise."""
    return ran(sample).printed


def ran(sample: Sample, folder: str | Path | None = None) -> Ran:
    """``sample``'s command (``before`` first): in a temporary folder once per process, or in
    ``folder``, which the caller made and keeps (conftest.py's ``readme_report``, which shares
    the run with every pytest-xdist worker); RuntimeError if it exits otherwise than the
    sample shows."""
    if folder is None:
        return _ran(sample.before, sample.argv, sample.cwd, sample.exit)
    if sample.before:
        _hookbench(sample.before, sample.cwd, 0, str(folder))
    done = _hookbench(sample.argv, sample.cwd, sample.exit, str(folder))
    return Ran(done.stdout, done.stderr, str(folder))


@functools.cache  # the README's report and docs/report.md's are one run
def _ran(before: tuple[str, ...], argv: tuple[str, ...], cwd: str, exit: int) -> Ran:
    tmp = _folder(before, cwd)
    done = _hookbench(argv, cwd, exit, tmp)
    return Ran(done.stdout, done.stderr, tmp)


@functools.cache  # examples/charlm's two samples gate one recorded baseline
def _folder(before: tuple[str, ...], cwd: str) -> str:
    """A temporary folder, removed at exit, in which ``before`` has run (in ``cwd``)."""
    tmp = tempfile.mkdtemp(prefix="hookbench-sample-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    if before:
        _hookbench(before, cwd, 0, tmp)
    return tmp


def _hookbench(command: tuple[str, ...], cwd: str, code: int,
               tmp: str) -> subprocess.CompletedProcess:
    """``hookbench command``, run in ``cwd`` with ``{out}`` in ``tmp``; RuntimeError unless it
    exits ``code``."""
    args = [a.replace("{out}", f"{tmp}/hookbench-out") for a in command]
    proc = subprocess.run([sys.executable, "-m", "hookbench", *args], cwd=ROOT / cwd,
                          env={**os.environ, "PYTHONPATH": "."}, capture_output=True, text=True)
    if proc.returncode != code:
        raise RuntimeError(f"hookbench {' '.join(command)} (in {cwd}) exited "
                           f"{proc.returncode}, not {code}:\n{proc.stdout}{proc.stderr[-3000:]}")
    return proc


def less_written(printed: str, files: list[str]) -> str:
    """``printed`` as the command prints it without the options that wrote ``files`` (as it
    names them): each taken out of its ``wrote A and B`` line, the line gone where none is left.
    For a sample checked against a run of its command with more outputs asked for (the CI
    recipe's gate adds ``--junit-xml`` and ``--json``; tests/test_ci_recipes.py), which print
    nothing else."""
    lines = []
    for line in printed.split("\n"):
        if line.startswith("wrote "):
            kept = [f for f in line.removeprefix("wrote ").split(" and ") if f not in files]
            if not kept:
                continue
            line = "wrote " + " and ".join(kept)
        lines.append(line)
    return "\n".join(lines)


def _is_row(line: str) -> bool:
    return line[:2] in ("  ", "! ", "- ")  # a row, marked failed (!) or SKIPPED (-)


def _sections(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(title, [header, rows...]) per section; a line outside any section has no rows."""
    out: list[tuple[str, list[str]]] = []
    for line in lines:
        if _is_row(line) and out and (out[-1][1] or out[-1][0]):
            out[-1][1].append(line)
        else:
            out.append((line, []))
    return out


def trim(sample: Sample, output: str) -> str:
    """``output`` as the sample shows it: its sections and rows, each run of the rows left out
    as one ``  ...`` line; blank lines between what is left, one at most."""
    kept: list[str] = []
    for title, body in _sections(output.rstrip("\n").split("\n")):
        if not body:  # a line of its own: the summary, "wrote ...", a blank line
            if title or (kept and kept[-1]):
                kept.append(title)
            continue
        if sample.sections is not None and not title.startswith(sample.sections):
            continue
        header, rows = body[0], body[1:]
        if sample.rows is None:
            keep = set(range(len(rows)))
        elif isinstance(sample.rows, int):
            keep = set(range(sample.rows))
        else:
            keep = {i for i, row in enumerate(rows) if re.match(sample.rows, row)}
        if sample.last and rows:
            keep.add(len(rows) - 1)
        kept += [title, header]
        for i, row in enumerate(rows):
            if i in keep:
                kept.append(row)
            elif kept[-1] != ELIDED:
                kept.append(ELIDED)
    return "\n".join(kept).strip("\n") + "\n"


def blocks(text: str) -> dict[str, list[tuple[int, int]]]:
    """Each sample's blocks in a document: the line spans (start, end) inside its fences."""
    lines = text.split("\n")
    found: dict[str, list[tuple[int, int]]] = {}
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if m:
            if not lines[i + 1].startswith("```"):
                raise ValueError(f"<!-- sample: {m[1]} --> must be followed by a ``` block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            found.setdefault(m[1], []).append((i + 2, end))
    return found


def markers() -> dict[str, list[str]]:
    """The documents each sample appears in."""
    out: dict[str, list[str]] = {}
    for doc in DOCUMENTS:
        for name in blocks((ROOT / doc).read_text()):
            out.setdefault(name, []).append(doc)
    return out


def _masked(text: str) -> list[str]:
    return [line if COUNTS.match(line) else " ".join(re.sub(VOLATILE, "#", line).split())
            for line in text.strip("\n").split("\n")]


def drift(shown: str, now: str) -> list[str]:
    """A diff of the block ``shown`` against the one the command prints ``now`` (trimmed), with
    what is volatile masked (``VOLATILE``) and runs of spaces as one; empty where they agree."""
    return list(difflib.unified_diff(_masked(shown), _masked(now), "shown", "now", lineterm=""))


def rewrite(text: str, name: str, block: str) -> str:
    """``text`` with every block of the sample ``name`` replaced by ``block``."""
    lines = text.split("\n")
    for start, end in reversed(blocks(text).get(name, [])):
        lines[start:end] = block.rstrip("\n").split("\n")
    return "\n".join(lines)


def check(name: str, now: str) -> list[str]:
    """Each block of the sample ``name`` that differs from ``now`` (``trim``-med): where it is,
    and the diff."""
    found = []
    for doc in markers().get(name, []):
        text = (ROOT / doc).read_text()
        for start, end in blocks(text)[name]:
            diff = drift("\n".join(text.split("\n")[start:end]), now)
            if diff:
                found.append(f"{doc}: the sample {name!r} has drifted (regenerate it: python "
                             f"docs/samples.py {name}):\n" + "\n".join(diff))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"samples (default: all of {list(SAMPLES)})")
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(SAMPLES))
    if unknown:
        parser.error(f"unknown samples {unknown}")
    drifted = []
    for name in args.names or SAMPLES:
        sample = SAMPLES[name]
        if sample.needs and importlib.util.find_spec(sample.needs) is None:
            print(f"{name}: not run: {sample.needs} is not installed")
            continue
        print(f"{name}: hookbench {' '.join(sample.argv)} (in {sample.cwd}) ...", flush=True)
        now = trim(sample, run(sample))
        if args.check:
            drifted += check(name, now)
            continue
        for doc in markers()[name]:
            path = ROOT / doc
            path.write_text(rewrite(path.read_text(), name, now))
    print("\n".join(drifted) or "every sample is what its command prints")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
