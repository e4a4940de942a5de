"""OptimizerInBackward against a standard optimizer.step(): property tests, the memory property
(gradients never all alive), schedulers, checkpoints, errors, and the grouped-mode benchmark."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from hookbench.gate import step_time
from hookbench.measure.faults import inject
from hookbench.measure.memory import measure
from hookbench.measure.parity import (
    FAMILIES,
    compare,
    live_gradients,
    tolerance,
    training,
    trajectory,
)
from hookbench.mechanisms.optimizer_in_backward import OptimizerInBackward
from hookbench.models.zoo import ACTIVATIONS, BENCHMARK_MLP, TinySpec
from hookbench.models.zoo import workload as zoo_workload

# -- strategies ---------------------------------------------------------------------------------


@st.composite
def tiny_specs(draw, dtypes=(torch.float32, torch.float64)) -> TinySpec:
    depth = draw(st.integers(1, 4))
    return TinySpec(
        kind=draw(st.sampled_from(["mlp", "convnet"])),
        depth=depth,
        width=draw(st.sampled_from([2, 4, 8])),
        activation=draw(st.sampled_from(sorted(ACTIVATIONS))),
        tied=depth >= 3 and draw(st.booleans()),
        frozen=draw(st.booleans()),
        dtype=draw(st.sampled_from(dtypes)),
        batch_size=draw(st.integers(1, 4)),
        seed=draw(st.integers(0, 2**16)),
    )


lrs = st.sampled_from([1e-3, 1e-2, 5e-2])
decays = st.sampled_from([0.0, 1e-2])


@st.composite
def optimizers(draw, families=("sgd", "adam", "adamw", "rmsprop", "adagrad")):
    """(optimizer class, kwargs) with randomized hyperparameters, for-loop implementation."""
    family = draw(st.sampled_from(families))
    kw = {"lr": draw(lrs), "weight_decay": draw(decays), "maximize": draw(st.booleans())}
    if family == "sgd":
        kw["momentum"] = draw(st.sampled_from([0.0, 0.5, 0.9]))
        kw["nesterov"] = kw["momentum"] > 0 and draw(st.booleans())
        kw["dampening"] = 0.0 if kw["nesterov"] else draw(st.sampled_from([0.0, 0.1]))
        return torch.optim.SGD, kw
    if family in ("adam", "adamw"):
        kw["amsgrad"] = draw(st.booleans())
        kw["betas"] = draw(st.sampled_from([(0.9, 0.999), (0.8, 0.99)]))
        return (torch.optim.Adam if family == "adam" else torch.optim.AdamW), kw
    if family == "rmsprop":
        kw["momentum"] = draw(st.sampled_from([0.0, 0.5]))
        kw["centered"] = draw(st.booleans())
        return torch.optim.RMSprop, kw
    kw["lr_decay"] = draw(st.sampled_from([0.0, 1e-3]))
    kw["initial_accumulator_value"] = draw(st.sampled_from([0.0, 0.1]))
    return torch.optim.Adagrad, kw


steps = st.integers(1, 4)
accumulations = st.integers(1, 3)

# -- equivalence --------------------------------------------------------------------------------


@given(spec=tiny_specs(), opt=optimizers(), n=steps, k=accumulations,
       mode=st.sampled_from(["in_backward", "in_backward_grouped"]))
@pytest.mark.smoke
def test_in_backward_is_bit_exact_with_forloop_step(spec, opt, n, k, mode):
    # Identical arithmetic on identical gradients: parameters and state equal after every step.
    cls, kw = opt
    expected = trajectory(spec, cls, kw, "forloop", steps=n, accumulation=k)
    result = compare(trajectory(spec, cls, kw, mode, steps=n, accumulation=k), expected)
    assert result.bit_exact, result.verdict()


@given(spec=tiny_specs(), opt=optimizers(), n=steps, k=accumulations,
       path=st.sampled_from(["foreach", "fused"]))
def test_in_backward_matches_foreach_and_fused_within_tolerance(spec, opt, n, k, path):
    cls, kw = opt
    assume(path != "fused" or cls is not torch.optim.RMSprop)  # RMSprop has no fused kernel
    expected = trajectory(spec, cls, kw, path, steps=n, accumulation=k)
    result = compare(trajectory(spec, cls, kw, "in_backward", steps=n, accumulation=k),
                     expected, tolerance(path, spec.dtype))
    assert result.ok, result.verdict()


@given(spec=tiny_specs(), opt=optimizers(), n=steps, k=accumulations)
def test_grouped_foreach_matches_standard_foreach(spec, opt, n, k):
    # The point of the grouped mode: the foreach kernels run inside each module.
    cls, kw = opt
    expected = trajectory(spec, cls, kw, "foreach", steps=n, accumulation=k)
    result = compare(trajectory(spec, cls, kw, "in_backward_grouped_foreach", steps=n,
                                accumulation=k), expected, tolerance("foreach", spec.dtype))
    assert result.ok, result.verdict()


# Bucket caps: a few hundred bytes cut a tiny spec into several buckets (one per parameter at
# the smallest), 25 MiB (DDP's default) holds it whole.
CAPS = st.sampled_from([1e-5, 2e-4, 1e-3, 25])


@given(spec=tiny_specs(), opt=optimizers(), n=steps, k=accumulations, cap=CAPS)
@pytest.mark.smoke
def test_bucketed_is_bit_exact_with_standard_foreach(spec, opt, n, k, cap):
    # Each bucket is one foreach step over its parameters: the foreach kernels compute every
    # element as the standard foreach step over all parameters does, so bit for bit.
    cls, kw = opt
    expected = trajectory(spec, cls, kw, "foreach", steps=n, accumulation=k)
    result = compare(trajectory(spec, cls, {**kw, "bucket_cap_mb": cap}, "in_backward_bucketed",
                                steps=n, accumulation=k), expected)
    assert result.bit_exact, result.verdict()


@given(spec=tiny_specs(), opt=optimizers(), n=steps)
def test_same_trajectory_as_torch_apply_optimizer_in_backward(spec, opt, n):
    cls, kw = opt
    result = compare(trajectory(spec, cls, kw, "in_backward", steps=n),
                     trajectory(spec, cls, kw, "peer", steps=n))
    assert result.bit_exact, result.verdict()


# -- float64 reference of the update rules -----------------------------------------------------


def _reference_sgd(p, g, state, lr, momentum, dampening, nesterov, weight_decay, maximize):
    g = -g if maximize else g
    g = g + weight_decay * p
    if momentum:
        buf = state.get("buf")
        buf = g.clone() if buf is None else momentum * buf + (1 - dampening) * g
        state["buf"] = buf
        g = g + momentum * buf if nesterov else buf
    return p - lr * g


def _reference_adam(p, g, state, lr, betas, weight_decay, amsgrad, maximize, decoupled, eps=1e-8):
    g = -g if maximize else g
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    t = state["t"] = state.get("t", 0) + 1
    m = state["m"] = betas[0] * state.get("m", torch.zeros_like(p)) + (1 - betas[0]) * g
    v = state["v"] = betas[1] * state.get("v", torch.zeros_like(p)) + (1 - betas[1]) * g * g
    if amsgrad:
        v = state["vmax"] = torch.maximum(state.get("vmax", torch.zeros_like(p)), v)
    denom = v.sqrt() / (1 - betas[1] ** t) ** 0.5 + eps
    return p - lr / (1 - betas[0] ** t) * m / denom


# The reference runs in float64 from torch's own gradients, so the gap is torch's rounding in the
# parameter dtype: a few ulps per elementwise op, ~10 ops per step, 4 steps; fp32 ulp 1.2e-7 and
# fp64 ulp 2.2e-16, with ~100x headroom. Updates are at most ~lr (<= 0.05) in size.
_REFERENCE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6),
                  torch.float64: dict(rtol=1e-12, atol=1e-14)}


@given(spec=tiny_specs(), opt=optimizers(families=("sgd", "adam", "adamw")), n=steps)
def test_sgd_and_adam_follow_a_float64_reference_of_the_update_rule(spec, opt, n):
    # Catches a change in torch's own optimizer arithmetic, which the bit-exact comparisons
    # above cannot: they only say that two torch paths agree with each other.
    cls, kw = opt
    model = spec.build()
    opt_ = cls(model.parameters(), foreach=False, **kw)
    params = [p for p in model.parameters() if p.requires_grad]
    ref = {p: p.detach().double().clone() for p in params}
    states: dict = {p: {} for p in params}
    for i in range(n):
        x, y = spec.batch(i)
        spec.loss(model(x), y).backward()
        for p in params:
            g = p.grad.double()
            if cls is torch.optim.SGD:
                ref[p] = _reference_sgd(ref[p], g, states[p], **kw)
            else:
                ref[p] = _reference_adam(ref[p], g, states[p], kw["lr"], kw["betas"],
                                         kw["weight_decay"], kw["amsgrad"], kw["maximize"],
                                         decoupled=cls is torch.optim.AdamW)
        opt_.step()
        opt_.zero_grad()
        for p in params:
            torch.testing.assert_close(p.detach().double(), ref[p], **_REFERENCE_TOL[spec.dtype])


# -- memory: gradients never all alive ---------------------------------------------------------


@pytest.mark.parametrize("family", ["sgd", "adam"])
@pytest.mark.smoke
def test_gradients_are_freed_as_soon_as_stepped(family):
    cls, kw = FAMILIES[family]
    spec = TinySpec(depth=4, width=8, tied=True, frozen=True)
    n_trainable = sum(p.requires_grad for p in spec.build().parameters())
    # A standard step holds every gradient at once; this is what optimizer-in-backward removes.
    assert live_gradients(spec, cls, kw, "forloop") == (n_trainable, 0)
    # Per parameter: only the arriving gradient; grouped: one Linear's weight and bias.
    assert live_gradients(spec, cls, kw, "in_backward") == (1, 0)
    assert live_gradients(spec, cls, kw, "in_backward_grouped") == (2, 0)
    # Bucketed, cut at 320 B from the back: [8.bias, 8.weight, 6.bias, 4.bias] (172 B),
    # [4.weight, 2.bias], [2.weight (tied: 6.weight)]. At most a bucket's gradients and the one
    # arriving: 4.weight arrives while the first bucket waits for 4.bias.
    bucketed = {**kw, "bucket_cap_mb": 320 / 2**20}
    assert live_gradients(spec, cls, bucketed, "in_backward_bucketed") == (4, 0)


@pytest.mark.smoke
def test_live_gradient_check_catches_a_hook_that_fires_too_early():
    # Fault: the hook runs before accumulation, so nothing is freed during backward and the
    # end-of-backward flush steps everything at once; numerics survive, the memory saving not.
    cls, kw = FAMILIES["adam"]
    spec = TinySpec(depth=3)
    with inject("fires_before_accumulation"):
        peak, _ = live_gradients(spec, cls, kw, "in_backward")
    assert peak > 1


# -- scheduler, accumulation edge cases, checkpoints -------------------------------------------


def _train(model, spec, n, opt=None, sched=None, k=1, start=0):
    for i in range(start, start + n):
        for micro in range(k):
            x, y = spec.batch(i * k + micro)
            (spec.loss(model(x), y) / k).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("grouped", [False, True])
def test_one_scheduler_drives_all_inner_optimizers(grouped):
    # OneCycleLR also cycles Adam's beta1, so every group option must reach the inner optimizers.
    spec = TinySpec(depth=3, width=8)
    std_model, oib_model = spec.build(), spec.build()
    std = torch.optim.Adam(std_model.parameters(), lr=1e-2, foreach=False)
    std_sched = torch.optim.lr_scheduler.OneCycleLR(std, max_lr=0.05, total_steps=6)
    with OptimizerInBackward(oib_model, torch.optim.Adam, lr=1e-2, foreach=False,
                             grouped=grouped) as oib:
        oib_sched = torch.optim.lr_scheduler.OneCycleLR(oib, max_lr=0.05, total_steps=6)
        for i in range(5):
            _train(std_model, spec, 1, std, std_sched, start=i)
            _train(oib_model, spec, 1, None, oib_sched, start=i)
            for a, b in zip(std_model.parameters(), oib_model.parameters()):
                assert torch.equal(a, b), f"step {i}"
            assert oib_sched.get_last_lr() == std_sched.get_last_lr()
            assert oib.param_groups[0]["betas"] == std.param_groups[0]["betas"]


class _TwoHeads(nn.Module):
    """Head b is used only on odd micro-batches: its gradient comes from some backwards only."""

    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        h = self.body(x).relu()
        self.calls += 1
        return self.a(h) + (self.b(h) if self.calls % 2 == 0 else 0)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_parameters_without_gradient_in_the_stepping_backward(grouped, k):
    # Head b's gradient may come from an earlier micro-batch than the k-th; a standard step
    # still applies it, so the end-of-backward flush must too.
    torch.manual_seed(0)
    std_model = _TwoHeads()
    oib_model = copy.deepcopy(std_model)
    std = torch.optim.SGD(std_model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    data = torch.randn(12, 3, 4)
    with OptimizerInBackward(oib_model, torch.optim.SGD, lr=0.1, momentum=0.9, foreach=False,
                             grouped=grouped, accumulation_steps=k):
        for i, x in enumerate(data):
            std_model(x).square().mean().div(k).backward()
            oib_model(x).square().mean().div(k).backward()
            if (i + 1) % k == 0:
                std.step()
                std.zero_grad()
                for a, b in zip(std_model.parameters(), oib_model.parameters()):
                    assert torch.equal(a, b), f"micro-batch {i}"


def test_frozen_parameters_get_no_hook_state_or_update():
    spec = TinySpec(depth=3, frozen=True)
    model = spec.build()
    frozen = [p.detach().clone() for p in model[0].parameters()]
    with OptimizerInBackward(model, torch.optim.Adam, lr=0.1) as opt:
        _train(model, spec, 2)
        for p, before in zip(model[0].parameters(), frozen):
            assert not p._post_accumulate_grad_hooks
            assert p not in opt.state
            assert torch.equal(p, before)


def test_tied_parameter_steps_once_per_backward():
    spec = TinySpec(depth=3, tied=True)
    model = spec.build()
    tied = model[2].weight
    assert tied is model[4].weight
    with OptimizerInBackward(model, torch.optim.Adam, lr=0.1) as opt:
        _train(model, spec, 3)
        assert int(opt.state[tied]["step"]) == 3
        # one inner optimizer per parameter; model.parameters() lists the tied one once
        assert len(opt.inner_optimizers) == len(list(model.parameters()))


# torch.optim accepts (name, tensor) pairs (model.named_parameters()) from torch 2.6 (#134107)
_NAMED_PARAMS = pytest.mark.skipif(
    torch.__version__ < (2, 6),
    reason=f"torch.optim takes named parameters from torch 2.6; this is {torch.__version__}")


@_NAMED_PARAMS
@pytest.mark.parametrize("grouped", [False, True])
def test_state_dict_interchanges_with_a_standard_optimizer(grouped):
    spec = TinySpec(depth=3, tied=True, frozen=True)
    kw = dict(lr=1e-2, weight_decay=1e-2, foreach=False)
    std_model, oib_model = spec.build(), spec.build()
    std = torch.optim.AdamW(std_model.named_parameters(), **kw)
    _train(std_model, spec, 2, std)
    oib_model.load_state_dict(std_model.state_dict())
    with OptimizerInBackward(oib_model, torch.optim.AdamW, grouped=grouped, **kw) as oib:
        # deepcopy as a saved checkpoint would be: Optimizer.load_state_dict does not copy the
        # 'step' tensors, so loading a live state dict would share them between optimizers.
        oib.load_state_dict(copy.deepcopy(std.state_dict()))  # a standard checkpoint loads ...
        _train(std_model, spec, 2, std, start=2)
        _train(oib_model, spec, 2, start=2)
        for a, b in zip(std_model.parameters(), oib_model.parameters()):
            assert torch.equal(a, b)
        back = torch.optim.AdamW(std_model.named_parameters(), **kw)
        back.load_state_dict(copy.deepcopy(oib.state_dict()))  # ... and goes back
        assert back.state_dict()["param_groups"] == std.state_dict()["param_groups"]
        for i, s in std.state_dict()["state"].items():
            for key, value in s.items():
                assert torch.equal(back.state_dict()["state"][i][key], value)


@_NAMED_PARAMS
def test_state_dict_is_matched_by_parameter_name():
    # A checkpoint whose groups list the same parameters in another order loads by name.
    spec = TinySpec(depth=2)
    model = spec.build()
    named = list(model.named_parameters())
    std = torch.optim.Adam(list(reversed(named)), lr=1e-2)
    _train(model, spec, 1, std)
    with OptimizerInBackward(model, torch.optim.Adam, lr=1e-2) as oib:
        oib.load_state_dict(copy.deepcopy(std.state_dict()))
        for p in model.parameters():
            assert torch.equal(oib.state[p]["exp_avg"], std.state[p]["exp_avg"])


# -- errors leave the model and optimizer as they were -----------------------------------------


def _hooks(model):
    """Post-accumulate-grad hooks per parameter."""
    return [len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()]


class _NeedsClosure(torch.optim.Optimizer):
    def step(self, closure):  # like LBFGS
        return closure()


@pytest.mark.parametrize("make, error, match", [
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, max_grad_norm=1.0), ValueError,
     "global gradient-norm clipping needs the norm over every gradient"),
    (lambda m: OptimizerInBackward(m, torch.optim.LBFGS), ValueError, "needs a closure"),
    (lambda m: OptimizerInBackward(m, _NeedsClosure), ValueError, "needs a closure"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam(m.parameters())), TypeError,
     "got an instance of Adam"),
    (lambda m: OptimizerInBackward(m, nn.Linear), TypeError, "Optimizer subclass"),
    (lambda m: OptimizerInBackward(m.state_dict(), torch.optim.Adam), TypeError, "nn.Module"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, accumulation_steps=0), ValueError,
     "accumulation_steps must be >= 1"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, accumulation_steps=1.5), TypeError,
     "accumulation_steps must be an int"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, lr=-1.0), ValueError,
     "Invalid learning rate"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, [m[0].weight * 2]), ValueError,
     "non-leaf tensor"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, [nn.Parameter(torch.ones(2))]),
     ValueError, "not a parameter of the model"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, [m[0].weight, m[0].weight]),
     ValueError, "appears in more than one place"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, [{"lr": 1.0}]), ValueError,
     "has no 'params'"),
    (lambda m: OptimizerInBackward(m, torch.optim.Adam, [{"params": [m[0].bias],
                                                         "clip_grad_norm": 1.0}]),
     ValueError, "not supported"),
])
def test_bad_input_raises_a_clear_error_and_leaves_the_model_unchanged(make, error, match):
    model = TinySpec(depth=2).build()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        make(model)
    assert _hooks(model) == [0] * len(before)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_registering_twice_on_one_model_is_refused():
    model = TinySpec(depth=2).build()
    with OptimizerInBackward(model, torch.optim.Adam, lr=1e-2):
        hooks = _hooks(model)
        with pytest.raises(ValueError, match="already stepped by another OptimizerInBackward"):
            OptimizerInBackward(model, torch.optim.SGD, lr=1e-2)
        assert _hooks(model) == hooks == [1] * len(hooks)
    OptimizerInBackward(model, torch.optim.SGD, lr=1e-2).remove()  # free again after removal


def test_bucket_misuse_is_refused_before_anything_changes():
    model = TinySpec(depth=2).build()
    for options, words in [({"bucket_cap_mb": 0}, "must be a positive number of MiB"),
                           ({"bucket_cap_mb": True}, "must be a positive number of MiB"),
                           ({"bucket_cap_mb": float("inf")}, "must be a positive number"),
                           ({"bucket_cap_mb": 1, "grouped": True}, "pass one of them")]:
        with pytest.raises(ValueError, match=words):
            OptimizerInBackward(model, torch.optim.Adam, lr=1e-2, **options)
        assert _hooks(model) == [0] * len(_hooks(model))


def test_clip_grad_norm_is_refused_with_advice():
    model = TinySpec().build()
    with OptimizerInBackward(model, torch.optim.Adam) as opt:
        with pytest.raises(ValueError, match="Clip per parameter instead"):
            opt.clip_grad_norm_(1.0)


def test_bad_state_dict_is_refused_before_anything_changes():
    spec = TinySpec(depth=2)
    model = spec.build()
    with OptimizerInBackward(model, torch.optim.Adam, lr=1e-2) as opt:
        _train(model, spec, 1)
        good = copy.deepcopy(opt.state_dict())
        bad = copy.deepcopy(good)
        bad["state"][0]["exp_avg"] = torch.zeros(99)
        with pytest.raises(ValueError, match=r"state 'exp_avg' of parameter '0.weight' has shape"):
            opt.load_state_dict(bad)
        renamed = copy.deepcopy(good)
        renamed["param_groups"][0]["param_names"][0] = "nope"
        with pytest.raises(ValueError, match=r"missing \['0.weight'\], unexpected \['nope'\]"):
            opt.load_state_dict(renamed)
        after = opt.state_dict()
        for i, s in good["state"].items():
            assert all(torch.equal(after["state"][i][k], v) for k, v in s.items())


# -- hooks removed, the model restored ---------------------------------------------------------


def test_remove_restores_the_model_exactly():
    spec = TinySpec(depth=3, tied=True)
    model = spec.build()
    with OptimizerInBackward(model, torch.optim.Adam, lr=1e-2):
        _train(model, spec, 1)
    assert _hooks(model) == [0] * len(_hooks(model))
    # Trained as a standard model from here: gradients stay in .grad and nothing steps.
    weights = [p.detach().clone() for p in model.parameters()]
    _train(model, spec, 1)
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_hooks_are_removed_when_forward_or_backward_raises(where):
    model = TinySpec(depth=2).build()

    def boom(*_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with OptimizerInBackward(model, torch.optim.SGD, lr=0.1):
            h = model[0].register_forward_hook(boom) if where == "forward" else \
                model[0].weight.register_hook(boom)
            try:
                model(torch.ones(1, 6)).sum().backward()
            finally:
                h.remove()
    assert _hooks(model) == [0] * len(_hooks(model))


def test_a_hook_that_fires_twice_is_refused_not_stepped_twice():
    model = TinySpec(depth=2).build()
    with inject("fires_twice"), OptimizerInBackward(model, torch.optim.SGD, lr=0.1):
        with pytest.raises(RuntimeError, match="fired twice for parameter"):
            model(torch.ones(1, 6)).sum().backward()


@pytest.mark.parametrize("grouped", [False, True])
def test_non_reentrant_activation_checkpointing_is_bit_exact(grouped):
    # A weight used inside and outside the checkpoint: its hook fires once, after both uses.
    torch.manual_seed(0)
    std_model = nn.Linear(3, 3)
    oib_model = copy.deepcopy(std_model)
    x = torch.randn(2, 3, requires_grad=True)

    def run(m):
        m(checkpoint(m, x, use_reentrant=False)).sum().backward()

    std = torch.optim.SGD(std_model.parameters(), lr=0.1)
    run(std_model)
    std.step()
    with OptimizerInBackward(oib_model, torch.optim.SGD, lr=0.1, grouped=grouped):
        run(oib_model)
    assert all(torch.equal(a, b) for a, b in zip(std_model.parameters(),
                                                 oib_model.parameters()))


@pytest.mark.parametrize("grouped", [False, True])
def test_reentrant_activation_checkpointing_is_refused_before_backward(grouped):
    # Its nested backward would fire the weight's hook once inside and once outside the
    # checkpoint, stepping it twice on partial gradients (hook_contract pins that firing).
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, requires_grad=True)
    with OptimizerInBackward(model, torch.optim.Adam, lr=0.1, grouped=grouped) as opt:
        with pytest.raises(RuntimeError, match="use_reentrant=True: its nested backward fires"):
            model(checkpoint(model, x, use_reentrant=True))
        assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# -- training conditions -------------------------------------------------------------------------


def _standard_and_in_backward(model_fn, cls, kw, batches, forward, grouped, add_group=None):
    """The same training with a standard for-loop step and in backward; both models' parameters
    after every step. ``forward(model, x, step)`` returns the loss; ``add_group(model)``, if
    given, returns a param group added after the first step (a new head, unfrozen layers)."""
    out = []
    for in_backward in (False, True):
        model = model_fn()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = (OptimizerInBackward(model, cls, params, grouped=grouped, foreach=False, **kw)
               if in_backward else cls(params, foreach=False, **kw))
        snaps = []
        try:
            for i, x in enumerate(batches):
                if i == 1 and add_group is not None:
                    opt.add_param_group(add_group(model))
                forward(model, x, i).backward()
                opt.step()
                opt.zero_grad()
                snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        finally:
            if in_backward:
                opt.remove()
        out.append((snaps, opt, model))
    return out


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


BATCHES = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("family", ["sgd", "adam", "adamw"])
def test_bf16_autocast_is_bit_exact_with_the_standard_autocast_step(family, grouped):
    # The forward and backward run the same bf16 kernels on both sides, the gradients reach
    # the fp32 parameters in fp32, and the update is the same for-loop arithmetic: bit-exact.
    cls, kw = FAMILIES[family]

    def forward(model, x, i):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x).float().square().mean()

    (std, *_), (oib, *_) = _standard_and_in_backward(_mlp, cls, kw, BATCHES, forward, grouped)
    assert compare(oib, std).bit_exact, compare(oib, std).verdict()


@pytest.mark.parametrize("grouped", [False, True])
def test_fp16_is_refused_in_every_form_it_can_take(grouped):
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    before = copy.deepcopy(model.state_dict())
    # float16 parameters: at construction, before any hook.
    half = copy.deepcopy(model).half()
    with pytest.raises(ValueError, match="parameter '0.weight' is float16: float16 training "
                                         "needs loss scaling"):
        OptimizerInBackward(half, torch.optim.Adam, grouped=grouped)
    assert _hooks(half) == [0] * len(_hooks(half))
    with OptimizerInBackward(model, torch.optim.Adam, lr=1e-2, grouped=grouped) as opt:
        # An fp16 autocast forward: before it runs (BatchNorm's running stats included).
        with pytest.raises(RuntimeError, match=r"forward under float16 autocast \(cpu\)"):
            with torch.autocast("cpu", dtype=torch.float16):
                model(BATCHES[0])
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert not opt.state
        # GradScaler.step: a clear refusal instead of "No inf checks were recorded".
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(BATCHES[0]).square().mean()).backward()
        with pytest.raises(ValueError, match="GradScaler.step\\(\\) on OptimizerInBackward: "
                                             "the parameters were already stepped"):
            scaler.step(opt)
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


def test_global_clipping_after_backward_is_a_no_op_as_the_readme_says():
    # Pinned, because it cannot be refused: torch.nn.utils.clip_grad_norm_ reads p.grad, which
    # the optimizer in backward has already applied and freed. The method on the optimizer
    # refuses (test_clip_grad_norm_is_refused_with_advice).
    model = _mlp()
    with OptimizerInBackward(model, torch.optim.SGD, lr=0.1):
        model(BATCHES[0]).square().mean().backward()
        assert float(nn.utils.clip_grad_norm_(model.parameters(), 1e-3)) == 0.0
        assert all(p.grad is None for p in model.parameters())


class _Unused(nn.Module):
    """``never`` gets no gradient in any backward; ``sometimes`` in every other one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.never, self.sometimes = nn.Linear(6, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x, step=0):
        h = self.body(x).tanh()
        return self.sometimes(h) if step % 2 else h[:, :2]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_unused_parameters_are_left_alone_as_a_standard_step_leaves_them(family, grouped):
    cls, kw = FAMILIES[family]
    (std, std_opt, _), (oib, oib_opt, model) = _standard_and_in_backward(
        _Unused, cls, kw, BATCHES, lambda m, x, i: m(x, i).square().mean(), grouped)
    assert compare(oib, std).bit_exact, compare(oib, std).verdict()
    initial = dict(_Unused().named_parameters())
    assert all(torch.equal(oib[-1][n], initial[n]) for n in ("never.weight", "never.bias"))
    assert model.never.weight not in oib_opt.state and model.never.bias not in oib_opt.state


