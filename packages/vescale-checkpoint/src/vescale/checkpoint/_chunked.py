"""A DCP-checkpointable view of a rank's boxes of a global tensor.

``ChunkedTensor`` implements DCP's ``_Checkpointable`` protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), the
same protocol torch's ``DTensor`` and ``LocalShardsWrapper`` implement, for an arbitrary
list of boxes. torch's ``LocalShardsWrapper`` cannot be used directly: it infers the
global size by concatenating shards along dim 0 or 1.

Saving writes each box as one DCP chunk; loading reads into the box views, which alias
the live local tensor, so data lands in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from vescale.checkpoint import _compat
from vescale.dtensor.chunks import UnsupportedLayout, local_boxes

__all__ = ["ChunkedTensor", "chunked_from_dtensor"]


class ChunkedTensor(torch.Tensor):
    """A global-shaped tensor handle whose data is a list of local boxes.

    Only DCP's checkpoint protocol is supported; any tensor op raises.

    Args:
        chunks: ``(global offsets, tensor)`` per box; each tensor has the box's sizes.
        global_shape: Shape of the whole tensor.
        dtype: Element type.
        after_load: Called after DCP filled the boxes (e.g. to copy a contiguous
            staging buffer back into a non-contiguous local tensor).
        device: Device of the box tensors (default CPU).
    """

    __slots__ = ("_chunks", "_after_load")

    @staticmethod
    def __new__(
        cls,
        chunks: Sequence[tuple[Sequence[int], torch.Tensor]],
        global_shape: Sequence[int],
        dtype: torch.dtype,
        after_load: Callable[[], None] | None = None,
        device: torch.device | None = None,
    ) -> ChunkedTensor:
        r = _compat.make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=dtype, device=device or torch.device("cpu")
        )
        r._chunks = [(torch.Size(off), t) for off, t in chunks]
        r._after_load = after_load
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise NotImplementedError(f"ChunkedTensor is a checkpoint handle; {func} is not supported")

    def __repr__(self) -> str:  # type: ignore[override]
        boxes = [(tuple(o), tuple(t.shape)) for o, t in self._chunks]
        return f"ChunkedTensor(size={tuple(self.shape)}, dtype={self.dtype}, boxes={boxes})"

    @property
    def chunks(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """``(global offsets, data)`` of every local box."""
        return list(self._chunks)

    def finish_load(self) -> None:
        if self._after_load is not None:
            self._after_load()

    # --------------------------------------------------------------- DCP protocol
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.shape,
                ),
            )
            for off, t in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.shape) for off, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self._chunks):
            off, t = self._chunks[index.index]
            if off == index.offset:
                return t
        for off, t in self._chunks:
            if off == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no local box at offsets {index.offset}")


def chunked_from_dtensor(dt: DTensor, *, for_load: bool) -> ChunkedTensor:
    """Describe a DTensor's local data as boxes of the global tensor (no communication).

    Args:
        dt: A DTensor (any placements that `local_boxes` supports).
        for_load: If true, the box views must alias the live local tensor; a
            non-contiguous local tensor is staged in a contiguous buffer that is copied
            back by `ChunkedTensor.finish_load`.

    Raises:
        UnsupportedLayout: The placements cannot be described as boxes.
    """
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise UnsupportedLayout("this rank is not part of the DTensor's mesh")
    boxes, local_shape = local_boxes(dt.shape, mesh.shape, coord, dt.placements)
    local = _compat.local_tensor(dt).detach()
    if tuple(local.shape) != tuple(local_shape):
        raise UnsupportedLayout(
            f"local tensor of shape {tuple(local.shape)} but the placements "
            f"{list(dt.placements)} imply {local_shape}"
        )
    after: Callable[[], None] | None = None
    if local.is_contiguous():
        flat = local.view(-1)
    else:
        flat = local.contiguous().view(-1)
        if for_load:
            target = local

            def after() -> None:
                target.copy_(flat.view(target.shape))

    chunks = [
        (b.offsets, flat[b.local_start : b.local_start + b.numel].view(b.sizes)) for b in boxes
    ]
    return ChunkedTensor(chunks, dt.shape, dt.dtype, after, local.device)
