"""FSDP2's per-rank peak on fake tensors against the ZeRO paper's formula
(``hookbench.engines.memory``): the model states counted to the byte, every setting within its
bound, the optimizer in backward below ZeRO-3 with a standard step, and each way FSDP2 could
keep memory it must free (a unit left gathered, gathered gradients kept past their
reduce-scatter, shard gradients kept past their step) shown to fail the row. One process, a
fake process group: ~1 s a row.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
import re
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from hookbench import Workload
from hookbench.engines import memory as engine_memory
from hookbench.engines.memory import rank_peak, state_bytes
from hookbench.gate import workload_checks
from hookbench.measure import memory as measure_memory
from hookbench.mechanisms import optimizer_in_backward
from hookbench.models.zoo import TinySpec
from hookbench.models.zoo import workload as zoo_workload

TRANSFORMER = zoo_workload("transformer", batch_size=2)  # Adam; 4 blocks and a tied root
MLP = TinySpec().workload()  # the zoo's small MLP, Adam


def paper(workload, world: int) -> int:
    """16 Psi / N with Adam, written out independently of the module: FSDP2 pads each
    parameter's dim 0 to N chunks of equal length; 4 B each of parameter, gradient and Adam's
    two moments per element, and Adam's 4-byte step count per tensor."""
    params = [p for p in workload.build().parameters() if p.requires_grad]
    elements = sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in params)
    return 16 * elements + 4 * len(params)


def test_adam_keeps_two_moments_per_element_and_a_step_per_tensor():
    assert state_bytes(torch.optim.Adam, {"lr": 1e-3}) == (8, 4)
    assert state_bytes(torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}) == (4, 0)
    assert state_bytes(torch.optim.SGD, {"lr": 1e-3}) == (0, 0)


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 8])
@pytest.mark.parametrize("setting", ["zero2", "zero3"])
def test_model_states_when_backward_ends_are_the_papers_16_psi_over_n(setting, world):
    # counted to the byte: the tracker and the formula count the same padded shards
    row = rank_peak(TRANSFORMER, setting, world)
    assert row["backend"] == "fake"
    assert row["states"] == paper(TRANSFORMER, world)
    assert row["problems"] == [], row["problems"]
    assert row["peak"] <= row["bound"]


def test_the_optimizer_in_backward_leaves_no_gradient_and_peaks_no_higher_than_zero3():
    rows = workload_checks.engine_memory(TRANSFORMER)
    zero3, inb = (rows[f"transformer/memory/fsdp2_{s}"] for s in ("zero3", "in_backward"))
    assert not zero3["problems"] and not inb["problems"], (zero3, inb)
    params = [p for p in TRANSFORMER.build().parameters() if p.requires_grad]
    world = 8
    grads = 4 * sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in params)
    assert zero3["states"] - inb["states"] == grads  # exactly the gradients' shards
    assert inb["peak"] <= zero3["peak"]


@pytest.mark.slow  # 6 s; the transformer's rows above are the default tier's
def test_every_setting_holds_its_bound_on_a_convnet_with_buffers():
    rows = workload_checks.engine_memory(zoo_workload("resnet18", batch_size=2))
    assert len(rows) == 3
    for key, row in rows.items():
        assert row["problems"] == [], (key, row["problems"])
        assert 0 < row["peak"] <= row["bound"], key


def test_a_unit_left_gathered_after_forward_fails_zero3(monkeypatch):
    # FSDP2 that never reshards: every unit stays gathered, ZeRO-3 holds ZeRO-2's memory
    monkeypatch.setattr(FSDPParamGroup, "reshard", lambda self: None)
    row = rank_peak(TRANSFORMER, "zero3")
    assert any("gathered parameters" in p for p in row["problems"]), row["problems"]
    ended = [p for p in row["problems"] if p.startswith("when backward ended")]
    # naming what is no model state (e3nn's potential under FSDP2: the comm context keeps
    # its last all-gather past backward, "all-gather buffers 512 B still live")
    assert ended and re.search(r": gathered parameters [0-9.]+ [KM]?B still live$", ended[0]), \
        row["problems"]


