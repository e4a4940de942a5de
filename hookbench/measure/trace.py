"""Where a training step first changed, and what kind of change it is: a trace of a workload's
first steps, recorded with the baseline and compared on the gate.

``trace`` trains a workload with the standard step of one optimizer implementation (for-loop,
foreach, fused) and keeps, per step, digests (sha256 of the bytes) and float64 L2 norms of
the batch, the parameters before the step, every module call of the forward (what it was given,
from a pre-hook, and what it returned, from ``ActivationCapture``), in the order the calls end,
the loss, every parameter's gradient and every parameter after the step. ``locate`` compares
two traces and names the first place they part, with its kind:

    data            the batch: the batch function's arithmetic (its draws are pinned)
    initialisation  the parameters before the first step: the initialisers' arithmetic
    forward         the first module call, in the order calls end, whose output differs while
                    what it was given is as recorded: the module's arithmetic; given other
                    inputs while every call before it returned its recorded output: arithmetic
                    between the modules (a functional op in the parent's forward)
    loss            the loss function's arithmetic on the recorded outputs
    backward        after an identical forward, the first module output, as backward goes,
                    reached by another gradient (from ``ActivationCapture(grads=True)``),
                    else the first parameter whose gradient differs, in the model's order
                    reversed: backward's arithmetic
    optimizer step  the first parameter updated otherwise from identical gradients: that
                    implementation's arithmetic

``RankTrace`` traces a rank's steps under an engine or ZeRO-2 (its share of each batch, its
loss, what the engine handed each collective: DDP's buckets to its comm hook, FSDP2's
reduce-scatters; its gradients after them, its parameters after each step), and ``locate_ranks`` names where rank 0's steps first parted:

    data            the rank's share of the batch
    forward         the loss on the rank's share (kernels at the share's batch size)
    backward        what reached a collective (in call order) on an identical forward: the
                    rank's backward, or how the engine packs its gradients
    collective      the gradients after the collectives, where what reached them is as
                    recorded: the collective's arithmetic
    optimizer step  the parameters after the step from identical synced gradients

``rounding_floor`` measures how far kernel rounding alone moves the workload's parameters
over the same steps: every module's output, the gradient reaching it, and every parameter's
gradient moved, element by element, by ``KERNEL_ROUNDING_ULPS`` ulps of its largest value (a
ranks row's on the ranks' shares). A release that changed bits where kernels round otherwise
(a reordered sum) moves them no further than that; one that changed what is
computed (an epsilon, a mask, a formula) moves the tensor where it first changed by far more
than a rounding, which ``locate``'s norms show.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from hookbench.core.workload import Workload
from hookbench.mechanisms.activation_capture import ActivationCapture
from hookbench.measure.bounds import KERNEL_ROUNDING_ULPS, rounding_eps
from hookbench.measure.parity import training, wide

__all__ = ["STEPS", "RankTrace", "locate", "locate_ranks", "repro", "rounding_floor", "trace"]

STEPS = 3  # the steps the trajectory rows train
Mark = tuple[str, float]  # (digest, float64 L2 norm) of one or more tensors


def _tensors(value: Any) -> Any:
    """The tensors in ``value`` (nested); a sparse one (an embedding's gradient) as its
    indices and values."""
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor) and t.is_sparse:
            t = t.detach().coalesce()
            yield from (t.indices(), t.values())
        elif isinstance(t, torch.Tensor):
            yield t


def _mark(value: Any) -> Mark:
    """The digest of every tensor in ``value`` (nested), with their float64 L2 norm."""
    h, squares = hashlib.sha256(), 0.0
    for t in _tensors(value):
        t = t.detach().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        # a copy: numpy over a tensor's own storage makes it unresizable (DDP's bucket, which
        # batched PowerSGD then resizes)
        h.update(t.reshape(-1).view(torch.uint8).clone().numpy().tobytes())
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            squares += float(t.double().abs().square().sum() if not t.is_complex()
                             else t.abs().double().square().sum())
    return h.hexdigest()[:16], squares ** 0.5


def trace(workload: Workload, implementation: str = "forloop",
          steps: int = STEPS, catch: tuple[int, str, int] | None = None) -> dict[str, Any]:
    """``steps`` standard steps of ``workload`` with ``implementation`` on batch ``i``'s
    share 0 (as the trajectory rows train), traced as the module docstring says. ``catch``
    (step, module name, call), or (step, parameter name, -1): also keep what that call was
    given and the module (``"caught"``), or the parameter, its gradient and optimizer state
    before that step's update, and the optimizer (``repro``)."""
    cls, kwargs = workload.optimizer
    eager = workload.replace(compile=None)  # hooks see each module's call: compared eager
    out: dict[str, Any] = {"implementation": implementation, "steps": []}
    with training(eager, cls, kwargs, implementation) as run:
        model = run.model
        names = {id(m): n for n, m in model.named_modules() if n}
        for i in range(steps):
            seen: dict[str, Any] = {"before": {n: _mark(p) for n, p in model.named_parameters()}}
            x, y = eager.data(i)
            seen["data"] = _mark((x, y))
            given: dict[tuple[str, int], Mark] = {}
            calls: dict[str, int] = {}

            def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
                if torch._C._current_graph_task_id() != -1:
                    return  # checkpointing recomputing in backward: not a call of the step
                name = names[id(module)]
                call = calls.get(name, 0)
                calls[name] = call + 1
                given[name, call] = _mark((args, kwargs))
                if catch == (i, name, call):
                    # a copy: the step goes on to update the module's parameters in place
                    out["caught"] = {"module": _bare(module), "args": _copied(args),
                                     "kwargs": _copied(kwargs)}

            handles = [m.register_forward_pre_hook(pre, with_kwargs=True)
                       for n, m in model.named_modules() if n]
            # open through backward: it also records the gradient reaching each output
            with ActivationCapture(model, grads=True) as cap:
                try:
                    loss = eager.compute_loss(model, x, y, (i, 0))
                finally:
                    for handle in handles:
                        handle.remove()
                (loss if run.scale is None else run.scale(loss)).backward()
            ended: dict[tuple[str, int], list[Any]] = {}
            for r in cap.records:  # in the order calls ended
                ended.setdefault((r.name, r.call), []).append((r.value, r.grad))
            seen["calls"] = [(name, call, type(model.get_submodule(name)).__name__,
                              given.get((name, call), ("", 0.0)),
                              _mark([v for v, _ in tensors]))
                             for (name, call), tensors in ended.items()]
            # the gradient reaching each call's output, latest call first (as backward goes)
            seen["reached"] = [(name, call, type(model.get_submodule(name)).__name__,
                                _mark([g for _, g in tensors if g is not None]))
                               for (name, call), tensors in reversed(ended.items())]
            seen["loss"] = _mark(loss)
            seen["grads"] = {n: _mark(p.grad) if p.grad is not None else None
                             for n, p in model.named_parameters()}
            if catch is not None and catch[0] == i and catch[2] == -1:
                p = model.get_parameter(catch[1])
                group = next(g for g in run.optimizer.param_groups
                             if any(q is p for q in g["params"]))
                out["caught"] = {"parameter": p.detach().clone(), "grad": p.grad.clone(),
                                 "state": _copied(dict(run.state_of(p))),
                                 "options": {k: v for k, v in group.items() if k != "params"},
                                 "class": type(run.optimizer)}
            run.optimizer_step()
            seen["after"] = {n: _mark(p) for n, p in model.named_parameters()}
            out["steps"].append(seen)
    return out


def _first(was: dict[str, Mark | None], now: dict[str, Mark | None]) -> str | None:
    return next((n for n in was if was[n] != now.get(n)), None) or next(
        (n for n in now if n not in was), None)


def _norms(was: Mark | None, now: Mark | None) -> str:
    return (f"L2 {was[1]:.9g} recorded, {now[1]:.9g} now" if was and now
            else f"{'none' if was is None else 'one'} recorded, "
                 f"{'none' if now is None else 'one'} now")


def locate(was: dict[str, Any], now: dict[str, Any]) -> dict[str, str] | None:
    """Where trace ``now`` first parts from the recorded ``was`` (None: nowhere): the step,
    the phase, where in it, and the kind of change, with the words."""
    impl = was["implementation"]
    for step, (a, b) in enumerate(zip(was["steps"], now["steps"])):
        def found(phase: str, where: str, kind: str, words: str,
                  marks: tuple[Mark | None, Mark | None] = (None, None)) -> dict[str, Any]:
            # the float64 L2 norms, recorded and now, of what first changed: how large the
            # change is where it happened, before training amplifies it
            return {"step": str(step), "phase": phase, "where": where, "kind": kind,
                    "words": f"first changed at step {step}, {phase}: {words}: {kind}",
                    "norms": tuple(m[1] if m else None for m in marks)}

        if a["data"] != b["data"]:
            return found("data", "the batch", "arithmetic of the batch function",
                         f"the batch ({_norms(a['data'], b['data'])})", (a["data"], b["data"]))
        if (name := _first(a["before"], b["before"])) is not None:
            marks = a["before"].get(name), b["before"].get(name)
            return found("initialisation", name, "arithmetic of the initialisation",
                         f"{name} ({_norms(*marks)})", marks)
        for (n, c, cls, given_a, out_a), (m, d, _, given_b, out_b) in zip(a["calls"], b["calls"]):
            if (n, c) != (m, d):
                return found("forward", n, "another forward",
                             f"the forward calls {m} (call {d}) where it called {n} (call {c})")
            if out_a != out_b:
                if given_a == given_b:
                    return found("forward", n, f"arithmetic of a module ({cls})",
                                 f"module {n} ({cls}, call {c}) given its recorded inputs "
                                 f"returns another output ({_norms(out_a, out_b)})",
                                 (out_a, out_b))
                return found("forward", n, "arithmetic between modules",
                             f"module {n} ({cls}, call {c}) is given other inputs while every "
                             f"call before it returned its recorded output (an op in its "
                             f"parent's forward)", (given_a, given_b))
        if len(a["calls"]) != len(b["calls"]):
            return found("forward", "the module calls", "another forward",
                         f"{len(b['calls'])} module calls where {len(a['calls'])} were recorded")
        if a["loss"] != b["loss"]:
            return found("loss", "the loss", "arithmetic of the loss",
                         f"the loss of the recorded outputs ({_norms(a['loss'], b['loss'])})",
                         (a["loss"], b["loss"]))
        # backward: the first module output, as backward goes, reached by another gradient;
        # what made it is the backward of the module that took that output in the forward
        ahead = None
        for (n, c, cls, got_a), (_, _, _, got_b) in zip(a.get("reached", ()),
                                                        b.get("reached", ())):
            if got_a != got_b:
                after = (f" while the output of {ahead[0]} ({ahead[1]}), after it, got its "
                         f"recorded gradient" if ahead else "")
                return found("backward", n, "arithmetic of backward",
                             f"the gradient reaching the output of module {n} ({cls}, call "
                             f"{c}) after the recorded forward{after} "
                             f"({_norms(got_a, got_b)})", (got_a, got_b))
            ahead = (n, cls)
        # backward reaches the parameters about in reverse: the last layer's gradient first
        if (name := _first(dict(reversed(a["grads"].items())), b["grads"])) is not None:
            marks = a["grads"].get(name), b["grads"].get(name)
            return found("backward", name, "arithmetic of backward",
                         f"the gradient of {name} after the recorded forward "
                         f"({_norms(*marks)})", marks)
        if (name := _first(a["after"], b["after"])) is not None:
            marks = a["after"].get(name), b["after"].get(name)
            return found("optimizer step", name,
                         f"arithmetic of the optimizer ({impl})",
                         f"{name} updated otherwise from its recorded gradient by the "
                         f"{impl} step ({_norms(*marks)})", marks)
    return None


def _local(t: Any) -> Any:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


class RankTrace:
    """A rank's steps, for ``locate_ranks``: told what reaches each collective the engine
    calls (``reach``, in call order), each micro-batch (``micro``), the gradients after a
    synced backward (``synced``) and the parameters after each step (``stepped``). ``steps``
    is what a rank returns. The engines tell it where they hand a collective its tensors,
    rather than a dispatch mode over all of backward, which would call Python on every op."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._reached: list[tuple[str, Mark]] = []

    def reach(self, collective: str, tensors: Any) -> None:
        """What the engine hands ``collective``, as handed: an in-place one overwrites it."""
        self._reached.append((collective, _mark([_local(t) for t in tree_leaves(tensors)
                                                 if isinstance(t, torch.Tensor)])))

    def micro(self, batch: Any, loss: torch.Tensor) -> None:
        if not self.steps or "after" in self.steps[-1]:
            self.steps.append({"micro": []})
        self.steps[-1]["micro"].append({"data": _mark(batch), "loss": _mark(loss),
                                        "reached": self._reached})
        self._reached = []

    def synced(self, grads: dict[str, Any]) -> None:
        self.steps[-1]["synced"] = {n: None if g is None else _mark(_local(g))
                                    for n, g in grads.items()}

    def stepped(self, model: nn.Module) -> None:
        self.steps[-1]["after"] = {n: _mark(_local(p)) for n, p in model.named_parameters()}


def locate_ranks(was: list[dict[str, Any]], now: list[dict[str, Any]]
                 ) -> dict[str, Any] | None:
    """Where rank 0's traced steps ``now`` (``RankTrace.steps``) first part from the recorded
    ``was`` (None: nowhere), as ``locate`` says it."""
    for step, (a, b) in enumerate(zip(was, now)):
        def found(phase: str, where: str, kind: str, words: str,
                  marks: tuple[Mark | None, Mark | None] = (None, None)) -> dict[str, Any]:
            return {"step": str(step), "phase": phase, "where": where, "kind": kind,
                    "words": f"on the ranks, first changed at step {step}, {phase}: {words}: "
                             f"{kind}", "norms": tuple(m[1] if m else None for m in marks),
                    "on_ranks": True}

        for m, (x, y) in enumerate(zip(a["micro"], b["micro"])):
            if x["data"] != y["data"]:
                return found("data", "rank 0's share", "arithmetic of the batch function",
                             f"rank 0's share of micro-batch {m} ({_norms(x['data'], y['data'])})",
                             (x["data"], y["data"]))
            if x["loss"] != y["loss"]:
                return found("forward", "rank 0's loss", "arithmetic of the forward on a "
                             "rank's share", f"rank 0's loss on micro-batch {m} "
                             f"({_norms(x['loss'], y['loss'])})", (x["loss"], y["loss"]))
            for c, ((op, got_a), (op_b, got_b)) in enumerate(zip(x["reached"], y["reached"])):
                if op != op_b:
                    return found("backward", f"collective {c}", "another collective",
                                 f"rank 0's backward calls {op_b} where it called {op}")
                if got_a != got_b:
                    return found("backward", f"collective {c} ({op})", "arithmetic of "
                                 "backward on a rank's share", f"what reached collective {c} "
                                 f"({op}) on micro-batch {m} after the recorded forward "
                                 f"({_norms(got_a, got_b)})", (got_a, got_b))
            if len(x["reached"]) != len(y["reached"]):
                return found("backward", "the collectives", "another collective",
                             f"rank 0's backward calls {len(y['reached'])} collectives where "
                             f"{len(x['reached'])} were recorded")
        if (name := _first(a.get("synced", {}), b.get("synced", {}))) is not None:
            marks = a["synced"].get(name), b["synced"].get(name)
            ops = sorted({op for x in a["micro"] for op, _ in x["reached"]})
            if not ops:  # no engine told what reached them: not told apart
                return found("backward or collective", name, "arithmetic of backward on a "
                             "rank's share or of its collectives", f"the gradient of {name} "
                             f"after the collectives ({_norms(*marks)})", marks)
            return found("collective", name, f"arithmetic of a collective "
                         f"({', '.join(ops)})", f"the gradient of {name} after the "
                         f"collectives, handed what was recorded ({_norms(*marks)})", marks)
        if (name := _first(a["after"], b["after"])) is not None:
            marks = a["after"].get(name), b["after"].get(name)
            return found("optimizer step", name, "arithmetic of the optimizer on a rank",
                         f"{name} updated otherwise from its recorded synced gradient "
                         f"({_norms(*marks)})", marks)
    return None


Micro = Callable[[int], list[tuple[Any, tuple[int, int]]]]  # step -> [(batch, key), ...]


def rounding_floor(workload: Workload, implementation: str = "forloop", steps: int = STEPS,
                   micro: Micro | None = None) -> dict[str, float]:
    """How far kernel rounding alone moves ``workload``'s parameters in ``steps`` standard
    steps of ``implementation`` (as ``trace`` trains them): per parameter, the largest
    |perturbed - clean| element after the last step (``name``), and the float64 L2 norm of
    perturbed - clean (``name#norm``: the most the change can move the norm a baseline
    stores), where the perturbed run moves every module's output and the gradient reaching
    it (``_rounding_everywhere``) and every parameter's gradient after each backward,
    element by element, by +-``KERNEL_ROUNDING_ULPS`` x eps (``bounds.rounding_eps``) x the
    tensor's largest |value| (signs from a fixed generator, not torch's default one).

    ``micro``: step i's micro-batches, each with its key, whose losses are divided by their
    number (a ranks row: every rank's share, as ``parity``'s ``step_on`` steps on them, so
    that BatchNorm over a share amplifies a rounding as it does on the ranks); by default
    the whole batch i."""
    cls, kwargs = workload.optimizer
    eager = workload.replace(compile=None)
    micro = micro or (lambda i: [(eager.data(i), (i, 0))])
    # an ulp of the lowest precision in play: under bf16 autocast a forward that rounds
    # otherwise moves the fp32 gradients by a bf16 ulp, not a float32 one
    eps = rounding_eps(workload)
    finals = []
    for perturbed in (False, True):
        signs = torch.Generator().manual_seed(0)
        with training(eager, cls, kwargs, implementation) as run, contextlib.ExitStack() as on:
            if perturbed:
                on.enter_context(_rounding_everywhere(run.model, eps, signs))
            for i in range(steps):
                batches = micro(i)
                for (x, y), key in batches:
                    loss = eager.compute_loss(run.model, x, y, key) / len(batches)
                    (loss if run.scale is None else run.scale(loss)).backward()
                for p in run.model.parameters() if perturbed else ():
                    if p.grad is not None and not p.grad.is_sparse:
                        p.grad.copy_(_rounded(p.grad, eps, signs))
                run.optimizer_step()
            finals.append({n: wide(p.detach()).clone()
                           for n, p in run.model.named_parameters()})
    clean, moved = finals
    floor = {}
    for name, value in clean.items():
        floor[name] = float((moved[name] - value).abs().max()) if value.numel() else 0.0
        # |norm(a) - norm(b)| <= norm(a - b): what the same change may do to a stored norm
        floor[f"{name}#norm"] = float((moved[name] - value).norm())
    return floor


def _rounded(t: torch.Tensor, eps: float, signs: torch.Generator) -> torch.Tensor:
    """``t`` with every nonzero element moved by +-``KERNEL_ROUNDING_ULPS`` x ``eps`` x its
    largest |value|: what a kernel summing in another order may give (an exact zero stays: a
    sum of zeros is zero in any order)."""
    if not (t.is_floating_point() or t.is_complex()) or not t.numel():
        return t
    ulp = eps * float(t.detach().abs().max())
    # the floor's own draws, out of the sight of a draws session replaying the workload's
    # (it would name them as draws the baseline lacks)
    with _disable_current_modes():
        sign = torch.randint(0, 2, t.shape, generator=signs).to(t) * 2 - 1
    return t + sign * (t != 0) * (KERNEL_ROUNDING_ULPS * ulp)


@contextlib.contextmanager
def _rounding_everywhere(model: nn.Module, eps: float, signs: torch.Generator):
    """Every module that computes (a leaf, or one with parameters of its own, as
    ``nn.MultiheadAttention``) returns its output ``_rounded``, and the gradient reaching that
    output is ``_rounded`` in backward: each kernel of another release rounding otherwise,
    forward and backward. Where BatchNorm over a small batch amplifies a rounding inside
    backward, moving the parameters' gradients alone after it misses that (timm's MobileNetV3
    on a share of 1 image: 792x such a floor on 2.9.1 against 2.6.0)."""
    def rounded(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            return t
        t = _rounded(t, eps, signs)
        if t.requires_grad:
            t.register_hook(lambda g: _rounded(g, eps, signs))
        return t

    handles = [m.register_forward_hook(lambda m, args, out: tree_map(rounded, out))
               for m in model.modules()
               if not list(m.children()) or any(True for _ in m.parameters(recurse=False))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _bare(module: nn.Module) -> nn.Module:
    """A copy of ``module`` without the hooks on it (this trace's, a capture's): what the
    module computes, and nothing that would not load beside torch alone."""
    bare = copy.deepcopy(module)
    for m in bare.modules():
        for name, value in vars(m).items():
            if "hooks" in name and isinstance(value, dict):
                value.clear()
    return bare


def _copied(value: Any) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


_SCRIPT = """\
# A change torch {now} makes against torch {was}, found by hookbench's gate ({row}):
#   {words}
# It imports only torch; {files} beside it hold what {what} was given, as recorded.
# Run it on both releases: the digest printed differs between them.
import hashlib
import sys
from pathlib import Path

