"""``hookbench zero2``: the ZeRO-2 demo, each rank's peak memory and its parity with
single-process training, under torchrun or on spawned gloo ranks; ``--simulate 1,8,64``: the
ZeRO paper's memory table, executed on fake tensors."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from hookbench.cli import common
from hookbench.core import launch
from hookbench.core.workload import Workload
from hookbench.measure import plot, zero2_runs, zero_paper
from hookbench.measure.parity import compare, parameters_only, trajectory
from hookbench.models.zoo import workload as zoo_workload


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
            "parity": compare(got["snapshots"], ref, zero2_runs.TOLERANCE)}


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
           > zero_paper.AGREEMENT]
    return 1 if far else 0


def run(args: argparse.Namespace) -> int:
    if args.simulate:
        return _zero_paper(args)

    spec = zoo_workload(args.model, batch_size=2 * args.nproc)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            world = dist.get_world_size()
            spec = zoo_workload(args.model, batch_size=2 * world)
            mine = _zero2_demo(dist.get_rank(), world, spec, args.steps, args.bucket_numel)
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
            if dist.get_rank() != 0:
                return 0 if all(r["parity"].ok for r in ranks) else 1
        finally:
            dist.destroy_process_group()
    else:
        common.progress(f"spawning {args.nproc} gloo ranks (run under torchrun to use its "
                        f"ranks) ...")
        world = args.nproc
        ranks = launch.run(_zero2_demo, world, spec, args.steps, args.bucket_numel, timeout=600)
    print(f"ZeRO-2, {spec.name}, {world} ranks, global batch {spec.batch_size}, "
          f"{args.steps} steps, bucket {args.bucket_numel} elements; memory of an Adam step:")
    for r in ranks:
        b = r["breakdown"]
        print(f"  rank {r['rank']}: peak {r['peak'] / 1e6:8.2f} MB  (parameters "
              f"{b['parameters'] / 1e6:.2f}, gradient shard {b['gradients'] / 1e6:.2f}, "
              f"optimizer state {b['optimizer_state'] / 1e6:.2f}, activations "
              f"{b['activations'] / 1e6:.2f}, temporaries {b['temporaries'] / 1e6:.2f})")
    for r in ranks:
        print(f"  rank {r['rank']} parameters vs single-process training (SGD, momentum 0.9): "
              f"{r['parity'].verdict()}")
    ok = all(r["parity"].ok for r in ranks)
    print("parity: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1
