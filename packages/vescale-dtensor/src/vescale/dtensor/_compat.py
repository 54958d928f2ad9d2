"""The one place where vescale-dtensor touches torch internals.

Every internal is probed by feature at import time; ``check_torch_internals()`` is
run by the test suite so that a torch upgrade that moves or changes one of them
fails loudly instead of silently misbehaving.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "make_spec",
    "new_dtensor",
    "shard_to_replicate",
    "replicate_to_shard",
    "shard_to_shard",
    "partial_to_replicate",
    "partial_to_shard",
    "shard_size_and_offset",
    "wait_tensor",
    "norm_partial",
    "is_async_tensor",
    "ORIGINAL_REDISTRIBUTE",
    "ORIGINAL_FROM_LOCAL",
    "register_foreach_type",
    "check_torch_internals",
]

AsyncCollectiveTensor = funcol.AsyncCollectiveTensor


def norm_partial(norm_type: float) -> Partial:
    """The pending-reduction placement of a p-norm computed on shards (torch private)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    return _NormPartial(norm_type)


# Captured before vescale patches them (see _dispatch.install_patches).
ORIGINAL_REDISTRIBUTE = DTensor.redistribute
ORIGINAL_FROM_LOCAL = DTensor.from_local


def make_spec(
    mesh: DeviceMesh,
    placements: Sequence,
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> DTensorSpec:
    """Build a ``DTensorSpec`` (private torch type) for the given layout."""
    return DTensorSpec(
        mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype),
    )


def new_dtensor(
    cls: type[DTensor], local: torch.Tensor, spec: DTensorSpec, requires_grad: bool
) -> DTensor:
    """Construct a DTensor (or subclass) around ``local`` without autograd wiring."""
    return cls(local, spec, requires_grad=requires_grad)


def shard_size_and_offset(size: int, num_chunks: int, rank: int) -> tuple[int, int]:
    """Local size and offset of ``rank``'s chunk under ``torch.chunk`` semantics."""
    n, off = Shard.local_shard_size_and_offset(size, num_chunks, rank)
    return int(n), int(off)


def shard_to_replicate(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, logical_shape: Sequence[int]
) -> torch.Tensor:
    return Shard(dim)._to_replicate_tensor(local, mesh, mesh_dim, list(logical_shape))


def replicate_to_shard(
    full: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, rank: int
) -> torch.Tensor:
    return Shard(dim)._replicate_to_shard(full, mesh, mesh_dim, rank)


def shard_to_shard(
    local: torch.Tensor,
    mesh: DeviceMesh,
    mesh_dim: int,
    src_dim: int,
    dst_dim: int,
    logical_shape: Sequence[int],
) -> torch.Tensor:
    return Shard(src_dim)._to_new_shard_dim(local, mesh, mesh_dim, list(logical_shape), dst_dim)


def partial_to_replicate(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, partial: Partial
) -> torch.Tensor:
    return partial._reduce_value(local, mesh, mesh_dim)


def partial_to_shard(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, partial: Partial, dim: int
) -> torch.Tensor:
    return partial._reduce_shard_value(local, mesh, mesh_dim, Shard(dim))


def is_async_tensor(t: object) -> bool:
    return isinstance(t, AsyncCollectiveTensor)


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """Wait for a pending functional collective result and return a plain tensor."""
    if isinstance(t, AsyncCollectiveTensor):
        return t.wait()
    return t


def _foreach_type_lists() -> list[list]:
    import torch.optim.optimizer as _optim
    import torch.utils._foreach_utils as _fe

    return [_optim._foreach_supported_types, _fe._foreach_supported_types]


def register_foreach_type(cls: type) -> None:
    """Let torch's optimizers and grad clipping pick foreach/fused kernels for ``cls``.

    torch checks ``type(p) in _foreach_supported_types`` (exact type), and registers
    only ``DTensor`` itself; a DTensor subclass must be added the same way, or torch
    silently falls back to its per-tensor loops on devices with foreach kernels.
    """
    for lst in _foreach_type_lists():
        if cls not in lst:
            lst.append(cls)


def check_torch_internals() -> list[str]:
    """Probe every torch internal vescale-dtensor relies on.

    Returns:
        A list of problems; empty when torch still looks as expected.
    """
    problems: list[str] = []

    def need(obj: object, name: str, params: Sequence[str] = ()) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            problems.append(f"{getattr(obj, '__name__', obj)}.{name} is missing")
            return
        if params:
            got = list(inspect.signature(fn).parameters)
            missing = [p for p in params if p not in got]
            if missing:
                problems.append(f"{name}: parameters {missing} missing (has {got})")

    need(
        Shard, "_to_replicate_tensor", ["local_tensor", "mesh", "mesh_dim", "current_logical_shape"]
    )
    need(Shard, "_replicate_to_shard", ["local_tensor", "mesh", "mesh_dim", "shard_index"])
    need(
        Shard,
        "_to_new_shard_dim",
        ["local_tensor", "mesh", "mesh_dim", "current_logical_shape", "new_shard_dim"],
    )
    need(Shard, "local_shard_size_and_offset", ["curr_local_size", "num_chunks", "rank"])
    need(Partial, "_reduce_value", ["tensor", "mesh", "mesh_dim"])
    need(Partial, "_reduce_shard_value", ["tensor", "mesh", "mesh_dim", "shard_spec"])
    need(DTensor, "from_local", ["local_tensor", "device_mesh", "placements", "shape", "stride"])
    need(DTensor, "redistribute", ["device_mesh", "placements", "async_op"])
    if "placements" not in getattr(DTensorSpec, "__dataclass_fields__", {}):
        problems.append("DTensorSpec has no dataclass field 'placements'")
    if TensorMeta._fields[:3] != ("shape", "stride", "dtype"):
        problems.append(f"TensorMeta fields changed: {TensorMeta._fields}")
    if not hasattr(torch.Tensor, "_dtensor__new__"):
        problems.append("torch.Tensor._dtensor__new__ missing (DTensor construction changed)")
    if "__torch_dispatch__" not in DTensor.__dict__:
        problems.append("DTensor.__torch_dispatch__ for subclasses is missing")
    try:
        p = norm_partial(3.0)
        if not (p.is_partial() and p.norm_type == 3.0):
            problems.append("_NormPartial changed (is_partial/norm_type)")
    except Exception as exc:  # pragma: no cover - only on a torch change
        problems.append(f"_NormPartial unavailable: {exc!r}")
    try:
        lists = _foreach_type_lists()
        if not all(isinstance(lst, list) and DTensor in lst for lst in lists):
            problems.append("_foreach_supported_types no longer lists DTensor")
    except (ImportError, AttributeError) as exc:  # pragma: no cover - only on a torch change
        problems.append(f"_foreach_supported_types unavailable: {exc!r}")
    if not isinstance(Replicate(), torch._C._distributed.Placement):
        problems.append("placements are no longer torch._C._distributed.Placement")
    return problems