def test_gathered_gradients_kept_past_their_reduce_scatter_fail(monkeypatch):
    kept: list[torch.Tensor] = []
    post_backward = FSDPParamGroup.post_backward

    def keeping(self, *args, **kwargs):
        kept.extend(fp._unsharded_param.grad for fp in self.fsdp_params
                    if fp._unsharded_param.grad is not None)
        return post_backward(self, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "post_backward", keeping)
    try:
        row = rank_peak(TRANSFORMER, "zero3")
    finally:
        kept.clear()
    assert any("communication" in p for p in row["problems"]), row["problems"]


def test_shard_gradients_kept_past_their_step_fail_the_optimizer_in_backward(monkeypatch):
    kept: list[torch.Tensor] = []
    finish = optimizer_in_backward.OptimizerInBackward._finish

    def keeping(self, unit):
        kept.extend(p.grad for p in unit.params if p.grad is not None)
        return finish(self, unit)

    monkeypatch.setattr(optimizer_in_backward.OptimizerInBackward, "_finish", keeping)
    try:
        rows = workload_checks.engine_memory(MLP)
    finally:
        kept.clear()
    # more activations and temporaries live when backward ended than FSDP2's standard step
    # leaves on the same model: the kept gradients (rank_peak alone has no yardstick for them)
    row = rows[f"{MLP.name}/memory/fsdp2_in_backward"]
    assert any("of activations and temporaries live, more than ZeRO-3's" in p
               for p in row["problems"]), row["problems"]


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="unknown FSDP2 setting"):
        rank_peak(TRANSFORMER, "zero4")


class Cycles(torch.nn.Module):
    """A forward that leaves a reference cycle holding a tensor (as Hugging Face's output
    objects can): freed only when Python's cyclic collector runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(
            torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh()), torch.nn.Linear(64, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        cycle: dict = {"hidden": h.repeat(1, 64)}  # 256 KB, more than the rest
        cycle["self"] = cycle
        return self.blocks[1](h)


CYCLES = Workload("cycles", model=Cycles, loss=torch.nn.functional.cross_entropy,
                  batch=lambda g: (torch.randn(16, 8, generator=g),
                                   torch.randint(0, 3, (16,), generator=g)))


@pytest.fixture
def gc_threshold():
    """Set Python's collection threshold for one test; restored in finally."""
    was = gc.get_threshold()
    try:
        yield gc.set_threshold
    finally:
        gc.set_threshold(*was)


def _peaks(set_threshold) -> list[tuple[int, int]]:
    out = []
    for threshold in ((1, 1, 1), (10**9,)):  # the collector at every allocation, and never
        set_threshold(*threshold)
        row = rank_peak(CYCLES, "zero2")
        out.append((row["peak"], row["left"]))
    return out


def test_the_bytes_do_not_depend_on_when_python_collects_cycles(gc_threshold, monkeypatch):
    often, never = _peaks(gc_threshold)
    assert often == never and never[1] == 0
    # Without the rule, the cycles the forward left (256 KB each step) count as kept by the
    # model when backward has ended, as many as the collector has not reached yet.
    monkeypatch.setattr(engine_memory, "collection_paused", contextlib.nullcontext)
    monkeypatch.setattr(engine_memory, "gc", types.SimpleNamespace(collect=lambda: 0))
    assert rank_peak(CYCLES, "zero2")["left"] >= 256 * 1024


