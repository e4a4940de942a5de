"""What the collectives of sharded training compute, on the installed torch: a semantics matrix.

ZeRO-2 here reduces with ``dist.reduce``; FSDP2 (the suite's peer) and DeepSpeed reduce-scatter;
a user's stack may use any of them. Each collective below runs on every rank of a gloo group
(2 and 3 ranks) for each ``ReduceOp`` on inputs whose exact result is known (small integers in
float32, so that SUM, AVG, MAX, MIN and PRODUCT are exact and any wrong element or wrong slice
shows), and the outcome is compared with the hand computation, bit for bit:

    ok              every rank holds the expected result
    WRONG: ...      some rank holds something else (the silent kind of regression: gloo's
                    reduce_scatter once ignored ``op``, turning AVG and MAX into SUM, #162338)
    unsupported: .. the collective raised: the pair is not supported by this torch and backend

A pair that changes outcome between torch releases is a diff for the upgrade gate; a WRONG
outcome is never acceptable. ``matrix(rank, world, fault)`` is one rank's run (``hookbench.core.launch``
spawns the ranks).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from hookbench.gate.checks import Run, Section

__all__ = ["COLLECTIVES", "OPS", "WORLDS", "matrix", "merged", "pairs", "run_matrix"]

# Rank processes take seconds: selfcheck runs the section clean and under its own fault.
FAULTS = ("reduce_scatter_ignores_op",)

OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")
WORLDS = (2, 3)
_N = 6  # elements per rank's input: divisible by every world size, so reduce-scatter splits it


def _input(rank: int) -> torch.Tensor:
    # (rank + 1) * [1, 2, ..., N]: every element distinct, every op's result an exact float.
    return (rank + 1) * torch.arange(1, _N + 1, dtype=torch.float32)


def _reduced(world: int, op: str) -> torch.Tensor:
    """The elementwise reduction over all ranks' inputs, computed by hand in float64."""
    xs = [_input(r).double() for r in range(world)]
    if op == "SUM":
        out = sum(xs)
    elif op == "AVG":
        out = sum(xs) / world
    elif op == "MAX":
        out = torch.stack(xs).amax(0)
    elif op == "MIN":
        out = torch.stack(xs).amin(0)
    else:
        out = torch.stack(xs).prod(0)
    return out.float()


def _run(rank: int, world: int, name: str, op_name: str | None, group: Any
         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(what this rank holds, what it should hold); (None, None) where the rank holds nothing
    defined (a reduce's non-destination ranks)."""
    op = getattr(dist.ReduceOp, op_name) if op_name else None
    x = _input(rank)
    if name == "all_reduce":
        dist.all_reduce(x, op=op, group=group)
        return x, _reduced(world, op_name)
    if name == "reduce":
        dist.reduce(x, dst=0, op=op, group=group)
        return (x, _reduced(world, op_name)) if rank == 0 else (None, None)
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        out = torch.empty(_N // world)
        getattr(dist, name)(out, x, op=op, group=group)
        return out, _reduced(world, op_name).chunk(world)[rank]
    if name == "all_gather_into_tensor":
        out = torch.empty(_N * world)
        dist.all_gather_into_tensor(out, x, group=group)
        return out, torch.cat([_input(r) for r in range(world)])
    if name == "broadcast":
        dist.broadcast(x, src=world - 1, group=group)
        return x, _input(world - 1)
    raise AssertionError(name)


# name -> takes a ReduceOp; the ones torch lacks are left out where it lacks them
COLLECTIVES: dict[str, bool] = {
    "all_reduce": True,
    "reduce": True,
    "reduce_scatter_tensor": True,
    "reduce_scatter_single": True,  # a newer name for reduce_scatter_tensor (torch 2.14)
    "all_gather_into_tensor": False,
    "broadcast": False,
}


def pairs() -> list[tuple[str, str | None]]:
    """(collective, op) for every collective the installed torch has."""
    return [(name, op) for name, takes_op in COLLECTIVES.items() if hasattr(dist, name)
            for op in (OPS if takes_op else (None,))]


def matrix(rank: int, world: int, fault: str | None = None) -> dict[str, str]:
    """This rank's outcome for every pair: "ok", "WRONG: ..." or "unsupported: ..."."""
    from hookbench.measure.faults import inject

    out = {}
    # Deprecation warnings (all_gather_into_tensor, reduce_scatter_tensor in torch 2.14) are
    # not outcomes; each rank would print one per call.
    with inject(fault), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, op in pairs():
            key = f"{name}/{op}" if op else name
            # A group of its own per pair: an unsupported op can leave an error on its group
            # that later collectives on the same group raise again (gloo, torch 2.4).
            group = dist.new_group(list(range(world)))
            try:
                got, expected = _run(rank, world, name, op, group)
            except Exception as e:  # noqa: BLE001 - recorded: the pair is unsupported here
                out[key] = f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                continue
            if got is None or torch.equal(got, expected):
                out[key] = "ok"
            else:
                out[key] = (f"WRONG: rank {rank} holds {got.tolist()}, expected "
                            f"{expected.tolist()}")
    return out


def merged(ranks: list[dict[str, str]]) -> dict[str, str]:
    """One outcome per pair over all ranks: the first rank's that is not "ok", else "ok"."""
    return {key: next((r[key] for r in ranks if r[key] != "ok"), "ok") for key in ranks[0]}


def run_matrix(fault: str | None = None, timeout: float = 120,
               worlds: tuple[int, ...] = WORLDS) -> dict[str, str]:
    """The whole matrix: ``world/pair -> outcome`` for 2 and 3 gloo ranks (or ``worlds``)."""
    from hookbench.core import launch

    out = {}
    for world in worlds:
        for key, outcome in merged(launch.run(matrix, world, fault, timeout=timeout)).items():
            out[f"{world} ranks/{key}"] = outcome
    return out


def measure(run: Run) -> dict[str, str]:
    return run_matrix(run.fault)  # the fault goes into the ranks, as for ZeRO-2


def judge(base: dict, now: dict, run: Run) -> Section:
    section = Section("Collectives on gloo against a hand computation and the baseline",
                      ("ranks/collective/op", "recorded", "verdict"))
    for key, outcome in now.items():
        rec = base.get(key)
        if outcome.startswith("WRONG"):  # never acceptable, whatever was recorded
            ok, verdict = False, f"{outcome} (a silently wrong result)"
        elif rec is None:
            ok, verdict = False, f"{outcome}; no baseline recorded"
        elif outcome == rec:
            ok, verdict = True, "identical" if outcome == "ok" else f"identical: {outcome}"
        elif outcome == "ok":
            ok, verdict = True, f"newly supported (was {rec})"
        else:
            ok, verdict = False, f"CHANGED: {outcome}"
        section.add(ok, key, rec.split(":")[0] if rec else "", verdict)
    for key in sorted(set(base) - set(now)):  # a collective this torch does not have
        name = key.split("/")[1]
        section.skip(f"torch {torch.__version__} has no torch.distributed.{name}", key,
                     base[key].split(":")[0])
    return section
