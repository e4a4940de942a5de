"""DeepSpeed ZeRO stage 2 as a peer of hookbench's ZeRO-2 (``hookbench.peers.deepspeed_zero2``),
fp32, 2 gloo ranks: the same parameters at every step, bit for bit, with and without gradient
accumulation; within tolerance with global-norm clipping; a fault in hookbench's reduction makes
the comparison fail; and per-rank memory side by side. Skipped with a reason where deepspeed is
not installed (the ``peers`` extra).

On a machine that never ran DeepSpeed, its first ``deepspeed.initialize`` JIT-builds a
shared-memory op (``deepspeed_shm_comm``, used only for inference all-reduce) into
~/.cache/torch_extensions: about a minute on 2 cores, once; later runs load it. Installing with
``DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1`` builds it at install time instead."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is an optional peer: pip install -e "
                                        "'.[peers]' (with DS_BUILD_OPS=0)")

from hookbench import launch, zero2_runs  # noqa: E402
from hookbench.peers import deepspeed_zero2  # noqa: E402
from hookbench.prerequisites import MissingPrerequisite  # noqa: E402
from hookbench.zoo import TinySpec  # noqa: E402

pytestmark = [pytest.mark.peers, pytest.mark.distributed]

# 227 parameters cut in two at 114 (DeepSpeed pads to a multiple of 2N, hookbench to N: both
# 228 here), so a parameter straddles the ranks; 50-element buckets, so a backward reduces
# several. 2 ranks: DeepSpeed divides each gradient by N before summing, hookbench sums then
# divides, which is the same in binary floating point only when N is a power of two.
SPEC, OPTIMIZERS, WORLD, STEPS = zero2_runs.PARITY_SPEC, zero2_runs.PARITY_OPTIMIZERS, 2, 5
# The global gradient norm of SPEC's batches is 0.34 to 1.08 at every step (SGD and Adam), so
# 0.1 clips every step.
CLIP = 0.1
FAULTS = ("collective_wrong_slice", "fires_twice")


def _case(name, **extra):
    cls, kw = OPTIMIZERS[name]
    return dict(spec=SPEC, optimizer_class=cls, kwargs=kw, bucket_numel=50, steps=STEPS, **extra)


CASES = {(name, acc, clip): _case(name, accumulation=acc, clipping=clip)
         for name in OPTIMIZERS for acc, clip in ((1, 0.0), (2, 0.0), (1, CLIP))}
CASES.update({(fault,): _case("adam", fault=fault) for fault in FAULTS})


@pytest.fixture(scope="module")
def runs():
    """Every case on both sides (hookbench's Zero2, DeepSpeed) from one start of 2 ranks."""
    keys = list(CASES)
    # 300 s: the first run on a machine JIT-builds DeepSpeed's shm op (module docstring).
    results = launch.run(deepspeed_zero2.peer_cases, WORLD, [CASES[k] for k in keys],
                         timeout=300)
    return {key: [results[rank][i] for rank in range(WORLD)] for i, key in enumerate(keys)}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bit_for_bit_the_same_parameters_as_deepspeed(runs, name, accumulation):
    # DeepSpeed with gradient_clipping=0.0, Zero2 without clipping; torch.equal for every
    # parameter after every step, on each rank.
    for rank, got in enumerate(runs[name, accumulation, 0.0]):
        assert len(got["deepspeed"]["snapshots"]) == STEPS
        problems = deepspeed_zero2.differences(got["hookbench"], got["deepspeed"])
        assert not problems, (rank, problems)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_with_clipping_within_tolerance(runs, name):
    # Within zero2_runs.TOLERANCE, not bit for bit: both scale the shard's gradient by the
    # global norm, but compute it in another order (DeepSpeed: the norm of each parameter's
    # piece, squared and summed; hookbench: the norm of the whole shard, squared) and the
    # factor by another formula (DeepSpeed g * (1 / ((norm + 1e-6) / c)), hookbench's as
    # torch.nn.utils.clip_grad_norm_'s, g * (c / (norm + 1e-6))): the norms differ in the last
    # bit, every clipped gradient by about an ulp. Seen: 3.7e-9 (SGD), 3.0e-8 (Adam) at most,
    # 0.3% and 1.2% of the tolerance.
    for rank, got in enumerate(runs[name, 1, CLIP]):
        # both clipped at every step (else this would compare unclipped training)
        for norms in (got["hookbench"]["grad_norms"], got["deepspeed"]["grad_norms"]):
            assert len(norms) == STEPS and min(norms) > CLIP, (rank, norms)
        problems = deepspeed_zero2.differences(got["hookbench"], got["deepspeed"],
                                               zero2_runs.TOLERANCE)
        assert not problems, (rank, problems)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_in_hookbench_fails_the_comparison(runs, fault):
    # The fault is injected on hookbench's side only (hookbench.faults, inside each rank);
    # DeepSpeed's side is the clean Adam run. The same check that passes above must fail.
    for rank in range(WORLD):
        faulty = runs[fault,][rank]["hookbench"]
        clean = runs["adam", 1, 0.0][rank]
        assert not deepspeed_zero2.differences(clean["hookbench"], clean["deepspeed"])
        assert deepspeed_zero2.differences(faulty, clean["deepspeed"]), (fault, rank)
        # and not only bit for bit: also outside the tolerance
        assert deepspeed_zero2.differences(faulty, clean["deepspeed"], zero2_runs.TOLERANCE)


# ~3.15M parameters: 1024 -> 1024 -> 1024 -> 1024 -> 3, batch 32 (16 per rank). Adam,
# for-loop, 2^20-element buckets on both sides.
MEMORY_SPEC = TinySpec(depth=3, width=1024, in_features=1024, batch_size=32)
MEMORY_BUCKET = 2**20


def test_per_rank_memory_below_deepspeed():
    # Both measured by hookbench.memory's StorageTracker on real CPU tensors, 512-byte rounding,
    # one warm-up step, then the peak of one step, on each of the 2 ranks
    # (deepspeed_zero2.rank_memory). MB (2^20 bytes) per rank, seen on torch 2.14.1 and
    # deepspeed 0.19.8 (ranges: both ranks, several runs, hookbench at 4a1059c and b875c47):
    #                  peak  parameters  gradients  optimizer state  activations  temporaries
    #   hookbench  38.2-38.6    12.0      0.0-4.0        12.0          0.1-0.4     10.0-14.1
    #   DeepSpeed  60.2-62.2    12.0     4.0-12.0        18.0            0.1       20.0-28.0
    # Parameters are the same 4 Psi (both pad 3,151,875 elements to 3,151,876). DeepSpeed's
    # optimizer state is Adam's 8 Psi/N plus the fp32 copy of the rank's partition that it keeps
    # even in fp32 (4 Psi/N, 6.0 MB; the ZeRO paper counts that master copy as optimizer state).
    # Gradients and temporaries together: hookbench 14.0-14.1 (the gradient shard, 4 Psi/N,
    # and one bucket in flight), DeepSpeed 30-32 (its contiguous gradient partition, 4 Psi/N,
    # at the step a flattened copy of it, the 4 MiB reduction bucket, whole 4 MiB parameter
    # gradients). How a buffer splits between those two rows depends on whether a .grad views
    # it at the peak, so only the peaks (and the parameters) are compared.
    adam = {"lr": 1e-3, "foreach": False}
    got = launch.run(deepspeed_zero2.rank_memory, WORLD, MEMORY_SPEC, torch.optim.Adam, adam,
                     MEMORY_BUCKET, timeout=300)
    mb = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    table = "\n".join(f"rank {rank} {side:9} peak {mb(m['peak']):>6} MB: "
                      + ", ".join(f"{k} {mb(v)}" for k, v in m["breakdown"].items())
                      for rank, sides in enumerate(got) for side, m in sides.items())
    print(f"\nper-rank memory of one step (pytest -s shows this):\n{table}")
    for rank, sides in enumerate(got):
        ours, theirs = sides["hookbench"], sides["deepspeed"]
        assert ours["breakdown"]["parameters"] == theirs["breakdown"]["parameters"], rank
        assert theirs["fp32_partition"] > 0, rank  # the copy hookbench does without
        assert ours["peak"] < theirs["peak"], table


def test_missing_deepspeed_is_a_missing_prerequisite(monkeypatch):
    # What the report and gate show as SKIPPED where the extra is absent: `import deepspeed`
    # fails as it does when it is not installed (None in sys.modules).
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(MissingPrerequisite, match="deepspeed is not installed"):
        deepspeed_zero2.trajectory(0, 1, SPEC, *OPTIMIZERS["sgd"], bucket_numel=50)
