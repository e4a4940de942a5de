"""Every bound a row is held to, in one place: each a named rule with the measurement behind it.

    Tolerance           rtol and atol, as ``torch.testing.assert_close`` reads them
    IMPLEMENTATIONS     another implementation of the same step against the for-loop
    tolerance           IMPLEMENTATIONS' rule by strategy and dtype (None: bit for bit)
    DATA_PARALLEL       ranks' summed gradients against one process's mean
    AUTOCAST            two fp32 updates an ulp apart, fed through a low-precision forward
    pure_data_parallel  the same in pure low precision: the ranks sum in that precision
    trajectory_bound    a strategy's trajectory against its reference (the rules above, by
                        whether the arithmetic is identical, the precision and compile)
    data_parallel_bound ZeRO-2's and the engines' parameters against DDP and one process
    FLOOR_FACTOR        how far another legal order may drift, in measured noise floors
    YARDSTICK_HEADROOM  how far that noise floor may grow over the recorded one
    STEP_TEMPORARIES    the slack of the optimizer in backward's peak over a standard step's
    MEMORY_SLACK        a peak on the fake backend against the recorded one
    CUDA_SLACK          CUDA's max_memory_allocated against the fake estimate
    STATES_AGREEMENT    measured model states against the ZeRO paper's formula
    KERNEL_ROUNDING_ULPS  how far a kernel that rounds otherwise moves a tensor
    rounding            a change between releases, where it first happened, that is that

A rule that changes is changed here; the rows name the rule they use (``hookbench.gate.rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hookbench.core.workload import Workload

__all__ = ["AUTOCAST", "CUDA_SLACK", "DATA_PARALLEL", "FLOOR_FACTOR", "IMPLEMENTATIONS",
           "KERNEL_ROUNDING_ULPS", "MEMORY_SLACK", "STATES_AGREEMENT", "STEP_TEMPORARIES",
           "YARDSTICK_HEADROOM", "Tolerance", "data_parallel_bound", "pure_data_parallel",
           "rounding", "rounding_eps", "tolerance", "trajectory_bound"]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# Paths whose arithmetic is not identical to the for-loop's. Identical arithmetic (every
# in-backward mode with foreach=False, and the peer) is compared bit for bit instead.
# PyTorch's own tests (test/test_optim.py) compare foreach with the for-loop in float64 at
# rtol=atol=1e-7 and fused in low precision at 5e-3. Here a few steps of a tiny model: fp32 eps
# is 1.2e-7, fused Adam was seen 2e-7 off per step (../shared/NOTES.md), and the gap can grow a
# little over steps through the model's own sensitivity, hence about 100 ulps in fp32. float64
# keeps the PyTorch test's 1e-7, which is still ~1e9 ulps of float64 headroom.
IMPLEMENTATIONS = {
    ("foreach", torch.float32): Tolerance(rtol=1e-5, atol=1e-6),
    ("foreach", torch.float64): Tolerance(rtol=1e-7, atol=1e-7),
    ("fused", torch.float32): Tolerance(rtol=1e-5, atol=1e-6),
    ("fused", torch.float64): Tolerance(rtol=1e-7, atol=1e-7),
}

# Against single-process training on the global batch: the reduction sums the ranks' mean
# gradients and divides by N, where the reference takes one mean over the global batch, a
# different order of fp32 additions. DeepSpeed's own tests compare with DDP + torch Adam at
# rtol 1e-5, atol 1e-6 over 5 steps; so does hookbench.
DATA_PARALLEL = Tolerance(rtol=1e-5, atol=1e-6)

# Under autocast two strategies whose fp32 updates differ by an ulp feed the next forward
# weights that round to different low-precision values now and then, so their trajectories
# drift apart by about one bf16/fp16 rounding of an activation: bf16 keeps 8 bits (eps 7.8e-3),
# fp16 11 bits (eps 9.8e-4). A quarter of eps relative to the parameter, plus an absolute
# floor for parameters near zero, still fails a step that went wrong (a whole lr-sized update).
AUTOCAST = {"bf16": Tolerance(rtol=2e-3, atol=1e-4), "fp16": Tolerance(rtol=2.5e-4, atol=1e-5)}

# Against the single process where DDP itself exceeds the derived tolerance: a sharded run may
# be up to this many times as far from it as DDP is, tensor by tensor (the largest |DDP -
# single process| of each parameter at each step, plus the tolerance). Two legal orders of the
# same additions are not each other's mirror image; 2x lets another legal order drift as far
# again, and a broken reduction is caught against DDP in any case. Per tensor, not per
# element: the drift spreads over a tensor chaotically, and an element where DDP happens to
# land near the single process has no floor of its own (timm's resnet10t, one image on each of
# 4 ranks: the FSDP2 rows 525x per element, 0.86x per tensor).
FLOOR_FACTOR = 2.0

# How far the yardstick, |DDP - single process| step by step (``references.noise_floor``), may
# grow over the one recorded on the trusted torch, plus the row's atol. On the same torch and
# CPU it is the same to the bit (the arithmetic is identical); another release may sum in
# another order, and training amplifies the difference the way it amplified the recorded one,
# so a factor, not an absolute. 4x leaves room for that and still catches a reduction that
# went wrong silently in both DDP and the engine judged against it (whose own row then holds
# within the grown floor).
YARDSTICK_HEADROOM = 4.0

# The most temporaries of a parameter's size a for-loop step makes at once: Adam's with L2
# weight decay holds the decayed gradient, the square root of its second moment and the
# denominator made from it (torch/optim/adam.py, _single_tensor_adam). Stepped in backward,
# they are made while activations are still live (timm's resnet10t: its largest conv, 576 KB,
# stepped early in backward; the peak 332 KB above the standard step's).
STEP_TEMPORARIES = 3

# The fake backend counts bytes exactly, so any growth is real; 1% lets a new workspace of a
# few hundred KB through and still catches one kept gradient (+15% on the transformer).
MEMORY_SLACK = 0.01
# The GPU tier's bound between CUDA's max_memory_allocated and the fake estimate (cuBLAS
# workspaces, kernels' scratch space; tests/measure/test_memory.py).
CUDA_SLACK = 0.05
# Measured model states against the ZeRO paper's 16 Psi / N formula (its Table 1, and
# FSDP2's padded shards at the end of backward): 2%. Seen: equal to the byte on every model
# here, as both count the same padded shards (the ZeRO table: within 0.01%, the model's Psi
# the paper's to 0.003%, 512-byte rounding the rest); the slack is for a state the count does
# not know.
STATES_AGREEMENT = 0.02
# A transform (checkpointing's recomputation, activation offload) against the same step without
# it: the same kernels on the same values, bit for bit on the Intel Xeon here; on an AMD EPYC
# GPT-2 with Hugging Face's gradient_checkpointing_enable() lands 7.3e-12 (1 thread) and
# 1.5e-11 (2 threads) off in one gradient, 0.35 and 0.72 ulp (float32 eps) of the largest
# gradient of the smallest-scaled tensor (ln_1.bias, 1.7e-4): the recomputation rounds
# otherwise there. So each tensor within this many ulps of its own largest value; a step that
# went wrong (another dropout mask, RReLU's wrong gradients, pytorch#193671) moves a gradient by
# a sizeable part of it.
KERNEL_ROUNDING_ULPS = 4


def rounding_eps(workload: Workload) -> float:
    """The eps of the lowest precision ``workload``'s step computes in (its pure dtype, its
    autocast dtype, else its parameters'): what a kernel's rounding is an ulp of."""
    dtype = workload.pure or {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        workload.precision, workload.parameter_dtype)
    return torch.finfo(dtype).eps


def rounding(workload: Workload, recorded: float, now: float) -> tuple[bool, float, float]:
    """Whether a tensor's float64 L2 norm, ``recorded`` on one release and ``now`` on another
    where a step first changed, moved by no more than a kernel's rounding: (within, relative
    change, limit). The limit is ``KERNEL_ROUNDING_ULPS`` x eps of the lowest precision the
    step computes in, relative: an element within that many ulps of the tensor's largest value
    moves the norm by less (most by far less: roundings of either sign cancel in it). A
    matmul in backward one ulp off moves the gradient reaching an attention block by 5e-9
    relative (tests/gate/test_rounding.py); RMSNorm's epsilon in bf16 (pytorch#189581) moves
    its output's by ~0.85, a 0.1% change of a formula by 1e-3."""
    limit = KERNEL_ROUNDING_ULPS * rounding_eps(workload)
    relative = abs(now - recorded) / abs(recorded) if recorded else (0.0 if not now else
                                                                     float("inf"))
    return relative <= limit, relative, limit


