"""Random draws pinned across releases (``hookbench.core.draws``): a workload's draws recorded and
replayed give the recorded step bit for bit on a torch that draws other numbers; a broken
random op is still caught, naming the op; what cannot be replayed is named."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hookbench import Workload
from hookbench.core import draws
from hookbench.engines import verdicts
from hookbench.gate import workload_checks
from hookbench.measure.faults import inject


class OtherStreams(TorchDispatchMode):
    """A release that draws other numbers from the same seed, each from the right
    distribution: every random op first takes one number from its generator."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        real = all(type(t) in (torch.Tensor, nn.Parameter) for t in tree_leaves(args)
                   if isinstance(t, torch.Tensor))  # not fake tensors (memory rows)
        if torch.Tag.nondeterministic_seeded in func.tags and real:
            torch.rand(1, generator=kwargs.get("generator"))
        return func(*args, **kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.b(self.drop(F.relu(self.a(x))))


def batch(g: torch.Generator):
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


class SelfCheckpointed(Net):
    """A model that checkpoints its own block, as Hugging Face's
    ``gradient_checkpointing_enable()`` does: the recomputation in backward runs outside
    every context the workload opens around its forward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        # the input requires grad: a reentrant checkpoint passes no gradient otherwise
        hidden = torch.utils.checkpoint.checkpoint(lambda h: self.drop(F.relu(h)), self.a(x),
                                                   use_reentrant=self.reentrant)
        return self.b(hidden)


WORKLOAD = Workload(name="drop", model=Net, batch=batch, loss=F.cross_entropy,
                    optimizer=(torch.optim.SGD, {"lr": 0.1}))
CHECKPOINTED = WORKLOAD.replace(name="drop-ckpt", checkpointing=nn.Dropout)
SELF_CHECKPOINTED = [WORKLOAD.replace(name=f"drop-self-ckpt-{r}", model=functools.partial(
    SelfCheckpointed, r)) for r in (False, True)]


def step(w: Workload) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One training step's loss and gradients, on batch 0's share 0: init, data and forward
    all draw."""
    model = w.build()
    x, y = w.data(0)
    loss = w.compute_loss(model, x, y, (0, 0))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(map(torch.equal, a[1], b[1]))


@pytest.mark.parametrize("w", [WORKLOAD, CHECKPOINTED, *SELF_CHECKPOINTED],
                         ids=["plain", "checkpointed", "model-checkpoints-itself",
                              "model-checkpoints-itself-reentrant"])
def test_replayed_draws_give_the_recorded_step_on_a_torch_that_draws_other_numbers(w):
    with draws.recording() as recorded:
        expected = step(w)
    assert same(step(w), expected)  # recording changes nothing
    with OtherStreams():
        assert not same(step(w), expected)  # unpinned: another step (the check can fail)
        with draws.replaying(recorded.draws) as session:
            got = step(w)
    assert same(got, expected)
    report = session.report(w.name)
    # every draw (init, batch, dropout) replayed, each other than this torch drew it
    assert report["draws"] == report["differ"] >= 5 and not report["problems"], report
    assert report["not_recorded"] == report["not_replayable"] == {}


def test_replay_on_the_same_torch_finds_every_draw_identical():
    with draws.recording() as recorded:
        step(WORKLOAD)
    with draws.replaying(recorded.draws) as session:
        step(WORKLOAD)
    report = session.report("drop")
    assert report["draws"] > 0 and report["differ"] == 0 and not report["problems"]


def _replayed_under(fault: str) -> dict:
    # several batches and shares: a distribution or a dependence on the seed shows over many
    with draws.recording() as recorded:
        for i in range(4):
            model = WORKLOAD.build()
            x, y = WORKLOAD.data(i)
            for share in range(2):
                WORKLOAD.compute_loss(model, x, y, (i, share))
    with inject(fault), draws.replaying(recorded.draws) as session:
        for i in range(4):
            model = WORKLOAD.build()
            x, y = WORKLOAD.data(i)
            for share in range(2):
                WORKLOAD.compute_loss(model, x, y, (i, share))
    return session.report("drop")


def test_pinning_does_not_hide_a_dropout_that_drops_another_fraction():
    assert _replayed_under(None)["problems"] == []  # many shares replayed: nothing to say
    problems = _replayed_under("dropout_drops_half")["problems"]
    assert len(problems) == 1 and problems[0].startswith("aten::bernoulli_(0.9) draws mean 0.5")
    assert "another distribution" in problems[0]


def test_pinning_does_not_hide_a_mask_that_ignores_the_seed():
    problems = _replayed_under("dropout_ignores_seed")["problems"]
    assert any(p.startswith("aten::bernoulli_ draws the same values from every generator "
                            "state") and p.endswith("it ignores the seed") for p in problems)


def test_a_draw_that_cannot_be_replayed_is_named_and_drawn_as_it_comes():
    with draws.recording() as session, draws.pinned("fused"):
        torch.native_dropout(torch.ones(64), 0.5, True)  # the fused op: output and mask at once
    with draws.recording() as compiled, draws.pinned("compiled", compiled=True):
        pass
    assert session.report("fused")["not_replayable"] == {"aten::native_dropout": 1}
    with draws.recording() as attention, draws.pinned("sdpa"):  # tagged, but draws nothing
        q = torch.randn(1, 2, 4, 8)
        F.scaled_dot_product_attention(q, q, q)
    assert attention.report("sdpa")["not_replayable"] == {}
    assert compiled.report("compiled")["not_replayable"] == {"the compiled forward": 1}
    # a draw the baseline lacks (here: other shapes) is named too
    with draws.replaying(session.draws) as replay, draws.pinned("fused"):
        torch.rand(3)
    assert replay.report("fused")["not_recorded"] == {"aten::rand": 1}


def test_draws_survive_a_file_and_nothing_is_pinned_outside_a_session(tmp_path):
    assert draws.active() is None
    with draws.recording() as recorded:
        expected = step(WORKLOAD)
    draws.save(tmp_path / "d.pt", recorded.draws, traces={"beside": 1})
    assert draws.load(tmp_path / "d.pt")["traces"] == {"beside": 1}
    with OtherStreams(), draws.replaying(draws.load(tmp_path / "d.pt")["draws"]):
        assert same(step(WORKLOAD), expected)
    assert draws.active() is None


def test_a_mask_is_kept_as_bits_and_read_back_as_drawn(tmp_path):
    mask = torch.bernoulli(torch.full((1001,), 0.5))  # not a multiple of 8
    values = {"mask": mask, "bool": mask.bool(), "normal": torch.randn(1001),
              "ints": torch.randint(0, 5, (1001,)), "empty": torch.empty(0, 3)}
    state = torch.get_rng_state()
    draws.save(tmp_path / "d.pt", {k: {"value": v, "after": state} for k, v in values.items()})
    back = draws.load(tmp_path / "d.pt")["draws"]
    for key, value in values.items():
        got = back[key]["value"]
        assert got.dtype == value.dtype and torch.equal(got, value), key
        assert torch.equal(back[key]["after"], state)
    stored = torch.load(tmp_path / "d.pt", weights_only=True)["draws"]
    assert stored["mask"]["bits"].numel() == 126 and "value" not in stored["mask"]
    assert "value" in stored["normal"] and "value" in stored["ints"]


# The contracts of torch's dropout the draws rows rely on, on plain torch: each fault above
# breaks one (``--hookbench-fault``), here without any pinning.
def test_dropout_drops_the_fraction_it_is_asked_to():
    for p in (0.1, 0.9):
        kept = float((F.dropout(torch.ones(200_000), p, training=True) != 0).double().mean())
        # 6 standard errors of a binomial proportion over 200,000 draws
        assert abs(kept - (1 - p)) < 6 * math.sqrt(p * (1 - p) / 200_000), (p, kept)


def test_dropout_masks_depend_on_the_seed():
    masks = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        masks.append(F.dropout(torch.ones(256), 0.5, training=True))
    assert not torch.equal(*masks)


class LayerDrop(nn.Module):
    """Each layer skipped at random in training (LayerDrop, Fan et al. 2019)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            if not self.training or torch.rand(()) > 0.3:
                x = F.relu(layer(x))
        return self.head(x)


def test_a_probe_of_what_a_row_applies_to_draws_as_recorded():
    """Which layers each rank skips decides whether FSDP2 applies. On a release that draws
    otherwise, the probe must see the recorded draws, or a row turns 'does not apply' (opt's
    LayerDrop on 2.9.1 against 2.6.0, when the memory rows asking it ran unpinned)."""
    w = WORKLOAD.replace(name="layerdrop", model=LayerDrop)
    with draws.recording() as recorded:
        expected = verdicts.not_applicable(w, 3, 2, ("fsdp2_zero2",))
    assert "the forward skips layers at random" in expected["fsdp2_zero2"]
    with OtherStreams():
        assert verdicts.not_applicable(w, 3, 2, ("fsdp2_zero2",)) != expected  # can fail
        with draws.replaying(recorded.draws):
            assert verdicts.not_applicable(w, 3, 2, ("fsdp2_zero2",)) == expected


def test_a_memory_row_is_pinned_and_the_sessions_copies_are_not_the_steps():
    """A forward that branches on its draws allocates by them: which layers LayerDrop skips
    decides the activations and which parameters have gradients and Adam state (Switch
    Transformers' router jitter on 2.9.1 against 2.6.0: optimizer state +5.6%, unpinned).
    The memory rows run pinned; what the session copies, digests and compares is not
    counted: recorded, replayed and measured without a session, the rows are the same."""
    w = WORKLOAD.replace(name="layerdrop", model=LayerDrop,
                         optimizer=(torch.optim.Adam, {"lr": 1e-3}))
    plain = workload_checks.memory(w)
    assert plain["layerdrop/memory/foreach"]["backend"] == "eager"  # fake cannot branch
    with draws.recording() as recorded:
        assert workload_checks.memory(w) == plain
    assert recorded.report("layerdrop")["draws"] > 0
    with OtherStreams():
        assert workload_checks.memory(w) != plain  # can fail: this release skips others
        with draws.replaying(recorded.draws):
            assert workload_checks.memory(w) == plain


def test_draws_that_read_other_numbers_are_other_draws():
    """Two workloads from one seed whose inits draw with another std at the same generator
    state (examples/hf: a Llama's o_proj and another model's): each replays its own values."""
    def init(std: float):
        def model():
            net = Net()
            nn.init.normal_(net.a.weight, 0.0, std)
            return net
        return model

    wide, narrow = (WORKLOAD.replace(name=f"std-{s}", model=init(s)) for s in (0.02, 0.01))
    with draws.recording() as recorded:
        narrow.build()  # recorded first, at the states wide then draws at
        expected = wide.build().a.weight.detach().clone()
    with OtherStreams(), draws.replaying(recorded.draws) as session:
        got = wide.build().a.weight
    assert torch.equal(got, expected), (float(got.norm()), float(expected.norm()))
    assert session.report("std-0.02")["not_recorded"] == {}


def test_a_small_mask_alike_by_chance_is_not_a_mask_that_ignores_the_seed():
    """timm's drop-path on 2 samples draws (2, 1, 1, 1) masks, mostly all ones: 12 of them all
    ones on one release is a 0.11 chance where the recorded ones were 10 of 12 all ones (seen
    on 2.9.1 against 2.6.0, ConvNeXt-atto). Masks that differ every time, all alike, are not."""
    session = draws.Session({})
    by_key = session.seen["w"]["by_key"]
    ones = "1" * 16
    by_key["aten::bernoulli_|(2, 1, 1, 1)|torch.float32|p"] = {
        f"state {i}": (ones, ones if i < 10 else f"{i:016d}") for i in range(12)}
    assert session.report("w")["problems"] == []
    by_key["aten::bernoulli_|(2, 1, 1, 1)|torch.float32|p"] = {
        f"state {i}": (ones, f"{i:016d}") for i in range(12)}
    problem, = session.report("w")["problems"]
    assert problem.startswith("aten::bernoulli_ draws the same values from every generator "
                              "state (12 draws of (2, 1, 1, 1))") and "ignores the seed" in problem


def _replayed_against(recorded_as, draw) -> list[str]:
    """The problems of replaying ``draw()``'s draws where the recorded values were
    ``recorded_as(value)``: another torch's draws of the same ops."""
    torch.manual_seed(0)
    with draws.recording() as recorded, draws.pinned("w"):
        draw()
    for d in recorded.draws.values():
        d["value"] = recorded_as(d["value"])
    torch.manual_seed(0)
    with draws.replaying(recorded.draws) as session, draws.pinned("w"):
        draw()
    report = session.report("w")
    assert report["differ"] > 0, report  # another torch's draws
    return report["problems"]


def test_a_masks_variance_is_held_to_a_masks_spread_not_a_normals():
    """timm's drop path (keep 0.92) recorded on 2.9.1 and replayed on 2.6.0: the recorded masks
    nearly all ones (variance 0.027), 2.6.0's as p(1 - p) has it (0.076). A normal's error of
    the variance, 2 var^2 / n, called that another distribution; a mask's fourth moment makes
    its error far wider. Here one zero recorded in 128 values against this torch's p = 0.92:
    8x the variance, 3 such errors apart."""
    def masks() -> None:
        for _ in range(16):
            torch.bernoulli(torch.full((8,), 0.92))

    zeros = [1]  # one zero in the 128 recorded values: variance 0.0077

    def nearly_all_ones(value: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(value)
        mask[:zeros[0]] = 0
        zeros[0] = 0
        return mask

    ones = _replayed_against(nearly_all_ones, masks)
    assert ones == [], ones
    # a draw whose spread is another (a normal at twice its scale) still fails, on its variance
    problems = _replayed_against(lambda v: 2 * v, lambda: [torch.randn(64) for _ in range(8)])
    assert len(problems) == 1 and problems[0].startswith("aten::randn() draws variance"), problems
    assert problems[0].endswith("another distribution")
