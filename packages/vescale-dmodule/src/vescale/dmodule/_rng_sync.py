"""Give every rank one rank's default random generator states.

Used where ranks must draw the same random values from their own generators: the
materialisation of a model built on the ``meta`` device (`parallelize_module`, every
rank initialises the full tensors and keeps its shards) and `reshard` (dropout continues
as after a checkpoint resume).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["sync_default_rng"]


def _states(device_type: str | None) -> list[Any]:
    states: list[Any] = [torch.get_rng_state()]
    cuda = device_type == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized())
    if cuda and torch.cuda.is_available():
        states.append(torch.cuda.get_rng_state())  # the current device's generator
    return states


def sync_default_rng(mesh: DeviceMesh | None = None, src: int = 0) -> None:
    """Every rank's default generators take one rank's states (a collective).

    The CPU generator, and CUDA's current-device generator where the mesh is on CUDA or
    CUDA is initialised, take the source rank's states; that rank's own generators do
    not change.

    Args:
        mesh: The ranks: those of a `DeviceMesh`, the source being the rank at
            coordinate ``(src, src, ...)`` (one small broadcast per mesh dim, in order),
            or ``None``: every rank of the default process group, global rank ``src``
            being the source.
        src: The source rank: on every mesh dim (as ``distribute_tensor``'s
            ``src_data_rank``), or a global rank when ``mesh`` is ``None``.

    Raises:
        ValueError: ``src`` is not a rank of every mesh dim (or of the default group),
            naming it and the mesh's shape, before any communication.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    if mesh is None:
        if not 0 <= src < dist.get_world_size():
            raise ValueError(
                f"sync_default_rng: src={src} is not a rank of the default process group "
                f"(world size {dist.get_world_size()})"
            )
        box = [_states(None)]
        dist.broadcast_object_list(box, src=src)
        _set(box[0])
        return
    shape = tuple(mesh.shape)
    if isinstance(src, bool) or not isinstance(src, int) or not all(0 <= src < n for n in shape):
        raise ValueError(
            f"src_data_rank={src!r} is not a rank of every dim of the mesh of shape {shape}"
        )
    if mesh.size() == 1:
        return
    box = [_states(mesh.device_type)]
    for d, n in enumerate(shape):
        if n > 1:  # after dim d, every rank holds the state of coordinate src on dims <= d
            dist.broadcast_object_list(box, group=mesh.get_group(d), group_src=src)
    _set(box[0])


def _set(states: list[Any]) -> None:
    torch.set_rng_state(states[0].cpu())
    if len(states) > 1 and torch.cuda.is_available():
        torch.cuda.set_rng_state(states[1].cpu())