@pytest.mark.parametrize("grouped", [False, True])
def test_add_param_group_registers_hooks_and_steps_the_new_parameters(grouped):
    # Unfreezing the first layer after one step, with its own learning rate.
    def frozen_mlp():
        model = _mlp()
        model[0].requires_grad_(False)
        return model

    def unfreeze(model):
        model[0].requires_grad_(True)
        return {"params": model[0].parameters(), "lr": 0.5}

    cls, kw = FAMILIES["sgd"]
    (std, std_opt, _), (oib, oib_opt, model) = _standard_and_in_backward(
        frozen_mlp, cls, kw, BATCHES, lambda m, x, i: m(x).square().mean(), grouped,
        add_group=unfreeze)
    assert compare(oib, std).bit_exact, compare(oib, std).verdict()
    assert not torch.equal(oib[-1]["0.weight"], oib[0]["0.weight"])  # it was stepped
    assert oib_opt.param_groups[1]["lr"] == 0.5
    assert oib_opt.param_groups[1]["param_names"] == ["0.weight", "0.bias"]


def test_add_param_group_refuses_bad_groups_before_anything_changes():
    model = _mlp()
    with OptimizerInBackward(model, torch.optim.Adam, [model[2].weight], lr=1e-2) as opt:
        groups, hooks = copy.deepcopy(opt.param_groups), _hooks(model)
        for group, error, match in [
            ({"params": [model[2].weight]}, ValueError, "'2.weight' appears in more than one"),
            ({"params": [nn.Parameter(torch.ones(2))]}, ValueError, "not a parameter of the "),
            ({"params": [model[0].weight], "lr": -1.0}, ValueError, "Invalid learning rate"),
            ([model[0].weight], TypeError, "param_group must be a dict"),
        ]:
            with pytest.raises(error, match=match):
                opt.add_param_group(group)
            assert _hooks(model) == hooks
            assert [g["param_names"] for g in opt.param_groups] == \
                [g["param_names"] for g in groups]


