"""Collectives that work the same on gloo and NCCL, including uneven ("ragged") ones.

Built only from what both backends support (measured on gloo, torch 2.13):
``all_gather_into_tensor`` into a 1-D buffer, ``reduce_scatter_tensor``,
``all_reduce`` and ``all_to_all_single`` with uneven splits. Everything goes
through torch's functional collectives, so each call is visible to
`vescale.dtensor.debug.CommDebugMode` with its byte count.

Conventions:

* ``group`` is ``None`` (the world), a ``ProcessGroup``, or a
  ``(DeviceMesh, mesh_dim)`` tuple (``mesh_dim`` an index or a name).
* ``op`` is ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` (or a ``ReduceOp``).
  ``"avg"`` works on every backend: ``ReduceOp.AVG`` where the backend
  supports it (probed once per backend), otherwise SUM then divide (floor
  division for integer tensors).
* Results are new tensors; inputs are never modified.
* ``async_op=True`` returns a `CollectiveHandle`; its ``wait()``
  returns the result.
* These functions are not differentiable (inputs are detached); use DTensor
  redistribution for autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._collectives_impl import (
    CollectiveHandle,
    GroupLike,
    avg_is_native,
    divide_,
    done,
    finish,
    funcol,
    reduce_op_name,
    resolve_group,
    resolve_mesh_dim,
    wait,
)

__all__ = [
    "CollectiveHandle",
    "GroupLike",
    "all_gather_coalesced",
    "all_gather_uneven",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single_uneven",
    "reduce_scatter_coalesced",
    "reduce_scatter_uneven",
    "resolve_mesh_dim",
]

#: ``all_gather_uneven(method="auto")`` pads when padding adds at most this
#: fraction of the gathered bytes; otherwise it uses ``all_to_all_single``.
PAD_OVERHEAD_LIMIT = 0.125


def _reduce_plan(pg: Any, op: str | Any) -> tuple[str, bool]:
    """Return (op name for the backend, divide afterwards?)."""
    name = reduce_op_name(op)
    if name == "avg" and not avg_is_native(pg):
        return "sum", True
    return name, False


def _check_dim(tensor: torch.Tensor, dim: int) -> int:
    if tensor.ndim == 0:
        raise ValueError("expected a tensor with at least one dimension, got a scalar")
    if not -tensor.ndim <= dim < tensor.ndim:
        raise ValueError(f"dim {dim} is out of range for a {tensor.ndim}-D tensor")
    return dim % tensor.ndim


def _check_sizes(sizes: Sequence[int], n: int, what: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        raise ValueError(
            f"{what} must have one entry per rank of the group ({n}), got {len(sizes)}"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what} must be non-negative, got {sizes}")
    return sizes


def _exchange_shapes(x: torch.Tensor, pg: Any) -> list[int]:
    """All-gather every rank's shape (dim 0 first); check trailing dims agree."""
    n = pg.size()
    shape = torch.tensor(list(x.shape), dtype=torch.int64)
    out = wait(funcol.all_gather_into_tensor(shape, n, pg.group_name)).view(n, x.ndim)
    shapes = [tuple(row) for row in out.tolist()]
    rest = {s[1:] for s in shapes}
    if len(rest) != 1:
        raise ValueError(
            f"all_gather_uneven: shapes may differ only along the gathered dim, got {shapes}"
        )
    return [s[0] for s in shapes]


# --------------------------------------------------------------------------- all_reduce


def all_reduce(
    tensor: torch.Tensor, group: GroupLike = None, op: str | Any = "sum", async_op: bool = False
) -> torch.Tensor | CollectiveHandle:
    """Reduce ``tensor`` over the group; every rank gets the result.

    Args:
        tensor: Same shape and dtype on every rank.
        group: Group to reduce over.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        async_op: Return a handle instead of the result.

    Returns:
        The reduced tensor (or a handle to it).
    """
    pg = resolve_group(group)
    name, divide = _reduce_plan(pg, op)
    out = funcol.all_reduce(tensor.detach().contiguous(), name, pg.group_name)
    n = pg.size()
    return finish(CollectiveHandle([out], lambda r: divide_(r[0], n) if divide else r[0]), async_op)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: GroupLike = None,
    op: str | Any = "sum",
    async_op: bool = False,
) -> list[torch.Tensor] | CollectiveHandle:
    """All-reduce many tensors with one collective per dtype (flattened into one buffer).

    Args:
        tensors: Tensors of any shapes; the list must match across ranks.
        group: Group to reduce over.
        op: Reduction, as for `all_reduce`.
        async_op: Return a handle instead of the result.

    Returns:
        The reduced tensors, in input order.
    """
    pg = resolve_group(group)
    return _reduce_coalesced(
        tensors,
        pg,
        op,
        async_op,
        lambda ts, name: funcol.all_reduce(
            torch.cat([t.reshape(-1) for t in ts]), name, pg.group_name
        ),
        lambda buf, ts: [p.view(t.shape) for p, t in zip(buf.split([t.numel() for t in ts]), ts)],
    )


