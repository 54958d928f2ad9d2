"""Direct redistribute steps between ``RaggedShard`` and range-like placements.

``RaggedShard`` (any ``dims``) and ``Shard(0)`` both give every rank one contiguous
range of the tensor's row-major storage. Moving between two such layouts only
exchanges the overlapping ranges (one ``all_to_all_single`` with splits), and
``Partial -> RaggedShard`` is one reduce-scatter, never an all-reduce plus a slice.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Placement, Shard

from vescale.dtensor import StepContext
from vescale.dtensor.collectives import all_to_all_single_uneven, reduce_scatter_uneven
from vescale.ragged._compat import shard_size_and_offset
from vescale.ragged._placement import RaggedShard


def element_ranges(
    p: Placement, logical_shape: tuple[int, ...], num_ranks: int
) -> list[tuple[int, int]] | None:
    """Every rank's ``[start, stop)`` in row-major element order, or None if not range-like."""
    if isinstance(p, RaggedShard):
        trailing = math.prod(logical_shape[len(p.dims) :])
        return [(a * trailing, b * trailing) for a, b in p.ranges(logical_shape)]
    if type(p) is Shard and p.dim == 0 and len(logical_shape) > 0:
        row = math.prod(logical_shape[1:])
        out = []
        for r in range(num_ranks):
            size, off = shard_size_and_offset(logical_shape[0], num_ranks, r)
            out.append((off * row, (off + size) * row))
        return out
    return None


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _local_shape(p: Placement, logical_shape: tuple[int, ...], n: int, rank: int):
    if isinstance(p, RaggedShard):
        return p.local_shape(logical_shape, n, rank)
    size, _ = shard_size_and_offset(logical_shape[0], n, rank)
    return (size, *logical_shape[1:])


def range_exchange_step(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """Move between two range-like layouts with one ``all_to_all_single``."""
    n, r, shape = ctx.num_ranks, ctx.rank, ctx.logical_shape
    src = element_ranges(ctx.src, shape, n)
    dst = element_ranges(ctx.dst, shape, n)
    assert src is not None and dst is not None
    send = [_overlap(src[r], dst[q]) for q in range(n)]
    recv = [_overlap(src[q], dst[r]) for q in range(n)]
    flat = local.reshape(-1)
    # My range is sorted and each destination's overlap is contiguous and in order.
    out = all_to_all_single_uneven(flat, recv, send, (ctx.mesh, ctx.mesh_dim))
    return out.reshape(_local_shape(ctx.dst, shape, n, r))


def reduce_scatter_step(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """``Partial(sum|avg) -> RaggedShard``: one (padded) reduce-scatter."""
    n, r, shape = ctx.num_ranks, ctx.rank, ctx.logical_shape
    dst = element_ranges(ctx.dst, shape, n)
    assert dst is not None
    counts = [b - a for a, b in dst]  # the ranges tile the storage in rank order
    op = ctx.src.reduce_op  # type: ignore[attr-defined]
    out = reduce_scatter_uneven(local.reshape(-1), counts, (ctx.mesh, ctx.mesh_dim), 0, op=op)
    return out.reshape(_local_shape(ctx.dst, shape, n, r))


def _root(p: RaggedShard) -> int:
    return next(i for i, u in enumerate(p.local_units) if u)


def _shard_pieces(shape: tuple[int, ...], d: int, n: int) -> list[tuple[int, ...]]:
    out = []
    for q in range(n):
        size, _ = shard_size_and_offset(shape[d], n, q)
        out.append(shape[:d] + (size,) + shape[d + 1 :])
    return out


def shard_to_root_step(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """``Shard(d) -> RaggedShard((), one-hot)``: every rank sends its shard to the root only."""
    n, r, shape = ctx.num_ranks, ctx.rank, tuple(ctx.logical_shape)
    root, d = _root(ctx.dst), ctx.src.dim  # type: ignore[arg-type, attr-defined]
    pieces = _shard_pieces(shape, d, n)
    numels = [math.prod(p) for p in pieces]
    send = [local.numel() if q == root else 0 for q in range(n)]
    recv = [numels[q] if r == root else 0 for q in range(n)]
    out = all_to_all_single_uneven(local.reshape(-1), recv, send, (ctx.mesh, ctx.mesh_dim))
    if r != root:
        return local.new_empty((0, *shape))
    parts = [t.view(p) for t, p in zip(out.split(numels), pieces)]
    return torch.cat(parts, dim=d).reshape(1, *shape)


def root_to_shard_step(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """``RaggedShard((), one-hot) -> Shard(d)``: the root sends every rank its shard only."""
    n, r, shape = ctx.num_ranks, ctx.rank, tuple(ctx.logical_shape)
    root, d = _root(ctx.src), ctx.dst.dim  # type: ignore[arg-type, attr-defined]
    pieces = _shard_pieces(shape, d, n)
    numels = [math.prod(p) for p in pieces]
    if r == root:
        full = local.reshape(shape)
        chunks = [c.contiguous().reshape(-1) for c in torch.split(full, [p[d] for p in pieces], d)]
        flat = torch.cat(chunks) if chunks else local.reshape(-1)
        send = numels
    else:
        flat, send = local.reshape(-1), [0] * n
    recv = [numels[r] if q == root else 0 for q in range(n)]
    out = all_to_all_single_uneven(flat, recv, send, (ctx.mesh, ctx.mesh_dim))
    return out.view(pieces[r])


def step_for(src: Placement, dst: Placement):
    """Direct steps this package answers; ``None`` routes through ``Replicate()``."""
    if isinstance(dst, RaggedShard):
        if isinstance(src, Partial) and src.reduce_op in ("sum", "avg"):
            return reduce_scatter_step
        if isinstance(src, RaggedShard) or (type(src) is Shard and src.dim == 0):
            return range_exchange_step
    elif isinstance(src, RaggedShard) and type(dst) is Shard and dst.dim == 0:
        return range_exchange_step
    # whole tensor on one root (Muon's gather/scatter) <-> Shard(d) for any d
    if isinstance(dst, RaggedShard) and dst.dims == () and type(src) is Shard:
        return shard_to_root_step
    if isinstance(src, RaggedShard) and src.dims == () and type(dst) is Shard:
        return root_to_shard_step
    return None
