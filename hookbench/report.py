"""``hookbench report``: what hookbench verifies, run on the installed torch, as a table.

Each section is a list of rows (what was checked, the verdict, whether it holds); a failed row
makes ``hookbench report`` exit non-zero, so the report doubles as a CI check.
"""

from __future__ import annotations

import platform
from typing import Any, Callable

import torch

from hookbench.core import launch
from hookbench.core.prerequisites import one_line
from hookbench.core.workload import Workload
from hookbench.gate.checks import Section, Verdict
from hookbench.gate.workload_checks import DESIGNED, live_verdict, refusal, say_warnings
from hookbench.engines import references
from hookbench.measure import bounds, zero2_runs
from hookbench.measure.memory import (CATEGORIES, MemoryResult, format_bytes,
                                      measure, measure_or_fall_back, table_unit)
from hookbench.measure.parity import compare, parameters_only, trajectory

__all__ = ["MEMORY_STRATEGIES", "SAVING_ROWS", "memory_section", "render", "workload_section",
           "zero2_section"]


MEMORY_STRATEGIES = ("foreach", "forloop", "fused", "in_backward", "in_backward_grouped_foreach",
                     "in_backward_bucketed")
# What saves activation memory, beside them: (row, strategy, workload changes, the row it is
# held against in ``memory_section``, so that a lost saving fails). Offload is
# ``Workload.offload``; checkpoint is ``checkpointing="repeated"``, each repeated block (the
# built-in models only: a user's workload checkpoints as its recipe says).
SAVING_ROWS = (
    ("foreach + offload", "foreach", {"offload": "lossless"}, "foreach"),
    ("in_backward + offload", "in_backward", {"offload": "lossless"}, "in_backward"),
    ("in_backward + offload bf16", "in_backward", {"offload": "bf16"}, "in_backward"),
    ("in_backward + checkpoint", "in_backward", {"checkpointing": "repeated"}, "in_backward"),
    ("in_backward + offload + checkpoint", "in_backward",
     {"offload": "lossless", "checkpointing": "repeated"}, "in_backward + checkpoint"))
_CHANGES = {row: changes for row, _, changes, _ in SAVING_ROWS}
_AGAINST = {row: against for row, _, _, against in SAVING_ROWS}


def _keeps_saving(r: MemoryResult, without: MemoryResult, offloads: bool) -> bool:
    """Whether ``r``, a step that saves activation memory, keeps its saving against the same
    step ``without`` it: below its peak where what ``r`` saves is a tenth of that peak, else
    not above it (the standard step peaks in optimizer.step(), with the activations gone; a
    small model's saved tensors stay under 1 KB each). Checkpointing saves the activations;
    offload (``offloads``) only those it moved to the host, so that a device copy kept alive
    is a lost saving."""
    moved = without.peak_breakdown["activations"]
    if offloads:
        moved = min(moved, r.host_peak)
    return r.peak < without.peak if moved >= 0.1 * without.peak else r.peak <= without.peak


def memory_section(results: list[MemoryResult],
                   stopped: dict[str, dict[str, str]] | None = None,
                   optimizer: str = "Adam") -> Section:
    """Peak and breakdown per strategy, the distance to the floor and the saving against the
    standard foreach step. A row fails when an in-backward strategy peaks above the standard
    step (equal is possible: where activations peak in backward, a small model or a long
    sequence, both steps peak there) or ever holds every gradient at once, or when a row of
    ``SAVING_ROWS`` loses its saving against the row it is held against (``_keeps_saving``);
    ``stopped``: what stopped a strategy's measurement (``attempt``), a row SKIPPED or FAILED
    saying so, or ``{"refused": why}``: a strategy that refused the workload by design, a row
    that passes saying so."""
    columns = ("strategy", "peak", "params", "grads", "opt state", "activations", "temporaries",
               "host", "floor", "vs floor", "vs foreach", "grads alive at once")
    first = results[0] if results else None
    # One unit for the whole table, from its largest cell (GB for ViT-L, MB for the zoo's
    # small models), so that a column compares by eye.
    unit, cell = table_unit(v for r in results for v in (
        r.peak, *r.peak_breakdown.values(), r.floor, r.gradients_alive_max, r.all_gradients,
        r.host_peak))
    section = Section(
        "Peak memory of one training step" + (
            f" ({first.model}, batch {first.batch_size}, {optimizer}, backend {first.backend}; "
            f"{unit})"
            if first else ""), columns)
    standard = next((r for r in results if r.strategy == "foreach"), None)
    by = {r.strategy: r for r in results}
    for r in results:
        in_backward = r.strategy.startswith("in_backward")
        # Bucketed, a bucket steps inside backward, beside what the last node still holds: on
        # a model smaller than a bucket (the transformer) that is the standard step plus 1 KiB
        # (one activation and one temporary of 512 B), hence 0.1%.
        slack = 1.001 if r.strategy == "in_backward_bucketed" else 1.0
        ok = not in_backward or ((standard is None or r.peak <= standard.peak * slack)
                                 and r.few_gradients_alive)
        without = by.get(_AGAINST.get(r.strategy))
        if without is not None:
            added = _CHANGES[r.strategy].keys() - _CHANGES.get(without.strategy, {}).keys()
            ok = ok and _keeps_saving(r, without, offloads="offload" in added)
        section.add(
            ok, r.strategy, cell(r.peak),
            *(cell(r.peak_breakdown[c]) for c in CATEGORIES), cell(r.host_peak),
            cell(r.floor), f"{r.above_floor:+.1%}",
            "" if standard is None else f"{r.peak / standard.peak - 1:+.1%}",
            f"{cell(r.gradients_alive_max)} of {cell(r.all_gradients)}",
        )
    for strategy, value in (stopped or {}).items():
        designed = next((k for k in DESIGNED if k in value), None)
        if designed:
            section.add(True, strategy, *[""] * (len(columns) - 2),
                        f"{DESIGNED[designed]}: {value[designed]}")
        else:
            section.add_stopped(value, strategy)
    return section