def _reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    pg: Any,
    op: str | Any,
    async_op: bool,
    launch: Callable[[list[torch.Tensor], str], torch.Tensor],
    split: Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]],
) -> list[torch.Tensor] | CollectiveHandle:
    """`_coalesced` for a reduction ``op`` over ``pg``.

    ``launch(ts, name)`` packs one dtype's tensors and starts the collective with the
    backend's op ``name``; ``split(buf, ts)`` cuts its finished buffer, already
    divided by the group size where ``"avg"`` ran as a sum, into one result per tensor.
    """
    name, divide = _reduce_plan(pg, op)
    n = pg.size()

    def unpack(buf: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        if divide:
            divide_(buf, n)
        return split(buf, ts)

    return _coalesced(tensors, lambda ts: launch(ts, name), unpack, async_op)


def _coalesced(
    tensors: Sequence[torch.Tensor],
    launch: Callable[[list[torch.Tensor]], torch.Tensor],
    unpack: Callable[[torch.Tensor, list[torch.Tensor]], list[torch.Tensor]],
    async_op: bool,
) -> list[torch.Tensor] | CollectiveHandle:
    """One collective per dtype over the tensors of that dtype, results in input order.

    ``launch(ts)`` packs the (detached) tensors of one dtype and starts their
    collective; ``unpack(buf, ts)`` turns its finished buffer into one result per
    tensor of ``ts``.
    """
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    pending = [launch([tensors[i].detach() for i in idx]) for idx in groups.values()]

    def finish_all(ready: list[torch.Tensor]) -> list[torch.Tensor]:
        results: list[Any] = [None] * len(tensors)
        for buf, idx in zip(ready, groups.values()):
            for i, out in zip(idx, unpack(buf, [tensors[i] for i in idx])):
                results[i] = out
        return results

    return finish(CollectiveHandle(pending, finish_all), async_op)


# --------------------------------------------------------------------------- all_gather


def all_gather_uneven(
    tensor: torch.Tensor,
    group: GroupLike = None,
    dim: int = 0,
    async_op: bool = False,
    *,
    sizes: Sequence[int] | None = None,
    method: str = "auto",
) -> torch.Tensor | CollectiveHandle:
    """Concatenate every rank's ``tensor`` along ``dim``; sizes along ``dim`` may differ.

    Args:
        tensor: This rank's piece; all other dims and the dtype must match
            across ranks. Zero-size pieces are allowed.
        group: Group to gather over.
        dim: Dimension to concatenate along.
        async_op: Return a handle instead of the result.
        sizes: Every rank's size along ``dim`` in group-rank order. When
            given, the sizes exchange (one tiny all-gather, always
            synchronous) is skipped.
        method: ``"pad"`` (pad to the largest piece, one all-gather of a
            flat buffer), ``"all_to_all"`` (``all_to_all_single`` with exact
            splits: no padding on the wire, ``N`` local copies of the input)
            or ``"auto"`` (pad when padding adds at most 12.5 %).

    Returns:
        The concatenated tensor (or a handle to it).

    Raises:
        ValueError: On mismatched shapes, bad ``sizes``, ``dim`` or ``method``.
    """
    if method not in ("auto", "pad", "all_to_all"):
        raise ValueError(f"method must be 'auto', 'pad' or 'all_to_all', got {method!r}")
    pg = resolve_group(group)
    n, me = pg.size(), pg.rank()
    dim = _check_dim(tensor, dim)
    x = tensor.detach().movedim(dim, 0).contiguous()
    rest = tuple(x.shape[1:])
    inner = int(torch.Size(rest).numel())
    if sizes is None:
        sizes = _exchange_shapes(x, pg)
    sizes = _check_sizes(sizes, n, "sizes")
    if sizes[me] != x.shape[0]:
        raise ValueError(
            f"sizes[{me}] is {sizes[me]} but this rank's tensor has size {x.shape[0]} along dim {dim}"
        )
    total, biggest = sum(sizes), max(sizes)

    def shaped(flat: torch.Tensor) -> torch.Tensor:
        return flat.view(total, *rest).movedim(0, dim)

    if total == 0:  # every rank knows the sizes: skipping is collective-consistent
        return done(x.new_empty((0, *rest)).movedim(0, dim), async_op)
    if all(s == biggest for s in sizes):
        out = funcol.all_gather_into_tensor(x.reshape(-1), n, pg.group_name)
        return finish(CollectiveHandle([out], lambda r: shaped(r[0])), async_op)
    if method == "auto":
        method = "pad" if (n * biggest - total) <= PAD_OVERHEAD_LIMIT * total else "all_to_all"
    if method == "pad":
        padded = x.new_zeros(biggest * inner)
        padded[: x.numel()] = x.reshape(-1)
        out = funcol.all_gather_into_tensor(padded, n, pg.group_name)

        def unpad(r: list[torch.Tensor]) -> torch.Tensor:
            rows = r[0].view(n, biggest * inner)
            return shaped(torch.cat([rows[i, : sizes[i] * inner] for i in range(n)]))

        return finish(CollectiveHandle([out], unpad), async_op)
    flat = x.reshape(-1).repeat(n)  # a copy: a one-element piece would expand to stride 0
    out = funcol.all_to_all_single(flat, [s * inner for s in sizes], [x.numel()] * n, pg.group_name)
    return finish(CollectiveHandle([out], lambda r: shaped(r[0])), async_op)


def all_gather_coalesced(
    tensors: Sequence[torch.Tensor], group: GroupLike = None, async_op: bool = False
) -> list[torch.Tensor] | CollectiveHandle:
    """All-gather many tensors along dim 0 with one collective per dtype.

    Args:
        tensors: Same shapes on every rank. A tensor of shape ``(a, *rest)``
            becomes ``(N * a, *rest)``; a scalar becomes shape ``(N,)``.
        group: Group to gather over.
        async_op: Return a handle instead of the result.

    Returns:
        The gathered tensors, in input order.
    """
    pg = resolve_group(group)
    n = pg.size()

    def unpack(buf: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        parts = buf.view(n, -1).split([t.numel() for t in ts], dim=1)
        return [
            p.reshape((n,) if t.ndim == 0 else (n * t.shape[0], *t.shape[1:]))
            for p, t in zip(parts, ts)
        ]

    return _coalesced(
        tensors,
        lambda ts: funcol.all_gather_into_tensor(
            torch.cat([t.reshape(-1) for t in ts]), n, pg.group_name
        ),
        unpack,
        async_op,
    )


# --------------------------------------------------------------------------- reduce_scatter


def reduce_scatter_uneven(
    tensor: torch.Tensor,
    sizes: Sequence[int],
    group: GroupLike = None,
    dim: int = 0,
    op: str | Any = "sum",
    async_op: bool = False,
) -> torch.Tensor | CollectiveHandle:
    """Reduce ``tensor`` over the group and give group rank ``i`` the ``i``-th piece.

    Args:
        tensor: The full tensor on every rank; its size along ``dim`` is ``sum(sizes)``.
        sizes: Piece sizes along ``dim`` in group-rank order (zeros allowed).
        group: Group to reduce over.
        dim: Dimension to split.
        op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
        async_op: Return a handle instead of the result.

    Returns:
        This rank's reduced piece (or a handle to it).
    """
    pg = resolve_group(group)
    n, me = pg.size(), pg.rank()
    dim = _check_dim(tensor, dim)
    sizes = _check_sizes(sizes, n, "sizes")
    name, divide = _reduce_plan(pg, op)
    x = tensor.detach().movedim(dim, 0).contiguous()
    if x.shape[0] != sum(sizes):
        raise ValueError(
            f"tensor has size {x.shape[0]} along dim {dim} but sum(sizes) is {sum(sizes)}"
        )
    rest = tuple(x.shape[1:])
    inner = int(torch.Size(rest).numel())
    biggest = max(sizes)

    def shaped(flat: torch.Tensor) -> torch.Tensor:
        if divide:
            divide_(flat, n)
        return flat.view(sizes[me], *rest).movedim(0, dim)

    if biggest == 0:
        return done(x.new_empty((0, *rest)).movedim(0, dim), async_op)
    if all(s == biggest for s in sizes):
        buf = x.reshape(-1)
    else:
        buf = x.new_zeros(n, biggest * inner)
        offset = 0
        for i, s in enumerate(sizes):
            buf[i, : s * inner] = x[offset : offset + s].reshape(-1)
            offset += s
        buf = buf.view(-1)
    out = funcol.reduce_scatter_tensor(buf, name, n, pg.group_name)
    return finish(CollectiveHandle([out], lambda r: shaped(r[0][: sizes[me] * inner])), async_op)


def reduce_scatter_coalesced(
    tensors: Sequence[torch.Tensor],
    group: GroupLike = None,
    op: str | Any = "sum",
    async_op: bool = False,
) -> list[torch.Tensor] | CollectiveHandle:
    """Reduce-scatter many tensors along dim 0 with one collective per dtype.

    Args:
        tensors: Same shapes on every rank; each dim 0 divisible by the group
            size ``N``. Group rank ``i`` gets rows ``[i*a/N, (i+1)*a/N)``.
        group: Group to reduce over.
        op: Reduction, as for `all_reduce`.
        async_op: Return a handle instead of the result.

    Returns:
        This rank's reduced chunks, in input order.
    """
    pg = resolve_group(group)
    n = pg.size()
    reduce_op_name(op)  # a bad op is reported before a bad shape
    for t in tensors:
        if t.ndim == 0 or t.shape[0] % n:
            raise ValueError(
                f"reduce_scatter_coalesced: dim 0 of every tensor must be divisible by {n}, got {tuple(t.shape)}"
            )

    def split(buf: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        pieces = buf.split([t.numel() // n for t in ts])
        return [p.view(t.shape[0] // n, *t.shape[1:]) for p, t in zip(pieces, ts)]

    return _reduce_coalesced(
        tensors,
        pg,
        op,
        async_op,
        lambda ts, name: funcol.reduce_scatter_tensor(
            torch.cat([t.reshape(n, -1) for t in ts], dim=1).reshape(-1), name, n, pg.group_name
        ),
        split,
    )


# --------------------------------------------------------------------------- all_to_all


def all_to_all_single_uneven(
    input: torch.Tensor,  # noqa: A002 (mirrors torch.distributed.all_to_all_single)
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: GroupLike = None,
    async_op: bool = False,
) -> torch.Tensor | CollectiveHandle:
    """Exchange rows of ``input`` (dim 0): rows ``input_split_sizes[j]`` go to group rank ``j``.

    Args:
        input: Rows to send, grouped by destination.
        output_split_sizes: Rows to receive from each rank. ``None``: exchanged
            first (one tiny synchronous all-to-all).
        input_split_sizes: Rows to send to each rank. ``None``: an even split.
        group: Group to exchange over.
        async_op: Return a handle instead of the result.

    Returns:
        The received rows, concatenated in source-rank order.
    """
    pg = resolve_group(group)
    n = pg.size()
    x = input.detach().contiguous()
    if x.ndim == 0:
        raise ValueError("all_to_all_single_uneven needs a tensor with at least one dimension")
    if input_split_sizes is None:
        if x.shape[0] % n:
            raise ValueError(
                f"input has {x.shape[0]} rows, not divisible by the group size {n}; pass input_split_sizes"
            )
        input_split_sizes = [x.shape[0] // n] * n
    input_split_sizes = _check_sizes(input_split_sizes, n, "input_split_sizes")
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(
            f"input_split_sizes sum to {sum(input_split_sizes)} but input has {x.shape[0]} rows"
        )
    if output_split_sizes is None:
        counts = torch.tensor(input_split_sizes, dtype=torch.int64)
        output_split_sizes = wait(
            funcol.all_to_all_single(counts, [1] * n, [1] * n, pg.group_name)
        ).tolist()
    output_split_sizes = _check_sizes(output_split_sizes, n, "output_split_sizes")
    out = funcol.all_to_all_single(x, output_split_sizes, input_split_sizes, pg.group_name)
    return finish(CollectiveHandle([out], lambda r: r[0]), async_op)
