"""The GPU tier's results in one file, and one line per check: the last step of .ci/gpu.

    python3 .ci/gpu_summary.py OUT BASELINES

reads what .ci/gpu's steps left in OUT and writes BASELINES/gpu/<device>.json, which holds
every number the tier measured: the device and the software it ran (device.json), each step's
exit code, seconds and time budget (steps.tsv), each gpu-marked test's outcome, seconds and
printed output (the JUnit XML of ``pytest -m gpu``; the tests print their peaks there), the
ViT-L/16 peaks of the tutorial's comparison (gpu_memory.json), the rows of ``report --device
cuda`` and of ``gate --device cuda`` with what each measured (their ``--json``), the whole-step
times of ``speed`` and the pytest-benchmark statistics of the CUDA benchmarks.

It prints a line per check: ``PASSED``, ``FAILED`` or ``SKIPPED`` (a missing optional
prerequisite, as pytest and the gate say it), the check's name and its words; a step that
failed or ran past its budget is a check too. Exit 1 when any check failed, else 0. Torch-free,
so that it runs (and is tested) anywhere.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TIMED_OUT = (124, 137)  # timeout(1): 124 on its SIGTERM, 137 when --kill-after had to SIGKILL


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def steps(out: Path) -> list[dict[str, Any]]:
    rows = []
    path = out / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, code, seconds, budget = line.split("\t")
        rows.append({"step": name, "exit": int(code), "seconds": int(seconds),
                     "budget_s": int(budget)})
    return rows


def tests(junit: Path) -> list[dict[str, Any]]:
    """Each testcase of a pytest JUnit XML: outcome, seconds, message, what it printed."""
    if not junit.exists():
        return []
    found = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            element = case.find(tag)
            if element is not None:
                outcome, message = name, element.get("message") or (element.text or "")
                break
        printed = "\n".join(filter(None, (e.text for e in case.iter("system-out"))))
        found.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message.strip(),
                      "printed": printed})
    return found


def benchmarks(folder: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.rglob("*.json")) if folder.exists() else []:
        for bench in json.loads(path.read_text()).get("benchmarks", []):
            found.append({"name": bench["fullname"], "group": bench.get("group"),
                          "params": bench.get("params"),
                          "stats": {k: bench["stats"][k] for k in
                                    ("min", "max", "mean", "median", "stddev", "rounds")}})
    return found


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def _one_line(text: str, width: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[:width - 3] + "..."


def lines(summary: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(verdict, check, words) per check."""
    out = []
    for s in summary["steps"]:
        if s["exit"] in TIMED_OUT:
            words = f"ran past its {s['budget_s']} s budget and was stopped"
        else:
            words = f"exit {s['exit']} in {s['seconds']} s (budget {s['budget_s']} s)"
        out.append(("PASSED" if s["exit"] == 0 else "FAILED", f"step {s['step']}", words))
    for t in summary["tests"]:
        out.append((t["outcome"].upper(), t["test"],
                    f"{t['seconds']:.1f} s" + (f": {t['message']}" if t["message"] else "")))
    for command in ("report", "gate"):
        for row in (summary[command] or {}).get("rows", []):
            verdict = {"pass": "PASSED", "fail": "FAILED", "skipped": "SKIPPED"}[row["verdict"]]
            out.append((verdict, f"{command} {row['section']}: {row['name']}", row["detail"]))
    return [(v, c, _one_line(w)) for v, c, w in out]


def summarize(out: Path, baselines: Path) -> tuple[Path, list[tuple[str, str, str]]]:
    device = _json(out / "device.json") or {}
    summary = {
        "device": device,
        "steps": steps(out),
        "tests": tests(out / "pytest-gpu.xml"),
        "vit_l_16_memory": _json(out / "gpu_memory.json"),
        "report": _json(out / "report.json"),
        "gate": _json(out / "gate-cuda.json"),
        "speed": _json(out / "speed-vit_l_16.json"),
        "benchmarks": benchmarks(out / "benchmarks"),
    }
    checks = lines(summary)
    summary["checks"] = [{"verdict": v, "check": c, "words": w} for v, c, w in checks]
    path = baselines / "gpu" / f"{slug(device.get('name', ''))}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return path, checks


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: gpu_summary.py OUT BASELINES", file=sys.stderr)
        return 2
    path, checks = summarize(Path(argv[0]), Path(argv[1]))
    for verdict, check, words in checks:
        print(f"{verdict:7} {check}: {words}")
    failed = sum(v == "FAILED" for v, _, _ in checks)
    print(f"{len(checks) - failed} of {len(checks)} checks did not fail; every number: {path}")
    return 1 if failed or not checks else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
