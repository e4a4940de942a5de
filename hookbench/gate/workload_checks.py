"""A user's workload under hookbench: what ``hookbench gate --workload`` gates and what the
pytest plugin asserts, measured the same way for both.

For each ``hookbench.Workload``, the rows ``hookbench.gate.rows.ROWS`` declares (keyed
``name/<row>``): what each runs, what it is held to in which order, by which bound of
``hookbench.measure.bounds``, with which extra checks, and what it refuses. Here they are
run, in one launch of the ranks for ZeRO-2 and the engines (every result addressed by its
(workload, row, case) key), and judged: ``judge`` against the baseline, ``live_verdict``
against the references alone (the report). Strategy rows store a fingerprint of parameters
and optimizer state after every one of STEPS steps (``baselines.fingerprint``); memory rows
one step's peak on the fake backend, or on real CPU tensors where fake ones cannot run the
model (the row names its backend; the gate compares like with like).

A strategy that needs an implementation the optimizer does not have (foreach, for a class
outside torch.optim) is a recorded row ``{"not_applicable": why}``; a broken workload (a loss
that is not a finite scalar, a batch that does not split over the ranks, a function that
raises) raises one ``ValueError`` before anything is measured (``Workload.check``).

Dropout and every other random number a forward draws come from the RNG the workload seeds
per batch and share (``Workload.forward_rng``), so they are the same in every run compared.
A strategy that refuses the workload by design (the optimizer in backward with fp16, which
needs a GradScaler that sees every gradient first, or with gradient clipping, which needs
every gradient's norm) is checked to refuse, in words, before it
changes anything: the row is ``{"refused": message}``, and it fails if the strategy accepts.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from hookbench.core.prerequisites import StorageFailed, attempt, one_line, warnings_kept
from hookbench.core.workload import Workload, describe
from hookbench.gate.baselines import fingerprint
from hookbench.gate.checks import Run, Section, trajectory_verdict
from hookbench.gate import replay, rows
from hookbench.gate.judge import Runs, judge_row, refused_words, trained
from hookbench.gate.memory import amount, memory_verdict
from hookbench.engines import fsdp2, references, verdicts
from hookbench.engines.loop import ACCUMULATION, Refused
from hookbench.engines.memory import rank_peak
from hookbench.measure.bounds import STEP_TEMPORARIES, YARDSTICK_HEADROOM
from hookbench.measure.memory import MemoryResult, measure_or_fall_back
from hookbench.measure.parity import (AGAINST_FORLOOP, Tolerance, accepts, compare, wide,
                                      refused_here, stepwise, trajectory,
                                      without_implementation)

__all__ = ["BATCHES", "DESIGNED", "MEMORY_STRATEGIES", "STEPS", "STRATEGIES", "ZERO2_RANKS",
           "bucket", "capture", "engine_memory", "engine_rows", "engine_runs", "forloop_options",
           "live_verdict", "measure_all", "measure_references", "memory", "not_applicable",
           "refusal", "refused_words", "say_warnings", "strategies", "trajectories",
           "transform", "zero2"]

FAULTS = None

STRATEGIES, MEMORY_STRATEGIES = rows.STRATEGIES, rows.MEMORY_STRATEGIES
STEPS, BATCHES, ZERO2_RANKS = rows.STEPS, rows.BATCHES, rows.ZERO2_RANKS
not_applicable, refusal = rows.not_applicable, rows.refusal
# Elements of each parameter stored for the comparison on another CPU (with its float64 norm):
# a user's model stored whole would make the baseline as large as the model.
SAMPLE = 64
ZERO2_MEMORY_WORLD = 8  # rank 0 of 8 simulated ranks, as the gate's zoo rows
def strategies(workload: Workload) -> tuple[str, ...]:
    """The strategy rows of ``workload`` (``rows.STRATEGY_ROWS``): ``STRATEGIES``, and after
    "foreach" "fused" and "capturable" where the workload's options name them."""
    return tuple(r.name for r in rows.STRATEGY_ROWS if r.only_if(workload))


def _reference(workload: Workload, strategy: str) -> tuple[str, bool] | None:
    held_to = rows.ROWS[strategy].references_for(workload)
    return (held_to[0].run, held_to[0].exact) if held_to else None


def forloop_options(workload: Workload) -> dict[str, Any]:
    """The workload's optimizer options for its for-loop implementation: the user's, less an
    implementation flag (``fused=True`` on FSDP2's DTensor shards has no kernel), with
    ``foreach=False`` where the class takes that option."""
    cls, kwargs = workload.optimizer
    options = without_implementation(kwargs)
    return {**options, "foreach": False} if accepts(cls, "foreach") else options


# The rows of a designed outcome, and what each says.
DESIGNED = {"refused": "refuses, as designed", "not_applicable": "does not apply",
            "torch_refuses": "torch refuses it, in its words"}


def _refused(workload: Workload, strategy: str) -> dict[str, Any]:
    """Run a strategy that must refuse: its first words, or a problem if it ran."""
    cls, kwargs = workload.optimizer
    try:
        trajectory(workload, cls, kwargs, strategy, steps=1)
    except (ValueError, RuntimeError) as e:
        return {"refused": refused_words(f"{type(e).__name__}: {e}")}
    return {"problems": [f"{strategy} trained the workload; it must refuse "
                         f"({refusal(workload, strategy)})"]}


