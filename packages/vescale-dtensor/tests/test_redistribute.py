"""Redistribution: every source/destination pair, values, gradients and communication.

Built-in placements go through torch's own redistribute (vescale must not change
them); the example plugin placement ``OwnerOnly`` goes through vescale's planner.
The toy third-party plugin is covered in ``tests/contract``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from vescale.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    get_plan,
    init_device_mesh,
    redistribute,
    register_plugin,
    unregister_plugin,
)
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed
from vescale.dtensor.testing.placements import OwnerOnly, OwnerPlugin

BUILTIN = [Replicate(), Shard(0), Shard(1)]


def _partial_of(x: torch.Tensor, mesh, placements) -> DTensor:
    base = [Replicate() if p.is_partial() else p for p in placements]
    local = distribute_tensor(x, mesh, base).to_local()
    coord = mesh.get_coordinate()
    for i, p in enumerate(placements):
        if p.is_partial() and coord[i] != 0:
            local = torch.zeros_like(local)
    return DTensor.from_local(local, mesh, placements, shape=x.shape, stride=x.stride())


def _kinds(cm) -> dict[str, int]:
    return {str(k).split(".")[-1].rstrip("')"): v for k, v in cm.get_comm_counts().items()}


EXPECTED_1D = {
    # (src kind, dst kind): collectives on one mesh dim
    ("R", "S"): {},
    ("S", "R"): {"all_gather_into_tensor": 1},
    # torch 2.13 falls back to all-gather + chunk for Shard -> Shard on CPU (no gloo alltoall)
    ("S", "S"): {"all_gather_into_tensor": 1},
    ("P", "R"): {"all_reduce": 1},
    ("P", "S"): {"reduce_scatter_tensor": 1},
}


def _kind(p) -> str:
    return "P" if p.is_partial() else "S" if p.is_shard() else "R"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", [(8, 4), (5, 3)])
def test_builtin_pairs_1d(world, shape):
    run = distributed(world)(_builtin_pairs_1d_body)
    run(shape)


def _builtin_pairs_1d_body(shape):
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    w = torch.randn(shape)
    for a, b in itertools.product(BUILTIN + [Partial()], BUILTIN):
        if a == b:
            continue
        d = _partial_of(x, mesh, [a]) if a.is_partial() else distribute_tensor(x, mesh, [a])
        with CommDebugMode() as cm:
            out = redistribute(d, mesh, [b])
        assert out.placements == (b,)
        assert torch.equal(out.full_tensor(), x), (a, b)
        assert _kinds(cm) == EXPECTED_1D[(_kind(a), _kind(b))], (a, b, _kinds(cm))
        if not a.is_partial():
            leaf = distribute_tensor(x, mesh, [a]).requires_grad_()
            (leaf.redistribute(mesh, [b]).full_tensor() * w).sum().backward()
            assert leaf.grad.placements == (a,) and torch.equal(leaf.grad.full_tensor(), w)


@pytest.mark.parametrize("shape", [(8, 4), (7, 5)])
@distributed(4, timeout=240)
def test_builtin_and_plugin_pairs_2d(shape):
    register_plugin(OwnerPlugin(), name="test-owner")
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        singles = BUILTIN + [OwnerOnly(1)]
        layouts = list(itertools.product(singles, repeat=2))
        sources = layouts + [
            (Partial(), Shard(0)),
            (Shard(1), Partial()),
            (Partial(), OwnerOnly(0)),
        ]
        for a in sources:
            d = _partial_of(x, mesh, a) if any(p.is_partial() for p in a) else None
            if d is None:
                d = distribute_tensor(x, mesh, a)
                assert torch.equal(d.full_tensor(), x), a
            for b in layouts:
                out = d.redistribute(mesh, b)
                assert tuple(out.placements) == tuple(b)
                assert torch.equal(out.full_tensor(), x), (a, b)
    finally:
        unregister_plugin(name="test-owner")


@distributed(4)
def test_gradients_through_plugin_placements_2d():
    register_plugin(OwnerPlugin(), name="test-owner")
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        x, w = torch.randn(6, 4), torch.randn(6, 4)
        for a, b in [
            ((OwnerOnly(1), Shard(1)), (Shard(0), Replicate())),
            ((Shard(0), OwnerOnly(0)), (OwnerOnly(1), OwnerOnly(1))),
            ((Replicate(), Shard(1)), (OwnerOnly(0), Shard(0))),
        ]:
            leaf = distribute_tensor(x, mesh, a).requires_grad_()
            (leaf.redistribute(mesh, b).full_tensor() * w).sum().backward()
            assert tuple(leaf.grad.placements) == a
            assert torch.equal(leaf.grad.full_tensor(), w), (a, b)
    finally:
        unregister_plugin(name="test-owner")


@distributed(4)
def test_plans_are_cached_and_minimal():
    register_plugin(OwnerPlugin(), name="test-owner")
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        p1 = get_plan(mesh, [OwnerOnly(0), Shard(1)], [Replicate(), Shard(1)], (8, 4))
        p2 = get_plan(mesh, [OwnerOnly(0), Shard(1)], [Replicate(), Shard(1)], (8, 4))
        assert p1 is p2
        # inner Shard(1) must be gathered before the outer plugin dim can change
        assert p1.describe() == [
            "mesh dim 1: S(1) -> R",
            "mesh dim 0: OwnerOnly(owner=0) -> R",
            "mesh dim 1: R -> S(1)",
        ]
        # a value-only change (Partial -> Replicate) leaves other dims alone
        p3 = get_plan(mesh, [Partial(), OwnerOnly(1)], [Replicate(), OwnerOnly(1)], (8, 4))
        assert p3.describe() == ["mesh dim 0: P(sum) -> R"]
        # Replicate -> plugin placement is local selection only
        x = torch.arange(32.0).reshape(8, 4)
        rep = distribute_tensor(x, mesh, [Replicate(), Replicate()])
        with CommDebugMode() as cm:
            out = rep.redistribute(mesh, [OwnerOnly(1), Shard(0)])
        assert cm.get_total_counts() == 0
        assert torch.equal(out.full_tensor(), x)
    finally:
        unregister_plugin(name="test-owner")


@distributed(2)
def test_errors_before_any_communication():
    register_plugin(OwnerPlugin(), name="test-owner")
    try:
        mesh = init_device_mesh("cpu", (2,))
        x = torch.randn(4, 4)
        d = distribute_tensor(x, mesh, [OwnerOnly(0)])
        other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))  # one all-gather
        with CommDebugMode() as cm:
            with pytest.raises(ValueError, match="one placement per mesh dim"):
                redistribute(d, mesh, [Replicate(), Replicate()])
            with pytest.raises(ValueError, match="out of range"):
                redistribute(d, mesh, [Shard(3)])
            with pytest.raises(ValueError, match="Partial"):
                redistribute(d, mesh, [Partial()])
            with pytest.raises(ValueError, match="keeps the mesh"):
                d.redistribute(other, [Replicate()])
        assert cm.get_total_counts() == 0
    finally:
        unregister_plugin(name="test-owner")
