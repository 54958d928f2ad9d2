"""clip_grad_norm_ over mixed placements and meshes against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    from_local,
    init_device_mesh,
    placement_registry,
)
from vescale.dtensor.testing import distributed
from vescale.optim import clip_grad_norm_

SHAPES = [(6, 4), (7, 3), (5, 6), (4, 4), (8,), (3, 5), (12, 2), (5,)]


def _clear_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from vescale.dtensor import _redistribute

    _clear_sharding_prop_cache()
    _redistribute._clear_caches()


def _partial(full, mesh, placements):
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(full, mesh, base).to_local()
    coord = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if p.is_partial() and coord[i] != 0:
            local = torch.zeros_like(local)
    return from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


def _layouts(mesh1, mesh2):
    RS = placement_registry()["RaggedShard"]
    return [
        (mesh1, [Replicate()]),
        (mesh1, [Shard(0)]),  # uneven: 7 rows over 4 ranks
        (mesh1, [Partial()]),
        (mesh1, [RS((0,), (1, 2, 0, 1))]),
        (None, None),  # a plain tensor
        (mesh2, [Shard(1), Replicate()]),
        (mesh2, [RS((0, 1), (5, 1)), Partial()]),
        (mesh2, [Replicate(), Shard(0)]),
    ]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf"), 3.0])
@distributed(4)
def test_clip_mixed_placements_matches_torch(norm_type):
    _clear_caches()
    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=g) for s in SHAPES]
    ref = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, gr in zip(ref, grads):
        p.grad = gr.clone()
    max_norm = 0.3
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
    holders = []
    for gr, (mesh, pls) in zip(grads, _layouts(mesh1, mesh2)):
        if mesh is None:
            holders.append(torch.nn.Parameter(torch.zeros_like(gr)))
            holders[-1].grad = gr.clone()
            continue
        if any(p.is_partial() for p in pls):
            dg = _partial(gr, mesh, pls)
        else:
            dg = distribute_tensor(gr, mesh, pls)
        p = torch.nn.Parameter(torch.zeros_like(dg))
        p.grad = dg
        holders.append(p)
    got = clip_grad_norm_(holders, max_norm, norm_type)
    assert not hasattr(got, "placements")
    assert abs(float(got) - float(want)) <= 1e-6 * float(want), (float(got), float(want))
    # every rank gets the same norm
    t = torch.tensor([float(got)])
    ts = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(ts, t)
    assert all(float(x) == float(t) for x in ts)
    for h, r in zip(holders, ref):
        full = h.grad.full_tensor() if hasattr(h.grad, "full_tensor") else h.grad
        torch.testing.assert_close(full, r.grad, rtol=1e-5, atol=1e-7)


@distributed(2)
def test_clip_no_clip_below_max_and_nonfinite():
    _clear_caches()
    mesh = init_device_mesh("cpu", (2,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.full((4, 2), 0.1), mesh, [Shard(0)])
    n = clip_grad_norm_([p], 10.0)
    assert abs(float(n) - (8 * 0.01) ** 0.5) < 1e-6
    torch.testing.assert_close(p.grad.full_tensor(), torch.full((4, 2), 0.1))
    p.grad = distribute_tensor(torch.tensor([[float("nan"), 1.0]] * 4), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