@_NAMED_PARAMS
def test_named_parameters_are_accepted_as_torch_optimizers_accept_them():
    model = _mlp()
    with OptimizerInBackward(model, torch.optim.Adam, model.named_parameters(), lr=1e-2) as opt:
        std = torch.optim.Adam(_mlp().named_parameters(), lr=1e-2)
        assert opt.state_dict()["param_groups"] == std.state_dict()["param_groups"]


# Every torch optimizer whose step needs no closure: stepped per parameter (or per module) it
# sees whole parameters, so even shape-dependent updates (Adafactor's factored second moment)
# hold, bit for bit against the for-loop step.
OTHER_OPTIMIZERS = {
    "adafactor": (getattr(torch.optim, "Adafactor", None), {"lr": 1e-2}),  # torch >= 2.5
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
}


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("name", OTHER_OPTIMIZERS)
def test_other_optimizer_classes_are_bit_exact(name, grouped):
    cls, kw = OTHER_OPTIMIZERS[name]
    if cls is None:
        pytest.skip(f"torch.optim.{name.title()} needs torch >= 2.5; this is {torch.__version__}")
    (std, *_), (oib, *_) = _standard_and_in_backward(
        _mlp, cls, kw, BATCHES, lambda m, x, i: m(x).square().mean(), grouped)
    assert compare(oib, std).bit_exact, compare(oib, std).verdict()


