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
        return mesh.get_group(mesh_dim)
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
