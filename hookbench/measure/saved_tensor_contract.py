"""The saved-tensor-hook behaviours that activation offload (``hookbench.mechanisms.activation_offload``)
relies on, as checks, and the gate's offload rows.

Each check builds a tiny graph under ``torch.autograd.graph.saved_tensors_hooks`` and raises
``ContractViolation`` when PyTorch behaves differently from what is pinned here; ``run_all``
runs them (``hookbench gate``'s offload section records and compares them, as the hooks
section does the hook contract). ``offload_rows`` checks the mechanism itself live: lossless
offload bit for bit per strategy, each compression within its derived bound, and one step's
memory with offload on the fake backend.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.autograd.graph import disable_saved_tensors_hooks, saved_tensors_hooks
import torch.utils.checkpoint

from hookbench.core.prerequisites import attempt
from hookbench.core.workload import of
from hookbench.measure import hook_contract
from hookbench.measure.hook_contract import ContractViolation, _expect
from hookbench.measure.memory import measure
from hookbench.measure.parity import compare, trajectory
from hookbench.mechanisms.activation_offload import ActivationOffload
from hookbench.models.zoo import TinySpec
from hookbench.models.zoo import workload as zoo_workload

__all__ = ["CHECKS", "OFFLOAD_STRATEGIES", "offload_rows", "run_all"]


class _Counting(saved_tensors_hooks):
    """Identity hooks that note every pack and unpack, with an id per saved tensor."""

    def __init__(self) -> None:
        self.packs: list[int] = []
        self.unpacks: list[int] = []
        self.tensors: list[torch.Tensor] = []
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> int:
        self.packs.append(len(self.tensors))
        self.tensors.append(t)
        return self.packs[-1]

    def _unpack(self, i: int) -> torch.Tensor:
        self.unpacks.append(i)
        return self.tensors[i]


def _x(*shape: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, torch.Size(shape).numel()).reshape(shape).requires_grad_()


def pack_once_per_saved_tensor() -> None:
    """Pack runs once for each tensor a backward formula saves: sin saves its input (1), mul
    saves both operands (2, also when they are one tensor)."""
    x = _x(8)
    for build, want in ((lambda: x.sin(), 1), (lambda: x * (x + 1), 2), (lambda: x * x, 2)):
        with (hooks := _Counting()):
            build()
        _expect(len(hooks.packs) == want, f"{len(hooks.packs)} packs, expected {want}")


def unpack_once_per_use_last_packed_first() -> None:
    """Backward unpacks each saved tensor once, the last op's first (a chain of three ops)."""
    x = _x(8)
    with (hooks := _Counting()):
        loss = x.sin().exp().tanh().sum()
    loss.backward()
    _expect(hooks.unpacks == hooks.packs[::-1],
            f"unpacked {hooks.unpacks} for packs {hooks.packs}, expected the reverse")


def unpack_returns_what_pack_kept() -> None:
    """Backward computes with what unpack returns: the identity gives the plain gradient."""
    x = _x(8)
    x.sin().pow(2).sum().backward()
    plain, x.grad = x.grad, None
    with _Counting():
        loss = x.sin().pow(2).sum()
    loss.backward()
    _expect(torch.equal(x.grad, plain), "the gradient under identity hooks differs")


def retained_graph_unpacks_again() -> None:
    """A graph kept with retain_graph=True unpacks every saved tensor again in a second
    backward (an offload that freed its copy at the first unpack would fail here)."""
    x = _x(8)
    with (hooks := _Counting()):
        loss = x.sin().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    _expect(hooks.unpacks == [0, 0], f"unpacks {hooks.unpacks}, expected [0, 0]")


def non_reentrant_checkpoint_hooks_take_precedence() -> None:
    """Inside a non-reentrant checkpoint its own hooks are innermost: of the 5 tensors the
    block saves the outer hooks see one, its input (kept to recompute it from), and beside it
    what is saved outside the block (sin's input). Empty tensors aside: torch up to 2.11 saves
    its inputs through an autograd.Function with an empty placeholder, which the outer hooks
    see too (removed by pytorch#174327); an offload keeps it, as every tensor below its
    threshold."""
    x = _x(4, 8)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    with (hooks := _Counting()):
        loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sin().sum()
    loss.backward()
    seen = [t for t in hooks.tensors if t.numel()]
    _expect(len(seen) == 2 and seen[0] is x,
            f"the outer hooks packed {len(seen)} non-empty tensors, expected 2 (the block's "
            f"input, then sin's input outside the block)")


