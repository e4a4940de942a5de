"""The PyTorch hook behaviours that optimizer-in-backward and ZeRO-2 rely on, as checks.

Each check builds a tiny graph, runs backward and raises ``ContractViolation`` (an
``AssertionError``) when PyTorch behaves differently from what is pinned here. The tests run
them, ``hookbench report`` prints them, and the fault-injection tests show that each injected
hook fault makes at least one of them fail. A check that pins a known PyTorch bug says so: when
the bug is fixed the check fails, on purpose, so that the fix is noticed and reviewed.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["CHECKS", "ContractViolation", "run_all"]


class ContractViolation(AssertionError):
    """PyTorch's hook behaviour differs from the pinned contract."""


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def _leaf(*shape: int) -> torch.Tensor:
    return torch.arange(1.0, 1.0 + torch.Size(shape).numel()).reshape(shape).requires_grad_()


def leaf_only() -> None:
    """register_post_accumulate_grad_hook raises on a non-leaf tensor."""
    non_leaf = _leaf(3) * 2
    try:
        handle = non_leaf.register_post_accumulate_grad_hook(lambda t: None)
    except RuntimeError as e:
        _expect("leaf" in str(e), f"the error does not mention leaf tensors: {e}")
        return
    handle.remove()
    raise ContractViolation("a post-accumulate-grad hook was accepted on a non-leaf tensor")


def registration_order() -> None:
    """Several post-accumulate-grad hooks on one tensor run in registration order."""
    p, calls = _leaf(3), []
    handles = [p.register_post_accumulate_grad_hook(lambda t, i=i: calls.append(i))
               for i in range(3)]
    try:
        (p * 2).sum().backward()
    finally:
        for h in handles:
            h.remove()
    _expect(calls == [0, 1, 2], f"hooks ran in order {calls}, expected [0, 1, 2]")


def once_per_backward_tied() -> None:
    """A parameter used twice in one forward (tied weights) fires its hook once per backward."""
    p, calls = _leaf(3), []
    handle = p.register_post_accumulate_grad_hook(lambda t: calls.append(t.grad.clone()))
    try:
        (p * 2 + p * 3).sum().backward()
    finally:
        handle.remove()
    _expect(len(calls) == 1, f"the hook fired {len(calls)} times for one backward, expected 1")
    _expect(torch.equal(calls[0], torch.full((3,), 5.0)),
            f"the hook saw grad {calls[0].tolist()}, expected the full sum [5, 5, 5]")


def sees_accumulated_grad() -> None:
    """When the hook runs, .grad already holds this backward's gradient plus what was there."""
    p, seen = _leaf(3), []
    p.grad = torch.ones(3)  # as left by an earlier micro-batch
    handle = p.register_post_accumulate_grad_hook(
        lambda t: seen.append(None if t.grad is None else t.grad.clone()))
    try:
        (p * 2).sum().backward()
    finally:
        handle.remove()
    _expect(len(seen) == 1, f"the hook fired {len(seen)} times, expected 1")
    _expect(seen[0] is not None and torch.equal(seen[0], torch.full((3,), 3.0)),
            f"the hook saw grad {seen[0]}, expected the accumulated [3, 3, 3]")


def firing_order() -> None:
    """Tensor pre-hook, AccumulateGrad pre-hook, post-accumulate hook, AccumulateGrad hook."""
    p, order = _leaf(3), []
    acc = p.view_as(p).grad_fn.next_functions[0][0]
    handles = [
        p.register_hook(lambda g: order.append("tensor")),
        acc.register_prehook(lambda g: order.append("acc_pre")),
        p.register_post_accumulate_grad_hook(lambda t: order.append("post_accumulate")),
        acc.register_hook(lambda gi, go: order.append("acc_post")),
    ]
    try:
        (p * 2).sum().backward()
    finally:
        for h in handles:
            h.remove()
    expected = ["tensor", "acc_pre", "post_accumulate", "acc_post"]
    _expect(order == expected, f"hooks ran as {order}, expected {expected}")


def free_grad_in_hook() -> None:
    """Setting .grad = None inside the hook frees it: its storage is gone after backward."""
    p, storages = _leaf(1024), []

    def free(t: torch.Tensor) -> None:
        storages.append(weakref.ref(t.grad.untyped_storage()))
        t.grad = None

    handle = p.register_post_accumulate_grad_hook(free)
    try:
        (p * 2).sum().backward()
    finally:
        handle.remove()
    _expect(p.grad is None, "a gradient set to None inside the hook exists after backward")
    _expect(len(storages) == 1 and storages[0]() is None,
            "the gradient's storage outlived backward although .grad was set to None in the hook")


def removal() -> None:
    """A removed hook no longer fires."""
    p, calls = _leaf(3), []
    handle = p.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    (p * 2).sum().backward()
    handle.remove()
    (p * 2).sum().backward()
    _expect(calls == [1], f"the hook fired {len(calls)} times across a removal, expected 1")


