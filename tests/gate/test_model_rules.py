"""Rules that hold for any model (issue 45), each shown on a model of this file's own, each
with the fault that breaks it: the same test run without the rule fails.

    randomness     a forward that draws from numpy's global RNG and Python's ``random``
                   (wav2vec2's SpecAugment does, with numpy): every strategy draws the same
                   masks, because every global RNG is seeded per batch and share
    model's hooks  a model that registers hooks of its own when built (Hugging Face's
                   ``gradient_checkpointing_enable`` does, on the input embeddings): the
                   capture row counts only hooks added while the capture was open
    torch refuses  an engine whose wrapper refuses the model (``fully_shard`` on a 0-dim
                   parameter, CLIP's ``logit_scale``): a recorded refusal in torch's words
    shared layers  a layer run at every depth (ALBERT): each FSDP2 hook may fire once per run
                   of its unit, measured; its sums come in pieces (not bit for bit DDP's);
                   the optimizer in backward refuses it under FSDP2, in words, before backward
    sparse         sparse gradients (DLRM's embedding bags): DDP trains and is judged, every
                   other row says why not
    warnings       torch's warnings from the ranks: in the row, once
    bounds         what is live when backward has ended under FSDP2: the model states by the
                   formula, the rest held to FSDP2's own standard step on the same model
    units          a block one of whose modules the root calls (DiT's conditioning) is no
                   FSDP2 unit; a shard without a gradient (an unused pooler) has no hook call
    yardstick      |DDP - single process| per step, stored at record: a later torch is held
                   to it with a stated headroom
    all at once    a model whose own autograd.Function hands out every gradient at the end
                   of its backward (torchdiffeq's adjoint): the memory rows say no step can
                   free one before the rest, and fail only on more than that
"""

from __future__ import annotations

import abc
import contextlib
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as module_mod

from hookbench import Workload
from hookbench.core import launch
from hookbench.core import workload as workload_module
from hookbench.core.leak_guard import untracked
from hookbench.engines import fsdp2, references
from hookbench.gate import workload_checks
from hookbench.measure.faults import inject


class SpecAugment(nn.Module):
    """Time steps masked at random in training, the mask drawn from numpy's global RNG and
    its length from Python's ``random``, inside the forward (transformers'
    ``_compute_mask_indices`` draws its masks with ``np.random``)."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encode(x))  # (batch, time, 8)
        if self.training:
            keep = np.random.rand(*h.shape[:2]) > 0.3
            keep[:, : random.randint(0, 2)] = False
            h = h * torch.from_numpy(keep).to(h.dtype).unsqueeze(-1)
        return self.head(h.mean(1))


def sequences(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


SPEC_AUGMENT = Workload("specaugment", model=SpecAugment, batch=sequences, loss=F.cross_entropy,
                        optimizer=(torch.optim.AdamW, {"lr": 1e-2}))



@contextlib.contextmanager
def _torch_only(seed: int, device="cpu"):
    """The fault: the forward's RNG as it was before the rule, torch's generator alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _problems(rows: dict) -> dict:
    return {k: v.get("problems") or v.get("error") for k, v in rows.items()
            if v.get("problems") or v.get("error")}


def test_a_forward_drawing_from_numpy_and_random_trains_alike_in_every_strategy():
    rows = workload_checks.trajectories(SPEC_AUGMENT)
    assert _problems(rows) == {}
    assert rows["specaugment/in_backward"]["parity"] == "vs forloop: bit-exact"


def test_the_rule_is_what_makes_it_hold(monkeypatch):
    # Without numpy and random seeded per batch, each strategy draws other masks: the
    # optimizer in backward, compared bit for bit with the for-loop step, fails.
    monkeypatch.setattr(workload_module, "seeded_rngs", _torch_only)
    rows = workload_checks.trajectories(SPEC_AUGMENT)
    assert "specaugment/in_backward" in _problems(rows)


