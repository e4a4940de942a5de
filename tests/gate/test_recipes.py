"""What real training recipes put in a ``Workload``, each checked to hold or to refuse in words,
and each check shown to fail when what it guards breaks:

    dropout          the forward's random numbers are seeded per batch and share, so every
                     strategy, and each ZeRO-2 rank's share, draws the reference's masks
    rounding level   a gradient that is zero in exact arithmetic (an attention key bias) is
                     found, and only those elements may differ by an optimizer step
    recipes          param groups, an LR scheduler, gradient clipping, keyword inputs,
                     checkpointing per layer by module class or name pattern
    report           ``hookbench report --workload`` runs the workload's own rows
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload
from hookbench.cli import main
from hookbench.gate import workload_checks
from hookbench.measure.faults import inject
from hookbench.measure.parity import (Comparison, NoiseBounds, Tolerance, compare,
                                      largest_step_per_lr, rounding_level, training, trajectory)
from hookbench.mechanisms import activation_capture, optimizer_in_backward


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.drop, self.out = nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.inp(x))))


class KeyBiasAttention(nn.Module):
    """One attention head with a qkv bias, as timm's ViT: softmax ignores a constant added to
    every score of a query, so the key bias's gradient is zero in exact arithmetic."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v))


class Tokens(nn.Module):
    """Keyword inputs, as a Hugging Face model takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        return self.head(torch.relu(self.block(h)))


def vectors(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def sequences(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 5, 8, generator=g), torch.randn(4, 5, 8, generator=g)


def token_batch(g: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, 11, (4, 6), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(4, 6)}, ids


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def no_decay_on_vectors(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


DROPOUT = Workload("dropout", model=DropoutNet, batch=vectors, loss=F.cross_entropy,
                   optimizer=(torch.optim.AdamW, {"lr": 1e-2}))
KEY_BIAS = Workload("key-bias", model=KeyBiasAttention, batch=sequences, loss=F.mse_loss,
                    optimizer=(torch.optim.Adam, {"lr": 1e-3}))
RECIPE = Workload("recipe", model=Tokens, batch=token_batch, loss=token_loss,
                  optimizer=(torch.optim.AdamW, {"lr": 1e-2}), param_groups=no_decay_on_vectors,
                  lr_scheduler=(torch.optim.lr_scheduler.LinearLR,
                                {"start_factor": 0.2, "total_iters": 2}))


def _failed(rows: dict) -> list[str]:
    return [key for key, row in rows.items() if row.get("problems") or "error" in row]


# -- dropout ----------------------------------------------------------------------------------

def test_dropout_draws_the_same_masks_in_every_strategy():
    rows = workload_checks.trajectories(DROPOUT)
    assert _failed(rows) == []
    assert rows["dropout/in_backward"]["parity"] == "vs forloop: bit-exact"
    assert rows["dropout/in_backward_grouped"]["parity"] == "vs forloop: bit-exact"


def test_without_the_seeded_forward_dropout_reads_as_an_optimizer_mismatch(monkeypatch):
    # What the issue saw on GPT-2: each run drew other masks from the global generator.
    monkeypatch.setattr(Workload, "forward_rng", lambda self, *a, **k: contextlib.nullcontext())
    rows = workload_checks.trajectories(DROPOUT)
    assert "MISMATCH (bit-exact expected)" in rows["dropout/in_backward"]["problems"][0]


def test_the_forward_rng_is_restored_and_differs_per_batch_and_share():
    state = torch.random.get_rng_state()
    draws = {}
    for key in [(0, 0), (0, 1), (1, 0), (0, 0)]:
        with DROPOUT.forward_rng(*key):
            draws.setdefault(key, []).append(torch.rand(4))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(*draws[(0, 0)])
    assert not torch.equal(draws[(0, 0)][0], draws[(0, 1)][0])
    assert not torch.equal(draws[(0, 0)][0], draws[(1, 0)][0])


@pytest.mark.distributed
def test_zero2_draws_on_each_rank_the_masks_the_reference_draws_for_its_share():
    row = workload_checks.zero2([DROPOUT])["dropout/zero2"]
    assert row["problems"] == [] and "ok" in row["parity"] or "bit-exact" in row["parity"]


# -- gradients at rounding level -----------------------------------------------------------------

def _level(workload: Workload) -> dict[str, torch.Tensor]:
    with training(workload, *workload.optimizer, "forloop") as run:
        return rounding_level(workload, run.model, [workload.data(0)], [(0, 0)])


def test_the_key_bias_gradient_is_found_at_rounding_level_and_nothing_else():
    level = _level(KEY_BIAS)
    dim = 8
    key = torch.zeros(3 * dim, dtype=torch.bool)
    key[dim:2 * dim] = True
    assert torch.equal(level["qkv.bias"], key)  # the key third, and only it
    assert sum(int(m.sum()) for n, m in level.items() if n != "qkv.bias") == 0


def test_a_model_without_such_gradients_has_none_at_rounding_level():
    assert sum(int(m.sum()) for m in _level(DROPOUT).values()) == 0


@pytest.mark.parametrize("cls, group", [
    (torch.optim.Adam, {"lr": 1.0}), (torch.optim.Adam, {"lr": 1.0, "betas": (0.9, 0.95)}),
    (torch.optim.AdamW, {"lr": 1.0, "weight_decay": 0.0}), (torch.optim.Adagrad, {"lr": 1.0}),
    (torch.optim.RMSprop, {"lr": 1.0}), (torch.optim.RMSprop, {"lr": 1.0, "momentum": 0.5}),
])
@pytest.mark.parametrize("scales", [
    [1e-10] * 6,                              # noise every step
    [1.0] + [1e-10] * 5,                      # a real gradient, then noise
    [1e-10, -1e-10] * 3,                      # noise flipping sign
    [1e-6, 1.0, -1e-10, 1e-10, -1.0, 1e-10],  # mixed scales
])
def test_largest_step_per_lr_bounds_every_step_torch_takes(cls, group, scales):
    p = nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = cls([p], **group, foreach=False)
    bound = largest_step_per_lr(opt.param_groups[0])
    for g in scales:
        before = p.detach().clone()
        p.grad = torch.full_like(p, g)
        opt.step()
        assert float((p.detach() - before).abs()) <= bound * group["lr"] * (1 + 1e-12)


def test_an_optimizer_whose_step_scales_with_the_gradient_is_not_excused():
    assert largest_step_per_lr(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1,
                                               momentum=0.9).param_groups[0]) is None


def test_noise_bounds_excuse_only_rounding_level_elements_and_only_up_to_the_bound():
    tol = Tolerance(rtol=0.0, atol=1e-6)
    expected = [{"w": torch.zeros(4)}]
    bound = [{"w": torch.tensor([0.0, 1e-3, 0.0, 0.0], dtype=torch.float64)}]

    def check(diff: list[float]) -> Comparison:
        return compare([{"w": torch.tensor(diff)}], expected, tol, bound)

    within = check([0.0, 9e-4, 0.0, 0.0])
    assert within.ok and within.rounding_level == 1 and "1 elements" in within.verdict()
    assert not check([0.0, 2e-3, 0.0, 0.0]).ok  # a step beyond any the optimizer takes
    assert not check([2e-6, 9e-4, 0.0, 0.0]).ok  # an element not at rounding level
    with pytest.raises(ValueError, match="need a tolerance"):
        compare(expected, expected, None, bound)


def test_noise_bounds_grow_by_each_steps_lr_from_the_first_step_an_element_is_noise():
    with training(KEY_BIAS, *KEY_BIAS.optimizer, "forloop") as run:
        bounds = NoiseBounds()
        for i in range(2):
            bounds.add(run, rounding_level(KEY_BIAS, run.model, [KEY_BIAS.data(i)], [(i, 0)]))
            run.step(i)
    reach = 2 * largest_step_per_lr(run.optimizer.param_groups[0]) * 1e-3
    first, second = (s["qkv.bias"] for s in bounds.steps)
    assert torch.allclose(first[8:16], torch.full((8,), reach, dtype=torch.float64))
    assert torch.allclose(second[8:16], torch.full((8,), 2 * reach, dtype=torch.float64))
    assert int((first > 0).sum()) == 8 and float(bounds.steps[-1]["qkv.weight"].sum()) == 0


# -- recipes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, error, words", [
    ({"param_groups": [1]}, TypeError, "param_groups must be a function of the model"),
    ({"lr_scheduler": torch.optim.lr_scheduler.LinearLR}, TypeError, "(class, kwargs) pair"),
    ({"lr_scheduler": (torch.optim.Adam, {})}, TypeError, "lr_scheduler class"),
    ({"clip_grad_norm": 0.0}, ValueError, "clip_grad_norm must be None or a positive number"),
    ({"clip_grad_norm": True}, ValueError, "clip_grad_norm must be None or a positive number"),
    ({"checkpointing": "blocks.0"}, ValueError, "re.compile"),
    ({"checkpointing": ()}, TypeError, "checkpointing must be one of"),
    ({"checkpointing": nn.Linear(2, 2)}, TypeError, "checkpointing must be one of"),
])
def test_a_malformed_recipe_is_refused_in_words(changes, error, words):
    with pytest.raises(error, match=re.escape(words)):
        RECIPE.replace(**changes)


def test_param_groups_that_are_not_groups_are_refused_when_training_starts():
    with pytest.raises(TypeError, match="non-empty list of dicts with 'params'"):
        trajectory(RECIPE.replace(param_groups=lambda m: [list(m.parameters())]),
                   *RECIPE.optimizer, "forloop", steps=1)


def test_param_groups_a_scheduler_and_keyword_inputs_train_alike_in_every_strategy():
    rows = workload_checks.trajectories(RECIPE)
    assert _failed(rows) == []
    assert rows["recipe/in_backward"]["parity"] == "vs forloop: bit-exact"


@pytest.mark.parametrize("without", [{"param_groups": None}, {"lr_scheduler": None}])
def test_the_param_groups_and_the_scheduler_change_the_training(without):
    # Each is applied: without it the same steps end elsewhere.
    steps = [trajectory(w, *w.optimizer, "forloop", steps=3)[-1]
             for w in (RECIPE, RECIPE.replace(**without))]
    assert not compare([steps[0]], [steps[1]]).bit_exact


@pytest.mark.distributed
def test_zero2_trains_param_groups_a_scheduler_clipping_and_a_key_bias_like_one_process():
    rows = workload_checks.zero2([RECIPE.replace(clip_grad_norm=0.5), KEY_BIAS])
    assert _failed(rows) == []
    # Compared, not refused: bit for bit, or within tolerance with the key bias's rounding-level
    # elements excused (seen both: "ok: ... 0.00831x of tolerance" when run alone on torch
    # 2.14.1; the old assertion only accepted a verdict starting with "ok", which none does).
    assert re.match(r"vs DDP on the same shares: (bit-exact|ok: ).*; vs one process on the "
                    r"ranks' shares: (bit-exact|ok: )",
                    rows["key-bias/zero2"]["parity"]), rows["key-bias/zero2"]["parity"]


def test_clipping_is_held_by_the_standard_step_and_refused_by_the_optimizer_in_backward():
    rows = workload_checks.trajectories(RECIPE.replace(clip_grad_norm=0.5))
    assert _failed(rows) == []
    refused = {key: row["refused"] for key, row in rows.items() if "refused" in row}
    assert sorted(refused) == [f"recipe/{s}" for s in ("in_backward", "in_backward_bucketed",
                                                       "in_backward_grouped",
                                                       "in_backward_grouped_foreach")]
    assert all(r.startswith("ValueError: global gradient-norm clipping needs the norm over "
                            "every gradient") for r in refused.values())
    clipped, plain = (trajectory(w, *w.optimizer, "forloop", steps=1)[-1]
                      for w in (RECIPE.replace(clip_grad_norm=0.01), RECIPE))
    assert not compare([clipped], [plain]).bit_exact  # the clip is applied


def test_clipping_that_the_optimizer_in_backward_accepted_would_fail_the_row(monkeypatch):
    monkeypatch.setattr(optimizer_in_backward.OptimizerInBackward, "clip_grad_norm_",
                        lambda self, *a, **k: None)
    row = workload_checks.trajectories(RECIPE.replace(clip_grad_norm=0.5))["recipe/in_backward"]
    assert "accepted global gradient clipping" in row["error"]


class _Block(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return torch.tanh(self.inner(x))


def _stack() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Sequential(_Block(), _Block()), nn.Linear(8, 8))


@pytest.mark.parametrize("selector", [_Block, (_Block, nn.Tanh), re.compile(r"1\.\d+"),
                                      re.compile(r"1(\.\d+)?")])
def test_checkpointing_per_layer_by_class_or_pattern_recomputes_each_layer_once(selector):
    w = KEY_BIAS.replace(model=_stack, checkpointing=selector)
    _Block.calls = 0
    model, (x, y) = w.build(), w.data(0)
    w.compute_loss(model, x, y).backward()
    # 2 blocks, once in forward and once recomputed; the pattern that also matches their
    # parent ("1") checkpoints the parent only, never a checkpoint inside a checkpoint.
    assert _Block.calls == 4
    plain = w.replace(checkpointing="none").build()
    w.compute_loss(plain, x, y).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                            plain.parameters()))


def test_a_selector_that_selects_nothing_is_refused_when_the_model_is_built():
    with pytest.raises(ValueError, match=r"re.compile\('blocks'\) selects no module"):
        KEY_BIAS.replace(model=_stack, checkpointing=re.compile("blocks")).build()


# -- capture and the report ---------------------------------------------------------------------

def test_capture_of_a_training_step_with_keyword_inputs_changes_nothing():
    row = workload_checks.capture(RECIPE)["recipe/capture"]
    assert row == {"records": 3, "calls": 3, "problems": []}


def test_a_capture_that_misses_calls_fails_the_row(monkeypatch):
    monkeypatch.setattr(activation_capture.ActivationCapture, "_record", lambda *a, **k: None)
    row = workload_checks.capture(RECIPE)["recipe/capture"]
    assert row["problems"] == ["0 calls recorded of 3 submodule calls"]


def test_report_with_a_workload_runs_its_own_rows(capsys, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_recipe.py").write_text("from test_recipes import RECIPE\n")
    code = main(["report", "--workload", "my_recipe:RECIPE", "--sections",
                 "optimizer,capture,memory", "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"recipe/in_backward_grouped +vs forloop: bit-exact", out)
    assert "recipe/capture" in out and "mlp" not in out
    # a 1.6 KB model: its memory table is in KB, not a column of 0.000 GB
    assert "backend fake; KB)" in out



def test_a_workloads_zero2_ranks_are_held_below_its_standard_step_and_fail_kept_gradients():
    from hookbench import report
    from hookbench.measure.memory import measure

    wide = Workload("wide", model=lambda: nn.Sequential(nn.Linear(256, 256), nn.ReLU(),
                                                        nn.Linear(256, 256)),
                    batch=lambda g: (torch.randn(8, 256, generator=g),
                                     torch.randn(8, 256, generator=g)), loss=F.mse_loss)
    own = {"wide/zero2": {"problems": [], "parity": "vs forloop on the ranks' shares: ok"}}
    standard = measure(wide, "foreach")
    section = report.zero2_section(wide, "fake", standard, None, parity=own)
    assert section.ok and "below the standard step's" in section.title, section.rows
    assert all("x the standard step's" in cells[-1] for cells, _ in section.rows[1:])
    with inject("keeps_gradients_alive"):
        section = report.zero2_section(wide, "fake", standard, None, parity=own)
    failed = [cells for cells, ok in section.rows[1:] if not ok]
    # seen: rank 0 of 2 in fp32 (its shard half the model) at 1.10x the standard step
    assert failed and all("not below the standard step's" in cells[-1]
                          or "holds every gradient at once" in cells[-1] for cells in failed)


def test_a_capture_that_changes_the_output_fails_the_row(monkeypatch):
    def changes(self, module, args, output):  # a hook that hands back another output
        return output * 1.0001 if torch.is_tensor(output) else None

    monkeypatch.setattr(activation_capture.ActivationCapture, "_record", changes)
    row = workload_checks.capture(RECIPE)["recipe/capture"]
    assert "the captured step's loss or gradients differ from the plain step's" in row["problems"]
