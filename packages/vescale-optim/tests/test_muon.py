"""vescale.optim.Muon on sharded parameters against torch.optim.Muon (+ AdamW)."""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor import (
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    placement_registry,
)
from vescale.dtensor.testing import distributed
from vescale.optim import Muon

# (shape, layout kind); matrices use Muon, the rest AdamW
PARAMS = [
    ((16, 8), "s0"),
    ((8, 12), "s1"),
    ((12, 10), "rs"),
    ((6, 6), "rep"),
    ((24, 8), "s0"),
    ((16,), "s0"),  # a bias: AdamW
    ((10, 4), "embed"),  # an embedding: AdamW by name
]
HP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 0.02, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _clear_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from vescale.dtensor import _redistribute

    _clear_sharding_prop_cache()
    _redistribute._clear_caches()


class _Model(torch.nn.Module):
    def __init__(self, tensors):
        super().__init__()
        self.mats = torch.nn.ParameterList([torch.nn.Parameter(t) for t in tensors[:5]])
        self.bias = torch.nn.Parameter(tensors[5])
        self.embed = torch.nn.Embedding(10, 4)
        self.embed.weight = torch.nn.Parameter(tensors[6])


def _placements(kind, n):
    RS = placement_registry()["RaggedShard"]
    if kind == "s1":
        return [Shard(1)]
    if kind == "rs":
        units = {2: (1, 2), 4: (3, 1, 0, 2)}[n]  # 12 rows, uneven, one rank empty
        return [RS((0,), units)]
    if kind == "rep":
        return [Replicate()]
    return [Shard(0)]


def _init():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(s, generator=g) for s, _ in PARAMS]


def _grads(step):
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(s, generator=g) for s, _ in PARAMS]


def _body(n, steps=5):
    _clear_caches()
    mesh = init_device_mesh("cpu", (n,))
    full = _init()
    dts = [distribute_tensor(t, mesh, _placements(kind, n)) for t, (_, kind) in zip(full, PARAMS)]
    model = _Model(dts)
    opt = Muon(model, adamw_lr=ADAMW["lr"], adamw_betas=ADAMW["betas"], **HP)
    ref_model = _Model([t.clone() for t in full])
    mats = [p for p in ref_model.mats]
    ref_muon = torch.optim.Muon(mats, **HP)
    ref_adam = torch.optim.AdamW([ref_model.bias, ref_model.embed.weight], **ADAMW)
    params = list(model.mats) + [model.bias, model.embed.weight]
    ref_params = mats + [ref_model.bias, ref_model.embed.weight]
    costs = []
    for s in range(steps):
        for p, rp, g, (_, kind) in zip(params, ref_params, _grads(s), PARAMS):
            p.grad = distribute_tensor(g, mesh, _placements(kind, n))
            rp.grad = g.clone()
        opt.step()
        ref_muon.step()
        ref_adam.step()
        costs.append(opt.last_local_cost)
    for i, (p, rp) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(
            p.full_tensor(), rp.detach(), rtol=1e-5, atol=1e-6, msg=f"param {i}"
        )
    for p, rp in zip(params[:5], mats):
        torch.testing.assert_close(
            opt.state[p]["momentum_buffer"].full_tensor(),
            ref_muon.state[rp]["momentum_buffer"],
            rtol=1e-5,
            atol=1e-6,
        )
    for p, rp in zip(params[5:], ref_params[5:]):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                opt.state[p][k].full_tensor(), ref_adam.state[rp][k], rtol=1e-5, atol=1e-7
            )
    # the embedding and the bias use AdamW; the five matrices Muon
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert len(opt.param_groups[0]["params"]) == 5
    return costs[-1]


@pytest.mark.parametrize("n", [2, 4])
def test_muon_matches_torch(n):
    from vescale.dtensor.testing import run_on_ranks

    costs = run_on_ranks(_body, n, n)
    total = sum(m * k * min(m, k) for (m, k), _ in [(s, None) for s, _ in PARAMS[:5]])
    assert sum(costs) == total  # each matrix orthogonalized exactly once
    biggest = max(m * k * min(m, k) for (m, k), _ in PARAMS[:5])
    assert max(costs) <= max(total / n, biggest) + biggest  # greedy balance bound


@distributed(4)
def test_muon_2d_mesh_tp_shard():
    _clear_caches()
    mesh = init_device_mesh("cpu", (2, 2))
    full = _init()[:2]
    pls = [[Replicate(), Shard(0)], [Shard(1), Shard(0)]]
    ps = [torch.nn.Parameter(distribute_tensor(t, mesh, pl)) for t, pl in zip(full, pls)]
    opt = Muon(ps, **HP)
    refs = [torch.nn.Parameter(t.clone()) for t in full]
    ref = torch.optim.Muon(refs, **HP)
    for s in range(3):
        for p, r, g, pl in zip(ps, refs, _grads(s)[:2], pls):
            p.grad = distribute_tensor(g, mesh, pl)
            r.grad = g.clone()
        opt.step()
        ref.step()
    for p, r in zip(ps, refs):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6)