def trajectories(workload: Workload) -> dict[str, dict[str, Any]]:
    """Each of ``STRATEGIES`` (and "fused" where the workload's options name it): a
    fingerprint and its parity with its reference (``problems``), or its refusal, or what
    stopped it (``{"error": ...}``)."""
    cls, kwargs = workload.optimizer
    runs: dict[str, list] = {}
    out = {}
    # The user's implementation as given: foreach=True is the foreach row already; fused=True
    # gets a row of its own (its kernel checked to run, ``parity.implementation_ran``), before
    # the bucketed mode, which steps with it and is compared with it. capturable=True too:
    # the user's options exactly, or torch's refusal of them on this device in its words.
    for strategy in strategies(workload):
        def run(strategy: str = strategy) -> dict[str, Any]:
            if not_applicable(workload, strategy):
                return {"not_applicable": not_applicable(workload, strategy)}
            if refusal(workload, strategy):
                return _refused(workload, strategy)
            refused = strategy == "capturable" and refused_here(cls, kwargs)
            if refused:
                return {"torch_refuses": refused}
            runs[strategy] = trajectory(workload, cls, kwargs, strategy, steps=STEPS)
            # On another CPU the bits may change; then the final parameters must stay within
            # what two implementations of the step may differ by.
            machine = rows.bound(strategy, workload, identical=False)
            row = {**fingerprint(runs[strategy], SAMPLE), "problems": [],
                   "tolerance": machine and {"rtol": machine.rtol, "atol": machine.atol}}
            if _reference(workload, strategy):
                reference, identical = _reference(workload, strategy)
                if workload.pure is not None and strategy in AGAINST_FORLOOP:
                    result = stepwise(workload, cls, kwargs, strategy, steps=STEPS)
                elif reference not in runs:
                    row["problems"].append(f"no {reference} run to compare with")
                    return row
                else:
                    result = compare(runs[strategy], runs[reference],
                                     rows.bound(strategy, workload, identical=identical))
                row["parity"] = f"vs {reference}: {result.verdict()}"
                if not result.ok:
                    row["problems"].append(row["parity"])
            return row

        out[f"{workload.name}/{strategy}"] = _row(run)
    return out


def _row(measure: Any, said: list[str] | None = None) -> dict[str, Any]:
    """``attempt(measure)``, with the warnings it raised (torch's, the model's) in the row's
    ``warnings``, each once, instead of on the terminal, after those already ``said`` (its
    references'); a row from spawned ranks also has rank 0's (``references.ranks``)."""
    said = list(said or ())
    with warnings_kept(said):
        row = attempt(measure)
    said += [w for w in row.get("warnings", []) if w not in said]
    return {**row, "warnings": said} if said else row


def bucket(workload: Workload) -> int:
    """A quarter of the trainable elements, so that one backward reduces several buckets."""
    with torch.device("meta"):
        numel = sum(p.numel() for p in workload.model().parameters() if p.requires_grad)
    return max(1, math.ceil(numel / 4))


def zero2_case(workload: Workload, fault: str | None = None, steps: int = STEPS
               ) -> dict[str, Any]:
    """ZeRO-2's run of ``workload`` for ``references.ranks``: its optimizer's for-loop, buckets
    of a quarter of its elements (``bucket``)."""
    return dict(spec=workload, optimizer_class=workload.optimizer[0],
                kwargs=forloop_options(workload), bucket_numel=bucket(workload), steps=steps,
                fault=fault, key=(workload.name, "zero2", "zero2"))


def measure_references(workload: Workload, results: dict[str, list[dict[str, Any]]],
                       steps: int, world: int, accumulation: int) -> references.Measured | None:
    """The references the rows of ``results`` (by row name) that trained declare, each
    measured once: the single process on ``world`` ranks' shares with the rows' accumulation,
    and a mixed-precision reference per (compute, reduce) dtype pair a row declares; None
    where no row trained."""
    ran = [name for name, ranks in results.items() if name in rows.ROWS and trained(ranks)]
    if not ran:
        return None
    mixed = {ref.dtypes(workload) for name in ran
             for ref in rows.ROWS[name].references_for(workload) if ref.dtypes}
    return references.measure(workload, forloop_options(workload), steps, world, accumulation,
                              tuple(sorted(mixed, key=str)))


def _measured(fn: Any) -> tuple[Any, list[str]]:
    """``fn()``'s references and the warnings measuring them raised (the single process's:
    they go into the rows judged against them), or what stopped it as a row's ``error``."""
    said: list[str] = []
    with warnings_kept(said):
        try:
            return fn(), said
        except StorageFailed:
            raise  # the file system failing stops the command (prerequisites.attempt)
        except Exception as e:  # noqa: BLE001 - every row held to them fails, naming it
            return {"error": one_line(e)}, said


