"""Pure low-precision training (issue 46): a workload whose model, inputs and optimizer state
are bf16 or fp16, no autocast and no fp32 masters, as torchtune trains by default.

    the workload      ``precision="bf16-true"`` casts the model and floating inputs, no
                      autocast, no GradScaler; with compile, or a bf16 model that does not
                      declare it, refused in words before any forward
    step by step      each implementation against the for-loop from the for-loop's own state
                      (``parity.stepwise``), for every family the gate's parity rows use; it
                      fails a kernel that skips bf16 updates (pytorch#191763, torch 2.12-2.13,
                      the fault ``fused_sgd_skips_low_precision``) or scales them, and refuses
                      a for-loop that makes non-finite values (pure fp16 Adam)
    the rows          a pure-bf16 LM with fused SGD: every strategy bit for bit its reference
                      but foreach and fused, held step by step; recorded bits gated bit for
                      bit; ZeRO-2, the engines and FSDP2's memory bound in the model's dtype
    by place          torch's CPU kernels round a bf16 element by where it falls in the tensor,
                      so ZeRO-2's 1-D pieces are held to DDP within the bound, not bit for bit:
                      an MLP whose pieces cut a vector in two holds, and fails under a fault
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload
from hookbench.cli import main
from hookbench.engines.memory import state_bytes
from hookbench.gate import workload_checks
from hookbench.gate.checks import ACCUMULATION, REPORT_SPEC, STEPS, Run
from hookbench.measure.faults import inject
from hookbench.measure.parity import (AGAINST_FORLOOP, IMPLEMENTATION_CASES,
                                      missing_implementation, stepwise)

BF16 = dataclasses.replace(REPORT_SPEC, dtype=torch.bfloat16)  # the gate's parity rows' model


class TinyLM(nn.Module):
    """A decoder as torchtune builds one, small: token embedding, pre-norm causal layers with
    dropout, a final norm and a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.1, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # torchtune's recipes compute the cross-entropy on logits upcast to fp32
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def regression(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


# pytorch#191763's case: fused SGD in pure bf16; AdamW is torchtune's default optimizer
SGD_FUSED = Workload(name="lm-bf16-sgd", model=TinyLM, batch=tokens, loss=next_token_loss,
                     optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
                     precision="bf16-true")
ADAMW = SGD_FUSED.replace(name="lm-bf16", optimizer=(torch.optim.AdamW,
                                                     {"lr": 1e-3, "weight_decay": 0.01}))


# -- the workload -------------------------------------------------------------------------------

def test_a_pure_workload_trains_its_model_and_floating_inputs_in_its_dtype():
    w = Workload(name="pure", model=mlp, batch=regression, loss=mse, precision="bf16-true")
    model = w.build()
    assert {t.dtype for t in [*model.parameters(), *model.buffers()]
            if t.is_floating_point()} == {torch.bfloat16}
    assert w.parameter_dtype == torch.bfloat16 and w.pure == torch.bfloat16
    x, y = w.data(0)
    assert x.dtype == torch.bfloat16 and y.dtype == torch.float32  # the target as given
    assert SGD_FUSED.data(0)[0].dtype == torch.int64  # token ids stay ids
    assert w.grad_scaler("cpu") is None  # torch's GradScaler refuses fp16 gradients
    with w.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    assert w.replace(precision="fp16-true").build()[0].weight.dtype == torch.float16


def test_pure_precision_with_compile_is_refused_in_words():
    with pytest.raises(ValueError, match="precision='bf16-true' with compile='inductor' is not "
                                         "supported: compiled low-precision code rounds"):
        SGD_FUSED.replace(compile="inductor")


def test_low_precision_parameters_not_declared_are_refused_before_any_forward():
    calls = []

    def counted(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return mse(output, target)

    w = Workload(name="undeclared", model=lambda: mlp().to(torch.bfloat16), batch=regression,
                 loss=counted)
    with pytest.raises(ValueError, match=r"model\(\) builds parameters in bfloat16 under "
                                         r"precision='fp32'; declare precision='bf16-true'"):
        w.check()
    assert calls == []
    w.replace(precision="bf16-true").check()  # declared: it runs
    assert calls


# -- step by step against the for-loop ----------------------------------------------------------

@pytest.mark.parametrize("case, implementation", [
    (case, impl) for case, (cls, _) in IMPLEMENTATION_CASES.items() for impl in AGAINST_FORLOOP
    if not missing_implementation(cls, impl)])
def test_every_implementation_follows_the_forloop_step_by_step_in_bf16(case, implementation):
    cls, kw = IMPLEMENTATION_CASES[case]
    result = stepwise(BF16, cls, kw, implementation, steps=STEPS, accumulation=ACCUMULATION)
    # seen on torch 2.14.1: at most 0.85x of the bound (SGD foreach, a momentum buffer)
    assert result.ok, result.verdict()


def test_a_kernel_that_skips_bf16_updates_fails_the_step_by_step_check():
    # pytorch#191763, emulated: the parameter stays where it was, a whole update away
    cls, kw = IMPLEMENTATION_CASES["sgd"]
    with inject("fused_sgd_skips_low_precision"):
        skipped = stepwise(BF16, cls, kw, "fused", steps=STEPS, accumulation=ACCUMULATION)
        fp32 = stepwise(REPORT_SPEC, cls, kw, "fused", steps=STEPS, accumulation=ACCUMULATION)
    assert not skipped.ok and skipped.verdict().startswith("FAIL"), skipped.verdict()
    assert skipped.ratio > 3  # seen: 5.8x
    assert fp32.ok, fp32.verdict()  # the fault is bf16's and fp16's only, as the bug was


def test_a_kernel_that_scales_the_update_fails_the_step_by_step_check(monkeypatch):
    # 16 eps|change| allows an eighth of the update for the rounding of Adam's intermediates;
    # an update half again as large is outside it
    adam = importlib.import_module("torch.optim.adam")
    kernel = adam._fused_adam
    monkeypatch.setattr(adam, "_fused_adam",
                        lambda *a, lr, **k: kernel(*a, lr=lr * 1.5, **k))
    cls, kw = IMPLEMENTATION_CASES["adam"]
    result = stepwise(BF16, cls, kw, "fused", steps=STEPS, accumulation=ACCUMULATION)
    assert not result.ok, result.verdict()


def test_a_forloop_that_makes_non_finite_values_is_refused_with_what_to_do():
    # Adam's eps 1e-8 is 0 in fp16: a zero gradient divides 0 by 0
    cls, kw = IMPLEMENTATION_CASES["adam"]
    with pytest.raises(ValueError, match=r"the for-loop step in float16 made a non-finite value "
                                         r"at step 0, .*precision='fp16', autocast with a "
                                         r"GradScaler"):
        stepwise(dataclasses.replace(REPORT_SPEC, dtype=torch.float16), cls, kw, "foreach")


# -- a pure-bf16 workload's rows ----------------------------------------------------------------

def test_every_strategy_of_a_pure_workload_holds_bit_for_bit_or_step_by_step():
    rows = workload_checks.trajectories(SGD_FUSED)
    assert not [(k, r) for k, r in rows.items() if r.get("problems") or "error" in r]
    parity = {k.split("/")[1]: r.get("parity", "") for k, r in rows.items()}
    for strategy in ("foreach", "fused"):
        assert parity[strategy].startswith("vs forloop: ok") and "of the bound" in parity[strategy]
    for strategy, reference in (("in_backward", "forloop"), ("in_backward_grouped", "forloop"),
                                ("in_backward_grouped_foreach", "foreach"),
                                ("in_backward_bucketed", "fused")):
        assert parity[strategy] == f"vs {reference}: bit-exact"
    assert all(r["tolerance"] is None for r in rows.values())  # another CPU: bit for bit


def test_the_gate_fails_the_fused_row_of_a_pure_workload_under_the_skipped_update():
    base = workload_checks.trajectories(SGD_FUSED)
    with inject("fused_sgd_skips_low_precision"):
        now = workload_checks.trajectories(SGD_FUSED)
    section = workload_checks.judge(base, now, Run())
    failed = {cells[0]: cells[-1] for cells, ok in section.rows if not ok}
    assert set(failed) == {"lm-bf16-sgd/fused", "lm-bf16-sgd/in_backward_bucketed"}, failed
    assert "vs forloop: FAIL" in failed["lm-bf16-sgd/fused"]
    assert "CHANGED bits; final parameters MISMATCH (bit-exact expected)" in failed[
        "lm-bf16-sgd/in_backward_bucketed"]  # its buckets step with the same fused kernel


def test_fsdp2s_memory_bound_counts_model_states_in_the_models_dtype():
    assert state_bytes(torch.optim.Adam, {"lr": 1e-3}, torch.bfloat16) == (4, 4)
    rows = workload_checks.engine_memory(ADAMW)
    assert rows and not [(k, r) for k, r in rows.items() if r.get("problems") or "error" in r]


@pytest.mark.slow
@pytest.mark.distributed
def test_record_and_gate_a_pure_bf16_workload_and_fail_it_under_the_skipped_update(
        tmp_path, capsys):
    # pytorch#191763 as a team meets it: the baseline recorded on a torch that steps bf16
    # right, the gate on one whose fused SGD skips the update (emulated by the fault: on torch
    # 2.12.1 and 2.13.0 the same gate fails the same rows, docs/releases.md)
    baseline = tmp_path / "baseline.json"
    path = f"{__name__}:SGD_FUSED"
    assert main(["record", "--workload", path, "--baseline", str(baseline)]) == 0
    recorded = json.loads(baseline.read_text())["workloads"]
    assert not [k for k, v in recorded.items() if v.get("problems") or "error" in v]
    assert main(["gate", "--workload", path, "--baseline", str(baseline)]) == 0
    capsys.readouterr()
    assert main(["gate", "--workload", path, "--baseline", str(baseline),
                 "--fault", "fused_sgd_skips_low_precision"]) == 1
    failed = [line.split()[1] for line in capsys.readouterr().out.splitlines()
              if line.startswith("! ")]
    assert failed == ["lm-bf16-sgd/fused", "lm-bf16-sgd/in_backward_bucketed"]


# -- stepped in pieces --------------------------------------------------------------------------


def test_a_bf16_kernel_rounds_an_element_by_its_place_in_the_tensor():
    # Why a bf16 parameter stepped in ZeRO-2's 1-D pieces cannot match DDP's whole-tensor step
    # bit for bit: the vectorised body and the scalar tail of ``add_(alpha=)`` round
    # differently (seen on torch 2.14.1, AVX512: element 33 of 200 when cut at 37). Which
    # elements differ depends on the CPU's vector width, so this looks for any cut.
    g = torch.Generator().manual_seed(0)
    p, grad = (torch.randn(200, generator=g).bfloat16() for _ in range(2))
    whole = p.clone().add_(grad, alpha=-0.1)
    differs = [cut for cut in range(1, 200) if not torch.equal(whole, torch.cat(
        [p[:cut].clone().add_(grad[:cut], alpha=-0.1),
         p[cut:].clone().add_(grad[cut:], alpha=-0.1)]))]
    assert differs, "bf16 add_ no longer rounds by place: ZeRO-2 could be held bit for bit"


class WideMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).float()


def classes(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)


# pure bf16 with SGD: ZeRO-2's buckets (a quarter of the elements) cut net.2.weight where a
# vector's elements round otherwise in one piece than in the whole (1.2e-4, an ulp, at step 0)
WIDE_SGD = Workload(name="mlp-bf16-sgd", model=WideMLP, batch=classes, loss=F.cross_entropy,
                    optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
                    precision="bf16-true")


@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_in_pure_bf16_is_held_to_ddp_within_the_bound_and_fails_under_a_fault():
    clean = workload_checks.zero2([WIDE_SGD], with_engines=False)["mlp-bf16-sgd/zero2"]
    assert clean["problems"] == [], clean
    assert ("bfloat16 parameters are stepped in other pieces, which CPU kernels round by "
            "place: within tolerance, not bit for bit") in clean["parity"]
    faulty = workload_checks.zero2([WIDE_SGD], "collective_wrong_slice",
                                   with_engines=False)["mlp-bf16-sgd/zero2"]
    assert faulty.get("problems") or "error" in faulty, faulty
