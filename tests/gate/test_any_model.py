"""Any model that trains eagerly records and gates (issue 33): each way a measuring method
can fail to fit a model falls back per row and says so, a designed refusal is a recorded row,
and a broken workload is told once, in one line, before anything is measured.

    fallbacks        a forward that reads a value (LayerDrop): memory on real CPU tensors,
                     named in the row; the gate compares like with like; torch's own error log
                     goes into the row, not onto the terminal
    any optimizer    a torch.optim.Optimizer outside torch.optim (no foreach option, not known
                     to be elementwise): foreach rows do not apply, ZeRO-2 refuses, in words,
                     recorded; the for-loop and the optimizer in backward still run
    broken workloads a non-scalar or non-finite loss, a batch that does not split over the
                     ranks, a factory, batch function or forward that raises, at any batch the
                     checks draw: one line, exit 2
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from hookbench import Workload
from hookbench.cli import main
from hookbench.gate import workload_checks
from hookbench.gate.checks import Run
from hookbench.measure.memory import measure_or_fall_back


class LayerDrop(nn.Module):
    """Each layer skipped with probability 0.5 per training forward, decided in Python on a
    value (fairseq's and transformers' LayerDrop): fake tensors cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = torch.tanh(layer(x))
        return self.head(x)


class LogsThenReads(LayerDrop):
    """torch logs an E-level line before it gives up on a model (as FakeTensorMode does for a
    meta kernel that rejects float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, FakeTensor):
            logging.getLogger("torch._subclasses.fake_tensor").error(
                "failed while attempting to run meta for aten.op")
        return super().forward(x)


class SignSGD(torch.optim.Optimizer):
    """An optimizer outside torch.optim, as bitsandbytes', timm's or transformers' are: no
    foreach option, and not one ZeRO-2 knows to be elementwise."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def vectors(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


LAYERDROP = Workload("layerdrop", model=LayerDrop, batch=vectors, loss=F.cross_entropy,
                     optimizer=(torch.optim.AdamW, {"lr": 1e-2}))
def linear() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


SIGN = Workload("sign", model=linear, batch=vectors, loss=F.cross_entropy,
                optimizer=(SignSGD, {"lr": 1e-2}))


# -- fallbacks -----------------------------------------------------------------------------------

def test_memory_falls_back_to_real_tensors_where_fake_ones_cannot_run_the_model():
    rows = workload_checks.memory(LAYERDROP)
    assert set(rows) == {f"layerdrop/memory/{s}" for s in workload_checks.MEMORY_STRATEGIES}
    for row in rows.values():
        assert row["problems"] == [] and row["backend"] == "eager", row
        assert row["fallback"] == ("fake tensors cannot run layerdrop: "
                                   "DataDependentOutputException: "
                                   "aten._local_scalar_dense.default; measured on real CPU "
                                   "tensors")
    # the same layers dropped in every run and strategy: the counts repeat to the byte
    assert workload_checks.memory(LAYERDROP) == rows


def test_the_gate_compares_a_fallback_row_with_fake_bytes_and_a_gpus_with_its_own():
    # fake and real CPU tensors are one tracker, exact on both (tests/measure/test_memory.py):
    # a torch whose meta kernels refuse the model is compared on the bytes, saying so
    now = workload_checks.memory(LAYERDROP)
    key = "layerdrop/memory/foreach"
    same = workload_checks.judge(now, now, Run())
    assert same.ok
    recorded_on_fake = {**now, key: {**now[key], "backend": "fake"}}
    moved = workload_checks.judge(recorded_on_fake, now, Run())
    assert moved.ok
    words = next(cells[-1] for cells, _ in moved.rows if cells[0] == key)
    assert words.endswith(f", backend eager: CHANGED backend: recorded on fake, measured now "
                          f"on eager, the same tracker: identical ({now[key]['fallback']})")
    smaller = {**now, key: {**now[key], "backend": "fake", "peak": now[key]["peak"] - 4096}}
    failed = [cells for cells, ok in workload_checks.judge(smaller, now, Run()).rows if not ok]
    assert [cells[0] for cells in failed] == [key]
    assert "the same tracker: EXCEEDED: peak" in failed[0][-1]
    on_a_gpu = {**now, key: {**now[key], "backend": "cuda"}}
    assert workload_checks.judge(on_a_gpu, on_a_gpu, Run()).ok  # like with like
    failed = [cells for cells, ok in workload_checks.judge(on_a_gpu, now, Run()).rows if not ok]
    assert [cells[0] for cells in failed] == [key]
    assert failed[0][-1].endswith(f", backend eager: CHANGED backend: recorded on cuda, "
                                  f"measured now on eager ({now[key]['fallback']})")