def zero2_row(workload: Workload, case: dict[str, Any], got: list[dict[str, Any]],
              ddp: list[dict[str, Any]], world: int = ZERO2_RANKS) -> dict[str, Any]:
    """ZeRO-2's row from what each rank returned for ``case`` (``got``) and for DDP's case
    beside it (``ddp``): its references measured, then judged as its entry declares."""
    results = {"zero2": got, "DDP on the same shares": ddp}
    return _judged(workload, results, _measured(lambda: measure_references(
        workload, results, case["steps"], world, 1)), world)["zero2"]


def zero2(workloads: list[Workload], fault: str | None = None, timeout: float = 300.0,
          with_zero2: bool = True, with_engines: bool = True, traced: bool = False
          ) -> dict[str, dict[str, Any]]:
    """ZeRO-2 on ``ZERO2_RANKS`` gloo ranks for every workload, torch's DDP beside it, and the
    engines' runs (``engines.verdicts``), from one start of the ranks (a fault is injected
    into ZeRO-2 and the engines, never into the DDP that judges ZeRO-2); then every
    reference, each measured once; then every row judged as its entry declares
    (``hookbench.gate.judge``). ``with_zero2=False``: the engines' rows only;
    ``with_engines=False``: ZeRO-2's only; ``traced``: each row also has ``ranks_trace``,
    rank 0's steps traced (``trace.RankTrace``), for the gate's replay file."""
    cases = [zero2_case(w, fault) for w in (workloads if with_zero2 else ())]
    engined = workloads if with_engines else []
    stopped, engine_cases = engine_runs(engined, fault)
    got = references.run_cases(
        [*cases, *references.ddp_beside(cases), *(c for w in engine_cases for c in w)],
        ZERO2_RANKS, timeout)
    zero2_results = {w.name: {"zero2": got[case["key"]],
                              "DDP on the same shares": got[(w.name, "zero2", "ddp")]}
                     for w, case in zip(workloads, cases)}
    # the references, each measured once, before any row is judged: ZeRO-2's here, the
    # engines' in engine_rows before it judges them
    measured = {w.name: _measured(lambda w=w: measure_references(
        w, zero2_results[w.name], STEPS, ZERO2_RANKS, 1)) for w in workloads[:len(cases)]}
    out = engine_rows(engined, stopped, got, traced=traced)
    for w in workloads[:len(cases)]:
        out[f"{w.name}/zero2"] = _judged(w, zero2_results[w.name], measured[w.name],
                                         ZERO2_RANKS, traced)["zero2"]
    return out


def _judged(w: Workload, results: dict[str, list[dict[str, Any]]],
            measured: tuple[references.Measured | dict | None, list[str]], world: int,
            traced: bool = False) -> dict[str, dict[str, Any]]:
    """Each row of ``results`` (by row name: ZeRO-2's, or the engines' that ran) judged against
    its references, measured already (``_measured``: a row's ``error`` where measuring them
    stopped), with a fingerprint of rank 0's parameters and the bound it was held to; the
    warnings of its run and of measuring go into each row."""
    reference, said = measured
    if isinstance(reference, dict):  # measuring the references stopped: so does every row
        return {n: _with_warnings(reference, said) for n in results if n in rows.ROWS}
    measured_or_none = reference or references.Measured([], None, "")

    def row(entry: rows.Row) -> dict[str, Any]:
        runs = Runs(w, results, measured_or_none, rows.bound(entry.name, w), world)
        got = judge_row(entry, runs)
        if "snapshots" in got:
            got = {**fingerprint(got.pop("snapshots"), SAMPLE), **got,
                   "tolerance": {"rtol": runs.tol.rtol, "atol": runs.tol.atol}}
            if traced and results[entry.name][0].get("trace") is not None:
                got["ranks_trace"] = results[entry.name][0]["trace"]
        warned = results[entry.name][0].get("warnings")
        return {**got, "warnings": warned} if warned else got

    return {n: _row(lambda n=n: row(rows.ROWS[n]), said) for n in results if n in rows.ROWS}


def _with_warnings(row: dict[str, Any], said: list[str]) -> dict[str, Any]:
    warned = row.get("warnings", [])
    new = [w for w in said if w not in warned]
    return {**row, "warnings": [*warned, *new]} if new else row


def engine_runs(workloads: list[Workload], fault: str | None, world: int = ZERO2_RANKS,
                engines: tuple[str, ...] = verdicts.ENGINES
                ) -> tuple[dict[str, dict[str, dict[str, str]]], list[list[dict[str, Any]]]]:
    """Per workload, the rows of the ``engines`` that do not run on it: ``{"not_applicable":
    why}`` (``verdicts.not_applicable`` on ``world`` ranks), ``{"error": why}`` (this torch
    cannot run the engine here, ``verdicts.cannot_run``: the row fails) or ``{"skipped": why}``
    (a missing optional prerequisite); and the runs of the others for ``references.ranks``."""
    broken = verdicts.cannot_run(engines)
    stopped = {w.name: {**{e: {"error": why} for e, why in broken.items()},
                        **{e: {"not_applicable": why} for e, why in
                           verdicts.not_applicable(w, STEPS, world, engines).items()},
                        **{e: {"skipped": why} for e in engines
                           if (why := rows.ROWS[f"engines/{e}"].skipped(w))}}
               for w in workloads}
    return stopped, [verdicts.cases(w, forloop_options(w), STEPS, stopped[w.name], fault,
                                    engines) for w in workloads]


