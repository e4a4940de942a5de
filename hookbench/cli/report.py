"""``hookbench report``: the hook mechanisms verified and peak memory measured on the installed
torch, for a zoo model or a user's workload; a PNG and a JSON beside the printed tables."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch

from hookbench import report
from hookbench.cli import REPORT_PRINTS, common
from hookbench.core import names
from hookbench.core.prerequisites import attempt
from hookbench.core.workload import Workload, checkpointed
from hookbench.engines import memory as engine_memory
from hookbench.engines.loop import ACCUMULATION
from hookbench.gate import checks, workload_checks
from hookbench.gate import engines as gate_engines
from hookbench.gate.workload_checks import not_applicable, refusal, refused_words
from hookbench.measure import plot
from hookbench.measure.memory import format_bytes, measure_or_fall_back
from hookbench.models import zoo


def _adds(spec: Workload, changes: dict[str, Any], own: bool) -> bool:
    """Whether a saving row measures something the workload does not already do: its own
    offload is in every row. Checkpointing rows are the built-in models' only, those with a
    repeated block: a user's workload checkpoints as its recipe says (``checkpointing``), and
    a generic checkpoint can break a library's block (GPT-2's, called with a key-value cache
    that the recomputation extends again: its recipe turns the cache off first)."""
    if "offload" in changes and spec.offload is not None:
        return False
    if "checkpointing" in changes:
        return (not own and spec.checkpointing == "none"
                and bool(checkpointed(spec.build(), "repeated")))
    return True


def run(args: argparse.Namespace) -> int:
    backend = common.backend(args.device)
    chosen = common.chosen(args.sections, names.REPORT_SECTIONS, "report sections")
    spec = common.one_workload(args)
    if args.workload:  # a broken workload: one line, exit 2, before anything is measured
        spec.check(shares=workload_checks.ZERO2_RANKS if "zero2" in chosen else 1,
                   batches=workload_checks.BATCHES)
    out = common.output_dir(args.out)
    files = common.verdict_files(args)
    began = time.perf_counter()  # the whole report's (each memory row times itself)
    sections: dict[str, checks.Section] = {}  # keyed as REPORT_PRINTS says, which --help lists
    results, written = [], [out / "report.json"]
    own = bool(args.workload)  # a user's workload: its own rows in place of the built-in's
    if "contract" in chosen:
        sections["contract"] = checks.contract_section()
    if "optimizer" in chosen:
        if own:
            common.progress(f"{spec.name}: every strategy, {workload_checks.STEPS} steps ...")
            sections["optimizer"] = report.workload_section(
                f"{spec.name}: the standard step per implementation and the optimizer in "
                f"backward per mode, {workload_checks.STEPS} steps, each against its reference",
                workload_checks.trajectories(spec))
        else:
            sections["optimizer"] = checks.optimizer_in_backward_section()
    if "capture" in chosen:
        sections["capture"] = report.workload_section(
            f"Activation capture on {spec.name}'s training step (statistics of every "
            f"submodule's output)", workload_checks.capture(spec))
    if "memory" in chosen:
        stopped: dict[str, dict[str, str]] = {}
        fallbacks: set[str] = set()
        rows = [(s, s, {}) for s in report.MEMORY_STRATEGIES] + [
            (label, strategy, changes) for label, strategy, changes, _ in report.SAVING_ROWS
            if _adds(spec, changes, own)]
        for label, strategy, changes in rows:
            if not_applicable(spec, strategy):  # an optimizer without that implementation
                stopped[label] = {"not_applicable": not_applicable(spec, strategy)}
                continue
            started = time.perf_counter()
            common.progress(f"measuring {spec.name} batch {spec.batch_size}, {label}, "
                      f"backend {backend} ...")
            snapshot = (out / f"snapshot-{spec.name}-{label.replace(' ', '')}.pickle"
                        if backend == "cuda" else None)
            measured = spec.replace(**changes)
            measured = measured.replace(compile=None) if backend == "fake" else measured
            def one() -> dict[str, Any]:
                result, fallback = measure_or_fall_back(measured, strategy, backend=backend,
                                                        snapshot_path=snapshot)
                if fallback:
                    fallbacks.add(fallback)
                return {"result": dataclasses.replace(result, strategy=label)}

            got = attempt(one)
            why = refusal(spec, strategy)
            if why:  # it must refuse, before it changes anything
                got = ({"refused": f"{refused_words(got['error'])} ({why})"}
                       if "error" in got
                       else {"error": f"measured a {spec.precision} step; it must refuse ({why})"})
            if "result" not in got:
                stopped[label] = got
                common.progress("  stopped: " + (got.get("error") or got.get("refused")
                                                 or got["skipped"]))
                continue
            results.append(got["result"])
            common.progress(f"  peak {format_bytes(results[-1].peak, 4)} "
                      f"({time.perf_counter() - started:.1f} s)")
        sections["memory"] = report.memory_section(results, stopped, spec.optimizer[0].__name__)
        if fallbacks:  # each strategy falls back for the same reason: say it once
            sections["memory"].title += "; " + "; ".join(sorted(fallbacks))
        if results:
            written.insert(0, plot.memory_timeline(results, out / "memory.png"))
    if "zero2" in chosen:
        zero2, engines = REPORT_PRINTS["zero2"]  # the engines train on zero2's gloo ranks
        by = {r.strategy: r for r in results}
        parity = None
        if own:
            common.progress(f"{spec.name}: ZeRO-2 on {workload_checks.ZERO2_RANKS} gloo ranks ...")
            parity = attempt(lambda: workload_checks.zero2([spec]))
            parity = parity if "error" not in parity else {f"{spec.name}/zero2": parity}
        sections[zero2] = report.zero2_section(spec, backend, by.get("foreach"),
                                               by.get("in_backward"), common.progress, parity)
        # A zoo model's engines train the gate's tiny MLP (engines.WORKLOAD), as its ZeRO-2
        # parity rows above do: every engine with its reference and DDP beside it holds ~10
        # copies of the model's training state per rank, and ViT-L/16's 4.9 GB each got the
        # ranks killed for memory on a 24 GiB machine. Its FSDP2 memory is the model's own, on
        # fake tensors, at one sample per rank (the zoo's models are stated at batch 1).
        engined = spec if own else gate_engines.WORKLOAD
        measured = spec if own else zoo.workload(
            spec.name, batch_size=workload_checks.ZERO2_RANKS, seed=spec.seed)
        if parity is None:
            common.progress(f"{engined.name}: the engines on {workload_checks.ZERO2_RANKS} "
                            f"gloo ranks ...")
            parity = attempt(lambda: workload_checks.zero2([engined], with_zero2=False))
        common.progress(f"{measured.name}: FSDP2's rank 0 of {engine_memory.WORLD} on fake "
                        f"tensors ...")
        sections[engines] = report.workload_section(
            f"The engines users run, on {workload_checks.ZERO2_RANKS} gloo ranks"
            + ("" if own else f" (parity on the gate's {engined.name}, "
                              f"{sum(p.numel() for p in engined.build().parameters())} "
                              f"parameters)")
            + f": DDP, FSDP2 as ZeRO-2 and ZeRO-3 ({ACCUMULATION} micro-batches a step, the "
            f"first without gradient sync), the optimizer in backward under FSDP2; "
            f"{measured.name}'s FSDP2 peak on rank 0 of {engine_memory.WORLD} on fake tensors "
            f"against the ZeRO formula (16 Psi / N with Adam) + what is gathered + activations",
            {**({k: v for k, v in parity.items() if "/engines/" in k} if "error" not in parity
                else {f"{engined.name}/engines": parity}),
             **workload_checks.engine_memory(measured)})
    data = {"torch": torch.__version__, "backend": backend, "model": spec.name,
            "batch_size": spec.batch_size, "memory": [r.to_dict() for r in results],
            "checks": [{"section": s.title, "row": list(cells), "ok": bool(verdict),
                        "verdict": verdict.name} for s in sections.values()
                       for cells, verdict in s.rows]}
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    written += common.write_verdicts(files, "hookbench report", sections,
                                     time.perf_counter() - began, model=spec.name,
                                     backend=backend)
    print(report.render(list(sections.values())))
    print(f"\nwrote {' and '.join(map(str, written))}"
          + (f" and memory snapshots in {out}" if backend == "cuda" and results else ""))
    return 0 if all(s.ok for s in sections.values()) else 1
