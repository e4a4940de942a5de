"""The ``hookbench`` command line.

    hookbench report        verify the hook mechanisms and measure peak memory on the installed
                            torch; writes a PNG and a JSON; exits 1 when a check fails
    hookbench capture       capture a zoo model's activations and print a per-layer table
    hookbench coord-check   the muP coordinate check: width sweep, verdict, plot; exits 1 on FAIL
    hookbench zero2         ZeRO-2 on a zoo model or --workload: per-rank peak memory and
                            parity; under torchrun (torchrun --nproc-per-node 2 -m hookbench
                            zero2) or spawning;
                            --simulate 1,8,64,1024: the ZeRO paper's memory table, executed
    hookbench engines       the engines users run (DDP, FSDP2, the optimizer in backward
                            under FSDP2) on a workload, each row judged; under torchrun, on
                            one machine or several, or spawning
    hookbench record        record the upgrade gate's baseline (baselines/gate.json and the
                            checkpoint files in baselines/checkpoints/) on purpose
    hookbench gate          the installed torch against that baseline; exits 1 on a regression
    hookbench selfcheck     the gate under every injected fault; exits 1 unless all are caught
    hookbench speed         the whole-step table: the optimizer in backward against the standard
                            step, per implementation, interleaved
    hookbench --version     hookbench's and torch's versions

The arguments are parsed here before torch is imported (from ``hookbench.core.names``), so
that ``--help`` and a bad argument answer at once; each subcommand then runs in a module of its
own in this folder (``hookbench.cli.gate`` for ``hookbench gate``; ``common`` holds what they
share), its ``run(args)`` returning the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hookbench.cli import interrupts
from hookbench.core import names

# What ``hookbench report --sections NAME`` prints for each NAME: zero2's gloo ranks also train
# the engines, whose section follows ZeRO-2's. The help lists these; hookbench.cli.report keys
# its sections by them.
REPORT_PRINTS = {**{section: (section,) for section in names.REPORT_SECTIONS},
                 "zero2": ("zero2", "engines")}
WORKLOAD_HELP = ("a workload by import path, package.module:attribute (a hookbench.Workload, a "
                 "list of them, or a function returning either), or a zoo model's name; "
                 "repeatable. Default: workloads in [tool.hookbench] of pyproject.toml")
# report and capture take one, named here only (not [tool.hookbench]'s workloads)
ONE_WORKLOAD_HELP = ("a workload by import path, package.module:attribute (a hookbench.Workload, "
                     "or a function returning one), or a zoo model's name, in place of --model")


def say(line: str) -> None:
    """One line on stderr in one write: ranks under torchrun share the agent's stderr, and
    ``print`` writes the text and its newline apart, so two ranks' lines could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def version() -> str:
    """``hookbench --version``: hookbench's and torch's versions as installed, read from their
    packages' metadata: importing torch would take seconds."""
    ours = names.installed_version("hookbench")
    if ours is None:  # a checkout on sys.path, not installed
        import hookbench

        ours = getattr(hookbench, "__version__", "(version unknown)")
    return f"hookbench {ours} (torch {names.installed_version('torch') or 'not installed'})"


