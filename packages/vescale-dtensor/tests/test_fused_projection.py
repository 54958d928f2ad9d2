"""Fused projections: split/chunk of ``_StridedShard`` parts and the cat of their gradients.

torch 2.13 gathers a ``_StridedShard(d, k)`` tensor to split it; vescale's two extra
propagation rules (``vescale.dtensor._compat.install_strided_split_rules``) keep the
parts sharded with no communication, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed

H = 4


def _fused(mesh):
    """A [q; k; v] projection (HF Conv1D layout, weight [in, 3H]), sharded and dense."""
    torch.manual_seed(0)
    w, b, x = torch.randn(H, 3 * H), torch.randn(3 * H), torch.randn(2, 5, H)
    wp = torch.nn.Parameter(distribute_tensor(w, mesh, [_StridedShard(1, split_factor=3)]))
    bp = torch.nn.Parameter(distribute_tensor(b, mesh, [_StridedShard(0, split_factor=3)]))
    xd = distribute_tensor(x, mesh, [Replicate()])
    return (wp, bp, xd), (w.requires_grad_(), b.requires_grad_(), x)


def _project(w, b, x, split):
    return split(torch.addmm(b, x.view(-1, H), w).view(2, 5, 3 * H))


@distributed(2)
def test_local_layout_is_the_same_slice_of_every_part():
    mesh = init_device_mesh("cpu", (2,))
    r = dist.get_rank()
    w = torch.arange(H * 3 * H, dtype=torch.float32).reshape(H, 3 * H)
    local = distribute_tensor(w, mesh, [_StridedShard(1, split_factor=3)]).to_local()
    half = H // 2
    expect = torch.cat([w[:, j * H + r * half : j * H + (r + 1) * half] for j in range(3)], 1)
    assert torch.equal(local, expect)


@distributed(2)
def test_split_and_chunk_give_sharded_parts_without_communication():
    mesh = init_device_mesh("cpu", (2,))
    for split in (lambda t: t.split(H, dim=2), lambda t: t.chunk(3, dim=-1)):
        (wp, bp, xd), (wr, br, x) = _fused(mesh)
        ref = _project(wr, br, x, split)
        with CommDebugMode() as fwd:
            parts = _project(wp, bp, xd, split)
            mixed = parts[0] * 1.0 + parts[1] * 2.0 + parts[2] * 3.0
        assert fwd.get_total_counts() == 0, fwd.get_comm_counts()
        assert [p.placements for p in parts] == [(Shard(2),)] * 3
        for got, want in zip(parts, ref):
            torch.testing.assert_close(got.full_tensor(), want, atol=1e-6, rtol=1e-6)
        with CommDebugMode() as bwd:
            (mixed.to_local() ** 2).sum().backward()
        assert bwd.get_total_counts() == 0, bwd.get_comm_counts()
        (sum(p * c for p, c in zip(ref, (1.0, 2.0, 3.0))) ** 2).sum().backward()
        # the gradient keeps the parameter's layout (cat of the parts' gradients)
        assert wp.grad.placements == (_StridedShard(1, split_factor=3),)
        torch.testing.assert_close(wp.grad.full_tensor(), wr.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bp.grad.full_tensor(), br.grad, atol=1e-5, rtol=1e-5)


@distributed(2)
def test_other_splits_keep_torch_rules():
    mesh = init_device_mesh("cpu", (2,))
    t = torch.arange(24.0).reshape(2, 12)
    strided = distribute_tensor(t, mesh, [_StridedShard(1, split_factor=3)])
    # four parts of a 3-part layout: torch's rule (gather), still the right values
    for got, want in zip(strided.split(3, dim=1), t.split(3, dim=1)):
        assert torch.equal(got.full_tensor(), want)
    # a plain Shard on another dim: unchanged behaviour
    rows = distribute_tensor(t, mesh, [Shard(0)])
    parts = rows.split(4, dim=1)
    assert [p.placements for p in parts] == [(Shard(0),)] * 3
    assert all(torch.equal(p.full_tensor(), w) for p, w in zip(parts, t.split(4, dim=1)))


@distributed(2)
def test_cat_skips_a_legacy_empty_tensor_like_torch():
    # an empty KV cache (torch.tensor([])) appended to: torch.cat skips 1-D empties
    mesh = init_device_mesh("cpu", (2,))
    kv = torch.randn(2, 4, 3, 8)
    empty = distribute_tensor(torch.tensor([]), mesh, [Replicate()])
    sharded = distribute_tensor(kv, mesh, [Shard(1)])
    with CommDebugMode() as comm:
        out = torch.cat([empty, sharded], dim=-2)
    assert comm.get_total_counts() == 0
    assert out.placements == (Shard(1),) and torch.equal(out.full_tensor(), kv)