def test_torch_error_log_goes_into_the_row_not_onto_the_terminal(capfd):
    result, why = measure_or_fall_back(LAYERDROP.replace(model=LogsThenReads), "foreach")
    assert result.backend == "eager"
    assert why.endswith("; torch logged 1 line, the first: ERROR "
                        "torch._subclasses.fake_tensor: failed while attempting to run meta "
                        "for aten.op")
    err = capfd.readouterr().err
    assert "failed while attempting" not in err
    # and torch's handlers are back: its log prints again afterwards
    logging.getLogger("torch._subclasses.fake_tensor").error("after the measurement")
    assert "after the measurement" in capfd.readouterr().err


def test_a_model_fake_tensors_can_run_stays_on_the_fake_backend():
    result, why = measure_or_fall_back(LAYERDROP.replace(model=linear))
    assert (result.backend, why) == ("fake", None)


# -- any optimizer -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sign_rows() -> dict:
    return workload_checks.measure_all([SIGN])


def test_an_optimizer_outside_torch_optim_runs_where_it_can_and_says_where_not(sign_rows):
    words = (f"{SignSGD.__module__}.SignSGD takes no foreach option (its for-loop is its only "
             f"implementation)")
    assert sign_rows["sign/foreach"] == {"not_applicable": words}
    assert sign_rows["sign/in_backward_grouped_foreach"] == {"not_applicable": words}
    for strategy in ("in_backward", "in_backward_grouped", "in_backward_bucketed"):
        assert sign_rows[f"sign/{strategy}"]["parity"] == "vs forloop: bit-exact", strategy
    assert sign_rows["sign/zero2"] == {"refused": "ValueError: SignSGD is not known to update "
                                                  "parameters elementwise"}
    assert set(k for k in sign_rows if "/memory/" in k) == {
        "sign/memory/forloop", "sign/memory/in_backward", "sign/memory/fsdp2_zero2",
        "sign/memory/fsdp2_zero3", "sign/memory/fsdp2_in_backward"}
    for setting in ("zero2", "zero3", "in_backward"):  # FSDP2 steps DTensor shards
        assert "not known to update parameters elementwise" in (
            sign_rows[f"sign/memory/fsdp2_{setting}"]["not_applicable"])


def test_a_recorded_refusal_gates_clean_and_fails_when_it_changes(sign_rows):
    assert workload_checks.judge(sign_rows, sign_rows, Run()).ok
    for changed in ({"not_applicable": "another reason"}, {"sha256": "0" * 64}):
        base = {**sign_rows, "sign/zero2": changed}
        failed = [cells for cells, verdict in workload_checks.judge(base, sign_rows, Run()).rows
                  if not verdict]
        assert [cells[0] for cells in failed] == ["sign/zero2"]
        assert failed[0][1].startswith("CHANGED: now refuses, as designed (ValueError: ")
    base = {k: v for k, v in sign_rows.items() if k != "sign/foreach"}
    failed = [cells for cells, verdict in workload_checks.judge(base, sign_rows, Run()).rows
              if not verdict]
    assert failed == [("sign/foreach", f"CHANGED: now does not apply ({SignSGD.__module__}."
                                       f"SignSGD takes no foreach option (its for-loop is its "
                                       f"only implementation)); recorded nothing")]


# -- broken workloads ----------------------------------------------------------------------------

def _raises() -> nn.Module:
    raise ZeroDivisionError("a typo in the factory")


def _bad_batch(g: torch.Generator):
    raise KeyError("input_ids")


def _raises_at_batch_4(g: torch.Generator):
    if g.initial_seed() == 4:  # seed 0's batch 4 (Workload.data)
        raise IndexError("the dataset ran out")
    return torch.randn(4, 6, generator=g), torch.zeros(4).long()