def test_every_global_rng_is_restored_after_a_forward_also_on_error():
    np.random.seed(7)
    random.seed(7)
    torch.manual_seed(7)
    before = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state())
    with SPEC_AUGMENT.forward_rng(1, 0):
        np.random.rand(3), random.random(), torch.rand(3)
    with pytest.raises(RuntimeError), SPEC_AUGMENT.forward_rng(2, 1):
        np.random.rand(3)
        raise RuntimeError("a forward that raises")
    assert (np.random.get_state()[1] == before[0]).all()
    assert random.getstate() == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])
    # and the same key draws the same numbers every time, another key others
    draws = []
    for key in ((1, 0), (1, 0), (1, 1)):
        with SPEC_AUGMENT.forward_rng(*key):
            draws.append((np.random.rand(), random.random(), torch.rand(()).item()))
    assert draws[0] == draws[1] and all(a != b for a, b in zip(draws[0], draws[2]))


class OwnHooks(nn.Module):
    """A model that registers a forward hook on its embedding when built, as Hugging Face's
    ``enable_input_require_grads`` (called by ``gradient_checkpointing_enable``) does, so that
    checkpointed blocks see inputs that require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)
        self.embed.register_forward_hook(lambda m, args, out: out.requires_grad_(True))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(1))


def token_ids(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)


def own_hooks() -> OwnHooks:
    # Built unseen by this suite's leak guard: the hook is the model's own and lives as long as
    # the model, as in a user's training; the guard would count it as this test's.
    with untracked():
        return OwnHooks()


OWN_HOOKS = Workload("own-hooks", model=own_hooks, batch=token_ids, loss=F.cross_entropy)


def test_the_models_own_hooks_are_not_counted_as_left_by_the_capture():
    assert workload_checks._hooks(OWN_HOOKS.build())  # what the old check counted as left
    row = workload_checks.capture(OWN_HOOKS)["own-hooks/capture"]
    assert row["problems"] == [] and row["records"] == row["calls"] == 2


def test_a_hook_the_capture_leaves_is_still_caught_beside_the_models_own():
    global_hooks = dict(module_mod._global_forward_hooks)
    try:
        with inject("removal_does_nothing"):
            row = workload_checks.capture(OWN_HOOKS)["own-hooks/capture"]
    finally:  # the fault leaves the capture's counting hook too: a global one, put back here
        module_mod._global_forward_hooks.clear()
        module_mod._global_forward_hooks.update(global_hooks)
    assert any(p.startswith("hooks left on ['embed', 'head'") for p in row["problems"]), row


class ScaledLogits(nn.Module):
    """CLIP's learned temperature: a 0-dim parameter, which ``fully_shard`` refuses by design
    ("doesn't support scalar parameters"); DDP trains it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3))
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) * self.logit_scale.exp()


