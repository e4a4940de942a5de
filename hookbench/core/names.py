"""The names the command line offers before it imports torch (``hookbench.cli``): the zoo's
models, the faults, the report's and the gate's sections and defaults. The modules that own
them take them from here (``hookbench.gate``) or assert at import that they match
(``hookbench.models.zoo``, ``hookbench.measure.faults``), so a name is added in one place."""

from importlib import metadata

ZOO = ("resnet18", "transformer", "vit_b_16", "vit_l_16")
FAULTS = ("fires_twice", "stops_after_first_backward", "never_fires",
          "fires_before_accumulation", "keeps_gradients_alive", "fires_late",
          "removal_does_nothing", "optimizer_arithmetic_changed", "collective_wrong_slice",
          "collective_low_precision", "private_module_missing", "private_api_changed",
          "tracker_misses_allocations", "reduce_scatter_ignores_op", "step_dtype_changed",
          "checkpoint_key_renamed", "new_warning", "compiled_module_skips_forward_hooks",
          "pack_called_twice", "unpack_returns_stale", "offload_keeps_device_copy",
          "compression_on_exact_tensor", "fsdp2_forgets_shard_hooks",
          "reduce_scatter_wrong_slice", "ddp_bucket_reduced_twice", "ddp_drops_settings",
          "ddp_ignores_comm_hook", "deepspeed_drops_settings", "fsdp2_drops_settings",
          "implementation_flag_ignored", "capturable_ignored", "kernel_ignores_maximize",
          "fused_sgd_skips_low_precision", "checkpoint_forgets_rng_state",
          "fsdp2_reduces_in_bf16", "dropout_drops_half", "dropout_ignores_seed")
# Faults of the DeepSpeed row, which the gate leaves out (deepspeed is an optional install):
# ``selfcheck`` does not run them, and the peers tier shows that they are caught.
PEER_FAULTS = ("deepspeed_drops_settings",)
# Faults of random draws, caught where a workload's draws are replayed (its ``draws`` row):
# ``selfcheck`` gates the zoo, which has none, so it does not run them; the default tier
# (tests/core/test_draws.py) and examples/charlm/check.sh show them caught.
DRAW_FAULTS = ("dropout_drops_half", "dropout_ignores_seed")
REPORT_SECTIONS = ("contract", "optimizer", "capture", "memory", "zero2")
GATE_SECTIONS = ("hooks", "parity", "numerics", "zero2", "engines", "collectives", "checkpoints",
                 "compile", "warnings", "memory", "offload", "workloads", "time")
# What a gate of the user's own workloads runs by default: the hook contract (torch's own
# behaviour) and the workloads' rows (``hookbench.gate.workload_checks``).
GATE_WORKLOAD_SECTIONS = ("hooks", "workloads")
GATE_MODELS = ("transformer", "resnet18", "vit_b_16")  # the gate's default
GATE_RECORD_MODELS = (*GATE_MODELS, "vit_l_16")  # recorded, so that --models vit_l_16 can be gated
# A step-time ratio fails this fraction above the recorded one (shared CI machines).
GATE_TIME_SLACK = 0.50
BASELINE = "baselines/gate.json"  # relative to the checkout, where hookbench is run


def installed_version(package: str) -> str | None:
    """``package``'s version from its installed metadata (without importing it: torch's import
    takes seconds), or None where it is not installed (a checkout on sys.path)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