class Counter(torch.nn.Module):
    """A module whose hash follows its state, as torchmetrics' ``Metric`` hashes its metric
    states: it counts the samples its forward sees (a Lightning ``training_step`` calls its
    accuracy metric on the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def __hash__(self) -> int:
        return hash((id(self), self.seen))

    def forward(self, logits: torch.Tensor) -> None:
        self.seen += logits.shape[0]


class Metered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 3))
        self.accuracy = Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        self.accuracy(logits.detach())
        return logits


METERED = CYCLES.replace(name="metered", model=Metered)


def test_a_module_whose_hash_follows_its_state_is_measured(monkeypatch):
    row = rank_peak(METERED, "zero2")
    assert row["backend"] == "fake" and not row["problems"], row
    # torch's ModTracker keys modules by hash: the counter gets another name when its forward
    # ends than when it began, and the tracker stops the row
    from torch.distributed._tools.mod_tracker import ModTracker

    monkeypatch.setattr(engine_memory, "_leaf_safe_mod_tracker", ModTracker)
    with pytest.raises(RuntimeError, match="The Module hierarchy tracking is wrong"):
        rank_peak(METERED.replace(name="metered-again"), "zero2")


class ImportsInForward(torch.nn.Module):
    """Imports a module with a tensor constant in its forward, as torchdiffeq's models do
    (its Butcher tableaus), and reads a value: fake tensors cannot run it."""

    module = "hookbench_constants"

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = importlib.import_module(self.module).SCALE
        return self.linear(x * scale[1] if bool(scale[0] < 1) else x)


@pytest.fixture
def constants(tmp_path, monkeypatch):
    """A module, not imported yet, whose top level makes a tensor; forgotten in finally."""
    (tmp_path / f"{ImportsInForward.module}.py").write_text(
        "import torch\nSCALE = torch.tensor([0.5, 2.0])\n")
    monkeypatch.syspath_prepend(tmp_path)
    try:
        yield
    finally:
        sys.modules.pop(ImportsInForward.module, None)


def test_a_module_first_imported_in_a_fake_forward_keeps_real_constants(constants, monkeypatch):
    workload = CYCLES.replace(name="imports", model=ImportsInForward)
    row = rank_peak(workload, "zero2")  # the fake attempt imports it, and cannot run it
    assert row["backend"] == "eager" and not row["problems"], row
    assert type(sys.modules[ImportsInForward.module].SCALE) is torch.Tensor
    # imported inside FakeTensorMode, the constant is a fake tensor, and the eager run fails
    sys.modules.pop(ImportsInForward.module)
    for module in (engine_memory, measure_memory):
        monkeypatch.setattr(module, "imports_as_real", contextlib.nullcontext)
    with pytest.raises(DataDependentOutputException):  # in the eager run, on the fake constant
        rank_peak(workload.replace(name="imports-again"), "zero2")
    assert type(sys.modules[ImportsInForward.module].SCALE) is not torch.Tensor


@pytest.mark.slow  # 12 s; the default tier fails the fault on the engine rows
def test_the_rows_shard_as_the_workload_declares_and_a_dropped_policy_fails_them():
    # Workload.fsdp2's units and MixedPrecisionPolicy (issue 46), the rows' reshard axis kept:
    # bf16 gathered parameters halve the gathered-parameter term and lower the peak, within
    # the bound computed for them; one unit gathers the four blocks at once.
    from hookbench.engines import fsdp2
    from hookbench.measure.faults import inject

    policy = fsdp2.api().MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32)
    plain = rank_peak(TRANSFORMER, "zero3")
    low = rank_peak(TRANSFORMER.replace(fsdp2={"mp_policy": policy}), "zero3")
    one = rank_peak(TRANSFORMER.replace(fsdp2={"units": re.compile(r"blocks")}), "zero3")
    assert not plain["problems"] and not low["problems"] and not one["problems"]
    assert low["terms"]["gathered parameters"] * 2 == plain["terms"]["gathered parameters"]
    assert low["peak"] < plain["peak"]
    assert one["terms"]["gathered parameters"] > plain["terms"]["gathered parameters"]
    # FSDP2 that drops the declared policy gathers fp32 again: above the bf16 row's bound
    with inject("fsdp2_drops_settings"):
        dropped = rank_peak(TRANSFORMER.replace(fsdp2={"mp_policy": policy}), "zero3")
    assert any("rank 0 of 8: peak" in p for p in dropped["problems"]), dropped["problems"]