def _engine_results(w: Workload, stopped: dict[str, dict[str, str]],
                    got: dict[references.Key, list[dict[str, Any]]],
                    engines: tuple[str, ...]) -> dict[str, list[dict[str, Any]]]:
    return {f"engines/{e}": got[(w.name, f"engines/{e}", e)] for e in engines
            if e not in stopped}


def engine_rows(workloads: list[Workload], stopped: dict[str, dict[str, dict[str, str]]],
                got: dict[references.Key, list[dict[str, Any]]], world: int = ZERO2_RANKS,
                engines: tuple[str, ...] = verdicts.ENGINES, traced: bool = False
                ) -> dict[str, dict[str, Any]]:
    """The ``name/engines/<engine>`` rows of ``engine_runs``'s runs from what the ranks
    returned for them (``got``: by key, each case's results in rank order): those that did
    not run as ``stopped`` says; the others judged against their references, every
    workload's measured before any row is judged."""
    results = {w.name: _engine_results(w, stopped[w.name], got, engines) for w in workloads}
    measured = {w.name: _measured(lambda w=w: measure_references(
        w, results[w.name], STEPS, world, ACCUMULATION)) for w in workloads}
    out: dict[str, dict[str, Any]] = {}
    for w in workloads:
        judged = _judged(w, results[w.name], measured[w.name], world, traced)
        out.update({f"{w.name}/engines/{e}": stopped[w.name].get(e) or judged[f"engines/{e}"]
                    for e in engines})
    return out


def capture(workload: Workload) -> dict[str, dict[str, Any]]:
    """``ActivationCapture`` (statistics of every submodule's output) on one training forward
    and backward of batch 0, against the same step without it (``capture`` row)."""
    from hookbench.mechanisms.activation_capture import ActivationCapture

    def run() -> dict[str, Any]:
        x, y = workload.data(0)
        results, calls = [], []
        for captured in (False, True):
            model = workload.build()
            counts: dict[int, int] = {}

            def count(module, args, output) -> None:  # independent of the capture's own hooks
                if any(torch.is_tensor(t) for t in tree_leaves(output)):  # what is recordable
                    counts[id(module)] = counts.get(id(module), 0) + 1

            # Both closed before backward: a block that checkpointing recomputes there runs
            # its submodules' forward hooks again (not a forward call of the step).
            # The model's own hooks (Hugging Face's gradient_checkpointing_enable puts one
            # on the input embeddings) are there before the capture opens: not the capture's.
            before = _hooks(model)
            with contextlib.ExitStack() as stack:
                cap = (stack.enter_context(ActivationCapture(model, stats=True))
                       if captured else None)
                stack.callback(torch.nn.modules.module.register_module_forward_hook(count).remove)
                loss = workload.compute_loss(model, x, y, (0, 0))
            loss.backward()
            submodules = {id(m) for n, m in model.named_modules() if n}
            calls.append(sum(n for key, n in counts.items() if key in submodules))
            left = sorted({name for name, _ in _hooks(model) - before})
            # a call whose output holds several tensors (a tuple) gives a record for each
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                            cap and len({(r.name, r.call) for r in cap.records}), left))
        (plain, plain_grads, _, _), (loss, grads, records, left) = results
        problems = []
        if _differs((loss, grads), (plain, plain_grads))[0]:
            problems.append("the captured step's loss or gradients differ from the plain step's")
        if records != calls[1]:
            problems.append(f"{records} calls recorded of {calls[1]} submodule calls")
        if left:
            problems.append(f"hooks left on {left[:3]} after the capture closed")
        return {"records": records, "calls": calls[1], "problems": problems}

    return {f"{workload.name}/capture": _row(run)}


Step = tuple[torch.Tensor, dict[str, "torch.Tensor | None"]]  # a step's loss and gradients


def _differs(step: Step, plain: Step, ulps: float = 0) -> tuple[str | None, str | None]:
    """What of one step (its loss, each parameter's gradient) is further from the plain
    step's than ``ulps`` (of its dtype's eps) x its own largest magnitude: "the loss", or the
    first gradient, with how far (None: nothing); and, where everything is within that but
    not bit for bit, the furthest, in words (None: bit for bit)."""
    (loss, grads), (plain_loss, plain_grads) = step, plain
    furthest: tuple[float, str] | None = None
    for name, a, b in (("the loss", loss, plain_loss),
                       *((f"{n}'s gradient", g, plain_grads[n]) for n, g in grads.items())):
        if (a is None) != (b is None):
            has = lambda t: "none" if t is None else "one"  # noqa: E731
            return f"{name} ({has(a)} where the plain step has {has(b)})", None
        if a is None or torch.equal(_dense(a), _dense(b)):
            continue
        eps = torch.finfo(a.dtype).eps
        a, b = wide(_dense(a)), wide(_dense(b))
        diff = float((a - b).abs().nan_to_num(float("inf")).max())
        scale = float(b.abs().max()) * eps
        ratio = diff / scale if scale else math.inf
        said = f"{name} (max |diff| {diff:.3g}, {ratio:.3g} ulp of its largest value)"
        if ratio > ulps:
            return said, None
        furthest = max(furthest or (ratio, said), (ratio, said))
    return None, furthest and furthest[1]


