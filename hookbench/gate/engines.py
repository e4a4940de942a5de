"""The gate's ``engines`` section: the engines users run when they outgrow one GPU
(``hookbench.engines``: DDP with accumulation under ``no_sync()``, FSDP2 as ZeRO-2 and ZeRO-3,
the optimizer in backward under FSDP2) on 2 gloo ranks, on the zoo's tiny MLP (227 parameters,
so that FSDP2's shards cut parameters; 6 samples, 3 per rank). Each row is held to what
``hookbench.engines.verdicts`` says: the engine's hook contract (every bucket reduced once,
every shard's post-accumulate-grad hook called once after its reduce-scatter, none without
gradient sync, no gathered gradient left), its parity with DDP, FSDP2 ZeRO-3 or one process,
and the stored checksum (or, on another CPU, the tolerance). FSDP2's per-rank memory
(``hookbench.engines.memory``) on the zoo's transformer, against its bound and the stored
bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from hookbench.core.workload import of
from hookbench.engines import fsdp2
from hookbench.gate import workload_checks
from hookbench.gate.checks import Run, Section
from hookbench.measure import zero2_runs
from hookbench.models.zoo import workload as zoo_workload

# The engine faults, and a hook fault the shards' hooks must show (each run starts the ranks).
FAULTS = ("fires_twice", "fsdp2_forgets_shard_hooks", "reduce_scatter_wrong_slice",
          "ddp_bucket_reduced_twice", "ddp_drops_settings", "ddp_ignores_comm_hook",
          "fsdp2_drops_settings", "fsdp2_reduces_in_bf16")
# Adam at the zoo's ZeRO-2 parity rate (zero2_runs.PARITY_OPTIMIZERS), for-loop; DDP and FSDP2
# with settings a team declares, each other than torch's default so that torch ignoring it
# shows (the arithmetic is the defaults': a 227-parameter model fits one bucket either way;
# fp32 reductions of fp32 gradients; no resharding changes no number; shards on the host,
# where CPU ranks keep them anyway). FSDP2's units: each Linear, which the default (repeated
# blocks) would not pick in an MLP, so that not resharding them after forward shows. DDP with
# a team's comm hook, bf16 compression (LLM stacks' choice, Accelerate's BF16): other numbers
# than DDP's own all-reduce, held to the hook applied by hand; the other engines are held to
# DDP without it.
WORKLOAD = of(zero2_runs.PARITY_SPEC).replace(
    optimizer=(torch.optim.Adam, {"lr": 1e-2}),
    ddp={"find_unused_parameters": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 1,
         "comm_hook": default_hooks.bf16_compress_hook},
    fsdp2={"units": torch.nn.Linear, "reshard_after_forward": False,
           "mp_policy": fsdp2.api().MixedPrecisionPolicy(reduce_dtype=torch.float32),
           "offload_policy": fsdp2.api().CPUOffloadPolicy(pin_memory=False)})


# FSDP2's per-rank memory on a model with units to gather and prefetch: the zoo's transformer
# (4 blocks and a tied root), 2 sequences, on fake tensors (~3 s)
MEMORY_WORKLOAD = zoo_workload("transformer", batch_size=2)


def measure(run: Run) -> dict[str, Any]:
    return {**workload_checks.zero2([WORKLOAD], run.fault, with_zero2=False),
            **workload_checks.engine_memory(MEMORY_WORKLOAD)}


def judge(base: dict, now: dict, run: Run) -> Section:
    return workload_checks.judge(
        base, now, run, f"Engines on {workload_checks.ZERO2_RANKS} gloo ranks, "
        f"{workload_checks.STEPS} steps of the zoo's {WORKLOAD.name}: each engine's hooks, "
        f"parity and stored checksum; FSDP2's peak on the {MEMORY_WORKLOAD.name}, rank 0 of "
        f"8 on fake tensors, against its bound and the stored bytes")
