"""Random draws pinned across torch releases: every random op a workload's build, batch and
forward make is recorded with the baseline and replayed on the gate, so that what the gate
compares does not depend on how a release draws its random numbers (torch 2.9.1 draws other
dropout masks than 2.6.0 for the same seed), while a broken random op still fails.

A draw is keyed by where it happens in its generator's stream: the state of the generator it
draws from (torch's default generator of its device, or the one passed to it), the op, the
shape and dtype of what it makes, and what it reads: the values of its tensors (a probability,
a sign pattern) and its numbers (a mean and std, bounds, a probability). That key is the same
on every release that seeds alike (``manual_seed``: the Mersenne Twister's state from a seed
has not changed), whatever the release then draws.
Replaying a draw hands back the recorded values and leaves the generator in the state the
recorded release left it in, so the draws after it keep their recorded keys. A checkpointed
block's recomputation in backward (``torch.utils.checkpoint``, the workload's own or one the
model turns on itself, like Hugging Face's ``gradient_checkpointing_enable()``) restores the
state its forward saw, and is pinned as that forward was: it finds the same draws, where
drawing anew would give it this release's mask while its forward had the recorded one.

What is not replayed is named, never silently drawn anew: an op whose values are not all
draws (``native_dropout``, a fused attention kernel that draws inside it), a draw the baseline
did not record (other inputs, shapes or dtypes), a compiled forward (its draws are inside the
compiled graph). Replayed draws are still made, and held to the recorded ones
(``Session.report``): the same distribution (a dropout dropping half its inputs at p=0.1
fails), and as dependent on the generator's state (a mask that is the same whatever the
seed fails), each naming the op.

    recording()          a session recording every draw made inside ``pinned``
    replaying(draws)     a session handing the recorded ``draws`` back
    pinned(name, ...)    the context a Workload opens around its build, batch and forward
    ENV                  the variable naming a draws file a spawned rank replays
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
from collections import Counter, defaultdict
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from hookbench.core.prerequisites import write_bytes

__all__ = ["ENV", "Session", "active", "load", "pinned", "recording", "replaying", "save"]

ENV = "HOOKBENCH_DRAWS"
# Ops every value of whose output is a draw (given the arguments in the key): replayed by
# handing back the recorded values. ``rrelu_with_noise`` draws its noise and multiplies: its
# noise is replayed and its output made again from it (input x noise, as its kernel does).
_PURE = frozenset(f"aten::{op}" for op in (
    "bernoulli", "bernoulli_", "uniform_", "normal_", "normal", "randn", "randn_like", "rand",
    "rand_like", "randint", "randint_like", "randperm", "random_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "multinomial", "poisson"))
_NOISE = "aten::rrelu_with_noise"
SIGMAS = 6.0  # a distribution check fails beyond 6 standard errors: ~2e-9 by chance
# A draw that ignores the seed fails where the recorded draws' own distribution would give
# every fresh draw alike with a smaller chance than this (8 distinct masks: 8^-7, 4.8e-7)
ALIKE = 1e-6


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    # a copy: numpy over a tensor's own storage would make it unresizable
    return hashlib.sha256(raw.clone().numpy().tobytes()).hexdigest()[:16]


def _generator(args: tuple, kwargs: dict) -> torch.Generator:
    """The generator an op draws from: the one passed, else its device's default."""
    if kwargs.get("generator") is not None:
        return kwargs["generator"]
    device = next((t.device for t in tree_leaves(args) if torch.is_tensor(t)),
                  torch.device(kwargs.get("device") or "cpu"))
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


