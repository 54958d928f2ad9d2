"""Box decomposition of a rank's local data for DTensors with plugin placements.

DCP describes every saved piece of a tensor as a *box* (``ChunkStorageMetadata``:
offsets and sizes in the global tensor). Plugin placements may give a rank data that
is not one box, e.g. ``RaggedShard`` holds one contiguous range of the row-major
storage. This module turns a rank's local tensor into boxes without communication.

Mesh dims apply left to right. While walking them we keep a list of *regions*
(global boxes) with the invariant::

    local.reshape(-1) == cat([global[box].reshape(-1) for box in regions])

and, for every local dim, the global dim it indexes (``None`` once a plugin
placement has flattened it). Each placement then narrows the regions:

- ``Replicate``: nothing changes;
- ``Shard(d)``: local dim ``d`` indexes global dim ``g`` over the same range in
  every region, so each region is cut along ``g`` (torch's chunk semantics);
- a plugin placement that keeps a contiguous flat range of its logical tensor
  (the local tensor of the previous mesh dims): the flat range is intersected with
  the regions and each intersection is split into boxes (partial first row, block
  of full rows, partial last row, recursively per dim).

A plugin placement tells us its flat range through ``local_flat_range(logical_shape,
num_ranks, rank)`` if it has one, or through RaggedShard's ``dims`` + ``ranges``.
Anything else is reported as unsupported (the caller then redistributes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Placement, Replicate, Shard

from vescale.dtensor import PluginPlacement

__all__ = ["Box", "UnsupportedLayout", "flat_range_boxes", "local_boxes"]


@dataclass(frozen=True)
class Box:
    """A box of the global tensor and where its data sits in the local tensor.

    Attributes:
        offsets: Global offsets per dim.
        sizes: Sizes per dim.
        local_start: Flat (row-major) position of the box's first element in the
            local tensor; the box's elements are the next ``numel`` local elements.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class UnsupportedLayout(NotImplementedError):
    """The placements give a rank data that this module cannot describe as boxes."""


def flat_range_boxes(
    shape: Sequence[int], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes covering the flat row-major range ``[start, stop)`` of ``shape``, in order.

    The result has at most ``2 * ndim - 1`` boxes: a partial first row (recursively),
    a block of full rows and a partial last row (recursively).

    Args:
        shape: Shape of the tensor.
        start: First flat index (inclusive).
        stop: Last flat index (exclusive).

    Returns:
        ``(offsets, sizes)`` pairs whose row-major concatenation is the range.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) out of bounds for shape {shape}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    if start == 0 and stop == total:
        return [((0,) * len(shape), shape)]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    rest = len(shape) - 1
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if r0 == r1:  # inside one row
        for off, size in flat_range_boxes(shape[1:], c0, c1):
            out.append(((r0, *off), (1, *size)))
        return out
    if c0:
        for off, size in flat_range_boxes(shape[1:], c0, inner):
            out.append(((r0, *off), (1, *size)))
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * rest, (r1 - r0, *shape[1:])))
    if c1:
        for off, size in flat_range_boxes(shape[1:], 0, c1):
            out.append(((r1, *off), (1, *size)))
    return out


def _plugin_flat_range(
    p: PluginPlacement, logical_shape: tuple[int, ...], n: int, rank: int
) -> tuple[int, int]:
    """Flat element range ``[a, b)`` of the logical tensor that ``rank`` holds."""
    fn = getattr(p, "local_flat_range", None)
    if callable(fn):
        a, b = fn(logical_shape, n, rank)
        return int(a), int(b)
    dims = getattr(p, "dims", None)
    ranges = getattr(p, "ranges", None)
    if isinstance(dims, tuple) and callable(ranges):
        k = len(dims)
        if dims != tuple(range(k)):
            raise UnsupportedLayout(f"{p}: flattened dims {dims} are not a leading prefix")
        a, b = ranges(logical_shape)[rank]
        trailing = math.prod(logical_shape[k:])
        return int(a) * trailing, int(b) * trailing
    raise UnsupportedLayout(
        f"{p} ({type(p).__qualname__}) does not describe its local data as a flat range "
        "(no local_flat_range(logical_shape, num_ranks, rank) method)"
    )


