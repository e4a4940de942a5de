"""The gate's ``time`` section, and the whole-step timing ``hookbench speed`` prints.

Step-time ratios (the optimizer in backward's modes over the standard step, activation capture
over a plain forward), each timed interleaved with what it is divided by (``interleaved``), at
most ``SLACK`` above the recorded ratio. Ratios, not seconds: a machine's speed cancels out of
them, its noise does not, hence the wide default slack."""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Any, Callable, Iterator

import torch

from hookbench.core import names
from hookbench.core.prerequisites import attempt
from hookbench.core.workload import Workload, of
from hookbench.gate import workload_checks
from hookbench.gate.checks import Run, Section
from hookbench.measure.parity import FAMILIES, accepts, training
from hookbench.mechanisms.activation_capture import ActivationCapture
from hookbench.models.zoo import BENCHMARK_MLP, TinySpec
from hookbench.models.zoo import workload as zoo_workload

FAULTS = ()  # no fault of ``hookbench.measure.faults`` targets speed: nothing for selfcheck
# The same ratio, measured interleaved (``interleaved``) in separate processes on these 2 shared
# cores, spread over 1.03-1.56x (grouped/foreach) and 1.27-1.35x (capture/plain). 50% stays
# clear of that noise and still catches a step that doubles; on a quiet, dedicated runner pass
# a tighter --time-slack. Fine time gating belongs to pytest-benchmark on one machine
# (--benchmark-compare-fail).
SLACK = names.GATE_TIME_SLACK
# A whole training step (forward, backward, step; Adam, batch 2) per optimizer implementation:
# each mode of the optimizer in backward that has the implementation against the standard step
# of the same implementation (``whole_step``). One parameter per step has no foreach form: a
# list of one tensor is the for-loop's arithmetic.
IMPLEMENTATIONS = {"forloop": {"foreach": False}, "foreach": {"foreach": True},
                   "fused": {"fused": True}}
WHOLE_STEP_MODES = {"per_parameter": "in_backward", "grouped": "in_backward_grouped",
                    "grouped_foreach": "in_backward_grouped_foreach",
                    "bucketed": "in_backward_bucketed"}  # bucketed as DDP buckets, 25 MiB
WHOLE_STEP_PAIRS = {"forloop": ("per_parameter", "grouped", "bucketed"),
                    "foreach": ("grouped_foreach", "bucketed"),
                    "fused": ("per_parameter", "grouped", "bucketed")}
GATED_WHOLE_STEP_MODEL = "transformer"  # the time section's; ViT-B/16 takes ~1.8 s a step here
# Targets the issue sets; reported beside each ratio, not gated (machines differ).
TIME_TARGETS = {"in_backward_grouped_vs_foreach": 1.10, "in_backward_bucketed_vs_foreach": 1.10,
                "capture_stats_vs_plain": 1.25,
                **{f"whole_step_{GATED_WHOLE_STEP_MODEL}_{impl}_{mode}": 1.02
                   for impl, modes in WHOLE_STEP_PAIRS.items() for mode in modes}}


def interleaved(fns: list[Callable[[], object]], rounds: int = 15) -> list[float]:
    """Seconds per call of each of ``fns``, each the fastest of ``rounds`` blocks (the least
    disturbed by the rest of the machine). All are called equally often, in rotation: a
    training step's cost drifts as its optimizer state evolves (seen here: 1.0x to 1.3x for the
    same pair timed with independent call counts), and must drift alike. The blocks last about
    0.1 s of the first function, at least one call."""
    from torch.utils.benchmark import Timer

    threads = torch.get_num_threads()
    timers = [Timer("fn()", globals={"fn": fn}, num_threads=threads) for fn in fns]
    number = max(1, round(0.1 / timers[0].timeit(1).median))
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, timer in enumerate(timers):
            best[i] = min(best[i], timer.timeit(number).median)
    return best


def _steady(stack: contextlib.ExitStack, spec: Workload | TinySpec,
            optimizer: tuple[type, dict[str, Any]], strategy: str, device: str
            ) -> Callable[[], None]:
    """``spec`` trained by ``strategy`` past its first step (Adam's state exists from there on:
    the steady state), its training held open by ``stack``; the next step's callable."""
    cls, kwargs = optimizer
    t = stack.enter_context(training(spec, cls, kwargs, strategy, device=device))
    t.step(0)
    return functools.partial(t.step, 1)