ZERO2_RANKS = (2, 8, 64)
ZERO2_BUCKET = 2**22  # gradient elements per bucket
# Rank 0's peak may exceed its bound (parameters + shard state + shard gradient + activations
# + one bucket) by this fraction: the fake backend rounds each allocation to 512 B and a
# parameter's gradient arrives while a bucket is in flight (seen, fake backend: ViT-L/16
# 0.96x, 0.93x, 1.00x at N = 2, 8, 64; the transformer 0.85x, 0.71x, 0.68x). A rank that
# keeps a second bucket alive (the concatenated copy the reduction used to make: the
# transformer at 1.11x, N = 2) fails, and so does one that holds every gradient again.
ZERO2_SLACK = 0.02


def zero2_bound(r: MemoryResult, world: int, bucket_numel: int = ZERO2_BUCKET,
                mixed: bool = False) -> int:
    """What rank 0 of ``world`` needs with Adam. fp32: all parameters (4 Psi), its shard of
    Adam's two moments (8 Psi / N) and of the gradient (4 Psi / N). bf16 with fp32 masters
    (``mixed``): all bf16 parameters (2 Psi), its shard of the bf16 gradient (2 Psi / N), of the
    fp32 masters (4 Psi / N) and of Adam's moments (8 Psi / N): the ZeRO paper's 2 Psi +
    14 Psi / N. Both plus the peak activations and one bucket of gradient elements."""
    p, size = r.parameters, 2 if mixed else 4  # p: the model's parameter bytes
    return (p + (7 if mixed else 3) * p // world + r.activations_peak
            + size * min(bucket_numel, p // size))


MIXED = {"param_dtype": torch.bfloat16}  # the report's mixed-precision ZeRO-2
# fp16 with dynamic loss scaling: a large first scale and growth every 2 steps, so that 5 steps
# both skip an overflowing step and grow the scale, as GradScaler would.
FP16 = {"param_dtype": torch.float16,
        "loss_scaling": {"init_scale": 2.0**18, "growth_interval": 2}}


def workload_section(title: str, rows: dict[str, dict[str, Any]]) -> Section:
    """A user's workload checked live (``hookbench.gate.workload_checks`` rows): each row's parity
    with its reference, its refusal by design, or what is wrong with it."""
    section = Section(title, ("workload/check", "verdict"))
    for key, value in rows.items():
        if not section.add_stopped(value, key):
            ok, words = live_verdict(key, value)
            section.add(ok, key, words)
    say_warnings(section, rows)
    return section


def zero2_section(spec: Workload, backend: str, standard: MemoryResult | None,
                  fused: MemoryResult | None,
                  progress: Callable[[str], None] = lambda message: None,
                  parity: dict[str, dict[str, Any]] | None = None) -> Section:
    """Parity of ZeRO-2 on 2 spawned gloo ranks against single-process training (fp32) and
    against its single-process data-parallel reference (bf16 with fp32 masters), and rank 0's
    peak for N ranks against its bound, beside the single-device strategies (where
    measured). ``parity``: a user's workload's own ZeRO-2 row (``workload_checks.zero2``) in
    place of the built-in model's parity rows."""
    def title(unit: str) -> str:
        return ("ZeRO-2 (sharded gradient release): parity on gloo, and rank 0's peak "
                f"({unit}) against its bound, fp32 4 Psi + 12 Psi / N, bf16 with fp32 masters "
                "2 Psi + 14 Psi / N, each + activations + bucket" if parity is None else
                "ZeRO-2 (sharded gradient release) on your workload: parity on 2 gloo ranks, and "
                "rank 0's peak below the standard step's, never every gradient at once")

    section = Section(title("GB"), ("check", "verdict"))
    # The table's one unit and cell format, from the first row measured (N = 2 in fp32: the
    # largest peak and bound, as both fall with N and bf16 is below fp32) and the one-device
    # peaks beside it; the title takes that unit once the rows are in.
    units: list[tuple[str, Callable[[float], str]]] = []
    if parity is not None:
        for key, value in parity.items():
            if not section.add_stopped(value, key):
                ok, words = live_verdict(key, value)
                section.add(ok, key, words)
    progress("ZeRO-2: parity on 2 gloo ranks, fp32 and bf16 ...")
    cases = [{**case, "key": (name, "zero2", "fp32")} for name, case in zip(
        zero2_runs.PARITY_OPTIMIZERS, zero2_runs.parity_cases() if parity is None else [])]
    mixed = [{**case, "kwargs": {**case["kwargs"], **extra}, "key": (*case["key"][:2], label)}
             for label, extra in (("bf16", MIXED), ("fp16", FP16)) for case in cases]
    got = None
    try:
        if cases:  # and torch's DDP on the fp32 cases, the reference of the same arithmetic
            got = references.gathered(launch.run(
                references.ranks, 2, cases + mixed + references.ddp_beside(cases)))
    except Exception as e:  # noqa: BLE001 - a crashed rank is a failed row, not a traceback
        section.add(False, "parity on 2 gloo ranks", f"FAILED: {one_line(e)}")
    for case in cases if got else ():
        ranks = got[case["key"]]
        ref = parameters_only(trajectory(case["spec"], case["optimizer_class"], case["kwargs"],
                                         "forloop", steps=case["steps"]))
        for rank, each in enumerate(ranks):
            result = compare(each["snapshots"], ref, bounds.DATA_PARALLEL)
            section.add(result.ok, f"{case['optimizer_class'].__name__}, gloo rank {rank} of 2",
                        result.verdict())
        ddp = got[(*case["key"][:2], "ddp")][0]["snapshots"]
        result = compare(ranks[0]["snapshots"], ddp)  # fp32 on gloo: the same arithmetic
        section.add(result.ok, f"{case['optimizer_class'].__name__} vs DDP, 2 gloo ranks",
                    f"{result.verdict()} (torch's DistributedDataParallel on the same shares)")
    fp32 = {case["key"][0]: case for case in cases}
    for case in mixed if got else ():
        ranks = got[case["key"]]
        extra = {k: case["kwargs"][k] for k in ("param_dtype", "loss_scaling")
                 if k in case["kwargs"]}
        ref = zero2_runs.mixed_reference(case["spec"], case["optimizer_class"],
                                         fp32[case["key"][0]]["kwargs"], case["steps"], 2,
                                         **extra)
        # The same operations in the same order as the reference: bit for bit.
        result = compare(ranks[0]["snapshots"], ref["snapshots"])
        masters = torch.cat([rank["masters"][-1][0][1] for rank in ranks])
        same = torch.equal(masters, ref["masters"])
        scales = ranks[0]["loss_scales"]
        scaled = scales == ref["scales"]
        words = f"parameters {result.verdict()}, masters {'bit-exact' if same else 'DIFFER'}"
        if "loss_scaling" in extra:  # skipped steps are where the scale backed off
            skipped = sum(b < a for a, b in zip([extra["loss_scaling"]["init_scale"]] + scales,
                                                scales))
            words += (f", loss scale {'as' if scaled else 'NOT as'} GradScaler's "
                      f"({skipped} of {len(scales)} steps skipped)")
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[extra["param_dtype"]]
        section.add(result.ok and same and scaled,
                    f"{case['optimizer_class'].__name__} {dtype} + fp32 masters, 2 gloo ranks",
                    words + " vs one process")
    # fp32, bf16 with fp32 masters, and fp32 with activation offload (where the workload
    # does not offload already), each held against its bound; offload also against fp32
    # without it at the same N, so that a lost saving fails.
    variants = [("", {}, {}), (", bf16", MIXED, {})]
    if spec.offload is None:
        variants.append((", offload", {}, {"offload": "lossless"}))
    without: dict[int, MemoryResult] = {}
    refused = refusal(spec, "zero2") if parity is not None else None
    said: set[str] = set()
    if refused:  # the parity row above shows ZeRO-2's own words; nothing to measure
        variants = []
    for n in ZERO2_RANKS:
        for label, extra, changes in variants:
            def check(n=n, extra=extra, changes=changes, label=label) -> tuple[bool, str]:
                progress(f"ZeRO-2: {spec.name} rank 0 of {n}{label}, backend {backend} ...")
                # the workload's optimizer (a user's) or Adam (the built-in models' table)
                options = ({**spec.optimizer[1], "bucket_numel": ZERO2_BUCKET, **extra}
                           if parity is not None else
                           {"lr": 1e-3, "bucket_numel": ZERO2_BUCKET, **extra})
                # The built-in models run on fake tensors: a fault there must fail their rows.
                how = measure_or_fall_back if parity is not None else (
                    lambda *a, **k: (measure(*a, **k), None))
                r, fallback = how(spec.replace(**changes), "zero2", backend=backend,
                                  world_size=n, optimizer_kwargs=options)
                if not (extra or changes):
                    without[n] = r
                if parity is not None:  # a user's model: see below
                    ok, words = _below_the_standard_step(r, standard)
                    if fallback:  # why, once: every row falls back for the same reason
                        words += f"; backend {r.backend}" + (
                            " (as above)" if fallback in said else f" ({fallback})")
                        said.add(fallback)
                else:
                    bound = zero2_bound(r, n, mixed=bool(extra))
                    ok = (r.peak <= bound * (1 + ZERO2_SLACK)
                          and r.few_gradients_alive)
                    if not units:
                        units.append(table_unit([r.peak, bound, *(
                            s.peak for s in (standard, fused) if s is not None)]))
                    cell = units[0][1]
                    beside = "" if standard is None or fused is None or extra or changes else (
                        f"; one device: foreach {cell(standard.peak)}, in backward "
                        f"{cell(fused.peak)}")
                    words = (f"peak {cell(r.peak)} = {r.peak / bound:.2f}x the bound "
                             f"{cell(bound)} (fails above {1 + ZERO2_SLACK:.2f}x)" + beside)
                if changes and n in without:
                    ok = ok and _keeps_saving(r, without[n], offloads=True)
                    amount = format_bytes if parity is not None else units[0][1]
                    words += (f"; without offload {amount(without[n].peak)}, host "
                              f"{amount(r.host_peak)}")
                return ok, words

            section.attempt(f"{spec.name} rank 0 of {n}{label}", check=check)
    if units:  # else no row printed an amount
        section.title = title(units[0][0])
    return section


def _below_the_standard_step(r: MemoryResult, standard: MemoryResult | None) -> tuple[bool, str]:
    """A user's workload's rank against the same workload's standard step on one device. Not
    against ``zero2_bound``: its formula is a large model's (its states dwarf activations,
    backward's temporaries, the optimizer's temporaries on a shard and the 512-byte rounding of
    each tensor), and a small model exceeds it with nothing wrong (seen: a 0.5 MB MLP at 1.06x,
    the 0.93M-parameter timm ViT at 1.12x in bf16)."""
    problems = [] if r.few_gradients_alive else [
        f"holds every gradient at once ({format_bytes(r.gradients_alive_max)})"]
    if standard is not None and r.peak >= standard.peak:
        problems.append(f"not below the standard step's {format_bytes(standard.peak)}")
    words = (f"peak {format_bytes(r.peak)}" + (f" = {r.peak / standard.peak:.2f}x the standard "
             f"step's" if standard is not None else "") + ", gradients alive at most "
             f"{format_bytes(r.gradients_alive_max)} of {format_bytes(r.all_gradients)}")
    return not problems, "; ".join([words, *problems])


def render(sections: list[Section], title: str = "hookbench report") -> str:
    lines = [
        f"{title}: torch {torch.__version__}, "
        f"CUDA {torch.cuda.get_device_name() if torch.cuda.is_available() else 'not available'}"
        f", Python {platform.python_version()}",
    ]
    for section in sections:
        widths = [max(len(c), *(len(cells[i]) for cells, _ in section.rows))
                  for i, c in enumerate(section.columns[:-1])]
        lines += ["", section.title]
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(section.columns, widths))
                     + "  " + section.columns[-1])
        for cells, verdict in section.rows:
            mark = {Verdict.PASS: " ", Verdict.FAIL: "!", Verdict.SKIPPED: "-"}[verdict]
            lines.append(mark + " " + "  ".join(c.ljust(w) for c, w in zip(cells, widths))
                         + "  " + cells[-1])
    verdicts = [verdict for s in sections for _, verdict in s.rows]
    failed, skipped = verdicts.count(Verdict.FAIL), verdicts.count(Verdict.SKIPPED)
    lines += ["", f"{verdicts.count(Verdict.PASS)} of {len(verdicts)} checks hold"
              + (f"; {failed} FAILED (marked !)" if failed else "")
              + (f"; {skipped} SKIPPED for a missing prerequisite (marked -)" if skipped else "")]
    return "\n".join(lines)