def transform(workload: Workload) -> dict[str, dict[str, Any]]:
    """``name/transform``, for a workload that saves memory with a transform (its
    checkpointing, the model's own Hugging Face ``gradient_checkpointing_enable``, activation
    offload): one training step's loss and every gradient against the same step without the
    transform, bit for bit, or within ``KERNEL_ROUNDING_ULPS`` of each tensor's largest value
    where this CPU rounds the transformed step otherwise (AMD EPYC: 0.72 ulp on GPT-2), saying
    so. Checkpointing recomputes the forward on the random numbers it drew (torch restores the
    RNG state) and offload hands back what it kept, so the same kernels run on the same
    values; a transform that changes gradients (pytorch#193671: ``nn.RReLU``
    under non-reentrant checkpointing, open) fails here, where every strategy, run under the
    same transform, would agree with every other. A compressed offload ("bf16", "int8") is
    lossy by design: its lossless form is held to the plain step. Compiled workloads are
    compared eager (the compiled step is held to the eager one elsewhere)."""
    eager = workload.replace(compile=None)
    own = _own_checkpointing(eager)
    used = [words for words, on in (
        (f"checkpointing={describe(workload.checkpointing)}"
         + (" (use_reentrant=True)" if workload.use_reentrant else ""),
         workload.checkpointing != "none"),
        ("the model's gradient_checkpointing_enable()", own),
        (f"offload={workload.offload!r}", workload.offload is not None)) if on]
    if not used:
        return {}
    lossy = workload.offload not in (None, "lossless")
    transformed = eager.replace(offload="lossless") if lossy else eager
    plain = eager.replace(checkpointing="none", use_reentrant=False, offload=None)

    def run() -> dict[str, Any]:
        x, y = workload.data(0)
        steps = []
        for w in (transformed, plain):
            model = w.build()
            if w is plain and own:
                getattr(model, own)()
            loss = w.compute_loss(model, x, y, (0, 0))
            loss.backward()
            steps.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        ulps = rows.bound("transform", workload)
        beyond, furthest = _differs(*steps, ulps=ulps)
        words = " and ".join(used) + (" (its lossless form: compression is lossy by design)"
                                      if lossy else "")
        if beyond:
            return {"problems": [f"{words}: {beyond} differs from the step without it"]}
        held = ("bit-exact with the step without it" if furthest is None else
                f"within {ulps:g} ulp of each one's largest value of the step "
                f"without it, not bit for bit: furthest {furthest}; this CPU's kernels "
                f"round the transformed step otherwise (seen on AMD EPYC)")
        return {"transform": f"{words}: the loss and {len(steps[0][1])} gradients {held}"}

    return {f"{workload.name}/transform": _row(run)}


# A model's own switch, as transformers names it: the newer names first (5.x deprecates the
# older, with a FutureWarning on every read).
_SWITCHES = (("is_activation_checkpointing", "activation_checkpointing_disable"),
             ("is_gradient_checkpointing", "gradient_checkpointing_disable"))


def _own_checkpointing(workload: Workload) -> str | None:
    """The name of the method that turns off the model's own checkpointing where the model
    has it on, else None; read off a model built on the meta device (or for real where it
    cannot be: a model that cannot be built at all fails its other rows)."""
    for device in ("meta", None):
        try:
            with torch.device(device) if device else contextlib.nullcontext():
                model = workload.model()
            break
        except Exception:  # noqa: BLE001 - the user's factory; its other rows say why
            model = None
    for flag, disable in _SWITCHES:
        on = getattr(model, flag, None)
        if on is not None:
            return disable if on and hasattr(model, disable) else None
    return None


def _dense(t: torch.Tensor) -> torch.Tensor:
    # a sparse gradient (nn.EmbeddingBag(sparse=True)) compared as the dense one it stands for
    return t.to_dense() if t.is_sparse else t