@contextlib.contextmanager
def steady_steps(spec: Workload | TinySpec, flags: dict[str, Any], strategies: tuple[str, ...],
                 device: str = "cpu", optimizer: tuple[type, dict[str, Any]] = FAMILIES["adam"]
                 ) -> Iterator[list[Callable[[], None]]]:
    """``optimizer`` (a class and its options; Adam by default) with ``flags``, trained by each
    of ``strategies`` in the steady state (``_steady``); a next-step callable per strategy."""
    cls, kw = optimizer
    with contextlib.ExitStack() as stack:
        yield [_steady(stack, spec, (cls, {**kw, **flags}), s, device) for s in strategies]


def _implementations(spec: Workload | TinySpec) -> dict[str, dict[str, Any] | str]:
    """Each implementation's flags for the optimizer ``spec`` trains with (Adam outside a
    workload), or why its class has none; the for-loop is there for every class."""
    if not isinstance(spec, Workload):
        return dict(IMPLEMENTATIONS)
    cls = spec.optimizer[0]
    return {impl: (workload_checks.not_applicable(spec, impl)
                   or (flags if impl != "forloop" or accepts(cls, "foreach") else {}))
            for impl, flags in IMPLEMENTATIONS.items()}


# A cell of the whole-step table: its values, one per run, or the words of why it has none.
Cell = list[float] | str


def whole_step(model: str | Workload, rounds: int = 15, runs: int = 1, batch_size: int = 2,
               device: str = "cpu", progress: Callable[[str], None] = lambda message: None
               ) -> dict[str, dict[str, Cell] | str]:
    """The whole-step table: per implementation (``IMPLEMENTATIONS``), ``"standard"``: the
    standard step's seconds, and for each mode of ``WHOLE_STEP_PAIRS``: its time over the
    standard step's; one value per run, each run ``rounds`` interleaved rounds of all of them
    (on CUDA the timer synchronizes around each block). ``model``: a zoo name, "mlp" for the
    benchmarks' MLP (both with Adam), or a workload, with its own optimizer. In place of
    values, the words of why there are none: an implementation its class lacks (the whole
    row), or a mode that refuses the workload (clipping, fp16 and a scheduler with the
    optimizer in backward). ``progress`` hears of each run."""
    spec = (model if isinstance(model, Workload) else BENCHMARK_MLP if model == "mlp" else
            zoo_workload(model, batch_size=batch_size))
    cls, kw = spec.optimizer if isinstance(spec, Workload) else FAMILIES["adam"]
    table: dict[str, dict[str, Cell] | str] = {}
    for impl, flags in _implementations(spec).items():  # one implementation's models at a time
        if isinstance(flags, str):
            table[impl] = flags
            continue
        row: dict[str, Cell] = {}
        steps: dict[str, Callable[[], None]] = {}
        with contextlib.ExitStack() as stack:
            for mode in ("standard", *WHOLE_STEP_PAIRS[impl]):
                strategy = impl if mode == "standard" else WHOLE_STEP_MODES[mode]
                try:
                    steps[mode] = _steady(stack, spec, (cls, {**kw, **flags}), strategy, device)
                    row[mode] = []
                except (ValueError, TypeError, RuntimeError) as e:
                    row[mode] = workload_checks.refused_words(f"{type(e).__name__}: {e}")
            if "standard" not in steps:  # nothing to divide by
                table[impl] = row["standard"]
                continue
            for run in range(runs):
                progress(f"{impl}: run {run + 1} of {runs} ...")
                standard, *others = interleaved(list(steps.values()), rounds)
                row["standard"].append(standard)
                for mode, seconds in zip(list(steps)[1:], others):
                    row[mode].append(seconds / standard)
        table[impl] = row
    return table


def whole_step_ratios(model: str, rounds: int = 15) -> dict[str, Any]:
    """``whole_step_<model>_<implementation>_<mode>``: each pair of the whole-step table, one
    run (``whole_step``); a pair without values ``{"error": why}``, which fails its row."""
    out: dict[str, Any] = {}
    for impl, row in whole_step(model, rounds).items():
        cells = row if isinstance(row, dict) else dict.fromkeys(WHOLE_STEP_PAIRS[impl], row)
        for mode in WHOLE_STEP_PAIRS[impl]:
            cell = cells[mode]
            out[f"whole_step_{model}_{impl}_{mode}"] = (cell[0] if isinstance(cell, list) else
                                                         {"error": cell})
    return out