import torch

here = Path(__file__).resolve().parent
{body}
out = out.detach().cpu()
digest = hashlib.sha256(f"{{out.dtype}}{{tuple(out.shape)}}".encode()
                        + out.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
digest = digest.hexdigest()[:16]  # as hookbench's trace marks a tensor
print(f"torch {{torch.__version__}}: {what} gives sha256 {{digest}}, L2 "
      f"{{float(out.double().norm()):.9g}}")
print("torch {was} recorded sha256 {recorded}, L2 {norm:.9g}")
sys.exit(0 if digest == "{recorded}" else 1)
"""


def repro(workload: Workload, implementation: str, found: dict[str, Any], was: dict[str, Any],
          folder: Path, row: str, torch_was: str) -> Path | None:
    """A standalone script reproducing a change ``locate`` ``found`` in one module's forward or
    one parameter's optimizer step, with what it was given beside it (as recorded: everything
    before it matched), into ``folder``; None where the change is elsewhere, or the module is
    not torch's own (the script would need the user's code), or it is on the ranks."""
    if found.get("on_ranks"):
        return None  # what a rank was given is not kept: no script stands alone for it
    step = int(found["step"])
    recorded_steps = was["steps"][step]
    stem = f"{workload.name}-{row}".replace("/", "-")
    if found["phase"] == "forward" and found["kind"].startswith("arithmetic of a module"):
        name, call = found["where"], next(c for n, c, *_ in recorded_steps["calls"]
                                          if n == found["where"])
        got = trace(workload, implementation, step + 1, catch=(step, name, call))["caught"]
        if not type(got["module"]).__module__.startswith("torch."):
            return None
        recorded = next(o for n, c, _, _, o in recorded_steps["calls"] if (n, c) == (name, call))
        saved = {"module": got["module"], "args": got["args"], "kwargs": got["kwargs"]}
        what = f"module {name} ({type(got['module']).__name__}, call {call})"
        body = (f"saved = torch.load(here / '{stem}.pt', weights_only=False)\n"
                f"out = saved['module'](*saved['args'], **saved['kwargs'])")
    elif found["phase"] == "optimizer step":
        got = trace(workload, implementation, step + 1, catch=(step, found["where"], -1))
        got, cls = got["caught"], got["caught"].pop("class")
        if getattr(torch.optim, cls.__name__, None) is not cls:
            return None  # not torch's own: the script would need the user's code
        saved = got
        recorded = recorded_steps["after"][found["where"]]
        what = f"the {implementation} step of {found['where']}"
        body = textwrap.dedent(f"""\
            saved = torch.load(here / '{stem}.pt', weights_only=False)
            p = torch.nn.Parameter(saved['parameter'])
            p.grad = saved['grad']
            opt = torch.optim.{cls.__name__}([p], **saved['options'])
            if saved['state']:
                opt.state[p] = saved['state']
            opt.step()
            out = p""")
    else:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(saved, folder / f"{stem}.pt")
    script = folder / f"{stem}.py"
    script.write_text(_SCRIPT.format(now=torch.__version__, was=torch_was, row=row,
                                     words=found["words"], files=f"{stem}.pt", what=what,
                                     body=body, recorded=recorded[0], norm=recorded[1]))
    return script
