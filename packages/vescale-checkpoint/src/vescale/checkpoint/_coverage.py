"""Checking that the saved chunks of a tensor cover it exactly (before DCP reads anything)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vescale.checkpoint._format import CheckpointCorruptError

# --------------------------------------------------------------------------- coverage
Box = tuple[list[int], list[int]]


def _gap(lo: list[int], hi: list[int], boxes: list[Box], d: int) -> Box | None:
    """A box inside ``[lo, hi)`` that none of ``boxes`` (all inside it) covers, or ``None``.

    Sweeps dim ``d``: between consecutive box boundaries the set of boxes crossing the
    slab is constant, and the slab is covered iff that set covers it in dims ``d+1..``.
    """
    if not boxes:
        return list(lo), [h - a for a, h in zip(lo, hi)]
    if d == len(lo):
        return None
    cuts = {lo[d], hi[d]}
    for b_lo, b_hi in boxes:
        cuts.add(b_lo[d])
        cuts.add(b_hi[d])
    order = sorted(boxes, key=lambda b: b[0][d])
    active: list[Box] = []
    seen: set[tuple[int, ...]] = set()
    nxt = 0
    edges = sorted(cuts)
    for a, b in zip(edges, edges[1:]):
        while nxt < len(order) and order[nxt][0][d] <= a:
            active.append(order[nxt])
            nxt += 1
        active = [x for x in active if x[1][d] > a]
        ids = tuple(sorted(map(id, active)))
        if ids in seen:  # the same boxes cross an earlier slab, which they covered
            continue
        seen.add(ids)
        sub_lo, sub_hi = list(lo), list(hi)
        sub_lo[d], sub_hi[d] = a, b
        gap = _gap(sub_lo, sub_hi, active, d + 1)
        if gap is not None:
            return gap
    return None


def uncovered_box(shape: Sequence[int], chunks: Iterable[Box]) -> Box | None:
    """``(offsets, sizes)`` of a box of a ``shape`` tensor that no chunk covers, or ``None``.

    Args:
        shape: The tensor's shape.
        chunks: ``(offsets, sizes)`` of the saved chunks (they may overlap).
    """
    shape = [int(s) for s in shape]
    if any(s == 0 for s in shape):
        return None
    boxes: list[Box] = []
    for off, size in chunks:
        b_lo = [max(0, int(o)) for o in off]
        b_hi = [min(h, int(o) + int(s)) for o, s, h in zip(off, size, shape)]
        if all(a < b for a, b in zip(b_lo, b_hi)):
            boxes.append((b_lo, b_hi))
    return _gap([0] * len(shape), shape, boxes, 0)


def check_chunks(key: str, md: TensorStorageMetadata, where: str | os.PathLike) -> None:
    """Raise unless the saved chunks of tensor ``key`` lie inside it and cover every element.

    Raises:
        CheckpointCorruptError: Naming the tensor and a chunk outside it, or a box that
            no chunk covers (a load would leave those elements unchanged).
    """
    shape = list(md.size)
    for c in md.chunks:
        off, size = list(c.offsets), list(c.sizes)
        if (
            len(off) != len(shape)
            or len(size) != len(shape)
            or any(o < 0 or s < 0 or o + s > h for o, s, h in zip(off, size, shape))
        ):
            raise CheckpointCorruptError(
                f"checkpoint {where}: tensor {key!r} of shape {shape} has a chunk at offsets "
                f"{off} with sizes {size} that does not lie inside it"
            )
    gap = uncovered_box(shape, ((c.offsets, c.sizes) for c in md.chunks))
    if gap is not None:
        raise CheckpointCorruptError(
            f"checkpoint {where}: tensor {key!r} of shape {shape} is not covered by its saved "
            f"chunks: no chunk holds the box at offsets {gap[0]} with sizes {gap[1]} "
            f"(the metadata lost a chunk)"
        )