def _against_plain(block: nn.Module, use_reentrant: bool) -> str | None:
    """What of one step differs when ``block`` runs under ``checkpoint`` from its plain step on
    the same random numbers: "the gradients", "the loss and the gradients", or None."""
    x = _x(4, 8)
    got = []
    for checkpointed in (False, True):
        with torch.random.fork_rng():  # the forward's draws; the recompute restores them
            torch.manual_seed(0)
            out = (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=use_reentrant)
                   if checkpointed else block(x))
        loss = out.pow(2).sum()
        leaves = [x, *block.parameters()]
        for t in leaves:
            t.grad = None
        loss.backward()  # not autograd.grad: the reentrant variant refuses it
        got.append((loss.detach(), [t.grad for t in leaves]))
    (plain_loss, plain), (loss, grads) = got
    if all(torch.equal(a, b) for a, b in zip(grads, plain)) and torch.equal(loss, plain_loss):
        return None
    return "the gradients" if torch.equal(loss, plain_loss) else "the loss and the gradients"


def checkpoint_recomputes_the_forward() -> None:
    """A checkpointed block with dropout gives its plain step's loss and gradients bit for
    bit, non-reentrant and reentrant: the recompute runs on the RNG state the forward drew
    from (``preserve_rng_state``), so it draws the same mask. Workloads' checkpointing and
    their ``transform`` rows (``hookbench.gate.workload_checks.transform``) rely on it."""
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 8))
    for reentrant in (False, True):
        differ = _against_plain(block, reentrant)
        _expect(differ is None, f"under checkpoint(use_reentrant={reentrant}) {differ} differ "
                                f"from the plain step's")


def rrelu_under_checkpoint_matches_the_plain_step() -> None:
    """``nn.RReLU`` in training draws a slope per element and saves it for backward. Under
    non-reentrant checkpointing torch leaves the recompute's noise unwritten (pytorch#193671,
    open), so the gradients are wrong while the loss is bit for bit (2.3e14 away on 2.14.1):
    a known failure where it reproduces, reported FIXED by a release that fixes it. Seen only
    where RReLU ends the block (a conv, a norm and an RReLU): the recompute stops once it has
    what backward needs, before the kernel has filled the noise it saved; after another layer
    it runs to the end."""
    block = nn.Sequential(nn.Linear(8, 8), nn.RReLU(0.1, 0.9))
    differ = _against_plain(block, use_reentrant=False)
    _expect(differ is None, f"under checkpoint(use_reentrant=False) {differ} differ from the "
                            f"plain step's (pytorch#193671)")


def disabled_hooks_refuse_in_their_message() -> None:
    """Entering saved-tensor hooks under disable_saved_tensors_hooks raises its message."""
    try:
        with disable_saved_tensors_hooks("no hooks in this region"):
            with _Counting():
                pass
    except RuntimeError as e:
        _expect("no hooks in this region" in str(e), f"raised without the message: {e}")
        return
    raise ContractViolation("saved-tensor hooks were accepted inside disable_saved_tensors_hooks")


def no_version_check_under_hooks() -> None:
    """Autograd checks no version counter under saved-tensor hooks: an in-place change after
    save reaches backward silently (so ActivationOffload checks it itself). Pinned: a torch
    that checks again fails this, to be noticed."""
    x = _x(8)
    with _Counting():
        y = x * 2
        w = y.sin()
        y.add_(1)
    try:
        w.sum().backward()
    except RuntimeError as e:
        raise ContractViolation(f"torch now checks versions under hooks: {e}") from None


