"""What each ``hookbench`` subcommand does (``hookbench.cli`` parses the arguments without
importing torch and calls the function here that it names): report, capture, coord-check,
zero2, record, gate, selfcheck, speed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hookbench import gate, report
from hookbench.core import names
from hookbench.core import launch
from hookbench.core.prerequisites import attempt
from hookbench.core.workload import Workload, checkpointed, configured, load
from hookbench.gate import baselines, checks, workload_checks
from hookbench.gate.workload_checks import refusal, refused_words
from hookbench.measure import plot, zero2_runs, zero_paper
from hookbench.measure.coord_check import QUANTITIES, coord_check, ratios
from hookbench.measure.faults import FAULTS
from hookbench.measure.memory import format_bytes, measure
from hookbench.measure.parity import compare, parameters_only, trajectory
from hookbench.mechanisms.activation_capture import ActivationCapture
from hookbench.models.zoo import ZOO
from hookbench.models.zoo import workload as zoo_workload


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


SECTIONS = names.REPORT_SECTIONS


def _chosen(value: str, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    chosen = tuple(value.split(","))
    unknown = set(chosen) - set(known)
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}; choose from {known}")
    return chosen


def _output_dir(path: str, option: str = "--out") -> Path:
    """The folder for a command's files, made and proven writable before anything is measured."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{option} {path}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write there ({e.strerror or e})") from None
    return out


