"""The sweep: every architecture of ``sweep.architectures`` through hookbench as a new user
would run it, one row per architecture, each stage a subprocess, timed:

    record                  hookbench record --workload sweep.architectures:ATTR
                            --baseline TMP/NAME.json: exit 0, and no row recorded as a known
                            failure on this torch (a row that fails on the torch you trust)
    gate                    hookbench gate against that baseline, on the same torch: exit 0
    fires_twice             the gate under --fault fires_twice: exit 1 with a failed row of
                            the architecture's own (``! NAME/...``): caught
    keeps_gradients_alive   the gate under --fault keeps_gradients_alive: the same

    python examples/sweep/run.py                            # all of them (hours on 2 cores)
    python examples/sweep/run.py --only bert,dlrm           # some
    python examples/sweep/run.py --stages record            # only record, for each
    python examples/sweep/run.py --json r.json --merge      # add to the results in r.json
    python examples/sweep/run.py --stages record --baselines DIR   # keep the baselines in DIR
    python examples/sweep/run.py --stages gate --baselines DIR     # gate those (another torch,
                                                            # another hookbench)
    python examples/sweep/run.py --json r.json --out docs/sweep.md --table-only
    python examples/sweep/run.py --check-only               # Workload.check on each (seconds)
    python examples/sweep/run.py --set fields ...           # the second sweep (issue 57):
                                                            # examples/fields' architectures

Writes the table (markdown, ``--out``: every architecture, "not run" where no result is
known) and every stage's result (``--json``); prints the totals. Exits 0 only when every stage
that ran ended as expected. Each command has a timeout (``--timeout``, default 900 s) and is
killed with its whole process group (its spawned ranks) when it runs out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the sets of architectures: each a folder beside this one holding the package of that name,
# whose ``architectures`` module has ARCHITECTURES, FAMILY and NAME
SETS = ("sweep", "fields")
# (stage, extra arguments, expected exit code)
STAGES = (("record", (), 0), ("gate", (), 0),
          ("fires_twice", ("--fault", "fires_twice"), 1),
          ("keeps_gradients_alive", ("--fault", "keeps_gradients_alive"), 1))
TRIM = 300


def _hookbench(args: list[str], timeout: float, home: Path) -> tuple[int | None, str, float]:
    """Exit code (None: timed out and killed), output, seconds; run in ``home``, the set's
    folder, which is on its path."""
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(home) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen([sys.executable, "-m", "hookbench", *args], cwd=home, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        out, _ = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its spawned ranks too
        out, _ = process.communicate()
        code = None
    return code, out, time.perf_counter() - started


def _known_failures(out: str) -> list[str]:
    """The rows ``hookbench record`` wrote as known failures on this torch (listed under its
    ``wrote ...; N known failures`` line, two spaces in)."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("wrote ") and "known failures on this torch" in line:
            return [x.strip() for x in lines[i + 1:] if x.startswith("  ")]
    return []


def _why(out: str, code: int | None, timeout: float) -> list[str]:
    """What went wrong: the failed rows (``! ``), known failures, an error line; else the
    output's last lines."""
    if code is None:
        return [f"timed out after {timeout:.0f} s and was killed"]
    lines = [line.rstrip() for line in out.splitlines()]
    picked = [line for line in lines if line.startswith("! ")] + _known_failures(out)
    if not picked:
        picked = [line.strip() for line in lines if "error" in line.lower()
                  and not line.lstrip().startswith(("File ", "warnings.warn"))][-3:]
    return [line[:TRIM] for line in (picked or [x.strip() for x in lines if x.strip()][-3:])]


