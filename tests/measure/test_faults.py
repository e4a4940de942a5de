"""The suite fails when post-accumulate-grad hooks misbehave.

Each fault of hookbench.measure.faults is injected and the suite's own checks must catch it: the hook
contract, the parity of optimizer-in-backward with a standard step, the live-gradient count,
and, end to end, a pytest run of the mechanism's test file with the fault injected. The
collective faults are caught in test_zero2.py; the whole catalogue against the upgrade gate in
test_gate.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hookbench.core import names
from hookbench.engines import deepspeed
from hookbench.measure import hook_contract
from hookbench.measure.faults import FAULTS, HOOK_FAULTS, inject
from hookbench.measure.parity import FAMILIES, compare, live_gradients, tolerance, trajectory
from hookbench.models.zoo import TinySpec

ROOT = Path(__file__).resolve().parents[2]

# Which contract checks each fault must break; the first one named is the check written for it.
CAUGHT_BY_CONTRACT = {
    "fires_twice": {"once_per_backward_tied", "registration_order", "retain_graph_second_backward"},
    "stops_after_first_backward": {"retain_graph_second_backward"},
    "never_fires": {"once_per_backward_tied", "sees_accumulated_grad", "firing_order"},
    "fires_before_accumulation": {"sees_accumulated_grad", "firing_order", "free_grad_in_hook"},
    "keeps_gradients_alive": {"free_grad_in_hook"},
    "fires_late": {"firing_order"},
}


def test_every_hook_fault_has_expectations():
    assert set(CAUGHT_BY_CONTRACT) == set(HOOK_FAULTS) and set(HOOK_FAULTS) < set(FAULTS)


@pytest.mark.parametrize("fault", HOOK_FAULTS)
def test_hook_contract_catches(fault):
    assert all(v is None for v in hook_contract.run_all().values())  # clean first
    with inject(fault):
        failed = {name for name, error in hook_contract.run_all().items() if error}
    assert CAUGHT_BY_CONTRACT[fault] <= failed


@pytest.mark.parametrize("fault", HOOK_FAULTS)
@pytest.mark.parametrize("family", ["sgd", "adam"])
def test_optimizer_in_backward_checks_catch(fault, family):
    cls, kw = FAMILIES[family]
    spec = TinySpec(depth=3, tied=True)
    expected = trajectory(spec, cls, kw, "forloop", steps=3, accumulation=2)
    assert compare(trajectory(spec, cls, kw, "in_backward", steps=3, accumulation=2),
                   expected).bit_exact
    assert live_gradients(spec, cls, kw, "in_backward")[0] == 1
    with inject(fault):
        try:
            diverged = not compare(
                trajectory(spec, cls, kw, "in_backward", steps=3, accumulation=2), expected
            ).bit_exact
            # A hook that fires too early is rescued numerically by the end-of-backward flush,
            # but then every gradient lives until the end: the memory check gives it away.
            kept_alive = live_gradients(spec, cls, kw, "in_backward")[0] > 1
        except RuntimeError as e:  # OptimizerInBackward refuses a hook that fires twice
            assert "fired twice" in str(e)
            diverged = kept_alive = True
    assert diverged or kept_alive, f"{fault} went unnoticed"


def test_removal_that_does_nothing_is_caught():
    # The one check written for it: the others would leave their hooks on modules this test's
    # leak guard watches (which is a second way the suite catches this fault).
    with inject("removal_does_nothing"), pytest.raises(hook_contract.ContractViolation,
                                                       match="fired 2 times across a removal"):
        hook_contract.removal()


def test_changed_optimizer_arithmetic_is_invisible_to_parity_but_not_to_the_baseline():
    # Both sides of a parity check step through the same changed Adam, so they still agree
    # bit for bit; only a stored trajectory shows the change (the gate's numerics section).
    cls, kw = FAMILIES["adam"]
    spec = TinySpec(depth=3, tied=True)
    stored = trajectory(spec, cls, kw, "forloop", steps=3)
    with inject("optimizer_arithmetic_changed"):
        standard = trajectory(spec, cls, kw, "forloop", steps=3)
        assert compare(trajectory(spec, cls, kw, "in_backward", steps=3), standard).bit_exact
    result = compare(standard, stored, tolerance("foreach", torch.float32))
    assert not result.ok, result.verdict()


def test_inject_restores_pytorch_even_when_the_block_raises():
    original = torch.Tensor.register_post_accumulate_grad_hook
    with pytest.raises(KeyError):
        with inject("fires_twice"):
            assert torch.Tensor.register_post_accumulate_grad_hook is not original
            raise KeyError
    assert torch.Tensor.register_post_accumulate_grad_hook is original


def test_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="unknown fault 'nope'"):
        with inject("nope"):
            pass


# For every fault, default-tier tests it must turn red when the suite runs under it
# (``--hookbench-fault``): for a hook fault, the mechanism's own numerics and memory checks;
# for another, the check that guards what it breaks. The run uses the default tier's marker
# expression, so a selection that is all slow collects nothing and fails this test.
SUITE_UNDER_FAULT = {
    **{fault: ("tests/engines/test_engines.py", "holds_on_a_workload_with_dropout")
       for fault in ("fsdp2_forgets_shard_hooks", "reduce_scatter_wrong_slice",
                     "ddp_bucket_reduced_twice", "ddp_drops_settings",
                     "ddp_ignores_comm_hook", "fsdp2_drops_settings", "fsdp2_reduces_in_bf16")},
    **{fault: ("tests/mechanisms/test_optimizer_in_backward.py",
               "bit_exact_with_forloop or freed_as_soon_as_stepped") for fault in HOOK_FAULTS},
    "removal_does_nothing": ("tests/measure/test_hook_contract.py", "test_contract"),
    "optimizer_arithmetic_changed": ("tests/mechanisms/test_optimizer_in_backward.py",
                                     "float64_reference_of_the_update_rule"),
    **{fault: ("tests/mechanisms/test_zero2.py", "parity_with_single_process_training")
       for fault in ("collective_wrong_slice", "collective_low_precision")},
    "private_module_missing": ("tests/gate/test_gate.py", "by_category and transformer"),
    "private_api_changed": ("tests/measure/test_memory.py", "about_6_gb"),
    "tracker_misses_allocations": ("tests/gate/test_gate.py", "by_category and transformer"),
    "reduce_scatter_ignores_op": ("tests/gate/test_collectives.py",
                                  "every_pair_matches_the_hand_computation"),
    "step_dtype_changed": ("tests/gate/test_checkpoints.py", "committed_checkpoints_resume"),
    "checkpoint_key_renamed": ("tests/gate/test_checkpoints.py", "committed_checkpoints_resume"),
    "new_warning": ("tests/gate/test_emitted_warnings.py", "every_run_emits"),
    "compiled_module_skips_forward_hooks": ("tests/gate/test_compiled_hooks.py",
                                            "eager_backend_keeps_forward_hooks"),
    "pack_called_twice": ("tests/measure/test_saved_tensor_contract.py", "test_contract"),
    "unpack_returns_stale": ("tests/mechanisms/test_activation_offload.py",
                             "lossless_offload_trains_bit_for_bit"),
    "offload_keeps_device_copy": ("tests/mechanisms/test_activation_offload.py",
                                  "count_as_host_memory"),
    "compression_on_exact_tensor": ("tests/mechanisms/test_activation_offload.py",
                                    "lossless_offload_trains_bit_for_bit"),
    "implementation_flag_ignored": ("tests/measure/test_optimizer_implementations.py",
                                    "runs_as_given or follows_the_forloop"),
    "capturable_ignored": ("tests/measure/test_optimizer_implementations.py",
                           "capturable_runs_as_given"),
    "kernel_ignores_maximize": ("tests/measure/test_optimizer_implementations.py",
                                "follows_the_forloop_step"),
    "fused_sgd_skips_low_precision": ("tests/measure/test_pure_precision.py",
                                      "step_by_step_in_bf16 or holds_bit_for_bit"),
    "checkpoint_forgets_rng_state": ("tests/gate/test_transforms.py",
                                     "bit_for_bit_the_plain_step or held_to_the_step"),
    "dropout_drops_half": ("tests/core/test_draws.py", "drops_the_fraction_it_is_asked_to"),
    "dropout_ignores_seed": ("tests/core/test_draws.py", "masks_depend_on_the_seed"),
    # the peers tier's (deepspeed installed); skipped, naming it, where it is not
    "deepspeed_drops_settings": ("tests/engines/test_engines.py",
                                 "deepspeed_zero2_trains_a_workload_like_ddp_as_declared"),
}


def test_every_fault_has_default_tier_tests_that_it_must_fail():
    assert set(SUITE_UNDER_FAULT) == set(FAULTS)


@pytest.mark.slow
@pytest.mark.parametrize("fault", SUITE_UNDER_FAULT)
def test_the_test_suite_fails_under(fault):
    if fault in names.PEER_FAULTS and deepspeed.available():
        pytest.skip(deepspeed.available())
    test_file, selected = SUITE_UNDER_FAULT[fault]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-x", "-k", selected,
         "-p", "no:cacheprovider", "--benchmark-disable", f"--hookbench-fault={fault}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout[-3000:] + proc.stderr
    assert f"FAULT INJECTED: {fault}" in proc.stdout
