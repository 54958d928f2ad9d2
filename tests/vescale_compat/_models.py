"""Small models for the veScale-compat tests (written for these tests)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RegressionMLP(nn.Module):
    """fc1 -> GELU -> fc2, with the loss computed inside ``forward`` (as veScale programs do)."""

    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(self.act(self.fc1(x))), y)


def mlp_plan():
    """veScale's Megatron plan for RegressionMLP on a 1-D tensor-parallel mesh."""
    from vescale.dtensor.placement_types import Replicate, Shard

    return {
        "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)]},
        "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]},
    }


@dataclass
class TinyGPTConfig:
    vocab_size: int = 32
    block_size: int = 8
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16


class _Norm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class _Attention(nn.Module):
    def __init__(self, c: TinyGPTConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.n_embd, c.n_embd)
        # no key bias: its gradient is zero up to rounding (softmax is shift-invariant),
        # which Adam would amplify; veScale's plan names it anyway (the key is skipped)
        self.k_proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.v_proj = nn.Linear(c.n_embd, c.n_embd)
        self.c_proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head = c.n_head

    def forward(self, x):
        b, t, e = x.size()
        h = self.n_head

        def heads(z):
            return z.view(b, t, h, e // h).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(e // h))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, e)
        return self.c_proj(y)


class _MLP(nn.Module):
    def __init__(self, c: TinyGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class _Block(nn.Module):
    def __init__(self, c: TinyGPTConfig) -> None:
        super().__init__()
        self.ln_1 = _Norm(c.n_embd)
        self.attn = _Attention(c)
        self.ln_2 = _Norm(c.n_embd)
        self.mlp = _MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A nanoGPT-shaped model: veScale's module names, tied embedding and head."""

    def __init__(self, c: TinyGPTConfig | None = None) -> None:
        super().__init__()
        c = c or TinyGPTConfig()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(c.vocab_size, c.n_embd),
                "wpe": nn.Embedding(c.block_size, c.n_embd),
                "h": nn.ModuleList([_Block(c) for _ in range(c.n_layer)]),
                "ln_f": _Norm(c.n_embd),
            }
        )
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.2 if "wpe" in name else 0.1)

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def nanogpt_plan():
    """veScale's nanoGPT plan (its examples' sharding_plan.py), for TinyGPT on a 1-D tp mesh."""
    from vescale.dtensor.placement_types import Replicate, Shard

    fwd = {
        "transformer.wte.input": [[Replicate()]],
        "transformer.wte.output": [[Replicate()]],
        "transformer.wpe.input": [[Replicate()]],
        "transformer.wpe.output": [[Replicate()]],
        r"transformer.h.\d+.input": [[Shard(1)]],
        r"transformer.h.\d+.attn.input": [[Replicate()]],
        r"transformer.h.\d+.attn.c_proj.output": [[Replicate()]],
        r"transformer.h.\d+.attn.output": [[Shard(1)]],
        r"transformer.h.\d+.mlp.c_fc.input": [[Replicate()]],
        r"transformer.h.\d+.mlp.c_proj.output": [[Replicate()]],
        r"transformer.h.\d+.mlp.output": [[Shard(1)]],
        "transformer.ln_f.input": [[Shard(1)]],
        "lm_head.input": [[Shard(2)]],
        "lm_head.output": [[Replicate()]],
    }
    params = {
        "transformer.wte.weight": [Shard(1)],
        "transformer.wpe.weight": [Shard(1)],
        r"transformer.h.\d+.attn.q_proj.weight": [Shard(0)],
        r"transformer.h.\d+.attn.q_proj.bias": [Shard(0)],
        r"transformer.h.\d+.attn.k_proj.weight": [Shard(0)],
        r"transformer.h.\d+.attn.k_proj.bias": [Shard(0)],
        r"transformer.h.\d+.attn.v_proj.weight": [Shard(0)],
        r"transformer.h.\d+.attn.v_proj.bias": [Shard(0)],
        r"transformer.h.\d+.attn.c_proj.weight": [Shard(1)],
        r"transformer.h.\d+.attn.c_proj.bias": [Replicate()],
        r"transformer.h.\d+.mlp.c_fc.weight": [Shard(0)],
        r"transformer.h.\d+.mlp.c_fc.bias": [Shard(0)],
        r"transformer.h.\d+.mlp.c_proj.weight": [Shard(1)],
        r"transformer.h.\d+.mlp.c_proj.bias": [Replicate()],
        "lm_head.weight": [Shard(1)],
    }
    return {"parameter": params, "forward": fwd}
