"""veScale's ``vescale.dtensor.random``: seeding random ops on DTensors.

``manual_seed(seed, device_mesh)`` checks that every rank passes the same seed (a
small all-gather), then seeds the default generator (``torch.manual_seed``) and, on
device types torch's DTensor random tracker supports (CUDA-like), that tracker.
Random ops on replicated DTensors then draw the same values on every rank; on CPU
meshes they use the default generator, so the same seed gives the same values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale.dtensor import _compat

__all__ = ["manual_seed"]


def manual_seed(seed: int, device_mesh: DeviceMesh, tp_dim: int = 0) -> None:
    """Seed random numbers for DTensor ops on ``device_mesh`` (a collective).

    Args:
        seed: The seed; must be the same on every rank.
        device_mesh: The mesh the random DTensors live on; must include this rank.
        tp_dim: veScale's tensor-parallel mesh dim. Accepted for veScale programs:
            vescale draws replicated random values identically on every rank, so it
            changes nothing.

    Raises:
        TypeError: ``seed`` is not an int or ``device_mesh`` not a DeviceMesh.
        ValueError: This rank is not in ``device_mesh``, ``tp_dim`` is not a mesh dim,
            or ranks passed different seeds (every rank raises, naming them).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"manual_seed: expected a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"manual_seed: this rank is not part of {device_mesh}")
    if not -device_mesh.ndim <= tp_dim < device_mesh.ndim:
        raise ValueError(
            f"manual_seed: tp_dim={tp_dim} is not a dim of the {device_mesh.ndim}-dim mesh"
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        seeds: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seeds, seed)
        if len(set(seeds)) != 1:
            raise ValueError(
                f"manual_seed: every rank must pass the same seed, got {seeds} (by rank)"
            )
    torch.manual_seed(seed)
    _compat.seed_dtensor_rng(seed, device_mesh)