def tolerance(strategy: str, dtype: torch.dtype) -> Tolerance | None:
    """The tolerance against the for-loop for ``strategy`` in ``dtype``; None means bit-exact."""
    # capturable computes the bias corrections from a tensor step count, in other roundings
    # than the for-loop's Python floats: a reordering, as foreach's
    if strategy in ("in_backward_grouped_foreach", "in_backward_bucketed", "capturable"):
        strategy = "foreach"
    # complex64 is float32's pairs: its parts round as float32's
    return IMPLEMENTATIONS.get((strategy, dtype.to_real()))


def pure_data_parallel(dtype: torch.dtype) -> Tolerance:
    """In pure low precision the ranks sum gradients in that precision, so a parameter lands a
    rounding of its own away now and then: up to 2 ulps relative (an ulp is eps|p| just above
    a power of two), above half a rounding of 1e-3 (bf16: 3.9e-6) for elements near zero. A
    gradient that went wrong moves a parameter by a whole update, which is larger wherever the
    update is larger than a rounding (the pure rows' faults: tests/measure/test_pure_precision.py)."""
    eps = torch.finfo(dtype).eps
    return Tolerance(rtol=2 * eps, atol=eps * 1e-3 / 2)


def trajectory_bound(workload: Workload, identical: bool) -> Tolerance | None:
    """A strategy's trajectory against its reference; ``identical``: the same operations in
    the same order (None: bit for bit)."""
    if workload.pure is not None:
        # In pure low precision a tolerance would have to be a rounding of the parameter
        # (bf16: 1/256 of it), which is as large as a small update: it could not fail a step
        # that went wrong. Every pair compared so runs the same kernels on the same tensors
        # (the for-loop in backward, the foreach modes in groups and buckets, whose kernels
        # work per element), so bit for bit; the implementations against the for-loop are
        # held step by step instead (``parity.stepwise``), and the recorded trajectory bit for
        # bit (measured: the same bits on torch 2.12.1 to 2.14.1, where nothing changed).
        return None
    if identical and workload.compile is None:
        return None  # the same operations in the same order: bit for bit
    if workload.precision in AUTOCAST:
        return AUTOCAST[workload.precision]
    return tolerance("foreach", workload.parameter_dtype)


def data_parallel_bound(workload: Workload) -> Tolerance:
    """ZeRO-2's and the engines' parameters against DDP's and one process's: another order of
    the fp32 gradient sum (and of a clipping norm), an ulp apart, which autocast turns into a
    low-precision rounding now and then (``AUTOCAST``); in pure low precision
    ``pure_data_parallel``."""
    if workload.pure is not None:
        return pure_data_parallel(workload.pure)
    return AUTOCAST.get(workload.precision, DATA_PARALLEL)