class Session(TorchDispatchMode):
    """Draws recorded (``draws`` filled) or replayed (``draws`` given), and what was seen, per
    workload name (``report``)."""

    def __init__(self, draws: dict[str, dict[str, Any]] | None = None):
        super().__init__()
        self.replaying = draws is not None
        self.draws: dict[str, dict[str, Any]] = {} if draws is None else draws
        self.name = ""  # the workload whose draws are being made
        self.last = ""  # the workload whose eager forward ran last: what backward recomputes
        self.seen: dict[str, dict[str, Any]] = defaultdict(lambda: {
            "draws": 0, "differ": 0, "not_recorded": {}, "not_replayable": {},
            "stats": defaultdict(lambda: [[0, 0.0, 0.0, 0.0, 0.0], [0, 0.0, 0.0, 0.0, 0.0]]),
            "by_key": {},
            "counted": set()})

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        name = func._schema.name
        arguments = [a.name for a in func._schema.arguments]
        if "dropout_p" in arguments:  # an attention kernel: at dropout_p=0 it draws nothing
            at = arguments.index("dropout_p")
            if not kwargs.get("dropout_p", args[at] if at < len(args) else 0.0):
                return func(*args, **kwargs)
        gen = _generator(args, kwargs)
        before = gen.get_state()
        out = func(*args, **kwargs)  # the draw this release makes
        if any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta
               for t in tree_leaves((out, args, kwargs)) if isinstance(t, torch.Tensor)):
            return out  # fake or meta tensors (a memory measurement): no values drawn
        seen = self.seen[self.name]
        if name not in _PURE and name != _NOISE:
            seen["not_replayable"][name] = seen["not_replayable"].get(name, 0) + 1
            return out
        drawn = args[1] if name == _NOISE else out  # what is drawn
        # the session's keys, copies and comparisons on the host, out of sight of every mode
        # below it: a memory measurement counts the step's storage, not the session's
        with _disable_current_modes():
            if not self._pinned(seen, name, gen, before, drawn, args, kwargs):
                return out
        return args[0] * drawn if name == _NOISE else out

    def _pinned(self, seen: dict, name: str, gen: torch.Generator, before: torch.Tensor,
                drawn: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        """The draw recorded, or replayed into ``drawn`` in place (True); False where it
        stays as drawn (recording, or a draw the baseline did not record)."""
        read = args[:1] if name == _NOISE else args[1:] if name.endswith("_") else args
        # what it reads: tensors by their values, numbers as given (normal_'s std: two inits
        # with another std at the same state draw other values; keyed alike, the second got
        # the first's, a Llama's o_proj at half its std)
        key = "|".join([name, str(tuple(drawn.shape)), str(drawn.dtype), _digest(before),
                        *(_digest(t) if torch.is_tensor(t) else repr(t)
                          for t in tree_leaves((read, kwargs))
                          if not isinstance(t, torch.Generator))])
        seen["draws"] += 1
        if not self.replaying:
            self.draws.setdefault(key, {"value": drawn.detach().cpu().clone(),
                                        "after": gen.get_state()})
            return False
        recorded = self.draws.get(key)
        if recorded is None:
            seen["not_recorded"][name] = seen["not_recorded"].get(name, 0) + 1
            return False
        fresh, value = drawn.detach().cpu(), recorded["value"]
        seen["differ"] += not torch.equal(fresh, value)
        self._observe(seen, name, key, fresh, value, args)
        gen.set_state(recorded["after"])
        with torch.no_grad():
            drawn.copy_(value)  # from the host: no device copy of it at the step's peak
        return True

    def _observe(self, seen: dict, name: str, key: str, fresh: torch.Tensor,
                 recorded: torch.Tensor, args: tuple) -> None:
        """Sums of the fresh and the recorded draws, per op and arguments, for ``report``;
        and which fresh values came from which state, to tell a draw that ignores it."""
        state_free = key.split("|", 4)
        state_free = "|".join(state_free[:3] + state_free[4:])
        seen["by_key"].setdefault(state_free, {})[key] = (_digest(fresh), _digest(recorded))
        if key in seen["counted"]:
            return  # each draw once: the runs of one step replay the same draws many times
        seen["counted"].add(key)
        params = ",".join(f"{a:.6g}" for a in args[1:] if isinstance(a, (int, float)))
        for sums, t in zip(seen["stats"][f"{name}({params})"], (fresh, recorded)):
            x = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach()).double()
            sums[0] += x.numel()
            for k in range(1, 5):  # the raw moments, for the mean and the variance's error
                sums[k] += float((x**k).sum())

    def report(self, name: str) -> dict[str, Any]:
        """What workload ``name``'s draws showed: how many were made and replayed, how many
        differ from the recorded ones, what was not recorded or not replayable, and the
        problems: a distribution other than the recorded one, a draw that does not depend on
        the generator's state."""
        seen = self.seen[name]
        problems = []
        for op, (now, was) in sorted(seen["stats"].items()):
            if now[0] == 0 or was[0] == 0:
                continue
            (n, mean, var, var_error), (m, rmean, rvar, rvar_error) = map(_moments, (now, was))
            error = math.sqrt(var / n + rvar / m) or 1e-12 * max(1.0, abs(rmean))
            spread = math.hypot(var_error, rvar_error)
            if abs(mean - rmean) > SIGMAS * error:
                problems.append(f"{op} draws mean {mean:.4g} over {n} values, the recorded "
                                f"draws {rmean:.4g} ({abs(mean - rmean) / error:.3g} standard "
                                f"errors apart): another distribution")
            elif rvar > 0 and abs(var - rvar) > SIGMAS * spread:
                problems.append(f"{op} draws variance {var:.4g}, the recorded draws "
                                f"{rvar:.4g} ({abs(var - rvar) / spread:.3g} standard errors "
                                f"apart): another distribution")
        for key, by_state in sorted(seen["by_key"].items()):
            pairs = list(by_state.values())  # one per generator state
            recorded = Counter(r for _, r in pairs)
            # the chance that draws from the recorded ones' distribution all came out alike:
            # small masks (timm's drop-path on 2 samples, (2, 1, 1, 1)) are often all ones
            alike = sum((n / len(pairs)) ** len(pairs) for n in recorded.values())
            if len(recorded) > 1 and len({f for f, _ in pairs}) == 1 and alike < ALIKE:
                problems.append(f"{key.split('|')[0]} draws the same values from every "
                                f"generator state ({len(pairs)} draws of {key.split('|')[1]}), "
                                f"where the recorded draws differ (alike by chance: "
                                f"{alike:.2g}): it ignores the seed")
        return {"draws": seen["draws"], "differ": seen["differ"],
                "not_recorded": dict(seen["not_recorded"]),
                "not_replayable": dict(seen["not_replayable"]), "problems": problems}