def _writable_file(path: str, option: str) -> Path:
    """A file a command will write at its end, checked before the minutes of measuring."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path}: is a folder, not a file")
    _output_dir(str(target.parent), option)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{option} {path}: cannot write there (read-only)")
    return target


def _workloads(args: argparse.Namespace) -> tuple[list[Workload], dict]:
    """The workloads ``--workload`` names (an import path, or a zoo model's name), else those
    of ``[tool.hookbench]`` in the nearest pyproject.toml; and that table."""
    config = configured()
    root = config.get("root", ".")
    paths = getattr(args, "workload", None) or config.get("workloads", [])
    return [w for path in paths
            for w in ([zoo_workload(path)] if path in ZOO else load(path, root))], config


def _one_workload(args: argparse.Namespace) -> Workload:
    """``--workload`` if given (it must name one), else the zoo's ``--model``."""
    if not args.workload:
        return zoo_workload(args.model, batch_size=args.batch_size)
    found, _ = _workloads(args)
    if len(found) != 1:
        raise ValueError(f"--workload names {len(found)} workloads "
                         f"({', '.join(w.name for w in found)}); {args.command} takes one")
    return found[0]


def _gated(args: argparse.Namespace) -> tuple[list[Workload], tuple[str, ...], str]:
    """What record and gate cover: the user's workloads (from --workload or pyproject.toml)
    with the hooks and workloads sections and their baseline, or the zoo's sections."""
    workloads, config = _workloads(args)
    default = gate.WORKLOAD_SECTIONS if workloads else gate.SECTIONS
    sections = _chosen(args.sections or ",".join(default), gate.SECTIONS, "gate sections")
    if "workloads" in sections and not workloads and args.sections:
        raise ValueError("the workloads section needs --workload package.module:attribute, or "
                         "workloads in [tool.hookbench] of pyproject.toml")
    baseline = args.baseline or config.get("baseline")
    if baseline is None and workloads:
        raise ValueError("name the baseline of your workloads: --baseline PATH, or baseline "
                         "in [tool.hookbench] of pyproject.toml")
    return workloads, sections, baseline or str(baselines.DEFAULT)


def _backend(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: the cuda backend needs CUDA, and "
                         "torch.cuda.is_available() is False; use --device fake")
    return ("cuda" if torch.cuda.is_available() else "fake") if device == "auto" else device


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


def _report(args: argparse.Namespace) -> int:
    backend = _backend(args.device)
    chosen = _chosen(args.sections, SECTIONS, "report sections")
    spec = _one_workload(args)
    out = _output_dir(args.out)
    sections, results, written = [], [], [out / "report.json"]
    own = bool(args.workload)  # a user's workload: its own rows in place of the built-in's
    if "contract" in chosen:
        sections.append(checks.contract_section())
    if "optimizer" in chosen:
        if own:
            _progress(f"{spec.name}: every strategy, {workload_checks.STEPS} steps ...")
            sections.append(report.workload_section(
                f"{spec.name}: the standard step per implementation and the optimizer in "
                f"backward per mode, {workload_checks.STEPS} steps, each against its reference",
                workload_checks.trajectories(spec)))
        else:
            sections.append(checks.optimizer_in_backward_section())
    if "capture" in chosen:
        sections.append(report.workload_section(
            f"Activation capture on {spec.name}'s training step (statistics of every "
            f"submodule's output)", workload_checks.capture(spec)))
    if "memory" in chosen:
        stopped: dict[str, dict[str, str]] = {}
        rows = [(s, s, {}) for s in report.MEMORY_STRATEGIES] + [
            (label, strategy, changes) for label, strategy, changes, _ in report.SAVING_ROWS
            if _adds(spec, changes, own)]
        for label, strategy, changes in rows:
            started = time.perf_counter()
            _progress(f"measuring {spec.name} batch {spec.batch_size}, {label}, "
                      f"backend {backend} ...")
            snapshot = (out / f"snapshot-{spec.name}-{label.replace(' ', '')}.pickle"
                        if backend == "cuda" else None)
            measured = spec.replace(**changes)
            measured = measured.replace(compile=None) if backend == "fake" else measured
            got = attempt(lambda: {"result": dataclasses.replace(
                measure(measured, strategy, backend=backend, snapshot_path=snapshot),
                strategy=label)})
            why = refusal(spec, strategy)
            if why:  # it must refuse, before it changes anything
                got = ({"refused": f"{refused_words(got['error'])} ({why})"}
                       if "error" in got
                       else {"error": f"measured a {spec.precision} step; it must refuse ({why})"})
            if "result" not in got:
                stopped[label] = got
                _progress(f"  stopped: {got.get('error') or got.get('refused') or got['skipped']}")
                continue
            results.append(got["result"])
            _progress(f"  peak {format_bytes(results[-1].peak, 4)} "
                      f"({time.perf_counter() - started:.1f} s)")
        sections.append(report.memory_section(results, stopped, spec.optimizer[0].__name__))
        if results:
            written.insert(0, plot.memory_timeline(results, out / "memory.png"))
    if "zero2" in chosen:
        by = {r.strategy: r for r in results}
        parity = None
        if own:
            _progress(f"{spec.name}: ZeRO-2 on {workload_checks.ZERO2_RANKS} gloo ranks ...")
            parity = attempt(lambda: workload_checks.zero2([spec]))
            parity = parity if "error" not in parity else {f"{spec.name}/zero2": parity}
        sections.append(report.zero2_section(spec, backend, by.get("foreach"),
                                             by.get("in_backward"), _progress, parity))
    data = {"torch": torch.__version__, "backend": backend, "model": spec.name,
            "batch_size": spec.batch_size, "memory": [r.to_dict() for r in results],
            "checks": [{"section": s.title, "row": list(cells), "ok": bool(verdict),
                        "verdict": verdict.name} for s in sections for cells, verdict in s.rows]}
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    print(report.render(sections))
    print(f"\nwrote {' and '.join(map(str, written))}"
          + (f" and memory snapshots in {out}" if backend == "cuda" and results else ""))
    return 0 if all(s.ok for s in sections) else 1


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
    out = _output_dir(args.out)
    with torch.device("meta"):
        psi = sum(p.numel() for p in zero_paper.GPT_7_5B.model().parameters())
    _progress(f"one step of {zero_paper.GPT_7_5B.name} ({psi / 1e9:.3f} B parameters) as rank 0 "
              f"of N = {', '.join(map(str, worlds))}, fake tensors ...")
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


def _zero2(args: argparse.Namespace) -> int:
    import os

    import torch.distributed as dist

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
        _progress(f"spawning {args.nproc} gloo ranks (run under torchrun to use its ranks) ...")
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


def _record(args: argparse.Namespace) -> int:
    models = _chosen(args.models, tuple(ZOO), "models")
    workloads, sections, baseline = _gated(args)
    target = _writable_file(baseline, "--baseline")
    _progress(f"recording the gate's baseline on torch {torch.__version__} ("
              + (f"workloads {', '.join(w.name for w in workloads)}" if workloads else
                 f"models {', '.join(models)}; a few minutes") + ") ...")
    with tempfile.TemporaryDirectory() as staging:  # files land only with a good baseline
        data = gate.record(models, sections, staging, workloads)
        failed = gate.failures(data)
        if failed:  # a baseline is what the next torch must reproduce: never one with failures
            print(f"hookbench record: NOT written: {len(failed)} measurements failed on torch "
                  f"{torch.__version__}:\n  " + "\n  ".join(failed))
            return 1
        if "checkpoints" in sections:
            folder = baselines.checkpoint_folder(target)
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("*.pt"):
                old.unlink()
            for new in Path(staging).glob("*.pt"):
                (folder / new.name).write_bytes(new.read_bytes())
    path = baselines.save(data, target)
    print(f"wrote {path}: torch {data['recorded_with']['torch']} on "
          f"{data['recorded_with']['cpu_capability']}; " + ", ".join(
              f"{section} {len(data[section])}" for section in gate.SECTIONS if section in data))
    return 0


def _gate(args: argparse.Namespace) -> int:
    workloads, sections, baseline = _gated(args)
    base = baselines.load(baseline)
    models = _chosen(args.models, tuple(ZOO), "models")
    device = _backend(args.device)
    _progress(f"gate: torch {torch.__version__} against the baseline of torch "
              f"{base['recorded_with']['torch']} ({baseline}) ...")
    result = gate.gate(base, sections, models, args.fault, device, time_slack=args.time_slack,
                       checkpoint_dir=baselines.checkpoint_folder(baseline),
                       strict_warnings=args.strict_warnings, workloads=workloads)
    print(report.render(list(result.values()), title="hookbench gate"))
    failed = [name for name, s in result.items() if not s.ok]
    skipped = sum(s.skipped for s in result.values())
    print(f"baseline: torch {base['recorded_with']['torch']} on "
          f"{base['recorded_with']['cpu_capability']}; GATE "
          + (f"FAILED in {', '.join(failed)}" if failed else "PASSED")
          + (f" ({skipped} rows SKIPPED, not compared)" if skipped else ""))
    return 1 if failed else 0


def _selfcheck(args: argparse.Namespace) -> int:
    base = baselines.load(args.baseline or baselines.DEFAULT)
    sections = _chosen(args.sections or ",".join(gate.SECTIONS), gate.SECTIONS, "gate sections")
    models = _chosen(args.models, tuple(ZOO), "models")
    json_path = _writable_file(args.json, "--json") if args.json else None
    caught = gate.selfcheck(base, sections, models, _progress,
                            baselines.checkpoint_folder(args.baseline or baselines.DEFAULT))
    width = max(map(len, FAULTS))
    print(f"hookbench selfcheck: the gate under each injected fault, torch {torch.__version__}")
    for fault, failed in caught.items():
        if fault is None:
            print(f"  {'no fault':{width}}  " + (
                "passes" if not failed else f"FAILS (it must pass): {failed}"))
        else:
            print(f"  {fault:{width}}  " + ("CAUGHT by " + "; ".join(
                f"{name} ({', '.join(rows[:3])}{', ...' if len(rows) > 3 else ''})"
                for name, rows in failed.items()) if failed else "MISSED"))
    if json_path:
        json_path.write_text(json.dumps({str(k): v for k, v in caught.items()}, indent=1))
    missed = [f for f, failed in caught.items() if f is not None and not failed]
    ok = not caught[None] and not missed
    print(f"{sum(bool(v) for f, v in caught.items() if f)} of {len(FAULTS)} faults caught"
          + ("; the clean run passes" if not caught[None] else "; the CLEAN RUN FAILS")
          + (f"; MISSED: {', '.join(missed)}" if missed else ""))
    return 0 if ok else 1


def _capture(args: argparse.Namespace) -> int:
    spec = _one_workload(args)
    model = spec.build().eval()
    x, _ = spec.data(0)
    with torch.no_grad(), spec.autocast("cpu"), ActivationCapture(
            model, include=args.include or None, exclude=args.exclude or None,
            stats=args.stats) as cap:
        spec.forward(model, x)
    rows = cap.table()
    if not rows:
        raise ValueError("the selected modules produced no output in forward (a module whose "
                         "forward is bypassed, such as nn.MultiheadAttention's out_proj, never "
                         "runs its hooks)")
    width = max(len(f"{r['name']}{'.' + r['path'] if r['path'] else ''}") for r in rows)
    print(f"{spec.name}, batch {spec.batch_size}: {len(rows)} outputs from "
          f"{len({r['name'] for r in rows})} modules ({'statistics' if args.stats else 'tensors'})")
    print(f"{'module':{width}}  call  {'shape':20}  " + "  ".join(f"{s:>10}" for s in _COLUMNS))
    for r in rows:
        name = r["name"] + ("." + r["path"] if r["path"] else "")
        print(f"{name:{width}}  {r['call']:>4}  {str(tuple(r['shape'])):20}  "
              + "  ".join(f"{r[s]:>10.4g}" for s in _COLUMNS))
    return 0


_COLUMNS = ("mean", "std", "min", "max", "rms", "mean_abs")


_IMPLEMENTATION_NAMES = {"forloop": "for-loop", "foreach": "foreach", "fused": "fused"}
_MODE_NAMES = {"per_parameter": "per parameter", "grouped": "grouped by module",
               "grouped_foreach": "grouped by module", "bucketed": "bucketed 25 MiB"}


def _speed(args: argparse.Namespace) -> int:
    if args.model == "mlp" and args.batch_size is not None:
        raise ValueError(f"--batch-size is for zoo models; the benchmarks' MLP has its own "
                         f"batch of {gate.BENCHMARK_MLP.batch_size}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: CUDA is not available here")
    json_path = _writable_file(args.json, "--json") if args.json else None
    batch = gate.BENCHMARK_MLP.batch_size if args.model == "mlp" else args.batch_size or 2
    what = (f"the benchmarks' MLP (0.8M parameters, batch {batch})" if args.model == "mlp" else
            f"{args.model}, batch {batch}")
    print(f"Whole training step (forward, backward, Adam step) of {what}: the optimizer in "
          f"backward over the standard step of the same implementation, {args.runs} runs of "
          f"{args.rounds} interleaved rounds (each run's fastest round); median (min-max) over "
          f"the runs, torch {torch.__version__}, " + (
              torch.cuda.get_device_name() if args.device == "cuda" else
              f"CPU, {torch.get_num_threads()} threads"))
    table = gate.whole_step(args.model, rounds=args.rounds, runs=args.runs, batch_size=batch,
                            device=args.device, progress=_progress)
    columns = list(dict.fromkeys(_MODE_NAMES[m] for modes in gate.WHOLE_STEP_PAIRS.values()
                                 for m in modes))
    print(f"  {'implementation':15} {'standard (ms)':>14}  " + "  ".join(f"{c:22}" for c in columns))
    for impl, row in table.items():
        cells = dict.fromkeys(columns, "-")
        for mode, values in row.items():
            if mode != "standard":
                cells[_MODE_NAMES[mode]] = (f"{statistics.median(values):.2f}x "
                                            f"({min(values):.2f}-{max(values):.2f})")
        print(f"  {_IMPLEMENTATION_NAMES[impl]:15} {statistics.median(row['standard']) * 1e3:14.1f}  "
              + "  ".join(f"{c:22}" for c in cells.values()))
    if json_path:
        json_path.write_text(json.dumps({"model": args.model, "batch_size": batch,
                                         "device": args.device,
                                         "runs": args.runs, "rounds": args.rounds,
                                         "environment": baselines.environment(),
                                         "table": table}, indent=1))
    return 0


def _coord_check(args: argparse.Namespace) -> int:
    try:
        widths = tuple(int(w) for w in args.widths.split(","))
    except ValueError:
        raise ValueError(f"--widths must be comma-separated integers, got {args.widths!r}")
    if args.peer and args.parametrization != "mup":
        raise ValueError("--peer mup compares muP with the library's muP; use "
                         "--parametrization mup")
    out = _output_dir(args.out)
    options = dict(widths=widths, steps=args.steps, seeds=args.seeds, lr=args.lr,
                   readout_zero_init=args.readout_init == "zero")
    if args.peer:
        try:
            from hookbench.measure.peers import microsoft_mup
        except ImportError as e:
            raise ImportError(f"--peer mup needs microsoft/mup (pip install -e '.[mup]'): {e}")
    _progress(f"training {args.model} ({args.parametrization}) at widths {widths}, "
              f"{args.seeds} seeds, {args.steps} steps ...")
    result = coord_check(args.model, args.parametrization, band=args.band, **options)
    peer = None
    if args.peer:
        _progress("the same with microsoft/mup (MuReadout, set_base_shapes, MuAdam, "
                  "get_coord_data) ...")
        peer = microsoft_mup.coordinates(args.model, **options)
    rows = [(layer, q, result.coords[layer][q]) for layer in result.coords for q in QUANTITIES]
    if peer is not None:
        rows = [row for layer in result.coords for row in (
            *(r for r in rows if r[0] == layer), (layer, "coord. (mup)", peer[layer]))]
    name = max(len(n) for n in result.coords)
    print(f"{'layer':{name}}  {'':12}  " + "  ".join(f"{f'step {t}':^14}" for t in range(
        result.steps + 1)) + "  (growth/shrinkage across widths; ! out of band)")
    for layer, quantity, table in rows:
        cells = []
        for t, row in enumerate(table):
            if quantity == "change" and t == 0:
                cells.append(f"{'-':^14}")
                continue
            up, down = ratios(row)
            mark = "!" if max(up, down) > result.band else " "
            cells.append(f"{up:6.2f}/{down:<6.2f}{mark}")
        print(f"{layer:{name}}  {quantity:12}  " + "  ".join(cells))
    png = plot.coord_check(result, out / f"coord-check-{args.model}-"
                                                    f"{args.parametrization}.png")
    print(f"\n{result.verdict()}")
    if peer is not None:
        print(f"hookbench vs microsoft/mup: coordinates differ by at most "
              f"{microsoft_mup.difference(result, peer):.2g} (relative)")
    print(f"wrote {png}")
    return 0 if result.passed else 1
