"""``hookbench zero2``: ZeRO-2 on a zoo model or a user's workload (``--workload``), each rank's
peak memory and its parity, under torchrun or on spawned gloo ranks; ``--simulate 1,8,64``:
the ZeRO paper's memory table, executed on fake tensors.

A zoo model is trained with SGD for parity (``_zero2_demo`` says why) and measured with Adam. A
workload trains with its own optimizer (its for-loop), held as the gate holds it
(``workload_checks.zero2_row``): to torch's DDP on the same ranks and to the single process,
every hook once, no gradient left; its memory is one step of that optimizer on each rank, on
real tensors (eager, as fake tensors do not run compiled code).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from hookbench import report
from hookbench.cli import common
from hookbench.core import launch
from hookbench.core.prerequisites import attempt
from hookbench.core.workload import Workload
from hookbench.engines import references
from hookbench.gate import workload_checks
from hookbench.measure import bounds, plot, zero2_runs, zero_paper
from hookbench.measure.parity import compare, parameters_only, trajectory
from hookbench.models.zoo import workload as zoo_workload

ZOO_BUCKET = 2**20  # elements of a zoo model's gradient bucket, unless --bucket-numel


def _zero2_demo(rank: int, world: int, spec: Workload, steps: int,
                bucket_numel: int) -> dict:
    """One rank of the demo: train, measure this rank's step, check against the reference.

    Parity is checked with SGD + momentum: Adam's first update is lr * sign(g) for every
    element, so where a transformer's gradient is at rounding level (attention keys at init)
    any other summation order flips whole steps; the sharding is what is being checked.
    Memory is measured with Adam, whose state the ZeRO formula counts."""
    sgd = {"lr": 1e-2, "momentum": 0.9, "foreach": False}
    got = zero2_runs.trajectory(rank, world, spec, torch.optim.SGD, sgd, bucket_numel, steps)
    memory = zero2_runs.rank_memory(rank, world, spec, {"lr": 1e-3, "foreach": False,
                                                   "bucket_numel": bucket_numel})
    ref = parameters_only(trajectory(spec, torch.optim.SGD, sgd, "forloop", steps=steps))
    return {"rank": rank, "peak": memory["peak"], "breakdown": memory["breakdown"],
            "parity": compare(got["snapshots"], ref, bounds.DATA_PARALLEL)}


def _zero_paper(args: argparse.Namespace) -> int:
    worlds = tuple(sorted({int(w) for w in args.simulate.split(",")}))
    if worlds[0] < 1:
        raise ValueError(f"--simulate takes rank counts >= 1, got {args.simulate}")
    out = common.output_dir(args.out)
    with torch.device("meta"):
        psi = sum(p.numel() for p in zero_paper.GPT_7_5B.model().parameters())
    common.progress(f"one step of {zero_paper.GPT_7_5B.name} ({psi / 1e9:.3f} B parameters) as "
                    f"rank 0 of N = {', '.join(map(str, worlds))}, fake tensors ...")
    rows = zero_paper.table(worlds)
    print(f"The ZeRO paper's Table 1 by execution: {psi / 1e9:.3f} B parameters, bf16 "
          f"parameters and gradients, fp32 masters and Adam (K = 12), rank 0 of N; model "
          f"states (GB) when backward has ended")
    print(f"{'N':>5}  {'stage':16}  {'params':>7}  {'grads':>7}  {'opt state':>9}  "
          f"{'measured':>8}  {'paper':>7}  {'diff':>6}  {'activations':>11}")
    for r in rows:
        paper = (zero_paper.PAPER[1][0] if r.stage == 0 else
                 zero_paper.PAPER[r.world][r.stage - 1] if r.world in zero_paper.PAPER else None)
        formula = zero_paper.paper_bytes(r.stage, r.world) / 1e9
        reference = paper if paper is not None else formula
        print(f"{r.world if r.stage else 'any':>5}  "
              f"{['data parallel', 'P_os (stage 1)', 'P_os+g (stage 2)'][r.stage]:16}  "
              f"{r.parameters / 1e9:7.2f}  {r.gradients / 1e9:7.2f}  "
              f"{r.optimizer_state / 1e9:9.2f}  {r.model_states / 1e9:8.2f}  "
              f"{reference:7.2f}{'' if paper is not None else '*'} "
              f"{r.model_states / 1e9 / reference - 1:+6.1%}  {r.activations_peak / 1e9:11.3f}")
    print("* not in the paper's table: its formula (4 Psi + 12 Psi/N, 2 Psi + 14 Psi/N)")
    print(f"wrote {plot.zero_paper(rows, out / 'zero-paper.png')}")
    far = [r for r in rows if abs(r.model_states / zero_paper.paper_bytes(r.stage, r.world) - 1)
           > bounds.STATES_AGREEMENT]
    return 1 if far else 0


def _workload_rank(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One rank of ZeRO-2 on a workload: its run and DDP's beside it (``references.ranks``),
    then, unless ZeRO-2 refused or failed, this rank's memory of one step."""
    got = references.ranks(rank, world, [case, *references.ddp_beside([case])])
    zero2, ddp = got[case["key"]], got[(*case["key"][:2], "ddp")]
    out: dict[str, Any] = {"rank": rank, "zero2": zero2, "ddp": ddp}
    if "refused" not in zero2 and not zero2["error"]:
        memory = zero2_runs.rank_memory(
            rank, world, case["spec"].replace(compile=None),
            {**case["kwargs"], "bucket_numel": case["bucket_numel"]},
            optimizer_class=case["optimizer_class"])
        out.update(peak=memory["peak"], breakdown=memory["breakdown"])
    return out


