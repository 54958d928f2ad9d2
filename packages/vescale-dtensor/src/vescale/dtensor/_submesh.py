"""Sub-meshes without one mesh dim: veScale's decoupled data parallelism.

veScale shards a model over ``mesh["TP"]`` and then makes it data parallel over
``mesh["DP"]``: the parameters are DTensors on the tensor-parallel sub-mesh, replicated
(implicitly) over the data-parallel dim. ``lift_placements`` reads such a parameter
as a DTensor of the joint mesh (``Replicate()`` inserted on the dp dim) with the same
local tensor, so the data-parallel engines treat both layouts alike. ``joint_mesh``
finds the mesh both sub-meshes were sliced from.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate

from vescale.dtensor import _compat

__all__ = ["is_complement", "lift_placements", "drop_dim", "joint_mesh"]


def is_complement(sub: DeviceMesh, mesh: DeviceMesh, dim: int | Sequence[int]) -> bool:
    """True if ``sub`` is ``mesh`` without mesh dim(s) ``dim``, at this rank's coordinate."""
    dims = sorted({dim} if isinstance(dim, int) else set(dim))
    if sub.ndim != mesh.ndim - len(dims) or sub.device_type != mesh.device_type:
        return False
    coord = mesh.get_coordinate()
    if coord is None:
        return False
    grid = mesh.mesh
    for d in reversed(dims):  # highest first: the lower indices stay valid
        grid = grid.select(d, coord[d])
    return torch.equal(grid, sub.mesh)


def lift_placements(
    sub: DeviceMesh, placements: Sequence[Placement], mesh: DeviceMesh, dim: int | Sequence[int]
) -> tuple[Placement, ...] | None:
    """``placements`` of a DTensor on ``sub`` read on ``mesh``, or ``None``.

    Returns the placements with ``Replicate()`` inserted at mesh dim(s) ``dim`` when
    ``sub`` is ``mesh`` without those dims (``is_complement``); ``None`` otherwise.
    """
    if not is_complement(sub, mesh, dim):
        return None
    dims = set([dim] if isinstance(dim, int) else dim)
    rest = iter(placements)
    return tuple(Replicate() if i in dims else next(rest) for i in range(mesh.ndim))


def drop_dim(placements: Sequence[Placement], dim: int) -> tuple[Placement, ...]:
    """``placements`` on the joint mesh read back on the sub-mesh without ``dim``."""
    return tuple(p for i, p in enumerate(placements) if i != dim)


def joint_mesh(dp_mesh: DeviceMesh, sub: DeviceMesh) -> tuple[DeviceMesh, int]:
    """The mesh of the dims of ``dp_mesh`` (1-D) and ``sub`` together, and the dp dim's index.

    Both must be slices of one named root mesh (``mesh["DP"]``, ``mesh["TP"]``); the
    result is the root sliced to those dims (the root itself when they are all of it).
    Without torch's root lookup, or for unnamed meshes, the joint mesh is built from the
    ranks (one small all-gather over the dp group; new process groups).

    Raises:
        ValueError: ``dp_mesh`` is not 1-D, or the two meshes do not combine (a rank of
            the dp group other than this one is also in ``sub``).
    """
    if dp_mesh.ndim != 1:
        raise ValueError(f"the data-parallel mesh must be 1-D, got {dp_mesh.ndim} dims ({dp_mesh})")
    mine = set(dp_mesh.mesh.flatten().tolist()) & set(sub.mesh.flatten().tolist())
    if mine != {dist.get_rank()}:
        raise ValueError(
            f"the data-parallel mesh {dp_mesh} and the parameters' mesh {sub} share ranks "
            f"{sorted(mine)}; expected them to meet only at this rank (orthogonal slices)"
        )
    root = _compat.root_mesh(dp_mesh)
    dp_names = dp_mesh.mesh_dim_names or ()
    sub_names = sub.mesh_dim_names or ()
    if root is not None and root is _compat.root_mesh(sub) and dp_names and sub_names:
        names = root.mesh_dim_names or ()
        want = [n for n in names if n in set(dp_names) | set(sub_names)]
        joint = root if len(want) == len(names) else root[tuple(want)]
        dim = want.index(dp_names[0])
        if is_complement(sub, joint, dim):
            return joint, dim
    # rebuild from ranks: dp dim first, then the sub-mesh's dims
    grids: list[torch.Tensor | None] = [None] * dp_mesh.size(0)
    dist.all_gather_object(grids, sub.mesh.cpu(), group=dp_mesh.get_group(0))
    grid = torch.stack([g for g in grids if g is not None])
    names = None
    if dp_names and sub_names:
        names = (dp_names[0], *sub_names)
    from vescale.dtensor.device_mesh import DeviceMesh as _VescaleMesh

    return _VescaleMesh(sub.device_type, grid, mesh_dim_names=names), 0
