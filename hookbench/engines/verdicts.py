"""A workload under the engines: which runs to start on the ranks, and each engine's verdict.

    ENGINES          the rows, ``<workload>/engines/<engine>``:
                       ddp                DDP, ACCUMULATION micro-batches per step, the first
                                          under ``no_sync()``
                       fsdp2_zero2        FSDP2 ``reshard_after_forward=False``, the same
                                          accumulation under ``set_requires_gradient_sync``
                       fsdp2_zero3        ``reshard_after_forward=True``
                       fsdp2_in_backward  zero3 with ``OptimizerInBackward`` on the shards
    not_applicable   the engines that cannot train a workload, and why, before any rank starts
    cases            the runs for ``references.ranks`` (a fault goes into every engine run)
    measure_references  what the rows are held to, measured once after the ranks ran
    judge            the rows from what the ranks returned and those references

What each row is held to:
    ddp       every bucket reduced once per synced backward, none under ``no_sync()`` (the
              comm hook's calls); both ranks' parameters equal; against one process training
              on the ranks' shares with the same accumulation within the derived tolerance and
              rounding-level bounds (``references``). Where DDP is further from it than that
              (BatchNorm over small shares: another legal fp32 order), it holds only if FSDP2
              ZeRO-2, another engine, drifts from it too and stays within 2x the measured
              noise floor |DDP - single process| of DDP. With the team's comm hook
              (``Workload.ddp["comm_hook"]``): that hook applied by hand to the same inputs,
              bit for bit (``ddp.by_hand``); DDP without it is held as above and is what the
              other engines are compared with.
    fsdp2_*   every shard's post-accumulate-grad hook called once per run of its unit in a
              synced backward (``fsdp2.unit_runs``, ``fsdp2.hook_problems``; none for a shard
              without a gradient) with its reduced shard gradient, never without sync; no gathered gradient left; both ranks equal. fp32: against DDP
              within the tolerance and 2x the measured noise floor, never bit for bit (FSDP2
              computes on gathered copies of the parameters, on which other kernels may run,
              and reduces its own buckets; bit-exactness is reported where it happens), then
              against one process as ZeRO-2 is (``references.judge``). bf16: FSDP2 runs
              ``MixedPrecisionPolicy(bf16, reduce fp32)``, other arithmetic than DDP's autocast;
              its fp32 shards against ``zero2_runs.mixed_reference`` (a bf16 model, fp32
              masters, the same reduction) within the bf16 tolerance (bit for bit on Llama,
              not on every model).
    fsdp2_in_backward   also no shard gradient left after its step; bit for bit fsdp2_zero3
              (the same arithmetic, stepped earlier); refused in words with clipping, fp16 or
              a unit run several times per forward (``fsdp2.repeated_units``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hookbench.core.workload import Workload
from hookbench.engines import ddp, deepspeed, fsdp2, references
from hookbench.engines.loop import ACCUMULATION
from hookbench.measure import zero2_runs
from hookbench.measure.bounds import FLOOR_FACTOR
from hookbench.measure.parity import Tolerance, compare
from hookbench.mechanisms.zero2 import ELEMENTWISE

__all__ = ["ENGINES", "PEERS", "cannot_run", "cases", "judge", "measure_references",
           "not_applicable", "sparse_gradients"]

ENGINES = ("ddp", "fsdp2_zero2", "fsdp2_zero3", "fsdp2_in_backward")
# Why DeepSpeed's sums are not DDP's (``hookbench.engines.deepspeed``)
DEEPSPEED_DIFFERS = ("DeepSpeed reduces every micro-batch's gradients and sums them in its "
                     "partition (no no-sync)",)
# Why FSDP2's sums are not DDP's (``judge``)
FSDP2_DIFFERS = ("FSDP2 computes on gathered copies of the parameters and reduce-scatters its "
                 "own buckets",)
# Beside the engines in ``hookbench engines`` only: the gate's rows must not depend on an
# optional install (deepspeed, the peers extra)
PEERS = ("deepspeed_zero2",)


def _uneven_gradients(workload: Workload, steps: int, world: int) -> str | None:
    """Where ranks would compute gradients for different parameters in one micro-batch (a
    forward that skips layers at random, LayerDrop), which: FSDP2 reduce-scatters the
    gradients a rank has, so ranks that differ would send collectives of other sizes and
    hang. Found by one process running each rank's share, as the ranks would."""
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
                  or uneven())
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


def _trained(ranks: list[dict[str, Any]]) -> bool:
    return not any(r.get("error") for r in ranks) and not (
        "refused" in ranks[0] or "torch_refuses" in ranks[0])


def measure_references(workload: Workload, got: dict[str, list[dict[str, Any]]],
                       kwargs: dict[str, Any], steps: int, world: int) -> references.Measured:
    """The references ``judge`` holds the engines in ``got`` to, each measured once: the
    single process with the engines' accumulation, and the mixed-precision reference in the
    dtypes FSDP2 computes and reduces in, where not the shards' (hookbench's policy under bf16,
    or the one the workload declares: ``Workload.fsdp2``) and an FSDP2 engine trained."""
    trained = {e for e, ranks in got.items() if _trained(ranks)}
    mixed = []
    dtypes = fsdp2.mixed_dtypes(workload)
    if dtypes and trained & {"fsdp2_zero2", "fsdp2_zero3"}:
        mixed.append(dtypes)
    if workload.precision == "bf16" and "deepspeed_zero2" in trained:
        mixed.append((torch.bfloat16, torch.float32))
    return references.measure(workload, kwargs, steps, world, ACCUMULATION, tuple(mixed))