def run(name: str, attribute: str, folder: Path, timeout: float,
        stages: tuple[str, ...], of: str = "sweep") -> dict:
    baseline = folder / f"{name}.json"
    workload = ["--workload", f"{of}.architectures:{attribute}", "--baseline", str(baseline)]
    results = {}
    for stage, extra, expected in STAGES:
        if stage not in stages:
            continue
        command = ["record", *workload] if stage == "record" else [
            "gate", *workload, *extra, "--out", str(folder / f"{name}-{stage}-out")]
        code, out, seconds = _hookbench(command, timeout, HERE.parent / of)
        known = _known_failures(out) if stage == "record" else []
        # under a fault, the hook-contract rows fail whatever the workload: caught means one
        # of the architecture's own rows failed too
        own = any(line.startswith(f"! {name}/") for line in out.splitlines())
        ok = code == expected and not known and (expected == 0 or own)
        results[stage] = {"exit": code, "expected": expected, "seconds": round(seconds, 1),
                          "ok": ok, "known_failures": len(known),
                          "why": [] if ok else (
                              ["exit 1, but no row of this architecture failed (only the hook "
                               "contract's)"] if code == expected and not own and expected
                              else _why(out, code, timeout))}
        print(f"  {stage:24} exit {code} in {seconds:.0f} s"
              + ("" if ok else ": " + " | ".join(results[stage]["why"])[:900]), flush=True)
        if stage == "record" and code != 0:
            break  # nothing to gate against
    return results


def cell(stage: dict | None, caught: bool) -> str:
    if stage is None:
        return "not run"
    if stage["ok"]:
        word = "caught" if caught else "ok"
    elif stage["exit"] is None:
        word = "TIMED OUT"
    elif stage.get("known_failures"):
        n = stage["known_failures"]
        word = f"FAILED ({n} known failure{'s' * (n > 1)})"
    elif caught and stage["exit"] == 1:
        word = "NOT CAUGHT (hook rows only)"
    elif caught:
        word = f"NOT CAUGHT (exit {stage['exit']})"
    else:
        word = f"FAILED (exit {stage['exit']})"
    return f"{word}, {stage['seconds']:.0f} s"


def table(results: dict, family: dict, sizes: dict) -> str:
    rows = ["| architecture | library | family | parameters | record | gate | fires_twice "
            "caught? | keeps_gradients_alive caught? |", "|---|---|---|---:|---|---|---|---|"]
    for name, (library, kind) in family.items():
        got = results.get(name, {})
        rows.append(f"| {name} | {library} | {kind} | {sizes.get(name, '')} | "
                    + " | ".join(cell(got.get(s), caught=e == 1) for s, _, e in STAGES) + " |")
    notes = []
    for name, got in results.items():
        for stage, r in got.items():
            if not r["ok"]:
                notes.append(f"- **{name} / {stage}** (exit {r['exit']}, expected "
                             f"{r['expected']}):\n" + "\n".join(
                                 f"  - `{line.replace('`', chr(39))}`" for line in r["why"]))
    return ("\n".join(rows) + "\n\n### Unexpected outcomes\n\n"
            + ("\n".join(notes) if notes else "None.") + "\n")


def markers(of: str) -> tuple[str, str]:
    """Where set ``of``'s table goes in a page (each set its own pair of lines)."""
    written = "examples/sweep/run.py" + ("" if of == "sweep" else f" --set {of}")
    return f"<!-- {of} table: written by {written} -->", f"<!-- end {of} table -->"


def write_table(path: Path, text: str, of: str = "sweep") -> None:
    """The table into ``path``: between set ``of``'s markers where the page has them (its
    prose kept), else the whole file."""
    BEGIN, END = markers(of)
    page = path.read_text() if path.exists() else ""
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        text = head + BEGIN + "\n\n" + text + "\n" + END + rest.split(END, 1)[1]
    path.write_text(text)


def totals(results: dict) -> str:
    out = []
    for stage, _, _ in STAGES:
        ran = [r[stage] for r in results.values() if stage in r]
        if ran:
            out.append(f"{stage} {sum(r['ok'] for r in ran)}/{len(ran)}")
    return ", ".join(out) or "nothing ran"