def retain_graph_second_backward() -> None:
    """With retain_graph, a second backward over the same graph fires the hook again."""
    p, grads = _leaf(3), []
    handle = p.register_post_accumulate_grad_hook(lambda t: grads.append(t.grad.clone()))
    try:
        loss = (p * 2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    finally:
        handle.remove()
    _expect(len(grads) == 2, f"two backward passes fired the hook {len(grads)} times")
    _expect(torch.equal(grads[-1], torch.full((3,), 4.0)),
            f"the second backward saw grad {grads[-1].tolist()}, expected [4, 4, 4]")


def checkpoint_reentrant_fires_twice() -> None:
    """Pinned: reentrant checkpointing fires a parameter used inside and outside it twice;
    non-reentrant fires once. Reentrant recomputation runs forward hooks again; non-reentrant
    recomputation stops early, as soon as the saved tensors it needs exist, before the module's
    forward hooks would run, so they do not fire again (seen on torch 2.14.1)."""
    lin = torch.nn.Linear(3, 3)
    counts = {}
    for reentrant in (True, False):
        fired, forwards = [], []
        handles = [lin.weight.register_post_accumulate_grad_hook(lambda t: fired.append(1)),
                   lin.register_forward_hook(lambda m, i, o: forwards.append(1))]
        try:
            x = torch.ones(2, 3, requires_grad=True)
            y = checkpoint(lin, x, use_reentrant=reentrant)
            lin(y).sum().backward()
        finally:
            for h in handles:
                h.remove()
        counts[reentrant] = (len(fired), len(forwards))
    _expect(counts[True] == (2, 3),
            f"reentrant checkpoint: hook fired {counts[True][0]} times and forward hooks "
            f"{counts[True][1]} times, expected 2 and 3")
    _expect(counts[False] == (1, 2),
            f"non-reentrant checkpoint: hook fired {counts[False][0]} times and forward hooks "
            f"{counts[False][1]} times, expected 1 and 2")


def accumulate_grad_node_hook_lost_after_set_data() -> None:
    """Pinned (pytorch#139742): a hook on the AccumulateGrad node stops firing after
    ``p.set_()`` (or ``p.data = ...`` of another dtype), because autograd builds the parameter
    a new AccumulateGrad node; the post-accumulate-grad hook lives on the tensor and keeps
    firing. This is why hookbench hooks tensors, not nodes."""
    p, node_calls, post_calls = _leaf(3), [], []
    acc = p.view_as(p).grad_fn.next_functions[0][0]
    handles = [acc.register_hook(lambda gi, go: node_calls.append(1)),
               p.register_post_accumulate_grad_hook(lambda t: post_calls.append(1))]
    try:
        with torch.no_grad():
            p.set_(torch.zeros(3))
        (p * 2).sum().backward()
    finally:
        for h in handles:
            h.remove()
    _expect(post_calls == [1], f"post-accumulate hook fired {len(post_calls)} times, expected 1")
    _expect(node_calls == [], "the AccumulateGrad node hook fired after p.set_(): "
            "pytorch#139742 looks fixed; review the peer and update this pin")


def full_backward_hooks() -> None:
    """Module full backward hooks, pinned as torch 2.4.1 to 2.15.0 behave: with no input that
    requires grad, the pre-hook and the hook each fire once per backward and the hook's
    ``grad_input`` is ``(None,)`` (from torch 2.8 with a warning, pytorch#155339); an in-place
    op on a hooked module's output raises at that op ("... is a view and is being modified
    inplace") instead of giving wrong gradients."""
    lin = torch.nn.Linear(3, 2)
    seen: list[tuple] = []
    handles = [lin.register_full_backward_pre_hook(lambda m, go: seen.append(("pre", len(go)))),
               lin.register_full_backward_hook(lambda m, gi, go: seen.append(("hook", gi)))]
    inplace = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pytorch#155339 warning: pinned, not shown
            lin(torch.ones(4, 3)).sum().backward()
        try:
            lin(torch.ones(4, 3, requires_grad=True)).relu_()
        except RuntimeError as e:
            inplace = str(e)
    finally:
        for h in handles:
            h.remove()
    _expect([kind for kind, _ in seen] == ["pre", "hook"],
            f"full backward hooks fired {[kind for kind, _ in seen]}, expected pre then hook, "
            f"once each")
    _expect(seen[1][1] == (None,), f"grad_input was {seen[1][1]}, expected (None,) with no "
                                   f"input requiring grad")
    _expect(inplace is not None and "is being modified inplace" in inplace,
            "an in-place op on a full-backward-hooked module's output did not raise"
            + (f" the pinned error: {inplace}" if inplace else ""))


CHECKS: list[Callable[[], None]] = [
    leaf_only,
    registration_order,
    once_per_backward_tied,
    sees_accumulated_grad,
    firing_order,
    free_grad_in_hook,
    removal,
    retain_graph_second_backward,
    checkpoint_reentrant_fires_twice,
    accumulate_grad_node_hook_lost_after_set_data,
    full_backward_hooks,
]


def run_all(checks: list[Callable[[], None]] | None = None) -> dict[str, str | None]:
    """Every check's name (of ``CHECKS``, or ``checks``) and None when it holds, or what went
    wrong.

    A check that raises anything but ContractViolation has met behaviour it did not expect at
    all (a hook that sees no gradient, say), which is a violation too.
    """
    results: dict[str, str | None] = {}
    for check in CHECKS if checks is None else checks:
        try:
            check()
            results[check.__name__] = None
        except ContractViolation as e:
            results[check.__name__] = str(e)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            results[check.__name__] = f"{type(e).__name__}: {e}"
    return results
