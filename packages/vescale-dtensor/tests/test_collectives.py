"""Tests of ``vescale.dtensor.collectives`` on real gloo ranks.

Every rank rebuilds all ranks' inputs from a fixed seed, computes the expected
result locally with plain torch and compares. Values are small integers, so
sums are exact in fp32 and bf16 whatever the reduction order.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor import _collectives_impl
from vescale.dtensor.collectives import (
    CollectiveHandle,
    all_gather_coalesced,
    all_gather_uneven,
    all_reduce,
    all_reduce_coalesced,
    all_to_all_single_uneven,
    reduce_scatter_coalesced,
    reduce_scatter_uneven,
)
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.dtensor.testing import distributed, run_on_ranks

WORLD_SIZES = [1, 2, 4]
DTYPES = [torch.float32, torch.bfloat16]
# Uneven sizes with a zero-size rank (for world size 4: 3, 0, 2, 5).
SIZES = {1: [3], 2: [3, 0], 4: [3, 0, 2, 5]}


def _inputs(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-4, 5, shape, generator=g).to(dtype) for shape in shapes]


def _reduce(tensors, op):
    stacked = torch.stack([t.float() for t in tensors])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "max":
        return stacked.amax(0)
    return stacked.amin(0)


# --------------------------------------------------------------------------- all_gather_uneven


def _all_gather_uneven_body(dtype, method):
    ws, rank = dist.get_world_size(), dist.get_rank()
    sizes = SIZES[ws]
    for dim in (0, 1):
        shapes = [(2, s, 3) if dim == 1 else (s, 2, 3) for s in sizes]
        pieces = _inputs(shapes, dtype, seed=10 + dim)
        expected = torch.cat(pieces, dim=dim)
        for given in (None, sizes):
            out = all_gather_uneven(pieces[rank], dim=dim, sizes=given, method=method)
            assert out.dtype == dtype
            assert torch.equal(out, expected), (dim, given)
    # even sizes take the plain all-gather path
    even = _inputs([(2, 3)] * ws, dtype, seed=3)
    assert torch.equal(all_gather_uneven(even[rank], method=method), torch.cat(even))
    # one-element pieces of a 1-D tensor (the all_to_all path once sent a stride-0 buffer)
    ones = [torch.full((1 if r % 2 == 0 else 3 + r,), float(r), dtype=dtype) for r in range(ws)]
    got = all_gather_uneven(ones[rank], sizes=[t.numel() for t in ones], method=method)
    assert torch.equal(got, torch.cat(ones))
    # every rank empty: no communication, right shape
    assert all_gather_uneven(torch.empty(0, 4, dtype=dtype), sizes=[0] * ws).shape == (0, 4)


@pytest.mark.parametrize("method", ["auto", "pad", "all_to_all"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_uneven(world_size, dtype, method):
    run_on_ranks(_all_gather_uneven_body, world_size, dtype, method)


@distributed(2)
def test_all_gather_uneven_rejects_mismatched_shapes():
    rank = dist.get_rank()
    with pytest.raises(ValueError, match="differ only along the gathered dim"):
        all_gather_uneven(torch.zeros(2, 3 + rank))
    # Checked before any communication, so each rank can fail on its own.
    with pytest.raises(
        ValueError, match=rf"sizes\[{rank}\] is 5 but this rank's tensor has size 2"
    ):
        all_gather_uneven(torch.zeros(2, 3), sizes=[5, 2] if rank == 0 else [2, 5])
    with pytest.raises(ValueError, match="one entry per rank"):
        all_gather_uneven(torch.zeros(2), sizes=[2])


# --------------------------------------------------------------------------- reduce_scatter_uneven


def _reduce_scatter_uneven_body(dtype, op):
    ws, rank = dist.get_world_size(), dist.get_rank()
    sizes = SIZES[ws]
    for dim in (0, 1):
        shape = (2, sum(sizes)) if dim == 1 else (sum(sizes), 2)
        full = _inputs([shape] * ws, dtype, seed=20 + dim)
        expected = _reduce(full, op).to(dtype)
        offset = sum(sizes[:rank])
        expected = expected.narrow(dim, offset, sizes[rank])
        out = reduce_scatter_uneven(full[rank], sizes, dim=dim, op=op)
        assert out.dtype == dtype and out.shape == expected.shape
        assert torch.equal(out, expected), (dim, out, expected)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_uneven(world_size, dtype, op):
    run_on_ranks(_reduce_scatter_uneven_body, world_size, dtype, op)


# --------------------------------------------------------------------------- all_to_all_single_uneven


def _all_to_all_body(dtype):
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    split = torch.randint(0, 4, (ws, ws), generator=g)  # split[i][j]: rows from i to j
    split[0, -1] = 0  # make sure some pair sends nothing
    sends = _inputs([(int(split[i].sum()), 3) for i in range(ws)], dtype, seed=8)
    expected = torch.cat([sends[i].split(split[i].tolist())[rank] for i in range(ws)])
    for out_sizes in (split[:, rank].tolist(), None):
        out = all_to_all_single_uneven(sends[rank], out_sizes, split[rank].tolist())
        assert torch.equal(out, expected)
    even = _inputs([(2 * ws, 3)] * ws, dtype, seed=9)
    expected_even = torch.cat([even[i].chunk(ws)[rank] for i in range(ws)])
    assert torch.equal(all_to_all_single_uneven(even[rank]), expected_even)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_single_uneven(world_size, dtype):
    run_on_ranks(_all_to_all_body, world_size, dtype)


# --------------------------------------------------------------------------- all_reduce


def _all_reduce_body(op, force_fallback):
    ws, rank = dist.get_world_size(), dist.get_rank()
    saved = dict(_collectives_impl._AVG_NATIVE)
    if force_fallback:
        _collectives_impl._AVG_NATIVE["gloo"] = False
    try:
        for dtype in DTYPES:
            xs = _inputs([(3, 5)] * ws, dtype, seed=30)
            before = xs[rank].clone()
            out = all_reduce(xs[rank], op=op)
            assert torch.equal(out, _reduce(xs, op).to(dtype))
            assert torch.equal(xs[rank], before), "the input must not change"
        ints = [torch.tensor([r + 1, 10 * (r + 1)]) for r in range(ws)]
        if op != "avg":
            assert torch.equal(all_reduce(ints[rank], op=op), _reduce(ints, op).long())
    finally:
        _collectives_impl._AVG_NATIVE.clear()
        _collectives_impl._AVG_NATIVE.update(saved)


@pytest.mark.parametrize(
    ("op", "force_fallback"),
    [("sum", False), ("max", False), ("min", False), ("avg", False), ("avg", True)],
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce(world_size, op, force_fallback):
    run_on_ranks(_all_reduce_body, world_size, op, force_fallback)


@distributed(2)
def test_avg_probe_on_gloo_and_op_names():
    # torch 2.13's gloo supports ReduceOp.AVG (older gloo builds rejected it).
    assert _collectives_impl.avg_is_native(dist.group.WORLD) is True
    assert _collectives_impl.reduce_op_name(dist.ReduceOp.MAX) == "max"
    assert _collectives_impl.reduce_op_name("mean") == "avg"
    with pytest.raises(ValueError, match="op must be one of"):
        all_reduce(torch.ones(1), op="median")
    with pytest.raises(TypeError, match="DeviceMesh, mesh_dim"):
        all_reduce(torch.ones(1), group="world")


# --------------------------------------------------------------------------- coalesced


def _shapes():
    return [(4, 3), (8,), (), (4, 2, 2)]


def _coalesced_body():
    ws, rank = dist.get_world_size(), dist.get_rank()
    per_rank = [_inputs(_shapes(), torch.float32, seed=40 + r) for r in range(ws)]
    mixed = [per_rank[r] + [torch.tensor([r, 2 * r], dtype=torch.bfloat16)] for r in range(ws)]
    # all_gather_coalesced: dim-0 concatenation of every rank's tensor
    gathered = all_gather_coalesced(mixed[rank])
    for i, out in enumerate(gathered):
        pieces = [
            mixed[r][i].reshape(1) if mixed[r][i].ndim == 0 else mixed[r][i] for r in range(ws)
        ]
        assert out.dtype == mixed[rank][i].dtype
        assert torch.equal(out, torch.cat(pieces)), i
    # all_reduce_coalesced
    for op in ("sum", "max", "avg"):
        reduced = all_reduce_coalesced(mixed[rank], op=op)
        for i, out in enumerate(reduced):
            exp = _reduce([mixed[r][i] for r in range(ws)], op).to(mixed[rank][i].dtype)
            assert out.shape == mixed[rank][i].shape and torch.equal(out, exp), (op, i)
    # reduce_scatter_coalesced: dim 0 divisible by ws
    rs_in = [_inputs([(4, 3), (8,), (4, 2, 2)], torch.float32, seed=50 + r) for r in range(ws)]
    for op in ("sum", "min"):
        outs = reduce_scatter_coalesced(rs_in[rank], op=op)
        for i, out in enumerate(outs):
            exp = _reduce([rs_in[r][i] for r in range(ws)], op).chunk(ws)[rank]
            assert torch.equal(out, exp), (op, i)
    assert all_reduce_coalesced([]) == [] and all_gather_coalesced([]) == []


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_coalesced(world_size):
    run_on_ranks(_coalesced_body, world_size)


@distributed(2)
def test_reduce_scatter_coalesced_rejects_indivisible():
    with pytest.raises(ValueError, match="divisible by 2"):
        reduce_scatter_coalesced([torch.ones(3)])


# --------------------------------------------------------------------------- async handles and mesh groups


@distributed(4)
def test_async_handles():
    ws, rank = dist.get_world_size(), dist.get_rank()
    xs = _inputs([(6, 2)] * ws, torch.float32, seed=60)
    h1 = all_reduce(xs[rank], op="sum", async_op=True)
    h2 = all_gather_uneven(xs[rank][: rank + 1], sizes=[1, 2, 3, 4], async_op=True)
    h3 = reduce_scatter_uneven(xs[rank], [1, 2, 0, 3], op="max", async_op=True)
    h4 = all_reduce_coalesced([xs[rank], xs[rank][0]], async_op=True)
    h5 = all_to_all_single_uneven(xs[rank][:4], [1] * 4, [1] * 4, async_op=True)
    assert all(isinstance(h, CollectiveHandle) for h in (h1, h2, h3, h4, h5))
    assert not h1.is_completed()
    total = torch.stack(xs).sum(0)
    assert torch.equal(h1.wait(), total) and h1.is_completed()
    assert h1.wait() is h1.wait()
    assert torch.equal(h2.wait(), torch.cat([xs[r][: r + 1] for r in range(ws)]))
    offsets = {0: (0, 1), 1: (1, 3), 2: (3, 3), 3: (3, 6)}[rank]
    assert torch.equal(h3.wait(), torch.stack(xs).amax(0)[offsets[0] : offsets[1]])
    a, b = h4.wait()
    assert torch.equal(a, total) and torch.equal(b, total[0])
    assert torch.equal(h5.wait(), torch.stack([xs[r][rank] for r in range(ws)]))


@distributed(4)
def test_mesh_dim_groups():
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    row, col = rank // 2, rank % 2
    x = torch.tensor([float(rank)])
    assert all_reduce(x, (mesh, "tp")).item() == 2 * row + 2 * row + 1
    assert all_reduce(x, (mesh, 0), op="avg").item() == (col + col + 2) / 2
    # uneven gather along the tp dim: rank r contributes r + 1 rows
    out = all_gather_uneven(torch.full((rank + 1, 2), float(rank)), (mesh, "tp"))
    r0, r1 = 2 * row, 2 * row + 1
    assert torch.equal(
        out, torch.cat([torch.full((r0 + 1, 2), float(r0)), torch.full((r1 + 1, 2), float(r1))])
    )
    pg = mesh.get_group("dp")
    assert torch.equal(all_gather_coalesced([x], pg)[0], torch.tensor([float(col), float(col + 2)]))


@distributed(4)
def test_resolve_mesh_dim():
    from vescale.dtensor import resolve_mesh_dim

    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert [resolve_mesh_dim(mesh, d) for d in ("dp", "tp", 0, 1, -1, -2)] == [0, 1, 0, 1, 1, 0]
    with pytest.raises(ValueError, match=r"dp_dim 'pp' is not in the mesh.*\('dp', 'tp'\)"):
        resolve_mesh_dim(mesh, "pp", "dp_dim")
    with pytest.raises(ValueError, match="mesh_dim 2 is out of range for a 2-dim mesh"):
        resolve_mesh_dim(mesh, 2)
    with pytest.raises(TypeError, match="must be an int or a mesh dim name"):
        resolve_mesh_dim(mesh, True)
    with pytest.raises(TypeError, match="expected a DeviceMesh"):
        resolve_mesh_dim("mesh", 0)  # type: ignore[arg-type]
    # the collectives take (mesh, name or negative index) through the same resolver
    x = torch.tensor([1.0])
    assert all_reduce(x, (mesh, -1)).item() == 2.0
