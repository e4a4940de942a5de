"""The ``hookbench`` command line.

    hookbench report    verify the hook mechanisms and measure peak memory on the installed
                        torch; writes a PNG and a JSON; exits 1 when a check fails
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hookbench import report
from hookbench.memory import measure
from hookbench.plot import memory_timeline
from hookbench.zoo import ZOO, ZooSpec


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _report(args: argparse.Namespace) -> int:
    backend = args.device
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "fake"
    spec = ZooSpec(args.model, batch_size=args.batch_size)
    out = Path(args.out)
    sections = [report.contract_section(), report.optimizer_in_backward_section()]
    results = []
    for strategy in report.MEMORY_STRATEGIES:
        started = time.perf_counter()
        _progress(f"measuring {spec.name} batch {spec.batch_size}, {strategy}, "
                  f"backend {backend} ...")
        snapshot = out / f"snapshot-{spec.name}-{strategy}.pickle" if backend == "cuda" else None
        results.append(measure(spec, strategy, backend=backend, snapshot_path=snapshot))
        _progress(f"  peak {results[-1].peak / 1e9:.3f} GB ({time.perf_counter() - started:.1f} s)")
    sections.append(report.memory_section(results))
    png = memory_timeline(results, out / "memory.png")
    data = {"torch": torch.__version__, "backend": backend, "model": spec.name,
            "batch_size": spec.batch_size, "memory": [r.to_dict() for r in results],
            "checks": [{"section": s.title, "row": list(cells), "ok": ok}
                       for s in sections for cells, ok in s.rows]}
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    print(report.render(sections))
    print(f"\nwrote {png} and {out / 'report.json'}"
          + (f" and memory snapshots in {out}" if backend == "cuda" else ""))
    return 0 if all(s.ok for s in sections) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hookbench",
        description="Regression and verification suite for the PyTorch hooks behind "
                    "memory-saving training.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "report", help="verify the hook mechanisms and measure peak memory on the installed torch",
    )
    rep.add_argument("--device", choices=("auto", "cuda", "fake"), default="auto",
                     help="memory backend: cuda (allocator statistics) or fake (FakeTensorMode "
                          "accounting, no GPU needed); auto picks cuda when present")
    rep.add_argument("--model", choices=sorted(ZOO), default="vit_l_16")
    rep.add_argument("--batch-size", type=int, default=1)
    rep.add_argument("--out", default="hookbench-out", help="folder for the PNG, JSON, snapshots")
    rep.set_defaults(run=_report)
    args = parser.parse_args(argv)
    if getattr(args, "batch_size", 1) < 1:
        parser.error("--batch-size must be >= 1")
    try:
        return args.run(args)
    except (RuntimeError, ValueError) as e:  # a measurement that cannot run here, say why
        print(f"hookbench {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