def sizes_of(workloads) -> dict[str, str]:
    import torch

    sizes = {}
    for w in workloads:
        with torch.device("meta"):
            model = w.model()
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sizes[w.name] = f"{total:,}" + ("" if trainable == total else
                                        f" ({trainable:,} trainable)")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="of", choices=SETS, default="sweep",
                        help="which architectures: examples/sweep's (default) or "
                             "examples/fields' (the fields the first sweep did not visit)")
    parser.add_argument("--only", help="comma-separated architecture names")
    parser.add_argument("--stages", default=",".join(s for s, _, _ in STAGES),
                        help="comma-separated stages (default: all four; gate and the faults "
                             "need record)")
    parser.add_argument("--out", type=Path, help="the table, as markdown")
    parser.add_argument("--json", type=Path, help="every stage's result")
    parser.add_argument("--merge", action="store_true",
                        help="start from the results already in --json (the table shows both)")
    parser.add_argument("--baselines", type=Path,
                        help="keep the baselines (and gate outputs) in this folder; without "
                             "record among --stages, gate the baselines already in it")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per command")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: write --out from the results in --json")
    parser.add_argument("--check-only", action="store_true",
                        help="only Workload.check(shares=2) on each (build, every batch's "
                             "forward and loss)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent / args.of))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    architectures = importlib.import_module(f"{args.of}.architectures")
    ARCHITECTURES, FAMILY, NAME = (architectures.ARCHITECTURES, architectures.FAMILY,
                                   architectures.NAME)

    names = args.only.split(",") if args.only else [w.name for w in ARCHITECTURES]
    unknown = set(names) - set(NAME)
    if unknown:
        parser.error(f"unknown architectures {sorted(unknown)}; choose from {sorted(NAME)}")
    stages = tuple(args.stages.split(","))
    if set(stages) - {s for s, _, _ in STAGES}:
        parser.error(f"--stages: choose from {[s for s, _, _ in STAGES]}")
    if "record" not in stages and not args.baselines:
        parser.error("--stages: record is needed (the gate runs against its baseline), or "
                     "--baselines with the baselines recorded before")
    by_name = {w.name: w for w in ARCHITECTURES}
    chosen = [by_name[n] for n in dict.fromkeys(names)]  # in the order given
    if args.check_only:
        from hookbench.gate.workload_checks import BATCHES, ZERO2_RANKS

        sizes = sizes_of(chosen)
        bad = 0
        for w in chosen:
            started = time.perf_counter()
            try:
                w.check(shares=ZERO2_RANKS, batches=BATCHES)
                print(f"{w.name:26} {sizes[w.name]:>26} ok "
                      f"({time.perf_counter() - started:.1f} s)", flush=True)
            except Exception as e:  # noqa: BLE001 - said, and counted
                bad += 1
                print(f"{w.name:26} {sizes[w.name]:>26} {type(e).__name__}: {e}"[:400])
        print(f"{len(chosen) - bad} of {len(chosen)} pass Workload.check(shares={ZERO2_RANKS}, "
              f"batches={BATCHES})")
        return 1 if bad else 0
    if args.table_only:
        if not (args.json and args.json.exists() and args.out):
            parser.error("--table-only needs --json (an existing results file) and --out")
        results = json.loads(args.json.read_text())
        write_table(args.out, table(results, FAMILY, sizes_of(ARCHITECTURES)), args.of)
        print(totals(results))
        return 0 if all(r["ok"] for got in results.values() for r in got.values()) else 1
    results = {}
    if args.merge and args.json and args.json.exists():
        results = json.loads(args.json.read_text())
    this_run = {}
    if "record" not in stages:
        missing = [w.name for w in chosen if not (args.baselines / f"{w.name}.json").exists()]
        if missing:
            parser.error(f"--baselines {args.baselines}: no baseline for {', '.join(missing)}")
    if args.baselines:
        args.baselines.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.baselines)) if args.baselines
          else tempfile.TemporaryDirectory(prefix="sweep-")) as folder:
        for w in chosen:
            print(f"{w.name} ...", flush=True)
            this_run[w.name] = results[w.name] = run(w.name, NAME[w.name], Path(folder),
                                                     args.timeout, stages, args.of)
            if args.json:  # after each, so that an interrupted sweep keeps what it ran
                args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.out:
        write_table(args.out, table(results, FAMILY, sizes_of(ARCHITECTURES)), args.of)
    print(f"this run: {totals(this_run)}")
    if args.merge:
        print(f"with the merged results: {totals(results)}")
    return 0 if all(r["ok"] for got in this_run.values() for r in got.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
