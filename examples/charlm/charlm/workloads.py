"""The training steps this project runs, described for hookbench (``hookbench.Workload``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charlm.model import VOCAB, CharLM
from hookbench import Workload

BATCH, SEQ = 8, 32


def batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


ADAMW = (torch.optim.AdamW, {"lr": 3e-3, "weight_decay": 0.01})

# What the project trains with today.
CHARLM = Workload("charlm", model=CharLM, batch=batch, loss=loss, optimizer=ADAMW)
# What it is moving to: bf16 autocast, each top-level block recomputed in backward.
CHARLM_BF16 = Workload("charlm-bf16-ckpt", model=CharLM, batch=batch, loss=loss, optimizer=ADAMW,
                       precision="bf16", checkpointing="blocks")
# fp16 with a GradScaler and SGD: the optimizer in backward must refuse it, in words.
CHARLM_FP16 = Workload("charlm-fp16", model=CharLM, batch=batch, loss=loss,
                       optimizer=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                       precision="fp16")

WORKLOADS = [CHARLM, CHARLM_BF16, CHARLM_FP16]
