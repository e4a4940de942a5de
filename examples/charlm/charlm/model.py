"""The model: embedding, a causal convolution, a GRU, and a head tied to the embedding."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 64, 32


class CharLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        # Causal: pad on the left only, so that position t sees tokens <= t.
        self.conv = nn.Sequential(nn.ConstantPad1d((2, 0), 0.0), nn.Conv1d(dim, dim, 3))
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two uses per step

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h, _ = self.rnn(h)
        return self.head(self.norm(h))
