"""``hookbench engines``: the engines' rows for a workload (DDP with accumulation under
``no_sync()``, FSDP2 as ZeRO-2 and ZeRO-3, the optimizer in backward under FSDP2, and DeepSpeed
ZeRO stage 2 where the peers extra is installed; each judged as ``hookbench.engines.verdicts``
says), on ``--nproc`` spawned gloo ranks, or under torchrun on
its ranks, on one machine or several (the multi-node recipe in docs/engines.md):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m hookbench engines --workload package.module:NAME

Under torchrun every rank first shows the others what it runs (torch, hookbench, Python, the
workloads, the fault); where any differs, every rank raises, naming it. A rank whose run raises
sends the error instead of its results, so that rank 0 reports it and none waits for it; a rank
that stops answering fails the others' collectives after ``--timeout`` seconds. Rank 0 prints
the rows; every rank exits with its verdict: 0 when all hold, 1 when one fails, 2 when the
command cannot run (one line).
"""

from __future__ import annotations

import argparse
from typing import Any

from hookbench import report
from hookbench.cli import common
from hookbench.core import launch
from hookbench.core.workload import Workload
from hookbench.engines import references, verdicts
from hookbench.engines.loop import ACCUMULATION
from hookbench.gate import engines as gate_engines
from hookbench.gate import workload_checks


# the gate's engines and DeepSpeed ZeRO-2 beside them (SKIPPED without the peers extra)
ENGINES = verdicts.ENGINES + verdicts.PEERS


def _workloads(args: argparse.Namespace) -> list[Workload]:
    found, _ = common.named_workloads(args)
    return found or [gate_engines.WORKLOAD]


def run(args: argparse.Namespace) -> int:
    workloads = _workloads(args)
    world = launch.torchrun_world() or args.nproc
    for w in workloads:  # on every rank alike: one line, exit 2, before anything trains
        w.check(shares=world)
    # once per process (every rank under torchrun computes the same): what runs, what cannot
    stopped, runs = workload_checks.engine_runs(workloads, args.fault, world, ENGINES)
    cases = [case for each in runs for case in each]

    # what the ranks run: torchrun's nccl or gloo, the spawned ranks' gloo (even beside CUDA)
    backend = launch.torchrun_backend() if launch.torchrun_world() else "gloo"

    def verdict(got: list, errors: list[str]) -> int:
        return _print(workloads, stopped, runs, args.fault, world, backend, got, errors)

    if launch.torchrun_world():
        return launch.on_torchrun(references.ranks, (cases,),
                                  common.what_runs(workloads, args.fault), args.timeout, verdict)
    common.progress(f"spawning {world} gloo ranks (run under torchrun to use its ranks) ...")
    got = references.run_cases(cases, world, args.timeout, backend)  # a crash fails one run
    return verdict([{key: ranks[r] for key, ranks in got.items()} for r in range(world)], [])


def _print(workloads: list[Workload], stopped: dict[str, Any], runs: list[list[dict]],
           fault: str | None, world: int, backend: str, got: list[Any],
           errors: list[str]) -> int:
    if errors:
        print("hookbench engines: FAILED: " + "; ".join(errors))
        return 1
    rows = workload_checks.engine_rows(workloads, stopped, references.gathered(got), world,
                                       ENGINES)
    section = report.workload_section(
        f"The engines on {world} {backend} ranks, "
        f"{workload_checks.STEPS} steps of {ACCUMULATION} micro-batches (the first without "
        f"gradient sync)" + (f", under fault {fault}" if fault else ""), rows)
    print(report.render([section], "hookbench engines"))
    return 0 if section.ok else 1