def _compiled(backend: str) -> None:
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        x = _x(4, 8)
        block(x).square().sum().backward()
        plain = [p.grad.clone() for p in block.parameters()]
        block.zero_grad()
        compiled = torch.compile(block, backend=backend)
        with (hooks := _Counting()):
            loss = compiled(x).square().sum()
        loss.backward()
        # Real tensors only, each unpacked once: an offload that also copied what the compiler
        # traces (FakeTensors, never unpacked) would hold copies of tensors that do not exist.
        traced = sum(isinstance(t, (FakeTensor, FunctionalTensor)) for t in hooks.tensors)
        _expect(len(hooks.packs) > 0 and not traced
                and sorted(hooks.unpacks) == hooks.packs,
                f"compiled ({backend}): {len(hooks.packs)} packs ({traced} of them the "
                f"tracer's fake or functional tensors, pytorch#113263), {len(hooks.unpacks)} "
                f"unpacks of {len(set(hooks.unpacks))} of them; expected each packed real "
                f"tensor unpacked once")
        close = torch.equal if backend == "eager" else (
            lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
        _expect(all(close(p.grad, q) for p, q in zip(block.parameters(), plain)),
                f"compiled ({backend}): gradients under identity hooks differ")
    finally:
        torch._dynamo.reset()


def compiled_eager_runs_the_hooks() -> None:
    """torch.compile(backend="eager") saves through the hooks, real tensors only, each
    unpacked once; gradients bit for bit."""
    _compiled("eager")


def compiled_inductor_runs_the_hooks() -> None:
    """torch.compile(backend="inductor") saves through the hooks too (AOTAutograd's saved
    tensors), real tensors only, each unpacked once; gradients within the foreach tolerance."""
    _compiled("inductor")


CHECKS: list[Callable[[], None]] = [
    pack_once_per_saved_tensor,
    unpack_once_per_use_last_packed_first,
    unpack_returns_what_pack_kept,
    retained_graph_unpacks_again,
    non_reentrant_checkpoint_hooks_take_precedence,
    checkpoint_recomputes_the_forward,
    rrelu_under_checkpoint_matches_the_plain_step,
    disabled_hooks_refuse_in_their_message,
    no_version_check_under_hooks,
    compiled_eager_runs_the_hooks,
    compiled_inductor_runs_the_hooks,
]


def run_all() -> dict[str, str | None]:
    """Every check's name and None when it holds, or what went wrong."""
    return hook_contract.run_all(CHECKS)


# -- the mechanism, live -------------------------------------------------------------------------

# Activations of 16 x 64 float32 (4 KB): above ActivationOffload's 1 KB, so they are offloaded
PARITY_SPEC = TinySpec(depth=3, width=64, batch_size=16)
OFFLOAD_STRATEGIES = ("forloop", "in_backward", "in_backward_grouped_foreach")
# bfloat16 keeps 8 significant bits: half an ulp, 2**-8 of the value; int8 with a per-tensor
# scale s = max|x| / 127: s / 2 (hookbench.mechanisms.activation_offload)
_BOUND = {"bf16": lambda x: 2.0**-8 * x.abs(),
          "int8": lambda x: torch.full_like(x, float(x.abs().max()) / 254)}


def _lossless(strategy: str) -> dict[str, Any]:
    spec, adam = of(PARITY_SPEC), (torch.optim.Adam, {"lr": 1e-2})
    result = compare(trajectory(spec.replace(offload="lossless"), *adam, strategy, steps=3),
                     trajectory(spec, *adam, strategy, steps=3))
    return {"ok": result.bit_exact, "verdict": f"vs without offload: {result.verdict()}"}


def _compressed(mode: str) -> dict[str, Any]:
    """A linear layer's weight gradient, dW = g^T x, with x compressed: off by at most
    |g|^T e for e the mode's elementwise bound, plus float32 rounding (1e-5 of |g|^T |x|);
    a large mean and a small spread, the hard case for a per-tensor scale."""
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 32)
    x, g = 1e3 + torch.randn(16, 64, generator=gen), torch.randn(16, 32, generator=gen)
    grads = []
    for offload in (None, ActivationOffload(lin, compress=mode)):
        lin.zero_grad()
        with offload if offload is not None else saved_tensors_hooks(lambda t: t, lambda t: t):
            out = lin(x)
        out.backward(g)
        grads.append(lin.weight.grad.clone())
    exact, approx = grads
    bound = g.abs().t() @ _BOUND[mode](x) + 1e-5 * (g.abs().t() @ x.abs())
    ratio = float(((approx - exact).abs() / bound).max())
    return {"ok": ratio <= 1 and not torch.equal(approx, exact),
            "verdict": f"weight gradient within {ratio:.3g}x its bound"}


def _memory() -> dict[str, Any]:
    r = measure(zoo_workload("transformer").replace(offload="lossless"), "in_backward")
    return {"peak": r.peak, "host_peak": r.host_peak, "breakdown": r.peak_breakdown,
            "gradients_alive_max": r.gradients_alive_max}


def offload_rows() -> dict[str, Any]:
    """The mechanism live: ``lossless/<strategy>``, ``<mode>`` per compression and
    ``memory/transformer/in_backward`` (its peak and host peak, to compare with the
    baseline)."""
    rows: dict[str, Any] = {f"lossless/{s}": attempt(lambda s=s: _lossless(s))
                            for s in OFFLOAD_STRATEGIES}
    rows.update({mode: attempt(lambda mode=mode: _compressed(mode)) for mode in _BOUND})
    rows["memory/transformer/in_backward"] = attempt(_memory)
    return rows
