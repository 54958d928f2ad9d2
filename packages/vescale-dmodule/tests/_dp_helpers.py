"""Shared models, data and reference training for the DDP/FSDP tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

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


def train_steps(
    model: nn.Module,
    mesh: DeviceMesh,
    data,
    *,
    micro: int = 1,
    accumulate=None,
    batch_slice=None,
    loss=None,
    group: str | None = "dp",
):
    """AdamW steps of ``model`` on this rank's slice of ``data``.

    Each step runs ``micro`` micro-batches. ``accumulate(model, last)`` is called before
    each one (FSDP2's ``set_requires_gradient_sync`` pattern); without it, all but the
    last run under ``no_sync``.

    Args:
        batch_slice: ``(t, mesh) -> this rank's part of the global batch t`` (default:
            `local_slice` over "dp").
        loss: ``(model, idx, tgt) -> loss`` (default: `gpt_loss`).
        group: Mesh dim whose ranks' losses are averaged (``None``: all ranks).

    Returns:
        The averaged loss of every step, and the optimizer.
    """
    from vescale.dmodule import no_sync

    batch_slice = batch_slice or local_slice
    loss = loss or gpt_loss
    pg = None if group is None else mesh.get_group(group)
    n = torch.distributed.get_world_size(pg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for idx, tgt in data:
        idx, tgt = batch_slice(idx, mesh), batch_slice(tgt, mesh)
        opt.zero_grad()
        total = torch.zeros(())
        for k, (ci, ct) in enumerate(zip(idx.chunk(micro), tgt.chunk(micro))):
            last = k == micro - 1
            if accumulate is not None:
                accumulate(model, last)
            with contextlib.nullcontext() if accumulate is not None or last else no_sync(model):
                value = loss(model, ci, ct) / micro
                value.backward()
            total += value.detach()
        torch.distributed.all_reduce(total, group=pg)
        losses.append(total.item() / n)
        opt.step()
    return losses, opt


def train_dp(
    wrap: Callable[[nn.Module, DeviceMesh], nn.Module],
    n: int,
    *,
    micro: int = 1,
    two_d: bool = False,
    mp=None,
):
    """`train_steps` of ``wrap(make_gpt(), mesh)`` (DDP or FSDP over the "dp" dim of
    ``mesh_for(n, two_d)``) on `batches`, next to `train_reference` on one device (under
    bf16 autocast when ``mp`` is set). Returns ``(model, ref, losses, ref_losses)``.
    """
    mesh = mesh_for(n, two_d)
    data = batches()
    ref = make_gpt()
    ref_losses = train_reference(ref, data, micro=micro, autocast=mp is not None)
    model = wrap(make_gpt(), mesh)
    losses, _ = train_steps(model, mesh, data, micro=micro)
    return model, ref, losses, ref_losses


def train_sometimes(wrap: Callable[[nn.Module, DeviceMesh], nn.Module]) -> nn.Module:
    """Five AdamW steps of `Sometimes` (``extra`` used on even steps only) wrapped by
    ``wrap(module, mesh_for(4))`` next to one device; the parameters must end equal and
    ``extra.weight.grad`` be ``None`` exactly after the steps that left it unused."""
    mesh = mesh_for(4)
    torch.manual_seed(0)
    ref = Sometimes()
    torch.manual_seed(0)
    model = wrap(Sometimes(), mesh)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(8, 8, generator=g)
        ref.use_extra = model.use_extra = step % 2 == 0
        opt_r.zero_grad()
        opt.zero_grad()
        F.mse_loss(ref(x), torch.zeros(8, 4)).backward()
        F.mse_loss(model(local_slice(x, mesh)), torch.zeros(2, 4)).backward()
        assert (model.extra.weight.grad is None) == (step % 2 == 1), step
        opt_r.step()
        opt.step()
    assert_params_close(model, ref)
    return model


def check_bad_input(wrap, other) -> DeviceMesh:
    """The input errors ``wrap(module, mesh, dim)`` (``replicate`` or ``fully_shard``)
    raises before any collective: an unknown mesh dim, a module already wrapped (again
    by ``wrap`` or by the ``other`` engine), parameters on two devices. Returns the mesh.
    """
    import pytest

    mesh = mesh_for(4)
    with pytest.raises(ValueError, match="'tp' is not in the mesh"):
        wrap(make_gpt(), mesh, "tp")
    model = wrap(make_gpt(), mesh, "dp")
    for again in (wrap, other):
        with pytest.raises(ValueError, match="already data-parallel"):
            again(model, mesh, "dp")
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    with pytest.raises(ValueError, match="different devices"):
        wrap(m, mesh, "dp")
    return mesh


def one_batch(model: nn.Module, mesh: DeviceMesh):
    """What the bytes/memory tests of a wrapped ``model`` start from: its engine, an
    AdamW (lr 1e-2), its parameter count and this rank's ``(idx, tgt)`` of one batch."""
    from vescale.dmodule import get_dp_engine

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nparams = sum(p.numel() for p in model.parameters())
    idx, tgt = batches(1)[0]
    return get_dp_engine(model), opt, nparams, local_slice(idx, mesh), local_slice(tgt, mesh)
