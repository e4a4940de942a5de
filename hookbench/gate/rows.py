"""The rows a workload gets, declared once: what each runs, what it is held to and in what
order, by which bound, with which extra checks, and what it refuses or skips, in the words it
prints. ``hookbench.gate.workload_checks`` runs them and ``hookbench.gate.judge`` judges the
ranks rows; nothing there decides which rows exist, what a row is compared with or why a row
refuses: adding a row, or changing a reference or a bound, is an edit of one entry here.

    Reference   a run the row is held to: bit for bit, or within the row's bound, and why;
                where the bound fails, its noise-floor fallback (``floor_of``,
                ``confirmed_by``), and whether the baseline keeps the floor (``yardstick``)
    Row         one entry: ``name`` (``<workload>/<name>`` in the baseline), ``kind`` (which
                judge reads it: trajectory, ranks, capture, transform, memory, draws), ``runs``,
                ``references`` (in the order they are judged; a reference whose ``when``
                does not hold for the workload is not one of its references), ``bound`` (a
                rule of ``hookbench.measure.bounds``, by name), ``checks`` (in words; a ranks
                row's ``checker`` makes them, ``hookbench.engines.verdicts``), ``refuses``
                (hookbench's designed refusal: the row must refuse in words) and
                ``not_applicable`` (the row does not apply to the workload, and says why),
                ``skipped`` (an optional prerequisite of the row is not installed: which)
    ROWS        every entry, in the order the rows are measured and shown
    row         the entry of a row key (``mlp/engines/ddp`` -> ROWS' ``engines/ddp``)

The refusals are the mechanisms' own designed limits: a strategy that refuses is run and must
refuse, before it changes anything, in those words; the engines that do not apply are
``hookbench.engines.verdicts.not_applicable``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from hookbench.core.workload import Workload
from hookbench.engines import deepspeed, fsdp2, verdicts
from hookbench.engines.loop import ACCUMULATION
from hookbench.measure import bounds
from hookbench.measure.parity import accepts
from hookbench.mechanisms.zero2 import ELEMENTWISE

__all__ = ["BATCHES", "DRAWS_ROW", "ENGINE_ROWS", "MEMORY_STRATEGIES", "PEER_ROWS", "ROWS",
           "STEPS", "STRATEGIES", "STRATEGY_ROWS", "ZERO2_RANKS", "Reference", "Row", "bound",
           "engines_not_applicable", "not_applicable", "refusal", "row"]

STEPS = 3
# The most batches a row draws (the engines' micro-batches): ``Workload.check`` runs them all
BATCHES = STEPS * ACCUMULATION
ZERO2_RANKS = 2  # the ranks ZeRO-2 and the engines train on

Why = Callable[[Workload], "str | None"]


def _never(workload: Workload) -> None:
    return None


def _always(workload: Workload) -> bool:
    return True


@dataclass(frozen=True)
class Reference:
    run: str  # the run held to: a strategy's row, or one of the references in words
    exact: bool  # bit for bit; else within the row's bound
    why: str | Why  # why it is (not) bit for bit (of the workload, where that depends on it)
    when: Callable[[Workload], bool] = _always  # where it is one of the row's references
    # The noise-floor fallback where the bound fails (one at most): ``floor_of``, the run whose
    # distance from this reference is the floor: where that run itself is beyond the bound,
    # the row is held within FLOOR_FACTOR x that distance; ``confirmed_by``, another row's
    # run that must drift from this reference too and stay within FLOOR_FACTOR x the row's
    # own distance of the row
    floor_of: str | None = None
    confirmed_by: str | None = None
    yardstick: bool = False  # the baseline keeps |DDP - this reference| per step (noise_floor)
    dtypes: Callable[[Workload], tuple] | None = None  # the mixed reference's (compute, reduce)

    def said(self, workload: Workload) -> str:
        return self.why if isinstance(self.why, str) else self.why(workload) or ""


@dataclass(frozen=True)
class Row:
    name: str
    kind: str  # "trajectory", "ranks", "capture", "transform", "memory"
    runs: str
    references: tuple[Reference, ...] = ()
    bound: str | None = None  # a rule of hookbench.measure.bounds, by name (None: bit for bit)
    checks: tuple[str, ...] = ()
    refuses: Why = _never
    not_applicable: Why = _never
    skipped: Why = _never  # a declared optional prerequisite this machine lacks, and which
    only_if: Callable[[Workload], bool] = _always  # a row only some workloads have at all
    checker: Callable[..., verdicts.Checked] | None = None  # a ranks row's checks
    accumulation: int = 1  # a ranks row's micro-batches per step, each on every rank

    def references_for(self, workload: Workload) -> tuple[Reference, ...]:
        return tuple(r for r in self.references if r.when(workload))


# -- the designed refusals, in the words the rows print -----------------------------------------

_REENTRANT = ("refuses reentrant checkpointing: its nested backward fires the hook of a "
              "parameter used inside and outside a checkpoint once in each")


def _zero2_refuses(workload: Workload) -> str | None:
    cls = workload.optimizer[0]
    sparse = verdicts.sparse_gradients(workload)
    if sparse:
        return (f"ZeRO-2 refuses sparse gradients: it reduces flat dense buckets, and "
                f"{sparse} makes sparse ones")
    if cls not in ELEMENTWISE:
        return (f"ZeRO-2 refuses {cls.__name__}: it steps 1-D pieces of parameters, and "
                f"{cls.__name__} is not known to update them elementwise")
    if workload.use_reentrant:
        return f"ZeRO-2 {_REENTRANT}, after its bucket may have been reduced"
    mixed = _mixed_group(workload)
    if mixed:
        return (f"ZeRO-2 refuses {mixed}: each param group is one flat buffer of one dtype "
                f"(declare param_groups that keep them apart)")
    return None


def _mixed_group(workload: Workload) -> str | None:
    """The first param group of ``workload`` whose trainable parameters mix dtypes (complex
    beside real), in words; else None."""
    model = workload.meta_model()
    groups = workload.optimizer_params(model) or [{"params": list(model.parameters())}]
    for i, group in enumerate(groups):
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in group["params"]
                         if p.requires_grad})
        if len(dtypes) > 1:
            return f"param group {i} mixing {' and '.join(dtypes)}"
    return None


def _in_backward_refuses(workload: Workload) -> str | None:
    if workload.use_reentrant:
        return f"the optimizer in backward {_REENTRANT}, stepping it twice"
    if workload.precision == "fp16":
        return ("the optimizer in backward refuses fp16: a GradScaler must see every gradient "
                "before any parameter is stepped")
    if workload.clip_grad_norm is not None:
        return ("the optimizer in backward refuses global gradient-norm clipping: the norm "
                "needs every gradient before any parameter is stepped")
    return None


def _fsdp2_in_backward_refuses(workload: Workload) -> str | None:
    return _in_backward_refuses(workload) or fsdp2.repeated_units(workload)


def _needs(option: str) -> Why:
    """The row needs the optimizer's ``option`` implementation (an optimizer outside
    torch.optim may have only its for-loop). The words name the class, not the torch release,
    so that a recorded row stays the same across releases."""
    def why(workload: Workload) -> str | None:
        cls = workload.optimizer[0]
        if accepts(cls, option):
            return None
        return (f"{cls.__module__}.{cls.__qualname__} takes no {option} option (its for-loop "
                f"is its only implementation)")
    return why


def engines_not_applicable(workload: Workload, engines: tuple[str, ...] = verdicts.ENGINES
                           ) -> dict[str, str]:
    """Engine -> why it cannot train ``workload`` on the ZERO2_RANKS ranks, for all of
    ``engines`` at once (a forward that skips layers at random is found by training once)."""
    return verdicts.not_applicable(workload, STEPS, ZERO2_RANKS, engines)


def _engine_not_applicable(engine: str) -> Why:
    return lambda workload: engines_not_applicable(workload, (engine,)).get(engine)


def _given(option: str) -> Callable[[Workload], bool]:
    return lambda workload: bool(workload.optimizer[1].get(option))


def _foreach(workload: Workload) -> bool:
    return accepts(workload.optimizer[0], "foreach")


_REORDERED = "foreach kernels step a list of tensors at once, in other roundings"
_SAME_STEP = "the same for-loop step of each parameter, taken inside backward"
_SHARES = ("one process sums loss / N per share where data parallelism sums the shares' "
           "gradients and divides: another legal fp32 order")
_DDP = Reference("DDP on the same shares", True,
                 "the same fp32 sums on 2 gloo ranks; not bit for bit where the arithmetic "
                 "differs by design (a clipping norm summed shard by shard, a compiled model, "
                 "low-precision parameters stepped in other pieces, more than 2 ranks): then "
                 "within the bound")
_SINGLE_WHY = (f"{_SHARES}; within the bound, or the measured noise floor where DDP itself "
               f"is further")


def _fp32(workload: Workload) -> bool:
    return workload.precision != "bf16"


def _single(when: Callable[[Workload], bool] = _always, yardstick: bool = False) -> Reference:
    return Reference("one process on the ranks' shares", False, _SINGLE_WHY, when,
                     floor_of="DDP on the same shares", yardstick=yardstick)


def _mixed(dtypes: Callable[[Workload], tuple | None]) -> Reference:
    return Reference("the mixed-precision reference", False,
                     "a low-precision model, fp32 masters, the same reduction; within the "
                     "bf16 bound and the rounding-level bounds, bit for bit on Llama but not "
                     "on every model (charlm-bf16-ckpt: 1.9e-4 on norm.bias, an Adam step on "
                     "a gradient at rounding level)",
                     when=lambda w: dtypes(w) is not None, dtypes=dtypes)


def _fsdp2_differs(workload: Workload) -> str:
    # FSDP2 is never DDP's arithmetic: it computes on gathered copies of the parameters (other
    # tensors, so other kernels may run: seen 5.4e-07 on a diffusers UNet's conv_in after one
    # step) and reduce-scatters its own buckets; a unit run several times per forward (a
    # layer shared across depth) it reduces in pieces, once per run
    return ("FSDP2 computes on gathered copies of the parameters and reduce-scatters its own "
            "buckets" + ("; FSDP2 reduces a unit run several times per forward in pieces, once "
                         "per run" if fsdp2.repeated_units(workload) else ""))


def _fsdp2_fp32(workload: Workload) -> bool:
    return fsdp2.mixed_dtypes(workload) is None


# FSDP2 with a standard step: DDP's sums in another order on other tensors, then one process;
# where it computes in low precision (its mp_policy), the reference of that arithmetic alone
_FSDP2_REFERENCES = (
    Reference("DDP on the same shares", False, _fsdp2_differs, when=_fsdp2_fp32),
    _mixed(fsdp2.mixed_dtypes),
    _single(when=_fsdp2_fp32))
_FSDP2_CHECKS = ("every shard's hook once per run of its unit in a synced backward",
                 "no gathered gradient left", "shard gradients held at once within 4 Psi / N",
                 "the declared settings run", "ranks agree")

STRATEGY_ROWS = (
    Row("forloop", "trajectory", "the workload's optimizer, its for-loop, the standard step",
        bound="trajectory_bound"),
    Row("foreach", "trajectory", "the standard step with foreach=True",
        (Reference("forloop", False, _REORDERED),), "trajectory_bound",
        not_applicable=_needs("foreach")),
    Row("fused", "trajectory", "the standard step with the user's fused=True",
        (Reference("forloop", False, "one fused kernel per parameter group"),),
        "trajectory_bound", checks=("the fused kernel ran",), not_applicable=_needs("fused"),
        only_if=_given("fused")),
    Row("capturable", "trajectory", "the standard step with the user's capturable=True, or "
        "torch's refusal of it on this device in its words",
        (Reference("forloop", False, "bias corrections from a tensor step count"),),
        "trajectory_bound", checks=("its first step reads nothing back to the host",),
        only_if=_given("capturable")),
    Row("in_backward", "trajectory", "OptimizerInBackward, one optimizer per parameter",
        (Reference("forloop", True, _SAME_STEP),), "trajectory_bound",
        refuses=_in_backward_refuses),
    Row("in_backward_grouped", "trajectory", "OptimizerInBackward grouped by module, for-loop",
        (Reference("forloop", True, _SAME_STEP),), "trajectory_bound",
        refuses=_in_backward_refuses),
    Row("in_backward_grouped_foreach", "trajectory",
        "OptimizerInBackward grouped by module, foreach in each group",
        (Reference("foreach", False, "foreach over each module's parameters, not all"),),
        "trajectory_bound", refuses=_in_backward_refuses, not_applicable=_needs("foreach")),
    Row("in_backward_bucketed", "trajectory",
        "OptimizerInBackward in DDP-style 25 MiB buckets, the implementation given in each",
        (Reference("fused", False, "its buckets step with the user's fused kernel",
                   when=_given("fused")),
         Reference("foreach", False, "foreach over each bucket, not all",
                   when=lambda w: _foreach(w) and not _given("fused")(w)),
         Reference("forloop", True, "the class's for-loop in each bucket: the same step",
                   when=lambda w: not _foreach(w))),
        "trajectory_bound", refuses=_in_backward_refuses),
)

ZERO2_ROW = Row(
    "zero2", "ranks", "Zero2 on 2 gloo ranks, the optimizer's for-loop, buckets of a quarter "
    "of the trainable elements", (_DDP, _single(yardstick=True)), "data_parallel_bound",
    ("every hook once per backward", "no gradient left on a parameter",
     "DDP's ranks hold the same parameters"), refuses=_zero2_refuses,
    checker=verdicts.zero2_checked)

ENGINE_ROWS = (
    Row("engines/ddp", "ranks", f"DDP, {ACCUMULATION} micro-batches per step, the first "
        f"under no_sync()",
        (Reference("the team's comm hook applied by hand", True,
                   "the hook's own arithmetic on each rank's accumulated gradients in DDP's "
                   "buckets", when=lambda w: (w.ddp or {}).get("comm_hook") is not None),
         # fp32: where DDP is further (BatchNorm over small shares: another legal fp32
         # order), confirmed by FSDP2 ZeRO-2, another engine, drifting from it too; under
         # bf16 autocast FSDP2 runs other arithmetic (its policy), so confirms nothing
         Reference("one process on the ranks' shares", False,
                   f"{_SHARES}; within the bound, or 2x the noise floor where FSDP2 ZeRO-2 "
                   f"drifts from it too", when=_fp32, confirmed_by="engines/fsdp2_zero2",
                   yardstick=True),
         Reference("one process on the ranks' shares", False, f"{_SHARES}; within the bound",
                   when=lambda w: not _fp32(w), yardstick=True)),
        "data_parallel_bound", ("every bucket reduced once per synced backward, none under "
                                "no_sync()", "the declared settings run", "ranks agree"),
        checker=verdicts.ddp_checked, accumulation=ACCUMULATION),
    Row("engines/fsdp2_zero2", "ranks", "FSDP2 reshard_after_forward=False, the same "
        "accumulation under set_requires_gradient_sync", _FSDP2_REFERENCES,
        "data_parallel_bound", _FSDP2_CHECKS, checker=verdicts.fsdp2_checked(False),
        not_applicable=_engine_not_applicable("fsdp2_zero2"), accumulation=ACCUMULATION),
    Row("engines/fsdp2_zero3", "ranks", "FSDP2 reshard_after_forward=True", _FSDP2_REFERENCES,
        "data_parallel_bound", _FSDP2_CHECKS, checker=verdicts.fsdp2_checked(False),
        not_applicable=_engine_not_applicable("fsdp2_zero3"), accumulation=ACCUMULATION),
    Row("engines/fsdp2_in_backward", "ranks", "FSDP2 ZeRO-3 with OptimizerInBackward on the "
        "shards", (Reference("engines/fsdp2_zero3", True, _SAME_STEP),), "data_parallel_bound",
        ("no shard gradient left after its step", "shard gradients held at once within the "
         "largest unit's", "ranks agree"),
        refuses=_fsdp2_in_backward_refuses, checker=verdicts.fsdp2_checked(True),
        not_applicable=_engine_not_applicable("fsdp2_in_backward"),
        accumulation=ACCUMULATION),
)

# Beside the engines in ``hookbench engines`` only: the gate's rows must not depend on an
# optional install (deepspeed, the peers extra)
PEER_ROWS = (
    Row("engines/deepspeed_zero2", "ranks", "DeepSpeed ZeRO stage 2 with the workload's "
        "declared config, the same accumulation",
        (Reference("DDP on the same shares", False, "DeepSpeed reduces every micro-batch's "
                   "gradients and sums them in its partition (no no-sync)", when=_fp32),
         _mixed(lambda w: None if _fp32(w) else (torch.bfloat16, torch.float32)),
         _single(when=_fp32)),
        "data_parallel_bound", ("the declared config runs", "ranks agree"),
        checker=verdicts.deepspeed_checked,
        not_applicable=_engine_not_applicable("deepspeed_zero2"),
        skipped=lambda workload: deepspeed.available(), accumulation=ACCUMULATION),
)

CAPTURE_ROW = Row(
    "capture", "capture", "ActivationCapture(stats=True) on one training step of batch 0",
    (Reference("the same step without it", True, "the capture only reads outputs"),),
    checks=("one record per submodule call", "no hook left after it closes"))

TRANSFORM_ROW = Row(
    "transform", "transform", "one step under the workload's checkpointing, the model's own "
    "gradient_checkpointing_enable or its activation offload (the lossless form of a "
    "compressed one)",
    (Reference("the same step without the transform", False,
               "recomputation replays the random numbers it drew; offload hands back what it "
               "kept: bit for bit on the Intel Xeon here, and within the bound where another "
               "CPU rounds the transformed step otherwise (AMD EPYC: 0.72 ulp on GPT-2)"),),
    "KERNEL_ROUNDING_ULPS")

DRAWS_ROW = Row(
    "draws", "draws", "every random op of the workload's builds, batches and forwards, "
    "recorded with the baseline (<baseline>.replay.pt) and replayed on the gate, in this "
    "process and on the ranks",
    checks=("the draws made now have the recorded draws' distribution",
            "they depend on the generator's state as the recorded ones do"))

MEMORY_ROWS = (
    Row("memory/foreach", "memory", "one standard step's peak on the fake backend (foreach, "
        "as on CUDA by default), real CPU tensors where fake ones cannot run the model",
        bound="MEMORY_SLACK", only_if=_foreach),
    Row("memory/forloop", "memory", "one standard step's peak (the for-loop of an optimizer "
        "without foreach)", bound="MEMORY_SLACK",
        only_if=lambda w: not _foreach(w)),
    Row("memory/in_backward", "memory", "OptimizerInBackward's peak",
        (Reference("the standard step", False, "its step's temporaries are made while "
                   "activations are live"),), "STEP_TEMPORARIES",
        ("fewer gradients alive at once than the standard step",
         "no more live when backward ends than the standard step's activations"),
        refuses=_in_backward_refuses),
    Row("memory/zero2", "memory", "rank 0 of 8 simulated ranks' peak under Zero2",
        bound="MEMORY_SLACK", checks=("fewer gradients alive at once than the standard step",),
        refuses=_zero2_refuses),
    Row("memory/fsdp2_zero2", "memory", "rank 0 of 8 simulated ranks' peak under FSDP2 "
        "ZeRO-2 on fake tensors", bound="STATES_AGREEMENT",
        not_applicable=_engine_not_applicable("fsdp2_zero2")),
    Row("memory/fsdp2_zero3", "memory", "the same under FSDP2 ZeRO-3",
        bound="STATES_AGREEMENT",
        not_applicable=_engine_not_applicable("fsdp2_zero3")),
    Row("memory/fsdp2_in_backward", "memory", "the same with OptimizerInBackward on the shards",
        (Reference("memory/fsdp2_zero3", False, "never above it; below it in model states "
                   "when backward has ended, and no more activations and temporaries left"),),
        "STATES_AGREEMENT", refuses=_fsdp2_in_backward_refuses,
        not_applicable=_engine_not_applicable("fsdp2_in_backward")),
)

ROWS = {r.name: r for r in (*STRATEGY_ROWS, ZERO2_ROW, *ENGINE_ROWS, *PEER_ROWS, CAPTURE_ROW,
                            TRANSFORM_ROW, *MEMORY_ROWS, DRAWS_ROW)}
STRATEGIES = tuple(r.name for r in STRATEGY_ROWS if r.only_if is _always)
MEMORY_STRATEGIES = ("foreach", "in_backward", "zero2")
assert [r.name.removeprefix("engines/") for r in ENGINE_ROWS] == list(verdicts.ENGINES)
assert [r.name.removeprefix("engines/") for r in PEER_ROWS] == list(verdicts.PEERS)


def bound(name: str, workload: Workload, **context: Any) -> Any:
    """Row ``name``'s bound on ``workload``: the rule its entry names, of
    ``hookbench.measure.bounds`` (a function of the workload and ``context``, or a constant);
    the runners hold each row to this, so that changing a row's bound is an edit of its entry."""
    rule = getattr(bounds, ROWS[name].bound)
    return rule(workload, **context) if callable(rule) else rule


def row(key: str) -> Row:
    """The entry of a row key: ``name/engines/ddp`` -> ``engines/ddp``; a workload's name
    holds no "/" (``Workload`` refuses one)."""
    return ROWS[key.split("/", 1)[1]]


def refusal(workload: Workload, name: str) -> str | None:
    """Why row ``name`` (a strategy: "in_backward", "zero2") refuses ``workload`` by design."""
    entry = ROWS.get(name)
    return entry.refuses(workload) if entry else None


def not_applicable(workload: Workload, name: str) -> str | None:
    """Why row ``name`` does not apply to ``workload``, or None."""
    entry = ROWS.get(name)
    return entry.not_applicable(workload) if entry else None
