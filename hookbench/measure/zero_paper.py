"""The ZeRO paper's memory table (Rajbhandari et al. 2020, Table 1), reproduced by executing
a training step, not by its formula.

A GPT-like model of 7.5 B parameters (``GPT_7_5B``: 36 pre-norm layers of width 4096) takes one
mixed-precision step (bf16 parameters and gradients, fp32 masters and Adam state: the paper's
K = 12) as rank 0 of N ranks, on fake tensors and a fake process group (``hookbench.measure.memory``'s
fake backend: no data, so the step needs seconds and little real memory). What is live when
backward has ended is the paper's model state, per category:

    plain data parallelism   ``Zero2`` on 1 rank: every gradient, master and moment (16 Psi)
    P_os (stage 1)           ``Zero2(shard_gradients=False)``: the whole gradient on every rank,
                             masters and moments sharded (4 Psi + 12 Psi / N)
    P_os+g (stage 2)         ``Zero2``: gradients sharded too (2 Psi + 14 Psi / N)

``table()`` measures them beside the paper's figures; activations are reported apart (the
paper leaves them out).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hookbench.core.workload import Workload
from hookbench.measure.memory import measure
from hookbench.models.zoo import TinyTransformer

__all__ = ["GPT_7_5B", "PAPER", "WORLDS", "Row", "paper_bytes", "table"]

WORLDS = (1, 8, 64, 1024)
# The paper's Table 1, 7.5 B parameters, GB (1e9 bytes), by N: P_os and P_os+g. N = 8 is not
# in the table; the formula it tabulates gives it.
PAPER = {1: (120.0, 120.0), 4: (52.5, 41.3), 16: (35.6, 21.6), 64: (31.4, 16.6),
         256: (30.4, 15.4), 1024: (30.1, 15.1)}
PSI_PAPER = 7.5e9
_SEQ = 128  # the model states do not depend on it; a short sequence keeps the step quick


def paper_bytes(stage: int, world: int, psi: float = PSI_PAPER) -> float:
    """The paper's model-state formula (K = 12): 16 Psi for data parallelism, 4 Psi + 12 Psi/N
    for stage 1, 2 Psi + 14 Psi/N for stage 2."""
    if stage == 0 or world <= 1:
        return 16 * psi
    return (4 + 12 / world) * psi if stage == 1 else (2 + 14 / world) * psi


def _tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, _VOCAB, (1, _SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


# 36 layers of 12 * 4096^2 + 2 * 4096 parameters and a tied embedding of 61,440 tokens:
# 7.500 B in all, the paper's Psi to 0.01%.
_VOCAB = 61_440
GPT_7_5B = Workload(
    "gpt-7.5b", model=functools.partial(TinyTransformer, vocab=_VOCAB, dim=4096, layers=36,
                                        heads=32, seq_len=_SEQ),
    batch=_tokens, loss=_loss)


@dataclass(frozen=True)
class Row:
    stage: int  # 0: plain data parallelism
    world: int
    parameters: int  # bytes, live when backward has ended
    gradients: int
    optimizer_state: int  # fp32 masters and Adam's two moments
    activations_peak: int

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def _measure(stage: int, world: int, workload: Workload) -> Row:
    r = measure(workload, "zero2", world_size=world, warmup=1, optimizer_kwargs={
        "lr": 1e-4, "param_dtype": torch.bfloat16, "shard_gradients": stage != 1,
        "bucket_numel": 2**25})
    b = r.after_backward
    return Row(stage, world, b["parameters"], b["gradients"], b["optimizer_state"],
               r.activations_peak)


def table(worlds: tuple[int, ...] = WORLDS, workload: Workload = GPT_7_5B) -> list[Row]:
    """Rank 0's model states per stage and N: data parallelism once (it does not depend on
    N), stages 1 and 2 for each N > 1."""
    rows = [_measure(0, 1, workload)]
    for world in worlds:
        if world > 1:
            rows += [_measure(1, world, workload), _measure(2, world, workload)]
    return rows