def _print_memory(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        if "peak" not in r:
            continue
        b = r["breakdown"]
        print(f"  rank {r['rank']}: peak {r['peak'] / 1e6:8.2f} MB  (parameters "
              f"{b['parameters'] / 1e6:.2f}, gradient shard {b['gradients'] / 1e6:.2f}, "
              f"optimizer state {b['optimizer_state'] / 1e6:.2f}, activations "
              f"{b['activations'] / 1e6:.2f}, temporaries {b['temporaries'] / 1e6:.2f})")


def _fails(errors: list[str]) -> bool:
    if errors:
        print("hookbench zero2: FAILED: " + "; ".join(errors))
    return bool(errors)


def run(args: argparse.Namespace) -> int:
    if args.simulate:
        return _zero_paper(args)
    world = launch.torchrun_world() or args.nproc
    if args.fault and not args.workload:
        raise ValueError("--fault needs --workload: the zoo demo's ZeRO-2 is held under every "
                         "fault by the gate (hookbench selfcheck)")
    if args.workload:
        spec = common.one_workload(args)
        spec.check(shares=world)  # a broken workload: one line, exit 2, before any rank starts
        case = workload_checks.zero2_case(spec, args.fault, args.steps)
        if args.bucket_numel:
            case["bucket_numel"] = args.bucket_numel
        fn, fn_args = _workload_rank, (case,)

        def verdict(ranks: list, errors: list[str]) -> int:
            if _fails(errors):
                return 1
            cls = spec.optimizer[0]
            print(f"ZeRO-2, {spec.name}, {world} ranks, global batch {spec.batch_size}, "
                  f"{args.steps} steps of {cls.__name__}, bucket {case['bucket_numel']} "
                  f"elements; memory of a step on each rank (real tensors):")
            _print_memory(ranks)
            got = [r["zero2"] for r in ranks]
            row = attempt(lambda: workload_checks.zero2_row(
                spec, case, got, [r["ddp"] for r in ranks], world))
            section = report.workload_section(
                f"ZeRO-2 against torch's DDP on the same {world} ranks and the single process",
                {f"{spec.name}/zero2": row})
            print(report.render([section], "hookbench zero2"))
            return 0 if section.ok else 1
    else:
        spec = zoo_workload(args.model, batch_size=2 * world)
        bucket_numel = args.bucket_numel or ZOO_BUCKET
        fn, fn_args = _zero2_demo, (spec, args.steps, bucket_numel)

        def verdict(ranks: list, errors: list[str]) -> int:
            if _fails(errors):
                return 1
            print(f"ZeRO-2, {spec.name}, {world} ranks, global batch {spec.batch_size}, "
                  f"{args.steps} steps, bucket {bucket_numel} elements; memory of an Adam step:")
            _print_memory(ranks)
            for r in ranks:
                print(f"  rank {r['rank']} parameters vs single-process training (SGD, "
                      f"momentum 0.9): {r['parity'].verdict()}")
            ok = all(r["parity"].ok for r in ranks)
            print("parity: " + ("PASS" if ok else "FAIL"))
            return 0 if ok else 1

    if launch.torchrun_world():
        return launch.on_torchrun(fn, fn_args, common.what_runs([spec], args.fault),
                                  args.timeout, verdict)
    common.progress(f"spawning {world} gloo ranks (run under torchrun to use its ranks) ...")
    return verdict(launch.run(fn, world, *fn_args, timeout=args.timeout), [])
