"""The saved-tensor-hook contract activation offload relies on (hookbench.measure.saved_tensor_contract),
and the gate's offload section, each failing under the fault it guards against."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hookbench import gate
from hookbench.gate import baselines
from hookbench.measure import saved_tensor_contract
from hookbench.measure.faults import inject
from hookbench.measure.hook_contract import ContractViolation


# torch's own bugs on the pinned torch, recorded as known failures in baselines/gate.json
# (docs/releases.md): each must fail so; a release that fixes one fails here, to be recorded
KNOWN = {"rrelu_under_checkpoint_matches_the_plain_step": r"\(pytorch#193671\)"}


@pytest.mark.parametrize("check", saved_tensor_contract.CHECKS, ids=lambda c: c.__name__)
def test_contract(check):
    if check.__name__ not in KNOWN:
        check()
        return
    with pytest.raises(ContractViolation, match=KNOWN[check.__name__]):
        check()


@pytest.mark.parametrize("fault, broken", [
    ("pack_called_twice", {"pack_once_per_saved_tensor", "retained_graph_unpacks_again"}),
    ("unpack_returns_stale", {"unpack_returns_what_pack_kept"}),
])
def test_the_contract_fails_under_a_saved_tensor_fault(fault, broken):
    with inject(fault):
        failed = {name for name, error in saved_tensor_contract.run_all().items() if error}
    assert broken <= failed


def test_the_compile_rows_fail_when_the_hooks_also_run_while_tracing(monkeypatch):
    # torch 2.4's behaviour (pytorch#113263; both rows read VIOLATED there): the hooks also
    # pack the tracer's fake tensors, which are never unpacked. Mimicked on this torch: the
    # compiled call first runs the block on fake tensors under the same hooks (11 packs, 5 of
    # them fake, as torch 2.4.1 reads).
    compile = torch.compile

    def tracing_under_the_hooks(model, **kwargs):
        compiled = compile(model, **kwargs)

        def call(x):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                model(mode.from_tensor(x))
            return compiled(x)
        return call

    monkeypatch.setattr(torch, "compile", tracing_under_the_hooks)
    seen = r"11 packs \(5 of them the tracer's fake or functional tensors, pytorch#113263\)"
    with pytest.raises(ContractViolation, match=seen):
        saved_tensor_contract.compiled_eager_runs_the_hooks()


def test_the_gates_offload_section_holds_on_the_recorded_torch():
    base = baselines.load()
    section = gate.check(base, gate.measure_all(("offload",)))["offload"]
    assert section.ok and len(section.rows) == len(saved_tensor_contract.CHECKS) + 6


@pytest.mark.parametrize("fault, row", [
    ("pack_called_twice", "contract/pack_once_per_saved_tensor"),
    ("unpack_returns_stale", "lossless/in_backward"),
    ("offload_keeps_device_copy", "memory/transformer/in_backward"),
    ("compression_on_exact_tensor", "lossless/forloop"),
])
def test_the_gates_offload_section_fails_under_each_offload_fault(fault, row):
    section = gate.check(baselines.load(), gate.measure_all(("offload",), fault=fault))["offload"]
    assert row in [cells[0] for cells, ok in section.rows if not ok]