def judge(workload: Workload, got: dict[str, list[dict[str, Any]]], measured: references.Measured,
          world: int, tol: Tolerance) -> dict[str, dict[str, Any]]:
    """Each engine's row from its ranks' results (``got``: engine -> per-rank results) and the
    references measured for them (``measure_references``): ``problems``, ``parity`` (what was
    compared, in words) and ``snapshots`` (rank 0's), or a designed outcome (``refused``:
    hookbench's; ``torch_refuses``: torch would not wrap it)."""
    with torch.device("meta"):
        trainable = [n for n, p in workload.build().named_parameters() if p.requires_grad]
    single, rounding, why = measured.single, measured.rounding, measured.why
    # FSDP2 is never DDP's arithmetic: it computes on gathered copies of the parameters (other
    # tensors, so other kernels may run: seen 5.4e-07 on a diffusers UNet's conv_in after one
    # step) and reduce-scatters its own buckets; and a unit run several times per forward (a
    # layer shared across depth) it reduces in pieces, once per run
    fsdp2_differs = (FSDP2_DIFFERS + (("FSDP2 reduces a unit run several times per forward in "
                                       "pieces, once per run",)
                                      if any(e.startswith("fsdp2") for e in got)
                                      and fsdp2.repeated_units(workload) else ()))
    out: dict[str, dict[str, Any]] = {}
    for engine, ranks in got.items():
        if any(r.get("error") for r in ranks):
            out[engine] = {"problems": [f"rank {i}: {r['error']}"
                                        for i, r in enumerate(ranks) if r.get("error")]}
        elif "refused" in ranks[0] or "torch_refuses" in ranks[0]:  # designed: recorded
            out[engine] = {k: ranks[0][k] for k in ("refused", "torch_refuses") if k in ranks[0]}
        else:
            if engine == "ddp":
                problems = (ddp.bucket_problems(ranks[0]["after_backward"], trainable)
                            + ddp.setting_problems(workload.ddp, ranks[0]))
            elif engine.startswith("fsdp2"):
                problems = (fsdp2.hook_problems(ranks[0]["after_backward"],
                                                fsdp2.unit_runs(workload),
                                                engine == "fsdp2_in_backward")
                            + fsdp2.setting_problems(workload.fsdp2, ranks[0]))
            else:  # DeepSpeed's own hooks are its business: its settings and parity are judged
                problems = deepspeed.setting_problems(workload, ranks[0])
            out[engine] = {"problems": problems + _ranks_agree(ranks),
                           "snapshots": ranks[0]["snapshots"]}
        if ranks[0].get("warnings"):  # said in the row, not on the terminal
            out[engine]["warnings"] = ranks[0]["warnings"]
    snaps = {e: row["snapshots"] for e, row in out.items() if "snapshots" in row}
    hook = (workload.ddp or {}).get("comm_hook")
    if hook is not None and "ddp" in snaps:  # the arithmetic the other engines share with DDP
        snaps["ddp"] = got["ddp"][0]["plain"]
    mixed = workload.precision == "bf16"
    fsdp2_dtypes = fsdp2.mixed_dtypes(workload)
    for engine, row in out.items():
        if "snapshots" not in row:
            continue
        words = []
        dtypes = (fsdp2_dtypes if engine.startswith("fsdp2")
                  else (torch.bfloat16, torch.float32) if mixed else None)
        if engine == "ddp":
            plain = ""
            if hook is not None:
                # the team's hook is its own arithmetic (lossy compression, low rank): held bit
                # for bit to itself applied by hand to the same inputs; DDP without it to the
                # one process below, and what the hook changes is said
                by_hand = compare(row["snapshots"], got["ddp"][0]["by_hand"])
                words.append(f"comm hook {ddp.in_words(hook)}: vs the hook applied by hand "
                             f"to each rank's accumulated gradients in DDP's buckets: "
                             f"{by_hand.verdict()}")
                if not by_hand.ok:
                    row["problems"].append(words[-1])
                moved = compare(row["snapshots"], snaps["ddp"])
                words.append("the hook changes nothing against DDP without it" if moved.bit_exact
                             else f"the hook moves the parameters up to {moved.max_abs:.3g} "
                                  f"from DDP without it ({moved.where})")
                plain = "DDP without the hook "
            result = compare(snaps["ddp"], single, tol, rounding)
            words.append(f"{plain}vs one process on the ranks' shares: {result.verdict()}")
            # the yardstick the baseline keeps: how far two legal references drift apart on
            # this workload, step by step (the gate holds a later torch to it)
            row["noise_floor"] = references.largest(references.noise_floor(snaps["ddp"], single))
            peer = snaps.get("fsdp2_zero2")
            if not result.ok and not mixed and peer is not None:
                # no engine does DDP's arithmetic: FSDP2 ZeRO-2, another order of the sums on
                # other tensors, must drift from the single process too (a DDP that is wrong
                # where FSDP2 is right fails), and stay within the noise floor's bounds of DDP
                bounds = references.floor_bounds(references.noise_floor(snaps["ddp"], single),
                                                 rounding)
                confirmed = (not compare(peer, single, tol, rounding).ok
                             and compare(peer, snaps["ddp"], tol, bounds).ok)
                by = (f"drifting from it too and within {FLOOR_FACTOR:g}x the noise "
                      f"floor of DDP")
            else:
                confirmed, by = False, ""
            if confirmed:
                words[-1] = (f"{plain}vs one process on the ranks' shares: {result.ratio:.3g}x "
                             f"the tolerance, another legal {_short(workload.parameter_dtype)} "
                             f"order, confirmed by FSDP2 ZeRO-2 "
                             f"{by}: this workload's noise floor")
            elif not result.ok:
                row["problems"].append(words[-1])
            if workload.ddp:  # what torch says it runs, beside what was declared
                words.append(f"declared {ddp.described(workload.ddp)}; DDP reports "
                             f"{ddp.described(got['ddp'][0]['settings'])}")
        elif engine == "fsdp2_in_backward":
            if "fsdp2_zero3" in snaps:
                result = compare(row["snapshots"], snaps["fsdp2_zero3"])
                words.append(f"vs FSDP2 ZeRO-3 with a standard step: {result.verdict()}")
                if not result.ok:
                    row["problems"].append(words[-1])
            else:
                row["problems"].append("no FSDP2 ZeRO-3 run to compare with")
        elif dtypes:
            # within the bf16 tolerance and the rounding-level bounds DDP's row has, not bit for
            # bit: the same arithmetic on Llama, not on a checkpointed LayerNorm model
            # (charlm-bf16-ckpt: 1.9e-4 on norm.bias, an Adam step on a gradient at rounding
            # level), so bit-exactness is reported, not required
            assert dtypes in measured.mixed, f"no {dtypes} reference measured for {engine}"
            result = compare(row["snapshots"], measured.mixed[dtypes], tol, rounding)
            reduced = "" if dtypes[1] == torch.float32 else f", {_short(dtypes[1])} reductions"
            words.append(f"fp32 shards vs one process with {_short(dtypes[0])} parameters"
                         f"{reduced} and fp32 masters: {result.verdict()}")
            if not result.ok:
                row["problems"].append(words[-1])
        else:
            # where DDP did not train (it failed on a declared setting, or with reentrant
            # checkpointing: its own words are in its row), one process is the yardstick alone
            ddp_failed = (None if "ddp" in snaps else
                          "DDP did not train the workload: its row says why"
                          if "ddp" in got else "no DDP run")
            verdict = references.judge(workload, row["snapshots"], snaps.get("ddp"), single,
                                       rounding, why, tol, world,
                                       DEEPSPEED_DIFFERS if engine == "deepspeed_zero2"
                                       else fsdp2_differs, no_ddp=ddp_failed or "")
            words.append(verdict["parity"])
            row["problems"] += verdict["problems"]
            if engine == "deepspeed_zero2" and workload.deepspeed:
                words.append(deepspeed.described(workload, got[engine][0]))
        if engine.startswith("fsdp2"):
            words.append(f"{got[engine][0]['units']} blocks sharded besides the root")
            if workload.fsdp2:  # what FSDP2 ran, beside what was declared
                words.append(f"declared {fsdp2.described(workload.fsdp2)}; FSDP2 runs "
                             f"{fsdp2.described(got[engine][0]['settings'])}")
            words.append(_gradient_memory(engine, got[engine][0], row))
        row["parity"] = "; ".join(words)
    return out


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype))


def _gradient_memory(engine: str, rank0: dict[str, Any], row: dict[str, Any]) -> str:
    """The most bytes of shard gradients rank 0 held at once in a synced backward, against
    what the engine is for: a standard step holds every shard's gradient at the step (ZeRO-2's
    4 Psi / N in fp32, Psi the trainable parameters, N the ranks; FSDP2 pads dim 0 to N
    rows); the optimizer in backward frees each unit's before the next unit's arrive, so at
    most the largest unit's. More than that: a gradient kept, or one that is not a shard.
    Kept in the row as ``shard_grad_bytes``."""
    peak = max(seen["peak_shard_grad_bytes"] for seen in rank0["after_backward"]
               if seen["synced"])
    units, whole = rank0["unit_bytes"], sum(rank0["unit_bytes"])
    bound, of = ((max(units), "the largest unit's shards") if engine == "fsdp2_in_backward"
                 else (whole, "all the rank's shards, 4 Psi / N"))
    words = (f"shard gradients held at once: at most {peak:,} B on rank 0 ({of}: "
             f"{bound:,} B of {whole:,} B)")
    row["shard_grad_bytes"] = {"peak": peak, "bound": bound, "all": whole}
    if peak > bound:
        row["problems"].append(words)
    return words