def features(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


SCALAR = Workload("scalar", model=ScaledLogits, batch=features, loss=F.cross_entropy,
                  optimizer=(torch.optim.AdamW, {"lr": 1e-2}))


@pytest.mark.distributed
def test_an_engine_torch_will_not_wrap_the_model_with_is_a_recorded_refusal_in_torchs_words():
    rows = workload_checks.zero2([SCALAR], with_zero2=False)
    assert rows["scalar/engines/ddp"]["problems"] == []
    for setting in ("zero2", "zero3", "in_backward"):
        assert rows[f"scalar/engines/fsdp2_{setting}"] == {
            "torch_refuses": "fully_shard: ValueError: fully_shard doesn't support scalar "
                             "parameters. Change logit_scale to a 1D tensor with numel equal "
                             "to 1."}, rows
    memory = workload_checks.engine_memory(SCALAR)
    assert all("torch_refuses" in row for row in memory.values()), memory
    # gated as refusals are: the same refusal holds; a refusal that goes away, or another
    # one, fails
    run = workload_checks.Run()
    assert workload_checks.judge(rows, rows, run).ok
    other = {**rows, "scalar/engines/fsdp2_zero2": {"torch_refuses": "fully_shard: other"}}
    assert not workload_checks.judge(rows, other, run).ok
    assert not workload_checks.judge(other, rows, run).ok


class ReturnsItsBias(nn.Module):
    """SigLIP's learned logit bias, handed to the loss as the parameter itself (open_clip's
    ``output_dict``): an output with no ``grad_fn``. DDP with ``find_unused_parameters=True``
    (hookbench's choice where a workload declares no ``ddp``) does not find its gradient
    accumulator from the outputs, marks it unused, then gets its gradient: "marked as ready
    twice", in plain torch too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.logit_bias = nn.Parameter(torch.full((1,), -1.0))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.lin(x), "logit_bias": self.logit_bias}


def biased_loss(output: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output["logits"] + output["logit_bias"], y)


@pytest.mark.distributed
def test_zero2_is_judged_without_ddp_where_ddp_stops_and_a_crashed_run_fails_alone():
    rows = workload_checks.zero2([SCALAR.replace(name="bias", model=ReturnsItsBias,
                                                 loss=biased_loss)])
    assert "Expected to mark a variable ready only once" in " ".join(
        rows["bias/engines/ddp"]["problems"]), rows
    # ZeRO-2 trained: held to one process on the ranks' shares, and not compared with the DDP
    # beside it, which stopped (its own row says why); before, its checks read DDP's missing
    # parameters: "KeyError: 'snapshots'"
    zero2 = rows["bias/zero2"]
    assert zero2["problems"] == [], zero2
    assert "vs DDP: not compared (DDP did not train the workload" in zero2["parity"], zero2
    # torch's FSDP2 frees a parameter the forward returned when it reshards after forward, and
    # the loss reads it: the rank dies (SIGSEGV on 2.14.1, also in plain torch). That run
    # alone fails; every other run of the launch is judged.
    assert rows["bias/engines/fsdp2_zero2"]["problems"] == [], rows["bias/engines/fsdp2_zero2"]
    for setting in ("zero3", "in_backward"):
        problems = rows[f"bias/engines/fsdp2_{setting}"]["problems"]
        assert problems and all("process killed by" in p and "a crash, not an exception"
                                in p for p in problems), problems


def test_a_death_outside_any_run_stops_the_launch_as_before(monkeypatch):
    # no rank had begun a run (its progress file says none): nothing to blame one run for
    def run(fn, world, cases, progress, timeout, backend):
        raise launch.RankFailed(f"rank 1 of 2 {launch.died(-9)}", 1, -9)

    monkeypatch.setattr(launch, "run", run)
    with pytest.raises(launch.RankFailed, match="rank 1 of 2 was killed by SIGKILL"):
        references.run_cases([{"key": ("w", "zero2", "x")}], 2, 10.0)
    assert launch.died(3) == "exited with code 3"


class AbstractBlock(abc.ABC, nn.Module):
    """A module class that derives from ``abc.ABC`` first (sentence-transformers' modules do):
    Python will not turn its instances into FSDP2's subclass of it in place ("object layout
    differs")."""


class Encoder(AbstractBlock):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.distributed
def test_a_module_class_fsdp2_cannot_subclass_in_place_is_a_refusal_in_pythons_words():
    rows = workload_checks.zero2([SCALAR.replace(name="abstract", model=Encoder)],
                                 with_zero2=False)
    assert rows["abstract/engines/ddp"]["problems"] == []
    for setting in ("zero2", "zero3", "in_backward"):
        assert rows[f"abstract/engines/fsdp2_{setting}"] == {
            "torch_refuses": "fully_shard: TypeError: __class__ assignment: 'FSDPEncoder' "
                             "object layout differs from 'Encoder'"}, rows


class SharedDepth(nn.Module):
    """ALBERT's shape: one layer group, held once, applied at every depth."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.groups = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(3):
            h = h + self.groups[0](h)
        return self.head(h)


SHARED = Workload("shared", model=SharedDepth, batch=features, loss=F.cross_entropy,
                  optimizer=(torch.optim.AdamW, {"lr": 1e-2}))


def test_how_often_a_shards_hook_may_fire_follows_from_how_often_its_unit_runs():
    runs = fsdp2.unit_runs(SHARED)
    assert runs == {"embed.weight": 1, "embed.bias": 1, "groups.0.0.weight": 3,
                    "groups.0.0.bias": 3, "groups.0.2.weight": 3, "groups.0.2.bias": 3,
                    "head.weight": 1, "head.bias": 1}
    assert "groups.0.0.weight: 3 runs" in fsdp2.repeated_units(SHARED)


@pytest.mark.distributed
def test_a_layer_shared_across_depth_trains_under_fsdp2_and_the_optimizer_in_backward_refuses():
    rows = workload_checks.zero2([SHARED], with_zero2=False)
    for engine in ("ddp", "fsdp2_zero2", "fsdp2_zero3"):
        assert rows[f"shared/engines/{engine}"]["problems"] == [], rows
    # the yardstick the baseline keeps, one value per step
    assert len(rows["shared/engines/ddp"]["noise_floor"]) == workload_checks.STEPS
    # summed in pieces, one per run: against DDP within the measured yardstick, not bit for bit
    assert "in pieces, once per run: within tolerance and 2x the noise floor" in rows[
        "shared/engines/fsdp2_zero2"]["parity"]
    refused = rows["shared/engines/fsdp2_in_backward"]["refused"]
    assert refused.startswith("ValueError: FSDP2 unit 'groups.0' runs 2 times in one forward")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hook_that_fires_twice_is_still_caught_beside_a_shared_layer():
    # on the parameters whose unit runs once (~4 s; the engines' fault tests are in the
    # default tier)
    faulty = workload_checks.zero2([SHARED], fault="fires_twice", with_zero2=False)
    assert "'embed.weight': 2" in " ".join(faulty["shared/engines/fsdp2_zero2"]["problems"])


class Recommender(nn.Module):
    """DLRM's shape, as recommender code writes it: embedding bags with sparse gradients (sum
    pooling), a dense bottom MLP, pairwise dot interactions, a top MLP; Adagrad."""

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
                                    for _ in range(3))
        self.bottom = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(8 + 6, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        z = torch.stack([x, *(t(ids[:, i]) for i, t in enumerate(self.tables))], 1)
        upper = torch.triu_indices(4, 4, 1)
        pairs = torch.bmm(z, z.transpose(1, 2))[:, upper[0], upper[1]]
        return self.top(torch.cat([x, pairs], 1)).squeeze(1)


def clicks(g: torch.Generator) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return ((torch.randn(8, 4, generator=g), torch.randint(0, 50, (8, 3, 2), generator=g)),
            torch.randint(0, 2, (8,), generator=g).float())


RECOMMENDER = Workload("dlrm", model=Recommender, batch=clicks,
                       loss=F.binary_cross_entropy_with_logits,
                       optimizer=(torch.optim.Adagrad, {"lr": 0.05}))


@pytest.mark.distributed
def test_sparse_gradients_train_under_ddp_and_every_other_row_says_why_not():
    rows = workload_checks.measure_all([RECOMMENDER])
    assert {k: v for k, v in rows.items() if "error" in v or v.get("problems")} == {}
    assert "vs one process on the ranks' shares: ok" in rows["dlrm/engines/ddp"]["parity"]
    assert rows["dlrm/zero2"]["refused"].startswith(
        "ValueError: ZeRO-2 reduces gradients as flat dense buckets, and 'tables.0' "
        "(EmbeddingBag(sparse=True))")
    for key in ("engines/fsdp2_zero2", "memory/fsdp2_zero3"):
        assert rows[f"dlrm/{key}"] == {"not_applicable": (
            "FSDP2 reduce-scatters dense gradients, and 'tables.0' "
            "(EmbeddingBag(sparse=True)) makes sparse ones")}
    # the sparse gradients are counted, as their indices and values
    assert rows["dlrm/memory/foreach"]["breakdown"]["gradients"] > 0
    assert rows["dlrm/capture"]["records"] > 0


class ViewOut(nn.Module):
    """A forward that returns a view (a slice of the logits), on which FSDP2 warns, once per
    rank: "FSDP2-wrapped module ... returned a view tensor"."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)[:, :3]


VIEW = Workload("view", model=ViewOut, batch=features, loss=F.cross_entropy)


@pytest.mark.distributed
def test_torchs_warnings_go_into_the_rows_detail_once_not_raw_onto_the_terminal(capfd):
    rows = workload_checks.zero2([VIEW], with_zero2=False)
    out, err = capfd.readouterr()
    assert "returned a view tensor" not in out + err
    warned = rows["view/engines/fsdp2_zero2"]["warnings"]
    assert len(warned) == 1 and warned[0].startswith("UserWarning: FSDP2-wrapped module")
    section = workload_checks.judge(rows, rows, workload_checks.Run())
    details = [cells[-1] for cells, _ in section.rows]
    assert sum("returned a view tensor" in d for d in details) == 1, details  # said once


class KeepsItsState(nn.Module):
    """A model that keeps a tensor from its forward until the next one (a recurrent or
    state-space model's last state, a cache): live when backward has ended, beside its
    states."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(6, 64), nn.Tanh()),
                                    nn.Linear(64, 3))
        self.last_state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks[0](x)
        self.last_state = hidden.detach().clone()
        return self.blocks[1](hidden)


KEEPS = Workload("keeps", model=KeepsItsState, batch=features, loss=F.cross_entropy)


def test_what_the_model_keeps_after_backward_is_held_to_fsdp2s_own_standard_step():
    # The rule: when backward has ended, the model states match the formula; the activations
    # and temporaries still live have no formula, and the optimizer in backward may leave no
    # more of them than ZeRO-3 with a standard step on the same model.
    rows = workload_checks.engine_memory(KEEPS)
    assert all(row["problems"] == [] for row in rows.values()), rows
    # the model's own state: 4 x 64 float32, rounded to 512 B blocks (the fake backend's)
    assert {key: row["left"] for key, row in rows.items()} == dict.fromkeys(rows, 1024)
    # A gradient kept after its step is more than ZeRO-3 leaves: caught in the same row.
    with inject("keeps_gradients_alive"):
        faulty = workload_checks.engine_memory(KEEPS)
    assert any("of activations and temporaries live, more than ZeRO-3's 1.024 KB" in p
               for p in faulty["keeps/memory/fsdp2_in_backward"]["problems"]), faulty


class ConditionedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mlp = nn.Linear(1, 6), nn.Linear(6, 6)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h) * e


class Conditioned(nn.Module):
    """DiT's shape (diffusers): the root embeds the timestep with a module that belongs to the
    first block (``transformer_blocks.0.norm1.emb``), outside that block's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConditionedBlock() for _ in range(2)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.blocks[0].emb(x[:, :1])
        for block in self.blocks:
            x = block(x, e)
        return self.head(x)


CONDITIONED = Workload("conditioned", model=Conditioned, batch=features, loss=F.cross_entropy)


def test_a_block_whose_module_the_root_calls_stays_in_the_roots_unit(monkeypatch):
    assert fsdp2.called_outside(CONDITIONED) == {"blocks.0"}
    rows = workload_checks.engine_memory(CONDITIONED)
    assert all(row["problems"] == [] for row in rows.values()), rows
    # Without the rule, block 0 is a unit, and its parameters are sharded when the root calls
    # its embedding.
    monkeypatch.setattr(fsdp2, "called_outside", lambda workload, fake=False: frozenset())
    broken = workload_checks.engine_memory(CONDITIONED)
    assert all("mixed torch.Tensor and DTensor" in row["error"] for row in broken.values()), broken


def test_a_shard_without_a_gradient_may_go_without_its_hook_call():
    # An unused pooler (VisionEncoderDecoder's ViT encoder): no gradient, so FSDP2 reduces
    # nothing for it and calls no hook. A shard that has its gradient must have had its call.
    runs = {"used": 1, "pooler": 1}
    seen = {"synced": True, "hook_calls": {"used": 1}, "not_reduced": [], "unsharded_grads": [],
            "shard_grads": ["used"]}
    assert fsdp2.hook_problems([seen], runs, in_backward=False) == []
    lost = {**seen, "hook_calls": {}, "shard_grads": ["used", "pooler"]}
    assert "{'used': 0, 'pooler': 0} times" in fsdp2.hook_problems([lost], runs, False)[0]
    # in backward the step frees every gradient: a call that was due and lost leaves it behind
    stepped = {**seen, "shard_grads": []}
    assert fsdp2.hook_problems([stepped], runs, in_backward=True) == []
    left = {**lost, "shard_grads": ["used"]}
    assert "shard gradients left after their step on ['used']" in fsdp2.hook_problems(
        [left], runs, in_backward=True)[0]


@pytest.mark.parametrize("grown, ddp_order, holds", [
    (1.0, None, True), (3.9, None, True), (4.0 + 1e-3, None, False), (340.0, False, False),
    (340.0, True, True)])
def test_the_yardstick_recorded_on_the_trusted_torch_holds_a_later_one(grown, ddp_order, holds):
    # |DDP - single process| per step, as record stores it in the DDP and ZeRO-2 rows; a later
    # torch may move it within YARDSTICK_HEADROOM (4x) and the row's atol, no further: a
    # reduction wrong alike in DDP and in what is judged against DDP shows here. Further only
    # where DDP is bit for bit one process in DDP's order on this torch (its reduction exact):
    # examples/hf's BatchNorm ResNet, 2.6.0 -> 2.9.1, grew 340x with a kernel rounding.
    atol = 1e-6
    row = {"sha256": "0" * 64, "tolerance": {"rtol": 1e-5, "atol": atol},
           "noise_floor": [0.0, 3e-5]}
    now = {**row, "noise_floor": [0.0, 3e-5 * grown + atol]}
    if ddp_order is not None:
        now["ddp_order"] = ddp_order
    section = workload_checks.judge({"w/engines/ddp": row}, {"w/engines/ddp": now},
                                    workload_checks.Run())
    assert section.ok is holds, section.rows
    detail = section.rows[0][0][-1]
    assert ("YARDSTICK GREW: DDP is" in detail) is (not holds)
    assert ("yardstick grew, and holds: DDP is" in detail) is (grown > 4 and holds)
    assert ("bit-exact with one process in DDP's order" in detail) is bool(ddp_order)


class Recomputed(torch.autograd.Function):
    """The forward of ``net`` without a graph; its backward runs it again with one and hands
    out every parameter's gradient at once, as views of one flat tensor (torchdiffeq's
    ``odeint_adjoint`` integrates one flat adjoint state backwards in its backward and
    splits it): one storage, alive until the last gradient is freed."""

    @staticmethod
    def forward(ctx, net: nn.Module, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.net = net
        ctx.save_for_backward(x)
        with torch.no_grad():
            return net(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            grads = torch.autograd.grad(ctx.net(x), (x, *ctx.net.parameters()), grad)
        flat = torch.cat([g.flatten() for g in grads])
        return (None, *(piece.view_as(g) for piece, g in zip(
            flat.split([g.numel() for g in grads]), grads)))


class AdjointLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh(),
                                 nn.Linear(32, 4, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Recomputed.apply(self.net, x, *self.net.parameters())


class AdjointBlock(AdjointLike):
    """The recomputed block inside a model (torchdiffeq's ODE block between a stem and a
    head): its gradients come as views of one storage larger than theirs, the head's on
    their own."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(super().forward(x))


def wide_features(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


ADJOINT_LIKE = Workload("adjoint-like", model=AdjointLike, batch=wide_features,
                        loss=F.cross_entropy, optimizer=(torch.optim.Adam, {"lr": 1e-2}))


def test_gradients_a_models_backward_hands_out_at_once_are_held_at_once(monkeypatch):
    rows = workload_checks.memory(ADJOINT_LIKE)
    for strategy in ("in_backward", "zero2"):
        row = rows[f"adjoint-like/memory/{strategy}"]
        assert row["problems"] == [], row
        assert row["together"] == ("every gradient arrives at once, from RecomputedBackward in "
                                   "backward: none can be freed before the rest"), row
    # what the optimizer in backward still must not do: keep a gradient after its step
    with inject("keeps_gradients_alive"):
        kept = workload_checks.memory(ADJOINT_LIKE)["adjoint-like/memory/in_backward"]
    assert any("when backward ended" in p for p in kept["problems"]), kept
    # without the rule, the model's own structure reads as the strategies' failure
    from hookbench.measure import memory

    monkeypatch.setattr(memory, "arriving_together", lambda *a, **k: (0, ""))
    rows = workload_checks.memory(ADJOINT_LIKE)
    assert "holds every gradient at once" in rows["adjoint-like/memory/in_backward"][
        "problems"][0], rows


def test_gradients_held_as_views_of_a_larger_storage_are_held_to_the_standard_step():
    """The block's gradients count the storage they view (the input's gradient in it too): the
    optimizer in backward holds more bytes than the parameters' gradients, and still fewer
    than the standard step, measured alike, which is the saving."""
    block = ADJOINT_LIKE.replace(name="adjoint-block", model=AdjointBlock)
    rows = workload_checks.memory(block)
    standard = rows["adjoint-block/memory/foreach"]["gradients_alive_max"]
    row = rows["adjoint-block/memory/in_backward"]
    assert row["problems"] == [] and "together" not in row, row
    assert row["gradients_alive_max"] < standard, (row, standard)
    with inject("keeps_gradients_alive"):
        kept = workload_checks.memory(block)["adjoint-block/memory/in_backward"]
    assert any("a gradient kept after its step" in p for p in kept["problems"]), kept