class _Version(argparse.Action):
    """``--version``: the line above on stdout, exit 0; read only when asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print hookbench's and torch's versions and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line naming the problem, exit code 2 (not the usage block)."""

    def error(self, message: str):  # type: ignore[override]
        say(f"{self.prog}: error: {message} (see {self.prog} --help)")
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(
        prog="hookbench",
        description="Regression and verification suite for the PyTorch hooks behind "
                    "memory-saving training.",
    )
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser(
        "report", help="verify the hook mechanisms and measure peak memory on the installed torch",
    )
    rep.add_argument("--device", choices=("auto", "cuda", "fake"), default="auto",
                     help="memory backend: cuda (allocator statistics) or fake (FakeTensorMode "
                          "accounting, no GPU needed); auto picks cuda when present (default: "
                          "%(default)s)")
    rep.add_argument("--model", choices=sorted(names.ZOO), default="vit_l_16",
                     help="the zoo model to measure (default: %(default)s)")
    rep.add_argument("--workload", action="append", help=ONE_WORKLOAD_HELP)
    rep.add_argument("--batch-size", type=int, default=1,
                     help="the zoo model's batch; a --workload brings its own (default: "
                          "%(default)s)")
    rep.add_argument("--out", default="hookbench-out",
                     help="folder for the PNG, JSON, snapshots (default: %(default)s)")
    rep.add_argument("--sections", default=",".join(names.REPORT_SECTIONS),
                     help="comma-separated, from " + ", ".join(
                         name if prints == (name,) else f"{name} (prints {' and '.join(prints)})"
                         for name, prints in REPORT_PRINTS.items()) + " (default: all)")
    rep.set_defaults(run="report")

    cap = commands.add_parser("capture", help="capture a zoo model's activations, print a table")
    cap.add_argument("--model", choices=sorted(names.ZOO), default="resnet18")
    cap.add_argument("--workload", action="append", help=ONE_WORKLOAD_HELP)
    cap.add_argument("--batch-size", type=int, default=1)
    cap.add_argument("--include", action="append", help="module name or glob; repeatable")
    cap.add_argument("--exclude", action="append", help="module name or glob; repeatable")
    cap.add_argument("--stats", action="store_true",
                     help="compute statistics inside the hooks instead of keeping tensors")
    cap.set_defaults(run="capture")

    coord = commands.add_parser("coord-check", help="the muP coordinate check (width sweep)")
    coord.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    coord.add_argument("--parametrization", choices=("mup", "sp"), default="mup")
    coord.add_argument("--widths", default="32,64,128,256,512",
                       help="comma-separated, increasing (default: 16x from 32)")
    coord.add_argument("--steps", type=int, default=3)
    coord.add_argument("--seeds", type=int, default=3)
    coord.add_argument("--lr", type=float, default=1e-2)
    coord.add_argument("--band", type=float, default=2.0,
                       help="largest allowed growth or shrinkage across the widths")
    coord.add_argument("--readout-init", choices=("zero", "random"), default="zero",
                       help="zero (mup's coordinate check) or MuReadout's default random init, "
                            "whose logits at init shrink as width^-1/2 by design")
    coord.add_argument("--peer", choices=("mup",),
                       help="also run microsoft/mup on the same graph, init, data and seeds and "
                            "print its coordinates beside hookbench's (needs the mup extra)")
    coord.add_argument("--out", default="hookbench-out")
    coord.set_defaults(run="coord_check")

    z2 = commands.add_parser(
        "zero2", help="ZeRO-2 demo training: per-rank peak memory and parity verdict "
                      "(under torchrun, or spawning --nproc gloo ranks)")
    z2.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    z2.add_argument("--model", choices=sorted(names.ZOO), default="transformer")
    z2.add_argument("--workload", action="append",
                    help=WORKLOAD_HELP + "; instead of --model: trained with its own "
                         "optimizer, held to torch's DDP and the single process")
    z2.add_argument("--steps", type=int, default=3)
    z2.add_argument("--bucket-numel", type=int,
                    help="elements of a gradient bucket (default: 2**20 for a zoo model, a "
                         "quarter of a workload's trainable elements)")
    z2.add_argument("--fault", choices=sorted(names.FAULTS),
                    help="with --workload: inject this fault into ZeRO-2 (never into the DDP "
                         "that judges it)")
    z2.add_argument("--timeout", type=float, default=600.0,
                    help="seconds the ranks may take before failing (default: %(default)s)")
    z2.add_argument("--simulate", metavar="N,N,...",
                    help="instead: the ZeRO paper's memory table by executing one step of a "
                         "7.5 B-parameter GPT as rank 0 of each N on fake tensors (e.g. "
                         "1,8,64,1024; under a minute)")
    z2.add_argument("--out", default="hookbench-out", help="folder for --simulate's figure")
    z2.set_defaults(run="zero2")

    eng = commands.add_parser(
        "engines", help="the engines' rows (DDP, FSDP2 ZeRO-2 and ZeRO-3, the optimizer in "
                        "backward under FSDP2) for a workload, under torchrun or spawning "
                        "--nproc gloo ranks")
    eng.add_argument("--workload", action="append",
                     help=WORKLOAD_HELP + "; else the gate's engines workload, the zoo's tiny MLP")
    eng.add_argument("--nproc", type=int, default=2, help="ranks to spawn without torchrun")
    eng.add_argument("--fault", choices=sorted(names.FAULTS), help="inject this fault")
    eng.add_argument("--timeout", type=float, default=600.0,
                     help="seconds a rank waits for the others before failing "
                          "(default: %(default)s)")
    eng.set_defaults(run="engines")

    def baseline_options(command: argparse.ArgumentParser, models: tuple[str, ...]) -> None:
        command.add_argument("--baseline",
                             help=f"the gate's baseline (default: baseline in [tool.hookbench] "
                                  f"of pyproject.toml, else {names.BASELINE})")
        command.add_argument("--models", default=",".join(models),
                             help="comma-separated zoo models for the memory section "
                                  "(default: %(default)s)")
        command.add_argument("--sections",
                             help=f"comma-separated (default: {','.join(names.GATE_SECTIONS)}; with "
                                  f"workloads, {','.join(names.GATE_WORKLOAD_SECTIONS)})")

    def verdict_options(command: argparse.ArgumentParser) -> None:
        command.add_argument("--junit-xml", metavar="PATH",
                             help="also write the rows as JUnit XML: a test suite per section, "
                                  "a failed row a failure (CI tools list them)")
        command.add_argument("--json", metavar="PATH",
                             help="also write every row as JSON: name, verdict, recorded, "
                                  "now, detail")

    verdict_options(rep)
    rec = commands.add_parser("record", help="record the upgrade gate's baseline on purpose "
                                             "(hook outcomes, checksums, memory, time ratios)")
    baseline_options(rec, names.GATE_RECORD_MODELS)
    rec.add_argument("--workload", action="append", help=WORKLOAD_HELP)
    rec.set_defaults(run="record")
    gt = commands.add_parser("gate", help="the installed torch against the stored baseline; "
                                          "exits 1 when hooks, numerics, memory or time regress")
    baseline_options(gt, names.GATE_MODELS)
    gt.add_argument("--workload", action="append", help=WORKLOAD_HELP)
    gt.add_argument("--device", choices=("auto", "cuda", "fake"), default="fake",
                    help="memory backend; cuda compares the allocator's peak with the fake "
                         "baseline within 5%%")
    gt.add_argument("--fault", choices=sorted(names.FAULTS), help="inject this fault (selfcheck "
                                                              "runs them all)")
    gt.add_argument("--time-slack", type=float, default=names.GATE_TIME_SLACK,
                    help="fail a step-time ratio this fraction above the recorded one "
                         "(default: %(default)s, for shared CI machines)")
    gt.add_argument("--strict-warnings", action="store_true",
                    help="fail on a warning a mechanism's run emits that the baseline did not "
                         "record, or one that vanished (default: list them only)")
    gt.add_argument("--out", default="hookbench-out",
                    help="folder for the figure of a failed memory or time row, recorded "
                         "against now (default: %(default)s)")
    verdict_options(gt)
    gt.set_defaults(run="gate")
    sp = commands.add_parser("speed", help="the whole-step table: each mode of the optimizer "
                                           "in backward against the standard step, interleaved")
    sp.add_argument("--model", choices=sorted({*names.ZOO, "mlp"}), default="vit_b_16",
                    help="a zoo model, or mlp: the benchmarks' MLP (default: %(default)s)")
    sp.add_argument("--workload", action="append",
                    help=WORKLOAD_HELP + "; instead of --model: timed with its own optimizer "
                         "and batch")
    sp.add_argument("--batch-size", type=int, help="a zoo model's batch (default: 2)")
    sp.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    sp.add_argument("--runs", type=int, default=5)
    sp.add_argument("--rounds", type=int,
                    help="interleaved rounds per run (default: 3; 15 with --targets)")
    sp.add_argument("--targets", action="store_true",
                    help="instead: the two ratios with speed targets (the grouped optimizer in "
                         "backward over the foreach step, statistics capture over the plain "
                         "forward), each beside its floor, timed as the gate times them")
    sp.add_argument("--json", help="also write the table here")
    sp.set_defaults(run="speed")
    sc = commands.add_parser("selfcheck", help="run the gate under every injected fault: each "
                                               "must be caught and the clean run must pass")
    baseline_options(sc, ("transformer",))
    sc.add_argument("--json", help="also write which section caught each fault here")
    sc.set_defaults(run="selfcheck")
    args = parser.parse_args(argv)
    for option in ("batch_size", "nproc", "steps", "seeds", "bucket_numel", "runs", "rounds",
                   "timeout"):
        value = getattr(args, option, None)  # None: not this command's, or not given
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1")
    # Ctrl-C or SIGTERM, from here on: one line, 130 or 143, nothing written
    # (hookbench.cli.interrupts); importing torch alone takes seconds.
    try:
        with interrupts.handled():
            return _run(args)
    except interrupts.Interrupted as e:
        say(e.said(args.command))
        return e.code


def _run(args: argparse.Namespace) -> int:
    try:
        command = importlib.import_module(f"hookbench.cli.{args.run}")
    except ImportError as e:  # a torch without a module or name hookbench imports at load time
        import torch

        say(f"hookbench: FAILED: cannot load hookbench on torch {torch.__version__}: "
            f"{type(e).__name__}: {e}")
        return 1
    # What cannot run here (bad arguments, no CUDA, no or a corrupt baseline): one line, exit 2.
    try:
        return command.run(args)
    except (RuntimeError, ValueError, TypeError, FileNotFoundError, ImportError) as e:
        say(f"hookbench {args.command}: error: {e}")
        return 2
    except OSError as e:  # the file system failed us (a full disk, a file too large): one line
        say(f"hookbench {args.command}: error: {e.filename or 'the file system'}: "
            f"{e.strerror or e}")
        return 1
