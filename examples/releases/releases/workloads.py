"""Workloads for gating one real torch release against another (issue 56): two models with
dropout, whose masks each release draws otherwise from the same seed; a Llama-style model in
pure bf16 with `nn.RMSNorm` at its default eps, whose arithmetic changed between 2.6.0 and 2.9.1
(pytorch#189581); and an MLP in pure bf16 with fused SGD (pytorch#191763, wrong on 2.4.1 to
2.13.0). `WORKLOADS` lists them."""
import torch
import torch.nn.functional as F
from torch import nn

from hookbench import Workload


class Encoder(nn.Module):
    """torch's own TransformerEncoder with a padding mask, dropout on."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, x):
        pad = x == 0
        return self.head(self.enc(self.emb(x), src_key_padding_mask=pad)).mean(1)


def tokens(g):
    x = torch.randint(1, 50, (8, 12), generator=g)
    x[:, -3:] = 0
    return x, torch.randint(0, 50, (8,), generator=g)


ENCODER = Workload(name="encoder", model=Encoder, batch=tokens, loss=F.cross_entropy,
                   optimizer=(torch.optim.AdamW, {"lr": 1e-3}))


class LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(60, 24)
        self.drop = nn.Dropout(0.2)
        self.rnn = nn.LSTM(24, 32, num_layers=2, dropout=0.2, batch_first=True)
        self.decoder = nn.Linear(32, 60)

    def forward(self, x):
        out, _ = self.rnn(self.drop(self.emb(x)))
        return self.decoder(self.drop(out[:, -1]))


def seqs(g):
    return torch.randint(0, 60, (8, 10), generator=g), torch.randint(0, 60, (8,), generator=g)


LSTM = Workload(name="lstm", model=LSTMLM, batch=seqs, loss=F.cross_entropy,
                optimizer=(torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}))


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.down(F.silu(self.up(self.norm2(x))))


class Llama(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.tok = nn.Embedding(64, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, 64, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        h = self.tok(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.norm(h)).float().mean(1)


def llama_batch(g):
    return torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8,), generator=g)


RMSNORM = Workload(name="rmsnorm-llama", model=Llama, batch=llama_batch, loss=F.cross_entropy,
                   optimizer=(torch.optim.AdamW, {"lr": 1e-3}), precision="bf16-true")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 10))

    def forward(self, x):
        return self.net(x).float()


def mlp_batch(g):
    return torch.randn(16, 16, generator=g), torch.randint(0, 10, (16,), generator=g)


# pure bf16 with fused SGD, as torchtune trains by default: pytorch#191763 (wrong on 2.4.1..2.13.0)
SGD_BF16 = Workload(name="sgd-fused-bf16", model=MLP, batch=mlp_batch, loss=F.cross_entropy,
                    optimizer=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
                    precision="bf16-true")

WORKLOADS = [ENCODER, LSTM, RMSNORM, SGD_BF16]