_ACTIVE: list[Session] = []


def active() -> Session | None:
    """The session of this process: the one opened, or a replay of the file ``ENV`` names (a
    spawned rank of a gate that replays)."""
    if not _ACTIVE and os.environ.get(ENV):
        _ACTIVE.append(Session(load(os.environ[ENV])["draws"]))
        torch.random.fork_rng = _fork_rng  # for the rank's life
    return _ACTIVE[-1] if _ACTIVE else None


_TORCH_FORK_RNG = torch.random.fork_rng


@contextlib.contextmanager
def _fork_rng(*args: Any, **kwargs: Any) -> Iterator[Any]:
    """torch's ``fork_rng``, which ``torch.utils.checkpoint`` opens around a recomputation
    in backward (reentrant or not, on every release since 2.4), with what runs inside it
    pinned as the forward it recomputes was. Nothing else changes: outside a backward, in a
    pinned context already, or without a session, it is torch's alone."""
    with _TORCH_FORK_RNG(*args, **kwargs) as got:
        session = active()
        if (session is None or session.name or not session.last
                or torch._C._current_graph_task_id() == -1):
            yield got
            return
        with pinned(session.last):
            yield got


@contextlib.contextmanager
def _session(session: Session) -> Iterator[Session]:
    _ACTIVE.append(session)
    torch.random.fork_rng = _fork_rng
    try:
        yield session
    finally:
        assert _ACTIVE[-1] is session, "sessions are opened and closed in order"
        _ACTIVE.pop()
        if not _ACTIVE:
            torch.random.fork_rng = _TORCH_FORK_RNG


def recording() -> contextlib.AbstractContextManager[Session]:
    return _session(Session())


def replaying(draws: dict[str, dict[str, Any]]) -> contextlib.AbstractContextManager[Session]:
    return _session(Session(draws))


@contextlib.contextmanager
def pinned(name: str, compiled: bool = False) -> Iterator[None]:
    """Workload ``name``'s draws made inside recorded or replayed (nothing without a session;
    a compiled forward is named, its draws being inside its graph)."""
    session = active()
    if session is None or session.name:  # nested: the outer context pins already
        yield
        return
    if compiled:
        seen = session.seen[name]["not_replayable"]
        seen["the compiled forward"] = seen.get("the compiled forward", 0) + 1
        yield
        return
    session.name = session.last = name
    try:
        with session:
            yield
    finally:
        session.name = ""


def save(path: str | os.PathLike, draws: dict[str, dict[str, Any]], **beside: Any) -> None:
    """The draws, and what else goes ``beside`` them in the same file (``draws`` to ``load``).
    A draw of zeros and ones (a dropout mask: nearly all of a speech model's 100 MB) is kept
    as bits."""
    buffer = io.BytesIO()
    torch.save({"draws": {key: _packed(d) for key, d in draws.items()}, **beside}, buffer)
    write_bytes(path, buffer.getbuffer())


def load(path: str | os.PathLike) -> dict[str, Any]:
    """A file ``save`` wrote: ``["draws"]``, and what was saved beside them."""
    got = torch.load(path, weights_only=True)
    got["draws"] = {key: _unpacked(d) for key, d in got["draws"].items()}
    return got


def _moments(sums: list[float]) -> tuple[int, float, float, float]:
    """(n, mean, variance, the variance's standard error) from the count and raw moment sums.
    The error is sqrt((m4 - var^2) / n), m4 the fourth central moment: a normal's 2 var^2 / n,
    but a mask's (Bernoulli) far wider where it is nearly all ones (timm's drop path, keep 0.92:
    the recorded variance 0.027, 2.6.0's 0.076, within 1.5 such errors)."""
    n, s1, s2, s3, s4 = sums
    mean = s1 / n
    var = max(s2 / n - mean**2, 0.0)
    m4 = s4 / n - 4 * mean * s3 / n + 6 * mean**2 * s2 / n - 3 * mean**4
    return int(n), mean, var, math.sqrt(max(m4 - var**2, 0.0) / n)


_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def _packed(draw: dict[str, Any]) -> dict[str, Any]:
    value = draw["value"]
    if value.is_complex() or not bool(((value == 0) | (value == 1)).all()):
        return draw
    flat = value.reshape(-1).to(torch.uint8)
    flat = torch.cat([flat, flat.new_zeros(-len(flat) % 8)]).reshape(-1, 8)
    bits = (flat * _BITS).sum(1, dtype=torch.uint8)
    return {"bits": bits, "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape), "after": draw["after"]}


def _unpacked(draw: dict[str, Any]) -> dict[str, Any]:
    if "bits" not in draw:
        return draw
    shape = draw["shape"]
    flat = ((draw["bits"].reshape(-1, 1) & _BITS) != 0).reshape(-1)[:math.prod(shape)]
    return {"value": flat.to(getattr(torch, draw["dtype"])).reshape(shape),
            "after": draw["after"]}
