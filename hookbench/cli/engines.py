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
import datetime
import os
import platform
from typing import Any

import torch
import torch.distributed as dist

import hookbench
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


def _what_runs(workloads: list[Workload], fault: str | None) -> dict[str, Any]:
    return {"torch": torch.__version__, "hookbench": hookbench.__version__,
            "python": platform.python_version(), "fault": fault,
            "workloads": [(w.name, w.optimizer[0].__name__, w.batch_size, w.precision)
                          for w in workloads]}


def _same_everywhere(mine: dict[str, Any], world: int) -> None:
    """Every rank's ``_what_runs``, gathered; raises on every rank where one differs."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    differ = [f"rank {r} has {key} {theirs[key]!r}, rank 0 {everyone[0][key]!r}"
              for r, theirs in enumerate(everyone) for key in mine
              if theirs[key] != everyone[0][key]]
    if differ:
        raise ValueError(f"the ranks do not run the same thing: {'; '.join(differ)}")


def _under_torchrun(workloads: list[Workload], fault: str | None, timeout: float,
                    cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]] | None:
    """This rank's part; rank 0 gets every rank's results, the others None."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    _same_everywhere(_what_runs(workloads, fault), world)
    try:
        mine: Any = references.ranks(rank, world, cases)
    except Exception as e:  # noqa: BLE001 - sent to rank 0, which says it; nobody waits
        mine = {"error": f"rank {rank}: {type(e).__name__}: {e}"}
    got: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, got, dst=0)
    return got


def run(args: argparse.Namespace) -> int:
    workloads = _workloads(args)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    for w in workloads:  # on every rank alike: one line, exit 2, before anything trains
        w.check(shares=world)
    # once per process (every rank under torchrun computes the same): what runs, what cannot
    stopped, runs = workload_checks.engine_runs(workloads, args.fault, world, ENGINES)
    cases = [case for each in runs for case in each]
    if under_torchrun:
        try:
            got = _under_torchrun(workloads, args.fault, args.timeout, cases)
            code = [0]
            if got is not None:
                code = [_print(workloads, stopped, runs, args.fault, world, got)]
            dist.broadcast_object_list(code, src=0)  # every rank exits with rank 0's verdict
            return code[0]
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    common.progress(f"spawning {world} gloo ranks (run under torchrun to use its ranks) ...")
    got = launch.run(references.ranks, world, cases, timeout=args.timeout)
    return _print(workloads, stopped, runs, args.fault, world, got)


def _print(workloads: list[Workload], stopped: dict[str, Any], runs: list[list[dict]],
           fault: str | None, world: int, got: list[Any]) -> int:
    failed = [g["error"] for g in got if isinstance(g, dict)]
    if failed:
        print("hookbench engines: FAILED: " + "; ".join(failed))
        return 1
    rows = workload_checks.engine_rows(workloads, stopped, runs, got, world, ENGINES)
    section = report.workload_section(
        f"The engines on {world} {'nccl' if torch.cuda.is_available() else 'gloo'} ranks, "
        f"{workload_checks.STEPS} steps of {ACCUMULATION} micro-batches (the first without "
        f"gradient sync)" + (f", under fault {fault}" if fault else ""), rows)
    print(report.render([section], "hookbench engines"))
    return 0 if section.ok else 1