def _float64_floor(model: torch.nn.Module) -> Callable[[], None]:
    """Forward hooks on every submodule of ``model`` doing only the reads and writes that rms
    and mean_abs cost in float64, as ``ActivationCapture`` computes them: each output copied
    into one reused float64 buffer, one dot, one abs in place, one sum; none of the capture's
    bookkeeping (records, names, reading back). Returns what removes them."""
    buf = torch.empty(0, dtype=torch.float64)

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        nonlocal buf
        if buf.numel() < out.numel():
            buf = torch.empty(out.numel(), dtype=torch.float64)
        d = buf[:out.numel()]
        d.view(out.shape).copy_(out)
        torch.dot(d, d)
        d.abs_().sum()

    handles = [m.register_forward_hook(hook) for m in list(model.modules())[1:]]
    return lambda: [h.remove() for h in handles]


def _per_module_foreach(spec: TinySpec, optimizer: tuple[type, dict[str, Any]]
                        ) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The standard step cut as the grouped mode cuts it: after backward, one foreach step per
    module that holds parameters (13 for the benchmarks' MLP), then zero_grad; the launches
    the grouped mode makes, without its hooks. The model, and its next step's callable, past
    its first step."""
    cls, kwargs = optimizer
    workload = of(spec)
    model = workload.build()
    optimizers = [cls(params, **{**kwargs, "foreach": True}) for module in model.modules()
                  if (params := list(module.parameters(recurse=False)))]
    x, y = workload.data(1)

    def step() -> None:
        workload.compute_loss(model, x, y, (1, 0)).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step()  # Adam's state exists from here on, as in steady_steps
    return model, step


# The two ratios the issue sets targets for (TIME_TARGETS), each timed interleaved with what it
# is divided by and with its floor: what the extra reads, writes and launches cost by
# themselves, in the same rotation. `hookbench speed --targets` prints them; the gate gates the
# ratios, not the floors.

def grouped_targets(rounds: int = 15, floor: bool = True) -> dict[str, float]:
    """On the benchmarks' MLP: the grouped and bucketed optimizer in backward over the foreach
    step, and (``floor``) the floor, one foreach step per module after backward
    (``_per_module_foreach``)."""
    extra = [_per_module_foreach(BENCHMARK_MLP, FAMILIES["adam"])[1]] if floor else []
    with steady_steps(BENCHMARK_MLP, {}, ("foreach", "in_backward_grouped_foreach",
                                            "in_backward_bucketed")) as steps:
        foreach_s, grouped_s, bucketed_s, *floor_s = interleaved([*steps, *extra], rounds)
    return {"in_backward_grouped_vs_foreach": grouped_s / foreach_s,
            "in_backward_bucketed_vs_foreach": bucketed_s / foreach_s,
            **({"grouped_floor_vs_foreach": floor_s[0] / foreach_s} if floor else {})}


def capture_targets(rounds: int = 15, floor: bool = True) -> dict[str, float]:
    """rms and mean_abs of every ResNet-18 module's output over the plain forward, and
    (``floor``) the floor, the float64 passes alone (``_float64_floor``). A copy of the model
    each: hooks on one must not slow the others' forwards down."""
    spec = zoo_workload("resnet18")
    captured, plain, x = spec.build().eval(), spec.build().eval(), spec.data(0)[0]
    floored = [spec.build().eval()] if floor else []
    removes = [_float64_floor(m) for m in floored]
    try:
        with torch.no_grad(), ActivationCapture(captured, stats=("rms", "mean_abs")) as cap:
            plain_s, captured_s, *floor_s = interleaved([
                lambda: plain(x), lambda: (cap.clear(), captured(x), cap.table()),
                *(functools.partial(m, x) for m in floored)], rounds)
    finally:
        for remove in removes:
            remove()
    return {"capture_stats_vs_plain": captured_s / plain_s,
            **({"capture_floor_vs_plain": floor_s[0] / plain_s} if floor else {})}


def measure(run: Run) -> dict[str, Any]:
    # The benchmarks' workloads (tests/mechanisms/: test_optimizer_in_backward.py and
    # test_activation_capture.py)
    # The grouped step's ratio spreads widely from one interleaved measurement to the next on 2
    # cores (seen on an AMD EPYC, same process and torch: 1.04x to 1.77x, against 1.17x recorded
    # on a Xeon; 1.77x failed a CI run at the 50% slack): the median of three, so that one
    # disturbed measurement neither fails the gate nor sets the baseline (~10 s more).
    runs = [grouped_targets(floor=False) for _ in range(3)]  # the floors are not gated
    out: dict[str, Any] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    value = attempt(lambda: capture_targets(floor=False))  # ResNet-18 needs torchvision
    out["capture_stats_vs_plain"] = value.get("capture_stats_vs_plain", value)  # or what stopped it
    out.update(whole_step_ratios(GATED_WHOLE_STEP_MODEL, rounds=5))
    return out


# A ratio above its slack is measured again, up to CONFIRMATIONS more times, and the lowest
# measurement is judged. Another process on the machine only ever slows a step down, so a
# disturbed measurement is outvoted by an undisturbed one, while a step that really became
# slower is slow in every measurement. Seen on a CI runner: the grouped ratio at 2.48x (the
# median of three, recorded 1.17x) in a gate that otherwise held.
CONFIRMATIONS = 2
REMEASURED = "remeasured"  # the time section's key for what was measured again, per ratio


def _measure_again(keys: set[str]) -> dict[str, Any]:
    """A fresh measurement of the ratios ``keys`` (and of the others measured with them)."""
    out: dict[str, Any] = {}
    if keys & {"in_backward_grouped_vs_foreach", "in_backward_bucketed_vs_foreach"}:
        out.update(grouped_targets(floor=False))
    if "capture_stats_vs_plain" in keys:
        out.update(capture_targets(floor=False))
    if any(key.startswith("whole_step_") for key in keys):
        out.update(whole_step_ratios(GATED_WHOLE_STEP_MODEL, rounds=5))
    return out


def _slower(base: dict, now: dict, slack: float) -> set[str]:
    return {key for key, ratio in now.items() if isinstance(ratio, float)
            and isinstance(base.get(key), float) and ratio > base[key] * (1 + slack)}


def confirm(base: dict, now: dict, slack: float,
            again: Callable[[set[str]], dict[str, Any]] = _measure_again) -> dict:
    """``now`` (the time section's ratios) with each ratio above ``slack`` over ``base``
    measured again by ``again``, up to ``CONFIRMATIONS`` times or until it holds, and replaced
    by the lowest of its measurements; those listed under ``REMEASURED``."""
    now = dict(now)
    seen: dict[str, list[float]] = {}
    for _ in range(CONFIRMATIONS):
        if not (slower := _slower(base, now, slack)):
            break
        fresh = attempt(lambda: again(slower))  # what stops it leaves the first values judged
        for key in slower:
            seen.setdefault(key, [now[key]])
            if isinstance(fresh.get(key), float):
                seen[key].append(fresh[key])
                now[key] = min(seen[key])
    return {**now, REMEASURED: seen} if seen else now


def judge(base: dict, now: dict, run: Run) -> Section:
    slack = run.time_slack
    section = Section(f"Step-time ratios against the baseline; fails {slack:.0%} above it",
                      ("ratio", "recorded", "now", "verdict"))
    remeasured = now.get(REMEASURED, {})
    for key, ratio in now.items():
        if key == REMEASURED:
            continue
        rec = base.get(key)
        if section.add_stopped(ratio, key):
            continue
        if not isinstance(rec, float):
            section.add(False, key, "", f"{ratio:.2f}x", "no baseline recorded")
            continue
        ok = ratio <= rec * (1 + slack)
        target = TIME_TARGETS[key]
        section.add(ok, key, f"{rec:.2f}x", f"{ratio:.2f}x",
                    ("holds" if ok else f"SLOWER: {ratio / rec - 1:+.0%} over the recorded ratio")
                    + f"; target {target:.2f}x {'met' if ratio <= target else 'missed'}"
                    + (f"; lowest of {len(remeasured[key])} measurements ("
                       + ", ".join(f"{r:.2f}x" for r in remeasured[key]) + ")"
                       if key in remeasured else ""))
    return section