def local_boxes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> tuple[list[Box], tuple[int, ...]]:
    """Boxes of the global tensor held by the rank at ``coordinate``.

    Args:
        global_shape: Global tensor shape.
        mesh_shape: Size of every mesh dim.
        coordinate: This rank's coordinate on the mesh.
        placements: One placement per mesh dim.

    Returns:
        ``(boxes, local_shape)``: non-empty boxes in local storage order and the shape
        of the local tensor they fill.

    Raises:
        UnsupportedLayout: A placement (or combination) cannot be described as boxes
            (``Partial``, an unknown plugin placement, a ``Shard`` of a dim that a
            plugin placement cut through).
    """
    gshape = tuple(int(s) for s in global_shape)
    regions: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((0,) * len(gshape), gshape)]
    local_shape = gshape
    gdim_of: list[int | None] = list(range(len(gshape)))
    for i, p in enumerate(placements):
        n, c = int(mesh_shape[i]), int(coordinate[i])
        if isinstance(p, Replicate):
            continue
        if isinstance(p, PluginPlacement):
            p.check_shape(local_shape, n)
            a, b = _plugin_flat_range(p, local_shape, n, c)
            new_local = tuple(int(s) for s in p.local_shape(local_shape, n, c))
            if math.prod(new_local) != b - a:
                raise UnsupportedLayout(
                    f"{p}: local shape {new_local} does not hold the {b - a} elements of its "
                    f"flat range [{a}, {b})"
                )
            new_regions = []
            pos = 0
            for off, size in regions:
                m = math.prod(size)
                s, e = max(a, pos), min(b, pos + m)
                if s < e:
                    for boff, bsize in flat_range_boxes(size, s - pos, e - pos):
                        new_regions.append((tuple(x + y for x, y in zip(off, boff)), bsize))
                pos += m
            regions = new_regions
            new_gdim: list[int | None] = [None] * len(new_local)
            for d, g in enumerate(gdim_of):
                ld = p.local_dim(d, len(local_shape))
                if ld is not None and g is not None:
                    new_gdim[ld] = g
            gdim_of, local_shape = new_gdim, new_local
            continue
        if type(p) is Shard:
            d = p.dim % len(local_shape) if local_shape else p.dim
            g = gdim_of[d]
            if g is None:
                raise UnsupportedLayout(
                    f"{p} on mesh dim {i} shards a dim that an outer plugin placement cut through"
                )
            size_d, off_d = Shard.local_shard_size_and_offset(local_shape[d], n, c)
            size_d, off_d = int(size_d), int(off_d)
            new_regions = []
            for off, size in regions:
                if size[g] != local_shape[d]:
                    raise UnsupportedLayout(
                        f"{p} on mesh dim {i}: local dim {d} is split across regions"
                    )
                o, s = list(off), list(size)
                o[g] += off_d
                s[g] = size_d
                new_regions.append((tuple(o), tuple(s)))
            regions = [r for r in new_regions if math.prod(r[1])]
            local_shape = local_shape[:d] + (size_d,) + local_shape[d + 1 :]
            continue
        raise UnsupportedLayout(f"placement {p} on mesh dim {i} cannot be saved as boxes")
    boxes, pos = [], 0
    for off, size in regions:
        m = math.prod(size)
        if m:
            boxes.append(Box(off, size, pos))
        pos += m
    if pos != math.prod(local_shape):
        raise UnsupportedLayout(
            f"boxes hold {pos} elements but the local shape {local_shape} holds "
            f"{math.prod(local_shape)}"
        )
    return boxes, local_shape