def _hooks(model: torch.nn.Module) -> set[tuple[str, int]]:
    """Every hook registered on ``model``'s modules and parameters, as (its owner's name, the
    hook's id: ids are unique in the process): forward, forward-pre, backward and
    backward-pre hooks, tensor and post-accumulate-grad hooks."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_post_accumulate_grad_hooks")
    return {(name or "the model", key)
            for name, owner in (*model.named_modules(), *model.named_parameters())
            for kind in kinds for key in (getattr(owner, kind, None) or {})}


def memory(workload: Workload) -> dict[str, dict[str, Any]]:
    """One step's peak per ``MEMORY_STRATEGIES`` on the fake backend (a compiled workload is
    measured eager: fake tensors do not run compiled code), with what the optimizer in
    backward must save: fewer gradients alive at once than the standard step, and its memory
    held to the standard step's (``_in_backward_memory``)."""
    eager = workload.replace(compile=None)
    cls, kwargs = workload.optimizer
    measured: dict[str, Any] = {}
    out = {}
    # The standard step: foreach, as on CUDA by default; an optimizer without it, its for-loop.
    standard_step = "foreach" if accepts(cls, "foreach") else "forloop"
    for strategy in (standard_step, *MEMORY_STRATEGIES[1:]):
        if refusal(workload, strategy):
            continue  # the trajectory and ZeRO-2 rows check the refusal
        def one(strategy: str = strategy) -> dict[str, Any]:
            zero = strategy == "zero2"
            r, fallback = measure_or_fall_back(
                eager, strategy, optimizer_class=cls,
                optimizer_kwargs={**kwargs, "bucket_numel": bucket(workload)} if zero
                else kwargs, world_size=ZERO2_MEMORY_WORLD if zero else 1)
            measured[strategy] = r
            problems = []
            standard = measured.get(standard_step)
            if strategy == "in_backward" and standard is not None:
                problems += _in_backward_memory(r, standard)
            # fewer than the standard step holds, measured alike, is a saving too: gradients a
            # model's backward hands out as views of one larger storage count that storage
            # (torchdiffeq's adjoint: its flat adjoint state, 90624 B, where the parameters'
            # gradients are 37992 B)
            fewer = standard is not None and r.gradients_alive_max < standard.gradients_alive_max
            if (strategy != standard_step and r.all_gradients > 0
                    and not r.few_gradients_alive and not fewer):
                problems.append(f"holds every gradient at once ({r.gradients_alive_max} B"
                                + (f"; the standard step {standard.gradients_alive_max} B"
                                   if standard is not None else "") + ")")
            # a saving the model's own backward rules out: said, not failed
            together = (f"every gradient arrives at once, from {r.together_from} in "
                        f"backward: none can be freed before the rest"
                        if strategy != standard_step and r.all_gradients > 0
                        and r.gradients_together >= r.all_gradients else None)
            return {"peak": r.peak, "breakdown": r.peak_breakdown,
                    "gradients_alive_max": r.gradients_alive_max, "problems": problems,
                    "backend": r.backend, **({"fallback": fallback} if fallback else {}),
                    **({"together": together} if together else {})}

        out[f"{workload.name}/memory/{strategy}"] = _row(one)
    return out


def _in_backward_memory(r: MemoryResult, standard: MemoryResult) -> list[str]:
    """The optimizer in backward's memory against the standard step's, on the same model.

    Its peak: not "below": where activations peak in backward (a small model, a long
    sequence), both steps peak there, and the saving shows in the gradients alive instead.
    Above by at most ``STEP_TEMPORARIES`` x the largest trainable parameter: stepped in
    backward, a parameter's step makes its temporaries while activations are still live, where
    a standard step makes them after backward has freed them (timm's resnet10t: its largest
    conv, 576 KB, stepped early in backward; the peak 332 KB above the standard step's).

    That slack can hide a gradient kept after its step where one parameter is most of the
    model; what is live when backward has ended cannot: every gradient has been stepped and
    freed, so no more than the standard step's activations and temporaries (exact counts, the
    same forward and backward)."""
    problems = []
    slack = STEP_TEMPORARIES * r.floor_breakdown["gradients_needed"]
    if r.peak > standard.peak + slack:
        problems.append(f"costs memory: peak {r.peak} B > the standard step's {standard.peak} B "
                        f"+ {slack} B (the step's temporaries of the largest parameter, "
                        f"{STEP_TEMPORARIES}x its bytes)")
    left = sum(r.after_backward.get(c, 0) for c in ("gradients", "activations", "temporaries"))
    was = sum(standard.after_backward.get(c, 0) for c in ("activations", "temporaries"))
    if left > was:
        problems.append(f"when backward ended {left} B of gradients, activations and "
                        f"temporaries were live, more than the standard step's {was} B of "
                        f"activations and temporaries (a gradient kept after its step)")
    return problems


