"""Internals of `vescale.dtensor.collectives`: group resolution, handles, op names.

Every collective is issued through torch's native functional collectives
(``torch.ops._c10d_functional``), which run on gloo and NCCL alike and are
dispatcher ops, so ``CommDebugMode`` sees (and counts) each one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale.dtensor._compat import C10D_FUNCTIONAL, default_group

__all__ = [
    "CollectiveHandle",
    "GroupLike",
    "avg_is_native",
    "resolve_mesh_dim",
    "funcol",
    "reduce_op_name",
    "resolve_group",
    "wait",
]

GroupLike = dist.ProcessGroup | tuple[DeviceMesh, int | str] | None

funcol = C10D_FUNCTIONAL

_OPS = {"sum": "sum", "avg": "avg", "mean": "avg", "max": "max", "min": "min", "product": "product"}
_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product",
}
_AVG_NATIVE: dict[str, bool] = {}


def resolve_mesh_dim(mesh: DeviceMesh, dim: int | str, what: str = "mesh_dim") -> int:
    """Index of the mesh dim ``dim`` (a name or an index, negative counts from the end).

    Args:
        mesh: The device mesh.
        dim: A name from ``mesh.mesh_dim_names`` or an index.
        what: How the caller calls the argument, for the error message (e.g. ``"dp_dim"``).

    Returns:
        The index in ``range(mesh.ndim)``.

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh`` or ``dim`` is neither a str nor an int.
        ValueError: A name the mesh does not have or an index out of range, naming the
            mesh's dims.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: expected a DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    dims = f"mesh dims: {names or 'unnamed'}, shape {tuple(mesh.shape)}"
    if isinstance(dim, str):
        if dim not in names:
            raise ValueError(
                f"{what} {dim!r} is not in the mesh: the mesh has no dim named {dim!r} "
                f"({dims}); pass one of the names or an index"
            )
        return names.index(dim)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{what} must be an int or a mesh dim name, got {dim!r}")
    if not -mesh.ndim <= dim < mesh.ndim:
        raise ValueError(f"{what} {dim} is out of range for a {mesh.ndim}-dim mesh ({dims})")
    return dim % mesh.ndim


def resolve_group(group: GroupLike) -> dist.ProcessGroup:
    """Turn ``None`` (world), a process group or ``(mesh, mesh_dim)`` into a process group.

    Raises:
        TypeError: For anything else.
        RuntimeError: If the default process group is not initialised.
    """
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError(
                "the default process group is not initialised; create a DeviceMesh first"
            )
        return default_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, mesh_dim = group
        return mesh.get_group(resolve_mesh_dim(mesh, mesh_dim))
    raise TypeError(
        f"group must be None, a ProcessGroup or a (DeviceMesh, mesh_dim) tuple, got {group!r}"
    )


def reduce_op_name(op: str | dist.ReduceOp) -> str:
    """Normalise a reduction to one of ``sum``, ``avg``, ``max``, ``min``, ``product``."""
    if isinstance(op, str):
        name = _OPS.get(op.lower())
    else:
        name = next((v for k, v in _REDUCE_OPS.items() if op == k), None)
    if name is None:
        raise ValueError(f"op must be one of 'sum', 'avg', 'max', 'min', 'product', got {op!r}")
    return name


def _probe_gloo_avg() -> bool:
    """Run ReduceOp.AVG on a private one-rank gloo group (no communication)."""
    try:
        pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        t = torch.ones(2)
        pg.allreduce([t], opts).wait()
        return bool(torch.all(t == 1))
    except Exception:  # noqa: BLE001 (unsupported: fall back to SUM then divide)
        return False


def avg_is_native(group: dist.ProcessGroup) -> bool:
    """Whether ``ReduceOp.AVG`` works on ``group``'s backend (probed once, cached).

    NCCL supports it; gloo is probed locally once per process; any other
    backend takes the SUM-then-divide path.
    """
    try:
        backend = str(dist.get_backend(group))
    except Exception:  # noqa: BLE001
        backend = "unknown"
    cached = _AVG_NATIVE.get(backend)
    if cached is None:
        if backend == "nccl":
            cached = True
        elif backend == "gloo":
            cached = _probe_gloo_avg()
        else:
            cached = False
        _AVG_NATIVE[backend] = cached
    return cached


def wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for a functional collective's output tensor."""
    return funcol.wait_tensor(t)


def divide_(t: torch.Tensor, n: int) -> torch.Tensor:
    """Divide in place (floor division for integer tensors)."""
    if t.is_floating_point() or t.is_complex():
        return t.div_(n)
    return t.div_(n, rounding_mode="floor")


class CollectiveHandle:
    """A pending collective: `wait` blocks and returns the result.

    Args:
        pending: Functional-collective outputs still in flight.
        finish: Turns the waited outputs into the result.
    """

    def __init__(
        self, pending: Sequence[torch.Tensor], finish: Callable[[list[torch.Tensor]], Any]
    ) -> None:
        self._pending = list(pending)
        self._finish = finish
        self._done = False
        self._result: Any = None

    def wait(self) -> Any:
        """Block until the collective finished; return the result (idempotent)."""
        if not self._done:
            ready = [wait(t) for t in self._pending]
            self._result = self._finish(ready)
            self._done = True
            self._pending = []
        return self._result

    def is_completed(self) -> bool:
        """Whether `wait` has already returned."""
        return self._done


def finish(handle: CollectiveHandle, async_op: bool) -> Any:
    """Return ``handle`` itself when ``async_op``, else its waited result."""
    return handle if async_op else handle.wait()


def done(value: Any, async_op: bool) -> Any:
    """Wrap an already-available result like a collective's."""
    return CollectiveHandle([], lambda _: value) if async_op else value


def numel(shape: Sequence[int]) -> int:
    """Number of elements of ``shape``."""
    return math.prod(shape)
