"""Creating and redistributing DTensors, with built-in and plugin placements alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor

from vescale.dtensor import _compat
from vescale.dtensor._dispatch import (
    PluginDTensor,
    from_local_plugin,
    has_plugin_placement,
    make_dtensor,
    redistribute_dtensor,
)
from vescale.dtensor._redistribute import get_plan
from vescale.dtensor.placement_types import PluginPlacement

__all__ = ["distribute_tensor", "redistribute", "from_local"]


def _check_placements(mesh: DeviceMesh, placements: Sequence[Placement]) -> tuple[Placement, ...]:
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"got {len(placements)} placements {[str(p) for p in placements]} for a "
            f"{mesh.ndim}-dim mesh; expected one placement per mesh dim"
        )
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"expected Placement instances, got {p!r} ({type(p).__name__})")
    return placements


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a full tensor over ``device_mesh`` with ``placements``.

    Works with torch's placements (this is then exactly
    :func:`torch.distributed.tensor.distribute_tensor`) and with plugin placements.

    Args:
        tensor: The full tensor (same shape on every rank).
        device_mesh: The mesh to distribute over.
        placements: One placement per mesh dim.
        src_data_rank: Rank whose ``tensor`` is the source of truth (its data is
            broadcast first); ``None`` uses each rank's own tensor without
            communication.

    Returns:
        A DTensor; a leaf that requires grad iff ``tensor`` does.
    """
    placements = _check_placements(device_mesh, placements)
    if not has_plugin_placement(placements):
        return _torch_distribute_tensor(
            tensor, device_mesh, placements, src_data_rank=src_data_rank
        )
    full = tensor.detach()
    if src_data_rank is not None:
        full = _torch_distribute_tensor(
            full, device_mesh, [Replicate()] * device_mesh.ndim, src_data_rank=src_data_rank
        ).to_local()
    plan = get_plan(device_mesh, [Replicate()] * device_mesh.ndim, placements, tensor.shape)
    local = plan.run(full)
    if local.data_ptr() == full.data_ptr() and local.numel():
        local = local.clone()
    return make_dtensor(
        local.contiguous(),
        device_mesh,
        placements,
        tensor.shape,
        requires_grad=tensor.requires_grad,
    )


def redistribute(
    dtensor: DTensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    async_op: bool = False,
) -> DTensor:
    """Redistribute ``dtensor`` to ``placements`` (differentiable).

    Equivalent to ``dtensor.redistribute(device_mesh, placements, async_op=...)``.
    The gradient comes back in the source placements (``Partial`` as ``Replicate``).
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"redistribute expects a DTensor, got {type(dtensor).__name__}")
    mesh = device_mesh or dtensor.device_mesh
    if placements is None:
        raise ValueError("redistribute needs placements (one per mesh dim)")
    placements = _check_placements(mesh, placements)
    if isinstance(dtensor, PluginDTensor) or has_plugin_placement(placements):
        return redistribute_dtensor(dtensor, mesh, placements, async_op=async_op)
    return _compat.ORIGINAL_REDISTRIBUTE(dtensor, mesh, placements, async_op=async_op)


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    run_check: bool = False,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
) -> DTensor:
    """Build a DTensor from each rank's local tensor (differentiable).

    For built-in placements this is :meth:`torch.distributed.tensor.DTensor.from_local`.
    With plugin placements and no ``shape``, the global shape is inferred by
    exchanging local shapes over each mesh dim (a small collective); the local
    tensor is always checked against the shape its placements imply.
    """
    placements = _check_placements(device_mesh, placements)
    if not has_plugin_placement(placements):
        return _compat.ORIGINAL_FROM_LOCAL(
            local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride
        )
    if shape is None:
        shape = _infer_global_shape(local_tensor, device_mesh, placements)
    return from_local_plugin(local_tensor, device_mesh, placements, tuple(shape), stride)


def _infer_global_shape(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    seen_plugin = False
    for p in placements:
        if isinstance(p, PluginPlacement):
            seen_plugin = True
        elif p.is_shard() and seen_plugin:
            raise ValueError(
                f"cannot infer the global shape for placements {[str(q) for q in placements]} "
                "(a Shard after a plugin placement); pass shape="
            )
    shape = tuple(local.shape)
    for i in reversed(range(mesh.ndim)):
        p = placements[i]
        if not (p.is_shard() or isinstance(p, PluginPlacement)):
            continue
        shapes: list[tuple[int, ...] | None] = [None] * mesh.size(i)
        dist.all_gather_object(shapes, shape, group=mesh.get_group(i))
        if isinstance(p, PluginPlacement):
            shape = tuple(p.logical_shape(shapes))  # type: ignore[arg-type]
        else:
            d = p.dim % len(shape)  # type: ignore[attr-defined]
            shape = shape[:d] + (sum(s[d] for s in shapes),) + shape[d + 1 :]  # type: ignore[index]
    return shape