def engine_memory(workload: Workload) -> dict[str, dict[str, Any]]:
    """``name/memory/fsdp2_<setting>``: rank 0 of ``engines.memory.WORLD``'s peak under FSDP2
    on fake tensors, against its bound (``hookbench.engines.memory``); the optimizer in backward
    also never above FSDP2 ZeRO-3 with a standard step, below it in model states when backward
    has ended, and leaving no more activations and temporaries live then than it does (the
    yardstick of what the model and FSDP2 keep, measured on this workload). Where FSDP2 does
    not apply (``verdicts.not_applicable``), so says the row; where this torch's FSDP2 cannot
    train on the CPU (``fsdp2.cannot_train_on_cpu``; the simulated rank is the CPU, GPUs or
    not), the row fails saying why; where the optimizer in backward refuses, its trajectory row
    says so and there is none."""
    on_cpu = fsdp2.cannot_train_on_cpu()
    stopped = {**{f"fsdp2_{s}": {"error": on_cpu} for s in fsdp2.SETTINGS if on_cpu},
               **{e: {"not_applicable": why} for e, why in
                  rows.engines_not_applicable(workload).items()}}
    # The engines' optimizer: the for-loop, as on their trajectory rows (a fused kernel has no
    # DTensor sharding strategy on FSDP2's shards).
    eager = workload.replace(compile=None, optimizer=(workload.optimizer[0],
                                                      forloop_options(workload)))
    out: dict[str, dict[str, Any]] = {}
    for setting in fsdp2.SETTINGS:
        key = f"{workload.name}/memory/fsdp2_{setting}"
        # the designed outcome first, as the judge's order has it: a row that refuses by
        # design has none on any torch, also where this torch's FSDP2 cannot train (a baseline
        # of 2.6.0 held charlm-fp16's as that error, which 2.9.1 then could not measure)
        if rows.ROWS[f"memory/fsdp2_{setting}"].refuses(workload):
            continue  # its trajectory row checks the refusal
        if f"fsdp2_{setting}" in stopped:
            out[key] = stopped[f"fsdp2_{setting}"]
            continue

        def one(setting: str = setting) -> dict[str, Any]:
            try:
                row = rank_peak(eager, setting)
            except Refused as e:
                return {"torch_refuses": str(e)}
            standard = out.get(f"{workload.name}/memory/fsdp2_zero3", {})
            if setting != "in_backward":
                return row
            if "peak" not in standard or standard["backend"] != row["backend"]:
                row["problems"].append(
                    "no FSDP2 ZeRO-3 row on the same backend to hold it to (ZeRO-3: " + (
                        f"backend {standard['backend']}, this row's {row['backend']})"
                        if "peak" in standard else f"{standard.get('error', 'not measured')})"))
                return row
            if row["peak"] > standard["peak"]:
                row["problems"].append(f"peak {amount(row['peak'])} above FSDP2 ZeRO-3's "
                                       f"with a standard step, {amount(standard['peak'])}")
            if row["states"] >= standard["states"]:
                row["problems"].append(f"when backward ended {amount(row['states'])} of "
                                       f"model states live, not below ZeRO-3's "
                                       f"{amount(standard['states'])}")
            # exact counts, and the same forward and backward: what ZeRO-3 keeps (a cache of
            # the model's, FSDP2's own) and not a byte more (a gradient kept after its step
            # shows here, as a temporary)
            if row["left"] > standard["left"]:
                row["problems"].append(f"when backward ended {amount(row['left'])} of "
                                       f"activations and temporaries live, more than "
                                       f"ZeRO-3's {amount(standard['left'])}")
            return row

        out[key] = _row(one)
    return out


def yardstick(rec: dict | None, value: dict) -> tuple[bool, str]:
    """Whether a row's yardstick (``noise_floor``, per step) holds the recorded one: within
    ``YARDSTICK_HEADROOM`` x it and the row's atol, or grown where DDP is bit for bit one
    process in DDP's order on this torch (``ddp_order``: its reduction exact, so the two legal
    orders moved apart on this torch's kernels, as BatchNorm over one image a rank amplifies a
    rounding); and the words where it grew ("" where it did not, or nothing is recorded)."""
    was, now = (rec or {}).get("noise_floor"), value.get("noise_floor")
    if not was or not now:
        return True, ""
    atol = (value.get("tolerance") or {}).get("atol", 0.0)
    over = [(step, n, w) for step, (w, n) in enumerate(zip(was, now))
            if n > YARDSTICK_HEADROOM * w + atol]
    if not over:
        return True, ""
    step, n, w = over[0]
    words = (f"DDP is {n:.3g} from one process at step {step}, more than "
             f"{YARDSTICK_HEADROOM:g}x the {w:.3g} recorded on the trusted torch + atol {atol:g}")
    if value.get("ddp_order"):
        return True, (f"yardstick grew, and holds: {words}, and bit-exact with one process in "
                      f"DDP's order on this torch: its reduction is exact, the two legal "
                      f"orders moved apart")
    return False, f"YARDSTICK GREW: {words}"


def measure_all(workloads: list[Workload], fault: str | None = None) -> dict[str, Any]:
    """Every row above for every workload (names must differ)."""
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise ValueError(f"workload names must differ: {sorted(names)}")
    for w in workloads:  # a broken workload raises here, once, not on every row
        w.check(shares=ZERO2_RANKS, batches=BATCHES)
    out: dict[str, Any] = {}
    for w in workloads:
        out.update(trajectories(w))
    try:
        out.update(zero2(workloads, fault, traced=True))
    except StorageFailed:
        raise  # the file system failing stops the command (prerequisites.attempt)
    except Exception as e:  # noqa: BLE001 - a crashed or late rank fails the ranks' rows
        out.update({key: {"error": one_line(e)} for w in workloads
                    for key in (f"{w.name}/zero2", *(f"{w.name}/engines/{engine}"
                                                     for engine in verdicts.ENGINES))})
    for w in workloads:
        out.update(capture(w))
        out.update(transform(w))
        out.update(memory(w))
        out.update(engine_memory(w))
    return out


def measure(run: Run) -> dict[str, Any] | None:
    """None without workloads: the section is not measured (the gate's default sections);
    their random draws recorded or replayed, and their steps traced, where the baseline has a
    replay file (``hookbench.gate.replay``)."""
    if not run.workloads:
        return None
    return replay.measured(run, lambda: measure_all(list(run.workloads), run.fault))


