"""Seeded sweeps of RaggedShard redistribution against dense tensors (exact comparisons)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from vescale.dtensor._redistribute import validate_layout
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed
from vescale.ragged import RaggedShard


def _units(rng: random.Random, n: int) -> tuple[int, ...]:
    while True:
        units = [rng.choice([0, 1, 1, 2]) for _ in range(n)]
        if sum(units) in (1, 2, 4, 8):  # powers of two fit the power-of-two row counts below
            return tuple(units)


def _ragged(rng: random.Random, shape: tuple[int, ...], n: int) -> RaggedShard | None:
    """A random RaggedShard that fits ``shape`` on ``n`` ranks, or None."""
    for _ in range(10):
        k = rng.randint(0, len(shape))
        units = _units(rng, n)
        prefix = 1
        for s in shape[:k]:
            prefix *= s
        if k == 0:
            units = tuple(1 if i == rng.randrange(n) else 0 for i in range(n))
            if not any(units):
                continue
        if prefix % sum(units) == 0:
            return RaggedShard(tuple(range(k)), units)
    return None


def _random_case(rng: random.Random, n: int):
    ndim = rng.randint(1, 3)
    shape = tuple(rng.randint(1, 4) for _ in range(ndim))
    shape = (shape[0] * rng.choice([2, 3, 4, 6]),) + shape[1:]

    def pick(allow_partial: bool):
        choice = rng.random()
        if choice < 0.55:
            p = _ragged(rng, shape, n)
            if p is not None:
                return p
        if choice < 0.7:
            return Replicate()
        if allow_partial and choice < 0.8:
            return Partial()
        return Shard(rng.randrange(ndim))

    return shape, pick(True), pick(False)


def _make(x, mesh, p):
    if p.is_partial():
        local = x if dist.get_rank() == 0 else torch.zeros_like(x)
        return DTensor.from_local(local, mesh, [p], shape=x.shape, stride=x.stride())
    return distribute_tensor(x, mesh, [p])


@distributed(4, timeout=300)
def test_seeded_sweep_1d():
    mesh = init_device_mesh("cpu", (4,))
    rng = random.Random(1234)
    kinds = set()
    for case in range(300):
        shape, a, b = _random_case(rng, 4)
        x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        d = _make(x, mesh, a)
        with CommDebugMode() as cm:
            out = d.redistribute(mesh, [b])
        assert torch.equal(out.full_tensor(), x), (case, shape, a, b)
        n_coll = cm.get_total_counts()
        if isinstance(a, RaggedShard) and isinstance(b, RaggedShard):
            assert n_coll <= 1, (a, b, cm.get_comm_counts())  # overlap exchange only
        root_pair = (isinstance(b, RaggedShard) and b.dims == () and a.is_shard()) or (
            isinstance(a, RaggedShard) and a.dims == () and b.is_shard()
        )
        if root_pair:  # gather to / scatter from one root: one all-to-all, no all-gather
            assert n_coll == 1, (a, b, cm.get_comm_counts())
            kinds.add("root")
        if isinstance(a, Replicate):
            assert n_coll == 0, (a, b)  # local selection
        if a.is_partial() and isinstance(b, RaggedShard):
            assert n_coll == 1, (a, b)  # one reduce-scatter
        if not a.is_partial():
            back = out.redistribute(mesh, [a])
            assert torch.equal(back.to_local(), d.to_local()), (case, shape, a, b)
        kinds.add((type(a).__name__, type(b).__name__))
    assert ("RaggedShard", "RaggedShard") in kinds and ("Partial", "RaggedShard") in kinds
    assert "root" in kinds


def _check_2d(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    n0, n1 = mesh_shape
    rng = random.Random(7)
    x = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    rows = RaggedShard((0,), _units(rng, n0))
    elems = RaggedShard((0, 1), _units(rng, n1))
    layouts = [
        (rows, Shard(1)),  # FSDP (whole rows) x TP (columns)
        (rows, Shard(0)),  # veScale's FSDP x TP: tp rows first, ragged rows inside
        (Shard(1), elems),  # TP outer, element-granular ragged inner
        (Shard(0), RaggedShard((0,), _units(rng, n1))),
        (rows, RaggedShard((0,), _units(rng, n1))),
        (Replicate(), elems),
    ]
    targets = [(Replicate(), Replicate()), (Shard(0), Shard(1)), (Shard(1), Shard(0))]
    skipped = 0
    for a in layouts:
        try:
            validate_layout(mesh, a, x.shape)  # the same verdict on every rank
        except ValueError:
            skipped += 1
            continue
        d = distribute_tensor(x, mesh, a)
        assert torch.equal(d.full_tensor(), x), (mesh_shape, a)
        for b in targets + layouts:
            out = d.redistribute(mesh, b)
            assert torch.equal(out.full_tensor(), x), (mesh_shape, a, b)
            assert torch.equal(out.redistribute(mesh, a).to_local(), d.to_local()), (a, b)
        leaf = d.detach().requires_grad_()
        w = torch.randn(x.shape)
        (leaf.redistribute(mesh, (Shard(0), Shard(1))).full_tensor() * w).sum().backward()
        assert tuple(leaf.grad.placements) == tuple(a)
        assert torch.equal(leaf.grad.full_tensor(), w)
    assert skipped <= 2, "the random units should mostly fit"


@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2), (4, 1)])
@distributed(4, timeout=300)
def test_composition_with_shard_4_ranks(mesh_shape):
    _check_2d(mesh_shape)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2), (1, 8), (8, 1)])
@distributed(8, timeout=400)
def test_composition_with_shard_8_ranks(mesh_shape):
    _check_2d(mesh_shape)


@distributed(4)
def test_shard_of_a_dim_the_ragged_split_cuts_applies_first():
    # veScale's FSDP x TP layout: the tp Shard is taken first, the ragged split over dp
    # applies inside the tp-local tensor (it would otherwise cut through the dim).
    mesh = init_device_mesh("cpu", (2, 2))
    dp, tp = mesh.get_coordinate()
    x = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)
    for rs, d in ((RaggedShard((0, 1), (1, 3)), 1), (RaggedShard((0,), (3, 1)), 0)):
        dt = distribute_tensor(x, mesh, [rs, Shard(d)])
        tp_local = x.chunk(2, dim=d)[tp]
        expected = rs.shard(tp_local, 2, dp)
        assert torch.equal(dt.to_local(), expected), (rs, d)
        assert torch.equal(dt.full_tensor(), x)
