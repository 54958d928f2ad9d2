"""veScale's RaggedShard examples through veScale's names, against dense single-device values.

``[RaggedShard(dims, units), Shard(d)]`` on a ``(dp, tp)`` mesh is veScale's FSDP x TP
layout: the tp shard is taken first and the ragged split over dp applies inside it.
"""

from __future__ import annotations

import torch

import vescale.checkpoint as vckpt
from vescale.dtensor.api import distribute_tensor, from_local, redistribute_dtensor
from vescale.dtensor.device_mesh import init_device_mesh
from vescale.dtensor.placement_types import Partial, RaggedShard, Replicate, Shard
from vescale.dtensor.testing import distributed

X = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7.0

# (placements, tp dim): the ragged split applies to the tp-local tensor
FSDP_TP = [
    ([RaggedShard((0,), (1, 3)), Shard(0)], 0),  # tp rows, then ragged rows (4 rows: 1 + 3)
    ([RaggedShard((0, 1), (5, 7)), Shard(0)], 0),  # tp rows, then ragged elements
    ([RaggedShard((0, 1), (1, 2)), Shard(1)], 1),  # tp columns, then ragged elements
    ([RaggedShard((0,), (2, 2)), Shard(1)], 1),  # whole rows: commutes with Shard(1)
]
OTHERS = [
    [Replicate(), Replicate()],
    [Shard(0), Shard(1)],
    [Shard(1), Shard(0)],
    [Replicate(), Shard(0)],
    [RaggedShard((0, 1), (3, 1)), Replicate()],
    [Replicate(), RaggedShard((0,), (1, 1))],
]


def _expected_local(rs: RaggedShard, tp_dim: int, dp: int, tp: int) -> torch.Tensor:
    return rs.shard(X.chunk(2, dim=tp_dim)[tp].contiguous(), 2, dp)


@distributed(4, timeout=300)
def test_fsdp_x_tp_layout_and_redistribution():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    for pl, tp_dim in FSDP_TP:
        dt = distribute_tensor(X, mesh, pl)
        assert torch.equal(dt.to_local(), _expected_local(pl[0], tp_dim, dp, tp)), pl
        assert torch.equal(dt.full_tensor(), X), pl
        # from the same local data on every rank (no global shape needed for rows)
        again = from_local(dt.to_local(), mesh, pl, shape=X.shape)
        assert torch.equal(again.full_tensor(), X)
        for other in OTHERS + [p for p, _ in FSDP_TP]:
            there = redistribute_dtensor(dt, mesh, other)
            assert torch.equal(there.full_tensor(), X), (pl, other)
            src = distribute_tensor(X, mesh, other)
            back = redistribute_dtensor(src, mesh, pl)
            assert tuple(back.placements) == tuple(pl)
            assert torch.equal(back.to_local(), dt.to_local()), (other, pl)


@distributed(4, timeout=300)
def test_fsdp_x_tp_forward_backward_and_ops():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    w = torch.randn(X.shape, generator=torch.Generator().manual_seed(3))
    for pl, _ in FSDP_TP:
        leaf = distribute_tensor(X, mesh, pl).requires_grad_()
        out = redistribute_dtensor(leaf, mesh, [Replicate(), Replicate()])
        (out.to_local() * w).sum().backward()
        assert tuple(leaf.grad.placements) == tuple(pl)
        assert torch.allclose(leaf.grad.full_tensor(), w), pl
        # element-wise ops run on the local shards; a full reduction is exact
        y = leaf.detach() * 2.0 + 1.0
        assert tuple(y.placements) == tuple(pl)
        assert torch.allclose(y.full_tensor(), X * 2.0 + 1.0)
        assert torch.allclose(leaf.detach().sum().full_tensor(), X.sum())
        # a Partial gradient reduce-scattered straight into the layout
        part = from_local(X.clone(), mesh, [Partial(), Partial()], shape=X.shape, stride=X.stride())
        rs = redistribute_dtensor(part, mesh, pl)
        assert torch.allclose(rs.full_tensor(), 4 * X), pl