class _RaisesOnBatch5(nn.Linear):
    """A forward that raises on one batch of the six the checks draw, not on the first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] == 5:
            raise RuntimeError("shape mismatch in a branch batch 0 never takes")
        return super().forward(x)


def _batch_number(g: torch.Generator):
    return torch.full((4, 6), float(g.initial_seed())), torch.zeros(4).long()


BROKEN = {
    "non-scalar": (LAYERDROP.replace(loss=lambda out, y: F.cross_entropy(
        out, y, reduction="none")), "workload 'layerdrop': loss(output, target) returned a "
        "tensor of shape (4,), not a scalar tensor (reduce it, e.g. with .mean())"),
    "nan": (LAYERDROP.replace(loss=lambda out, y: out.sum() * float("nan")),
            "workload 'layerdrop': loss(output, target) is nan on batch 0, before any step: "
            "nothing can be compared (check the model's initialisation and inputs)"),
    "split": (LAYERDROP.replace(batch=lambda g: (torch.randn(3, 6), torch.zeros(3).long())),
              "workload 'layerdrop': batch(generator) gives a batch of 3 rows (target), which "
              "does not split over 2 data-parallel ranks; make the batch a multiple of 2"),
    "factory": (LAYERDROP.replace(model=_raises), "workload 'layerdrop': model() raised "
                "ZeroDivisionError: a typo in the factory"),
    "batch": (LAYERDROP.replace(batch=_bad_batch),
              "workload 'layerdrop': batch(generator) raised KeyError: 'input_ids'"),
    # a later batch: recorded, it would read as a failure of torch's
    "later batch": (LAYERDROP.replace(batch=_raises_at_batch_4),
                    "workload 'layerdrop': batch(generator) at batch 4 raised IndexError: the "
                    "dataset ran out"),
    "later forward": (LAYERDROP.replace(model=lambda: _RaisesOnBatch5(6, 3), batch=_batch_number),
                      "workload 'layerdrop': the model's forward at batch 5 raised RuntimeError: "
                      "shape mismatch in a branch batch 0 never takes"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_workload_is_told_once_before_anything_is_measured(case):
    workload, message = BROKEN[case]
    with pytest.raises(ValueError) as e:
        workload_checks.measure_all([workload])
    assert str(e.value) == message


@pytest.mark.parametrize("command", ["record", "gate", "report", "speed"])
def test_the_command_line_says_it_in_one_line_with_exit_2(command, tmp_path, monkeypatch,
                                                          capsys):
    (tmp_path / "broken.py").write_text(
        "import torch, torch.nn.functional as F\nfrom torch import nn\n"
        "from hookbench import Workload\n"
        "W = Workload('broken', model=lambda: nn.Linear(6, 3),\n"
        "             batch=lambda g: (torch.randn(4, 6, generator=g), torch.zeros(4).long()),\n"
        "             loss=lambda out, y: F.cross_entropy(out, y, reduction='none'))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load() puts the project first
    argv = [command, "--workload", "broken:W", "--baseline", str(tmp_path / "b.json")]
    if command in ("report", "speed"):
        argv = [command, "--workload", "broken:W", "--out" if command == "report" else "--json",
                str(tmp_path / "out")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"hookbench {command}: error: workload 'broken': loss(output, target) "
                   f"returned a tensor of shape (4,), not a scalar tensor (reduce it, e.g. with "
                   f".mean())\n")
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "out").exists()


# -- the whole-step table (hookbench speed) -----------------------------------------------------

def test_speed_times_a_workload_with_its_own_optimizer_and_says_why_a_cell_is_empty(
        tmp_path, monkeypatch, capsys):
    # SignSGD has only its for-loop: the foreach and fused rows say so. Clipped, every mode of
    # the optimizer in backward refuses in its own words, and the for-loop is still timed.
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "signs.py").write_text(
        "from test_any_model import SIGN\n"
        "CLIPPED = SIGN.replace(name='clipped', clip_grad_norm=1.0)\n")
    for name in ("SIGN", "CLIPPED"):
        target = tmp_path / f"{name}.json"
        assert main(["speed", "--workload", f"signs:{name}", "--runs", "2", "--rounds", "1",
                     "--json", str(target)]) == 0
        out = capsys.readouterr().out
        assert "(forward, backward, SignSGD step)" in out, out
        table = json.loads(target.read_text())["table"]
        lacks = (f"{SignSGD.__module__}.SignSGD takes no {{}} option (its for-loop is its only "
                 f"implementation)")
        assert table["foreach"] == lacks.format("foreach") and table["fused"] == lacks.format(
            "fused")
        forloop = table["forloop"]
        assert len(forloop["standard"]) == 2 and all(s > 0 for s in forloop["standard"])
        modes = [m for m in forloop if m != "standard"]
        assert modes == ["per_parameter", "grouped", "bucketed"]
        for mode in modes:
            if name == "SIGN":
                assert len(forloop[mode]) == 2 and all(r > 0 for r in forloop[mode]), forloop
            else:
                assert forloop[mode].startswith("ValueError: global gradient-norm clipping "
                                                "needs the norm over every gradient"), forloop
        assert re.search(r"for-loop +[\d.]+  " + (r"\d" if name == "SIGN" else r"refused \(1\)"),
                         out), out
        assert re.search(r"foreach +none \(\d\)", out), out


def test_speed_on_a_workload_takes_no_batch_size(capsys):
    assert main(["speed", "--workload", "transformer", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hookbench speed: error: --batch-size is for zoo models; a workload has its "
                   "own batch"]


def test_what_a_backend_prints_as_a_group_connects_stays_off_the_terminal(capfd, monkeypatch):
    """gloo on torch 2.9.1 prints "[Gloo] Rank 1 is connected to 1 peer ranks. ..." from C++
    straight to file descriptor 1 as each rank joins: past Python's streams and torch's log
    levels. The ranks join with descriptor 1 on /dev/null; it is back afterwards."""
    import torch.distributed as dist

    from hookbench.core import launch

    def connects(*args, **kwargs):
        os.write(1, b"[Gloo] Rank 0 is connected to 1 peer ranks.\n")

    monkeypatch.setattr(dist, "init_process_group", connects)
    launch._init("gloo", 0, 0, 2, 10.0, store=object())
    print("after the group connected", flush=True)
    assert capfd.readouterr().out == "after the group connected\n"
