"""Shared models, data and reference training for the DDP/FSDP tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from vescale.dmodule.testing import GPT, GPTConfig

STEPS = 5
GLOBAL_BATCH = 8
SEQ = 8
TOL = dict(atol=1e-5, rtol=1e-5)


def cfg() -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)


def make_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg())


class Sometimes(nn.Module):
    """An MLP whose ``extra`` layer runs only when ``use_extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.extra = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.use_extra = True

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        if self.use_extra:
            x = x + self.extra(x)
        return self.head(x)


def mesh_for(n: int, two_d: bool = False) -> DeviceMesh:
    """A mesh whose "dp" dim has ``n`` ranks, inside the 4-rank pool."""
    if n == 4 and not two_d:
        return init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    if n == 2 and two_d:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    if n == 2:
        return DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("rep", "dp"))
    raise ValueError(n)


def batches(steps: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g)
        tgt = torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=g)
        out.append((idx, tgt))
    return out


def local_slice(t: torch.Tensor, mesh: DeviceMesh, dim: str = "dp") -> torch.Tensor:
    n = mesh.size(mesh.mesh_dim_names.index(dim))
    r = mesh.get_local_rank(dim)
    k = t.shape[0] // n
    return t[r * k : (r + 1) * k]


def gpt_loss(model, idx, tgt):
    out = model(idx)
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), tgt.reshape(-1))


def train_reference(model, data, *, lr=1e-2, micro: int = 1, autocast: bool = False):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for idx, tgt in data:
        opt.zero_grad()
        total = 0.0
        for ci, ct in zip(idx.chunk(micro), tgt.chunk(micro)):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = gpt_loss(model, ci, ct) / micro
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_params_close(model, ref, **tol):
    tol = tol or TOL
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full(got[name].detach()), p.detach(), **tol, msg=name)


def fresh_caches() -> None:
    """Drop torch's redistribution/sharding-propagation caches inside a test body.

    They hold meshes of earlier test bodies (whose process groups the pool destroyed);
    a body that builds several meshes starts every one without them.
    """
    from vescale.dtensor import _compat

    _compat.clear_dtensor_caches()
