"""A workload under the engines: which runs to start on the ranks, and each row's own checks.

    ENGINES          the rows, ``<workload>/engines/<engine>``:
                       ddp                DDP, ACCUMULATION micro-batches per step, the first
                                          under ``no_sync()``
                       fsdp2_zero2        FSDP2 ``reshard_after_forward=False``, the same
                                          accumulation under ``set_requires_gradient_sync``
                       fsdp2_zero3        ``reshard_after_forward=True``
                       fsdp2_in_backward  zero3 with ``OptimizerInBackward`` on the shards
    not_applicable   the engines that cannot train a workload, and why, before any rank starts
    cases            the runs for ``references.ranks`` (a fault goes into every engine run)
    *_checked        each ranks row's own checks (ZeRO-2's, DDP's, FSDP2's, DeepSpeed's):
                     what ``hookbench.gate.rows`` names as an entry's ``checker``

What each row is compared with, in which order and within which bound, is its entry in
``hookbench.gate.rows``; ``hookbench.gate.judge`` judges every ranks row by it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from hookbench.core.workload import Workload
from hookbench.engines import ddp, deepspeed, fsdp2
from hookbench.engines.loop import ACCUMULATION
from hookbench.measure import zero2_runs
from hookbench.measure.parity import compare
from hookbench.mechanisms.zero2 import ELEMENTWISE

__all__ = ["ENGINES", "PEERS", "Checked", "cannot_run", "cases", "ddp_checked",
           "deepspeed_checked", "fsdp2_checked", "not_applicable", "sparse_gradients",
           "zero2_checked"]

ENGINES = ("ddp", "fsdp2_zero2", "fsdp2_zero3", "fsdp2_in_backward")
# Beside the engines in ``hookbench engines`` only: the gate's rows must not depend on an
# optional install (deepspeed, the peers extra)
PEERS = ("deepspeed_zero2",)


def _uneven_gradients(workload: Workload, steps: int, world: int) -> str | None:
    """Where ranks would compute gradients for different parameters in one micro-batch (a
    forward that skips layers at random, LayerDrop), which: FSDP2 reduce-scatters the
    gradients a rank has, so ranks that differ would send collectives of other sizes and
    hang. Found by one process running each rank's share, as the ranks would, on the draws the
    rows train on (replayed where the gate replays them)."""
    model = workload.build()
    for index in range(steps * ACCUMULATION):
        sets = []
        for rank in range(world):
            x, y = zero2_runs.local_batch(workload, index, rank, world, "cpu")
            workload.compute_loss(model, x, y, (index, rank)).backward()
            sets.append({n for n, p in model.named_parameters() if p.grad is not None})
            model.zero_grad(set_to_none=True)
        if len({frozenset(s) for s in sets}) > 1:
            differ = sorted(set.union(*sets) - set.intersection(*sets))
            return (f"in micro-batch {index} the ranks compute gradients for different "
                    f"parameters ({len(differ)}, e.g. {differ[0]}: the forward skips layers "
                    f"at random); FSDP2 reduce-scatters only the gradients a rank has, so the "
                    f"ranks' collectives would not match (DDP's find_unused_parameters "
                    f"handles this)")
    return None


def sparse_gradients(workload: Workload) -> str | None:
    """The first module that makes sparse gradients (``nn.Embedding``/``EmbeddingBag`` with
    ``sparse=True``), named with its class, or None."""
    with torch.device("meta"):
        model = workload.model()
    return next((f"{name!r} ({type(m).__name__}(sparse=True))"
                 for name, m in model.named_modules() if getattr(m, "sparse", False) is True
                 and any(p.requires_grad for p in m.parameters(recurse=False))), None)


def not_applicable(workload: Workload, steps: int, world: int,
                   engines: tuple[str, ...] = ENGINES) -> dict[str, str]:
    """Engine -> why it cannot train ``workload``, for those of ``engines`` that cannot (DDP
    trains any workload)."""
    cls = workload.optimizer[0]
    uneven = functools.cache(lambda: _uneven_gradients(workload, steps, world))  # trains: once
    why: dict[str, str | None] = {}
    sparse = sparse_gradients(workload)
    if any(e.startswith("fsdp2") for e in engines):
        common = ((f"FSDP2 reduce-scatters dense gradients, and {sparse} makes sparse ones"
                   if sparse else None)
                  or (f"FSDP2 steps each rank's DTensor shard of every parameter; "
                   f"{cls.__name__} is not known to update parameters elementwise (nor to "
                   f"step DTensors)" if cls not in ELEMENTWISE else None)
                  or ("hookbench's FSDP2 rows train eager models (a compiled one is not "
                      "sharded here)" if workload.compile is not None else None)
                  or fsdp2.mixed_unit(workload) or uneven())
        why.update(dict.fromkeys((e for e in engines if e.startswith("fsdp2")), common))
    if "deepspeed_zero2" in engines:
        why["deepspeed_zero2"] = (
            (f"DeepSpeed reduces dense gradients, and {sparse} makes sparse ones" if sparse
             else None)
            or deepspeed.cannot_train(workload)
            or (f"DeepSpeed steps each rank's flat partition alone; {cls.__name__} is not known "
                f"to update parameters elementwise" if cls not in ELEMENTWISE else None)
            or ("hookbench's DeepSpeed row trains eager models" if workload.compile is not None
                else None)
            or (uneven() or "").replace("FSDP2 reduce-scatters", "DeepSpeed reduces"))
    return {e: w for e, w in why.items() if w}


def cannot_run(engines: tuple[str, ...]) -> dict[str, str]:
    """Engine -> why this torch cannot run it on this machine's ranks, whatever the workload:
    the FSDP2 engines on CPU ranks (no CUDA) where ``fsdp2.cannot_train_on_cpu`` finds FSDP2
    cannot train (torch 2.4.1 to 2.6.0). Their rows fail with these words, naming the
    exception: a check that could not run is never a pass, and the other engines' rows still
    run."""
    if torch.cuda.is_available() or not any(e.startswith("fsdp2") for e in engines):
        return {}
    why = fsdp2.cannot_train_on_cpu()
    return {e: why for e in engines if why and e.startswith("fsdp2")}


def cases(workload: Workload, kwargs: dict[str, Any], steps: int, skip: dict[str, Any],
          fault: str | None, engines: tuple[str, ...] = ENGINES) -> list[dict[str, Any]]:
    """The runs for ``references.ranks``: one per engine of ``engines`` not in ``skip``, keyed
    (workload, "engines/<engine>", engine)."""
    base = dict(spec=workload, optimizer_class=workload.optimizer[0], kwargs=kwargs,
                steps=steps, accumulation=ACCUMULATION, fault=fault)
    return [{**base, "key": (workload.name, f"engines/{engine}", engine),
             **({"engine": "fsdp2", "setting": engine.removeprefix("fsdp2_")}
                if engine.startswith("fsdp2") else {"engine": engine.removesuffix("_zero2")})}
            for engine in engines if engine not in skip]


def _ranks_agree(got: list[dict[str, Any]]) -> list[str]:
    return [f"rank {r} holds other parameters than rank 0" for r, g in enumerate(got[1:], 1)
            if not compare(g["snapshots"], got[0]["snapshots"]).bit_exact]


@dataclass
class Checked:
    """A row's own checks (``hookbench.gate.rows``' ``checker``): what they found wrong, what
    they say ran beside what was declared (after the references' words), and what the row
    keeps of them."""
    problems: list[str] = field(default_factory=list)
    words: list[str] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)


def zero2_checked(workload: Workload, ranks: list[dict[str, Any]],
                  results: dict[str, list[dict[str, Any]]]) -> Checked:
    """ZeRO-2's: every hook once per backward, no gradient left on a parameter, the ranks
    agree (``zero2_runs.rank_problems``), and so do DDP's beside it where DDP trained (where
    it stopped, ZeRO-2 is not compared with it, and DDP's own row says why)."""
    ddp = results["DDP on the same shares"]
    trained = all("snapshots" in d for d in ddp)
    return Checked(zero2_runs.rank_problems(ranks) + (
        [] if not trained or all(compare(d["snapshots"], ddp[0]["snapshots"]).bit_exact
                                 for d in ddp[1:])
        else ["DDP's ranks hold different parameters"]))


def ddp_checked(workload: Workload, ranks: list[dict[str, Any]],
                results: dict[str, list[dict[str, Any]]]) -> Checked:
    """DDP's: every bucket reduced once per synced backward and none under ``no_sync()`` (the
    comm hook's calls), the declared settings run, the ranks agree."""
    with torch.device("meta"):
        trainable = [n for n, p in workload.build().named_parameters() if p.requires_grad]
    said = ([f"declared {ddp.described(workload.ddp)}; DDP reports "
             f"{ddp.described(ranks[0]['settings'])}"] if workload.ddp else [])
    return Checked(ddp.bucket_problems(ranks[0]["after_backward"], trainable)
                   + ddp.setting_problems(workload.ddp, ranks[0]) + _ranks_agree(ranks), said)


def fsdp2_checked(in_backward: bool):
    """FSDP2's: every shard's post-accumulate-grad hook once per run of its unit in a synced
    backward (``fsdp2.hook_problems``; with the optimizer in backward also no shard gradient
    left after its step), its reduce-scatter handed the dtype it reduces in
    (``fsdp2.reduction_problems``), the declared settings run, the ranks agree, and the shard gradients
    held at once within what the engine is for (``_gradient_memory``)."""
    def checked(workload: Workload, ranks: list[dict[str, Any]],
                results: dict[str, list[dict[str, Any]]]) -> Checked:
        rank0 = ranks[0]
        mixed = fsdp2.mixed_dtypes(workload)
        problems = (fsdp2.hook_problems(rank0["after_backward"], fsdp2.unit_runs(workload),
                                        in_backward)
                    + fsdp2.reduction_problems(rank0["after_backward"], {mixed[1]} if mixed
                                               else workload.parameter_dtypes)
                    + fsdp2.setting_problems(workload.fsdp2, rank0) + _ranks_agree(ranks))
        said = [f"{rank0['units']} blocks sharded besides the root"]
        inner = max(seen.get("calls_in_forward", 0) for seen in rank0["after_backward"])
        if inner:  # told: the hooks' counts and the step are backward's
            said.append(f"FSDP2 called {inner} shards' hooks inside a forward, reducing what "
                        f"earlier micro-batches accumulated at the end of an autograd.grad in "
                        f"it; counted and stepped in backward, on the sum")
        if workload.fsdp2:  # what FSDP2 ran, beside what was declared
            said.append(f"declared {fsdp2.described(workload.fsdp2)}; FSDP2 runs "
                        f"{fsdp2.described(rank0['settings'])}")
        held, words, kept = _gradient_memory(in_backward, rank0)
        return Checked(problems + ([] if held else [words]), [*said, words],
                       {"shard_grad_bytes": kept})
    return checked


def deepspeed_checked(workload: Workload, ranks: list[dict[str, Any]],
                      results: dict[str, list[dict[str, Any]]]) -> Checked:
    """DeepSpeed's: its declared config runs (its own hooks are its business), the ranks
    agree."""
    return Checked(deepspeed.setting_problems(workload, ranks[0]) + _ranks_agree(ranks),
                   [deepspeed.described(workload, ranks[0])] if workload.deepspeed else [])


def _gradient_memory(in_backward: bool, rank0: dict[str, Any]
                     ) -> tuple[bool, str, dict[str, int]]:
    """The most bytes of shard gradients rank 0 held at once in a synced backward, against
    what the engine is for: a standard step holds every shard's gradient at the step (ZeRO-2's
    4 Psi / N in fp32, Psi the trainable parameters, N the ranks; FSDP2 pads dim 0 to N
    rows); the optimizer in backward frees each unit's before the next unit's arrive, so at
    most the largest unit's, and those a forward left: FSDP2 reduce-scatters at the end of an
    autograd.grad inside it, and the step waits for backward's part. More than that: a
    gradient kept, or one that is not a shard. Whether it held, in words, and what the row
    keeps as ``shard_grad_bytes``."""
    synced = [seen for seen in rank0["after_backward"] if seen["synced"]]
    peak = max(seen["peak_shard_grad_bytes"] for seen in synced)
    carried = max(seen.get("carried_shard_grad_bytes", 0) for seen in synced)
    units, whole = rank0["unit_bytes"], sum(rank0["unit_bytes"])
    bound, of = ((max(units) + carried, "the largest unit's shards" + (
        f" + {carried:,} B the forward left, reduced by FSDP2 at the end of an autograd.grad "
        f"inside it" if carried else "")) if in_backward
                 else (whole, "all the rank's shards, 4 Psi / N"))
    words = (f"shard gradients held at once: at most {peak:,} B on rank 0 ({of}: "
             f"{bound:,} B of {whole:,} B)")
    return peak <= bound, words, {"peak": peak, "bound": bound, "all": whole}