@distributed(4, timeout=300)
def _save_fsdp_x_tp(path: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {f"t{i}": distribute_tensor(X * (i + 1), mesh, pl) for i, (pl, _) in enumerate(FSDP_TP)}
    vckpt.save(path, state)
    # load into other layouts, and into the FSDP x TP layouts from a Shard-saved checkpoint
    targets = [
        [Shard(1), Shard(0)],
        [Replicate(), Replicate()],
        [RaggedShard((0,), (3, 1)), Shard(1)],
        [Replicate(), Shard(1)],
    ]
    out = {k: distribute_tensor(torch.zeros_like(X), mesh, t) for k, t in zip(state, targets)}
    vckpt.load(path, out)
    for i, k in enumerate(state):
        assert torch.equal(out[k].full_tensor(), X * (i + 1)), k
    vckpt.save(
        path + "-dense", {k: distribute_tensor(X * 3, mesh, [Shard(0), Shard(1)]) for k in state}
    )
    back = {
        k: distribute_tensor(torch.zeros_like(X), mesh, pl) for k, (pl, _) in zip(state, FSDP_TP)
    }
    vckpt.load(path + "-dense", back)
    for k, v in back.items():
        assert torch.equal(v.full_tensor(), X * 3), k


@distributed(2)
def _load_on_two(path: str):
    mesh = init_device_mesh("cpu", (2,))
    out = {"t0": distribute_tensor(torch.zeros_like(X), mesh, [RaggedShard((0, 1), (1, 2))])}
    vckpt.load(path, out, strict=False)
    assert torch.equal(out["t0"].full_tensor(), X)


def test_fsdp_x_tp_checkpoint_reshards(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_fsdp_x_tp(path)
    _load_on_two(path)


@distributed(4, timeout=300)
def test_raggedshard_doc_examples_1d():
    """veScale's RaggedShard capabilities on one mesh dim: redistribution, ops, AdamW, clip, Muon's root."""
    from vescale.dtensor.debug import CommDebugMode
    from vescale.optim import clip_grad_norm_

    mesh = init_device_mesh("cpu", (4,))
    full = torch.randn(10, 3, generator=torch.Generator().manual_seed(1))
    units = (1, 2, 1, 1)  # 20% / 40% / 20% / 20% of the elements
    rs = [RaggedShard((0, 1), units)]
    dt = distribute_tensor(full, mesh, rs)
    r = mesh.get_coordinate()[0]
    start = 6 * sum(units[:r])
    assert torch.equal(dt.to_local(), full.reshape(-1)[start : start + 6 * units[r]])
    # RaggedShard -> Replicate forward; the gradient comes back ragged without communication
    leaf = dt.detach().requires_grad_()
    rep = redistribute_dtensor(leaf, mesh, [Replicate()])
    assert torch.equal(rep.to_local(), full)
    with CommDebugMode() as cm:
        rep.backward(torch.ones_like(rep))
    assert cm.get_total_counts() == 0
    assert tuple(leaf.grad.placements) == tuple(rs) and torch.equal(
        leaf.grad.to_local(), torch.ones(6 * units[r])
    )
    # to Shard / other RaggedShard / from Partial
    for target in (
        [Shard(0)],
        [Shard(1)],
        [RaggedShard((0,), (2, 0, 2, 1))],
        [RaggedShard((), (0, 0, 1, 0))],
    ):
        moved = redistribute_dtensor(dt, mesh, target)
        assert torch.equal(moved.full_tensor(), full), target
        assert torch.equal(redistribute_dtensor(moved, mesh, rs).to_local(), dt.to_local())
    part = from_local(full.clone(), mesh, [Partial()], shape=full.shape, stride=full.stride())
    assert torch.allclose(redistribute_dtensor(part, mesh, rs).full_tensor(), 4 * full)
    # element-wise AdamW and the global gradient norm on ragged parameters, vs dense
    w = torch.nn.Parameter(distribute_tensor(full, mesh, rs))
    dense = torch.nn.Parameter(full.clone())
    g = torch.randn(10, 3, generator=torch.Generator().manual_seed(2)) * 3
    w.grad = distribute_tensor(g, mesh, rs)
    dense.grad = g.clone()
    n1 = clip_grad_norm_([w], 1.0)
    n2 = torch.nn.utils.clip_grad_norm_([dense], 1.0)
    torch.testing.assert_close(
        torch.as_tensor(n1.full_tensor() if hasattr(n1, "full_tensor") else n1), n2
    )
    for p in (w, dense):
        opt = torch.optim.AdamW([p], lr=0.1)
        opt.step()
    torch.testing.assert_close(w.full_tensor(), dense.detach(), rtol=1e-6, atol=1e-6)