def judge(base: dict, now: dict, run: Run, title: str | None = None) -> Section:
    section = Section(title or (
        f"Your workloads: {STEPS} steps per strategy against the stored checksum and live "
        f"against its reference, ZeRO-2 and the engines on {ZERO2_RANKS} gloo ranks, "
        f"fake-backend peak memory"), ("workload/check", "verdict"))
    for key, value in now.items():
        if section.add_stopped(value, key):
            continue
        rec, kind = base.get(key), rows.row(key).kind
        designed = next((k for k in DESIGNED if k in value), None)
        if designed:  # a refusal or an option that does not apply: recorded, and must stay so
            ok = rec is not None and rec.get(designed) == value[designed]
            words = DESIGNED[designed]
            section.add(ok, key, f"{words}: {value[designed]}" if ok else
                        f"CHANGED: now {words} ({value[designed]}); recorded " + (
                            "nothing" if rec is None else next(
                                (f"{DESIGNED[k]} ({rec[k]})" for k in DESIGNED if k in rec),
                                "a run")))
        elif value.get("problems"):
            section.add(False, key, "; ".join(value["problems"]))
        elif kind == "memory":
            # like with like: fake and real CPU tensors are one tracker, exact on both (a
            # torch whose meta kernels refuse the model moves it to real ones: mixtral's
            # torch._grouped_mm on 2.9.1), a GPU's allocator is another
            was, now_on = (rec or {}).get("backend", "fake"), value.get("backend", "fake")
            comparable = was == now_on or {was, now_on} <= {"fake", "eager"}
            ok, verdict = memory_verdict(rec, value, "fake") if comparable else (False, "")
            if was != now_on:
                verdict = (f"CHANGED backend: recorded on {was}, measured now on {now_on}"
                           + (f", the same tracker: {verdict}" if comparable else ""))
            fallback = f" ({value['fallback']})" if value.get("fallback") else ""
            section.add(ok, key, f"peak {amount(value['peak'])}, backend {now_on}: "
                                 f"{verdict}{fallback}"
                        + "".join(f"; {value[k]}" for k in ("against", "together")
                                  if k in value))
        elif kind == "transform":  # live: the transformed step against the plain one
            section.add(True, key, value["transform"])
        elif kind == "draws":
            section.add(True, key, replay.drawn(value))
        elif kind == "capture":  # a module call more or less is a changed model
            ok = rec is not None and rec.get("records") == value["records"]
            section.add(ok, key, f"{value['records']} of {value['calls']} module calls "
                        f"recorded, training unchanged: " + ("identical" if ok else
                        f"CHANGED: recorded {'nothing' if rec is None else rec.get('records')}"))
        else:  # another CPU may change the bits: then the row's own tolerance
            tol = value.get("tolerance")
            ok, verdict = trajectory_verdict(rec, value, tol and Tolerance(**tol),
                                             run.machine_note)
            if not ok and value.get("rounding") and rec and "final" in rec:
                ok, verdict = replay.within_rounding(rec, value, tol and Tolerance(**tol),
                                                     run.machine_note)
            held, drift = yardstick(rec, value)
            changed = not ok or bool(drift) or "identical" not in verdict
            section.add(ok and held, key, "; ".join(filter(None, (
                verdict, drift, value.get("parity"),
                changed and replay.located(value, run.machine_note)))))
    say_warnings(section, now)
    replay.say_replayed(section, now)
    names = {key.split("/")[0] for key in now}
    for key in sorted(k for k in set(base) - set(now) if k.split("/")[0] in names):
        section.add(False, key, "recorded, but not measured now (re-record on purpose)")
    return section


def live_verdict(key: str, value: dict[str, Any]) -> tuple[bool, str]:
    """A row judged now, against its references only (``hookbench report``, ``hookbench
    engines``): its designed outcome, its problems, or what it was held to, in words."""
    designed = next((k for k in DESIGNED if k in value), None)
    if designed:
        return True, f"{DESIGNED[designed]}: {value[designed]}"
    if value.get("problems"):
        return False, "; ".join(value["problems"])
    kind = rows.row(key).kind
    if kind == "capture":
        return True, (f"{value['records']} of {value['calls']} module calls recorded; loss "
                      f"and gradients bit for bit without capture")
    if kind == "transform":
        return True, value["transform"]
    if "against" in value:  # an engine's peak against its bound
        return True, value["against"] + (f" (backend {value['backend']}: {value['fallback']})"
                                         if value.get("fallback") else "")
    return True, value.get("parity", "the reference the others follow")


def say_warnings(section: Section, now: dict[str, Any]) -> None:
    """Each row's detail ends with the warnings its run raised, in a few words; a warning
    already said on an earlier row is not repeated."""
    said: set[str] = set()
    for i, (cells, verdict) in enumerate(section.rows):
        new = [w for w in (now.get(cells[0]) or {}).get("warnings", []) if w not in said]
        said.update(new)
        if new:
            shown = "; ".join(w if len(w) <= 120 else w[:117] + "..." for w in new)
            section.rows[i] = ((*cells[:-1], f"{cells[-1]}; warned: {shown}"), verdict)
