"""Creating and redistributing DTensors, with built-in and plugin placements alike.

This is also veScale's ``vescale.dtensor.api`` module path: ``distribute_tensor``,
``from_local``, ``redistribute_dtensor`` and ``to_local`` keep veScale's argument
forms (see ``docs/migrating.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor import distribute_tensor as _torch_distribute_tensor

from vescale.dtensor import _compat
from vescale.dtensor._dispatch import (
    PluginDTensor,
    from_local_plugin,
    has_plugin_placement,
    make_dtensor,
)
from vescale.dtensor._dispatch import redistribute_dtensor as _redistribute_plugin
from vescale.dtensor._redistribute import application_order, get_plan, validate_layout
from vescale.dtensor.placement_types import PluginPlacement, normalize_placements

__all__ = ["distribute_tensor", "redistribute", "from_local", "redistribute_dtensor", "to_local"]


def _check_placements(
    mesh: DeviceMesh, placements: Sequence[Placement], ndim: int | None = None
) -> tuple[Placement, ...]:
    placements = normalize_placements(placements, mesh.ndim)
    if ndim is not None:
        for i, p in enumerate(placements):
            if isinstance(p, Shard) and not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"{p!r} on mesh dim {i} is out of range for a {ndim}-dim tensor: "
                    f"expected a dim in [{-ndim}, {ndim})"
                )
    return placements


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a full tensor over ``device_mesh`` with ``placements``.

    Works with torch's placements (this is then exactly
    `torch.distributed.tensor.distribute_tensor`) and with plugin placements.

    Args:
        tensor: The full tensor (same shape on every rank).
        device_mesh: The mesh to distribute over.
        placements: One placement per mesh dim (a shorter list is padded with
            ``Replicate()``; ``None``: replicated on every mesh dim).
        src_data_rank: Rank whose ``tensor`` is the source of truth (its data is
            broadcast first); ``None`` uses each rank's own tensor without
            communication.

    Returns:
        A DTensor; a leaf that requires grad iff ``tensor`` does.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"distribute_tensor needs a DeviceMesh, got {type(device_mesh).__name__} "
            "(vescale has no current-mesh context: pass the mesh)"
        )
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    # Validate before any communication (the src_data_rank broadcast included), so a
    # bad layout raises on every rank instead of after a collective on some.
    placements = _check_placements(device_mesh, placements, tensor.ndim)
    if has_plugin_placement(placements):
        validate_layout(device_mesh, placements, tensor.shape)
    else:
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
    placements = _check_placements(mesh, placements, dtensor.ndim)
    if isinstance(dtensor, PluginDTensor) or has_plugin_placement(placements):
        return _redistribute_plugin(dtensor, mesh, placements, async_op=async_op)
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

    For built-in placements this is `torch.distributed.tensor.DTensor.from_local`.
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


def redistribute_dtensor(
    dtensor: DTensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    async_op: bool = True,
) -> DTensor:
    """veScale's name for ``redistribute`` (differentiable).

    Args:
        dtensor: The DTensor to redistribute.
        device_mesh: Its mesh (``None``: the DTensor's own).
        placements: Target placements (a shorter list is padded with ``Replicate()``).
        async_op: Leave the last collective's result pending until it is used (veScale's
            default ``True``); the values are the same either way.

    Returns:
        The redistributed DTensor.
    """
    return redistribute(dtensor, device_mesh, placements, async_op=async_op)


def to_local(
    dtensor: DTensor,
    *,
    grad_placements: Sequence[Placement] | None = None,
    async_output: bool = True,
) -> torch.Tensor:
    """veScale's ``to_local``: this rank's local tensor of ``dtensor`` (differentiable).

    Args:
        dtensor: The DTensor.
        grad_placements: Placements the gradient of the result will have (as in
            ``torch.distributed.tensor.DTensor.to_local``).
        async_output: Accepted for veScale programs; the local tensor waits for a
            pending collective when it is first used either way.

    Returns:
        The local tensor.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"to_local expects a DTensor, got {type(dtensor).__name__}")
    del async_output  # same values either way (see Args)
    return dtensor.to_local(grad_placements=grad_placements)


def _infer_global_shape(
    local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> tuple[int, ...]:
    order = application_order(placements, local.ndim)
    seen_plugin = False
    for i in order:
        p = placements[i]
        if isinstance(p, PluginPlacement):
            seen_plugin = True
        elif p.is_shard() and seen_plugin:
            raise ValueError(
                f"cannot infer the global shape for placements {[str(q) for q in placements]} "
                "(a Shard applied after a plugin placement); pass shape="
            )
    shape = tuple(local.shape)
    for i in reversed(order):
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
