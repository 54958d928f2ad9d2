"""Box decomposition of a rank's local data for DTensors with plugin placements.

DCP describes every saved piece of a tensor as a *box* (``ChunkStorageMetadata``:
offsets and sizes in the global tensor). Plugin placements may give a rank data that
is not one box, e.g. ``RaggedShard`` holds one contiguous range of the row-major
storage. This module turns a rank's local tensor into boxes without communication.

Mesh dims apply in their application order (left to right, except that a ``Shard``
applies before a plugin placement that would cut through its dim; see
``vescale.dtensor.application_order``). While walking them we keep a list of *regions*
(global boxes) with the invariant:

```python
local.reshape(-1) == cat([global[box].reshape(-1) for box in regions])
```

and, for every local dim, the global dim it indexes (``None`` once a plugin
placement has flattened it). Each placement then narrows the regions:

- ``Replicate``: nothing changes;
- ``Shard(d)``: local dim ``d`` indexes global dim ``g`` over the same range in
  every region, so each region is cut along ``g`` (torch's chunk semantics);
- a plugin placement that keeps flat ranges of its logical tensor (the local tensor
  of the previous mesh dims): each range is intersected with the regions and each
  intersection is split into boxes (partial first row, block of full rows, partial
  last row, recursively per dim).

A plugin placement tells us its data through
`local_flat_ranges` (row-major element ranges of
its logical tensor, in local storage order). A placement that returns ``None`` is
reported as unsupported (the caller then redistributes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Replicate, Shard

from vescale.dtensor import PluginPlacement, _compat
from vescale.dtensor._redistribute import application_order

__all__ = [
    "Box",
    "UnsupportedLayout",
    "flat_range_boxes",
    "local_boxes",
    "dcp_write_items",
    "dcp_chunk_list",
    "dcp_tensor_shard",
]


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


def _plugin_flat_ranges(
    p: PluginPlacement, logical_shape: tuple[int, ...], n: int, rank: int
) -> list[tuple[int, int]]:
    """Flat element ranges of the logical tensor that ``rank`` holds, in local order."""
    ranges = p.local_flat_ranges(logical_shape, n, rank)
    if ranges is None:
        raise UnsupportedLayout(
            f"{p} ({type(p).__qualname__}) does not describe its local data as flat ranges "
            "(local_flat_ranges returned None)"
        )
    return [(int(a), int(b)) for a, b in ranges]


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
    for i in application_order(placements, len(gshape)):
        p = placements[i]
        n, c = int(mesh_shape[i]), int(coordinate[i])
        if isinstance(p, Replicate):
            continue
        if isinstance(p, PluginPlacement):
            p.check_shape(local_shape, n)
            ranges = _plugin_flat_ranges(p, local_shape, n, c)
            new_local = tuple(int(s) for s in p.local_shape(local_shape, n, c))
            held = sum(b - a for a, b in ranges)
            if math.prod(new_local) != held:
                raise UnsupportedLayout(
                    f"{p}: local shape {new_local} does not hold the {held} elements of its "
                    f"flat ranges {ranges}"
                )
            new_regions = []
            for a, b in ranges:
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
            # Shard(d) names a dim of the global tensor; find where it lives locally.
            g = p.dim % len(gshape) if gshape else p.dim
            if g not in gdim_of:
                raise UnsupportedLayout(
                    f"{p} on mesh dim {i} shards a dim that a plugin placement applied "
                    "before it cut through"
                )
            d = gdim_of.index(g)
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


# ---------------------------------------------------------------------- DCP protocol
def _dtensor_boxes(dt) -> tuple[list[Box], torch.Tensor]:
    for p in dt.placements:
        if p.is_partial():
            raise ValueError(
                "Any checkpointing related operations are not supported for DTensor with "
                f"partial placements ({list(dt.placements)}); redistribute first"
            )
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnsupportedLayout("this rank is not part of the DTensor's mesh")
    try:
        boxes, local_shape = local_boxes(dt.shape, mesh.shape, coord, dt.placements)
    except UnsupportedLayout as exc:
        raise NotImplementedError(
            f"torch.distributed.checkpoint cannot save or load a DTensor with placements "
            f"{list(dt.placements)} directly: {exc}. Use vescale.checkpoint, which "
            "redistributes such tensors."
        ) from exc
    local = _compat.local_tensor(dt)
    if tuple(local.shape) != tuple(local_shape):
        raise UnsupportedLayout(
            f"local tensor of shape {tuple(local.shape)} but the placements imply {local_shape}"
        )
    if not local.is_contiguous():
        raise NotImplementedError(
            "torch.distributed.checkpoint needs a contiguous local tensor for plugin placements"
        )
    return boxes, local.view(-1)


def dcp_write_items(dt, fqn: str) -> list:
    """DCP ``__create_write_items__`` for a DTensor with plugin placements: one item per box."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    boxes, flat = _dtensor_boxes(dt)
    props = TensorProperties.create_from_tensor(flat)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(b.offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(
                    offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes)
                ),
                properties=props,
                size=dt.shape,
            ),
        )
        for b in boxes
    ]


def dcp_chunk_list(dt) -> list:
    """DCP ``__create_chunk_list__``: the boxes this rank holds."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    boxes, _ = _dtensor_boxes(dt)
    return [
        ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
        for b in boxes
    ]


def dcp_tensor_shard(dt, index) -> torch.Tensor:
    """DCP ``__get_tensor_shard__``: a view of the local data of the box at ``index.offset``."""
    boxes, flat = _dtensor_boxes(dt)
    want = tuple(index.offset)
    for b in boxes:
        if b.offsets == want:
            return flat[b.local_start : b.local_start + b.numel].view(b.sizes)
    raise ValueError(f"{index.fqn}: this rank holds no box at offsets {want}")