# -- speed ---------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="adam-step")
@pytest.mark.parametrize(
    "strategy", ["forloop", "foreach", "in_backward", "in_backward_grouped_foreach",
                 "in_backward_bucketed"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_benchmark_step_time(benchmark, strategy, device):
    # BENCHMARK_MLP (~0.8M parameters): one training step per round, the same number of rounds
    # for every strategy. The step's cost drifts as Adam's state evolves, so equal step counts
    # keep the strategies comparable (conftest.py prints their ratios).
    spec = BENCHMARK_MLP
    cls, kw = FAMILIES["adam"]
    benchmark.extra_info.update(strategy=strategy, device=device)
    # The step's peak memory beside its time in the stored run: on the CPU the fake backend's
    # (exact, as CUDA's allocator would count it), on a GPU max_memory_allocated.
    benchmark.extra_info["peak_bytes"] = measure(
        spec, strategy, optimizer_class=cls, optimizer_kwargs=kw,
        backend="fake" if device == "cpu" else "cuda").peak
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with training(spec, cls, kw, strategy, device=device) as run:
        run.step(0)  # Adam creates its state lazily: time the steady state
        benchmark.pedantic(lambda: (run.step(1), sync()), rounds=100, warmup_rounds=5)


# The whole step of a real model, per implementation: ViT-B/16 and the transformer, batch 2,
# Adam; the standard step and each mode of the optimizer in backward that has the
# implementation (step_time.WHOLE_STEP_PAIRS). conftest.py prints each pair's ratio; `hookbench
# speed` times them interleaved, and `hookbench gate` the transformer's (its time section).
# ViT-L/16 (batch 1, the tutorial's) is the GPU tier's.
WHOLE_STEP_ROUNDS = {"transformer": 20, "vit_b_16": 5, "vit_l_16": 20}  # ViT-B/16: ~1.8 s a
# step on 2 cores


@pytest.mark.parametrize("impl, mode", [
    (impl, mode) for impl, modes in step_time.WHOLE_STEP_PAIRS.items()
    for mode in ("standard", *modes)])
@pytest.mark.parametrize("model, batch, device", [
    pytest.param("vit_b_16", 2, "cpu", id="vit_b_16"),
    pytest.param("transformer", 2, "cpu", id="transformer"),
    pytest.param("vit_l_16", 1, "cuda", marks=pytest.mark.gpu, id="vit_l_16-cuda")])
def test_benchmark_whole_step(benchmark, model, batch, device, impl, mode):
    spec, (cls, kw) = zoo_workload(model, batch_size=batch), FAMILIES["adam"]
    benchmark.group = f"whole-step-{model}"
    benchmark.extra_info.update(strategy=f"{mode}-{impl}", device=device)
    strategy = impl if mode == "standard" else step_time.WHOLE_STEP_MODES[mode]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with training(spec, cls, {**kw, **step_time.IMPLEMENTATIONS[impl]}, strategy,
                  device=device) as run:
        run.step(0)  # Adam's state exists from here on: the steady state
        benchmark.pedantic(lambda: (run.step(1), sync()), rounds=WHOLE_STEP_ROUNDS[model],
                           warmup_rounds=1)


def test_a_sharded_unit_run_twice_in_one_forward_is_refused_before_anything_steps():
    # FSDP2 calls a unit's hooks once per run of it, so a layer shared across depth would be
    # stepped twice in one backward. On a fake process group of 2 ranks, in this process.
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hookbench.engines import fsdp2

    class Repeats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared, self.head, self.times = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), \
                nn.Linear(4, 2), 1

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.times):
                x = self.shared(x)
            return self.head(x)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = Repeats()
        fsdp2.api().fully_shard(model.shared, mesh=init_device_mesh("cpu", (2,)))
        fsdp2.api().fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        opt = OptimizerInBackward(model, torch.optim.SGD, lr=0.1)
        try:
            model(torch.ones(2, 4)).sum().backward()  # one run per forward: it trains
            stepped = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
            assert not torch.equal(stepped["shared.0.weight"], before["shared.0.weight"])
            model.times = 2
            with pytest.raises(ValueError, match="FSDP2 unit 'shared' runs 2 times in one "
                                                 "forward"):
                model(torch.ones(2, 4))
            # the values as they were (the root's are left gathered by FSDP2's own forward)
            assert all(torch.equal(getattr(p, "full_tensor", p.detach)(), stepped[n])
                       for n, p in model.named_parameters())
        finally:
            opt.remove()
            fsdp2.remove_hooks(model)
    finally:
        dist.destroy_process_group()
