"""The one place where vescale-checkpoint touches torch internals.

Probed by feature when imported (see ``vescale.dtensor.compat.TorchInternals``):
DCP's filesystem ``_StorageInfo`` (the location of a chunk in a data file, which the
checked reader and writer extend with a CRC32) and ``torch._utils._element_size``.
A missing one is replaced by a public equivalent where one exists, with one
``TorchInternalsWarning``; `check_torch_internals` reports what was found.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch
import torch.distributed as dist

from vescale.dtensor.compat import StridedShard, default_group, local_tensor, sibling_internals

__all__ = [
    "StorageInfo",
    "StridedShard",
    "check_torch_internals",
    "default_group",
    "element_size",
    "local_tensor",
    "new_member_group",
]

_INTERNALS = sibling_internals(
    "vescale-checkpoint",
    shared=(
        "torch.distributed.tensor.placement_types._StridedShard",
        "torch.distributed.distributed_c10d._get_default_group",
        "DTensor._local_tensor",
    ),
)


def _storage_info() -> tuple[type, str | None]:
    try:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
    except ImportError as exc:
        problem = f"cannot be imported: {exc}"
    else:
        names = [f.name for f in dataclasses.fields(_StorageInfo)]
        if names[:3] == ["relative_path", "offset", "length"]:
            return _StorageInfo, None
        problem = f"fields changed: {names}"

    @dataclasses.dataclass
    class _StorageInfo:  # the same fields, for the checked reader and writer
        relative_path: str
        offset: int
        length: int
        transform_descriptors: list | None = None

    return _StorageInfo, problem


#: DCP's ``_StorageInfo`` (file, offset, length of one chunk).
StorageInfo, _storage_problem = _storage_info()
_INTERNALS.probe(
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    lambda: _storage_problem,
    instead="checkpoints are read and written with vescale's own chunk locations; "
    "DCP's FileSystemReader cannot read them",
    required=True,
)

_ELEMENT_SIZE = getattr(torch._utils, "_element_size", None)
_ELEMENT_SIZE_OK = _INTERNALS.probe(
    "torch._utils._element_size",
    lambda: (
        None
        if callable(_ELEMENT_SIZE) and _ELEMENT_SIZE(torch.bfloat16) == 2
        else "is missing or changed"
    ),
    instead="torch.empty((), dtype=dtype).element_size()",
)


def make_wrapper_subclass(cls: type, size: torch.Size, **kwargs) -> torch.Tensor:
    """A tensor subclass instance with no storage of its own (``ChunkedTensor``)."""
    return torch.Tensor._make_wrapper_subclass(cls, size, **kwargs)  # type: ignore[attr-defined]


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    if _ELEMENT_SIZE_OK:
        return _ELEMENT_SIZE(dtype)
    return torch.empty((), dtype=dtype).element_size()


# ``new_group(ranks, use_local_synchronization=True)`` is made by its members alone. Some
# torch releases (2.15) count such a group in ``_world.group_count`` on the members only:
# the next group that every rank creates (``new_group``, a ``DeviceMesh``) then gets a
# different name on members and non-members, and its rendezvous hangs. The count is put
# back on the members, so that every rank keeps the same count.
_GROUP_COUNT = "torch.distributed.distributed_c10d._world.group_count"
_WORLD = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
_GROUP_COUNT_OK = _INTERNALS.probe(
    _GROUP_COUNT,
    lambda: None if isinstance(getattr(_WORLD, "group_count", None), int) else "is missing",
    instead="save(async_op=True, process_group=<a subgroup>) saves synchronously",
)


def new_member_group(ranks: list[int], timeout: timedelta) -> dist.ProcessGroup | None:
    """A gloo group of ``ranks`` created by those ranks alone (``None``: unavailable).

    Every rank's process-group count stays as it was, so groups that all ranks create
    later get the same name everywhere. Raises torch's ``ValueError`` / ``RuntimeError``
    where a group of the same ranks already holds the name.
    """
    if not _GROUP_COUNT_OK:
        return None
    before = _WORLD.group_count
    group = dist.new_group(
        list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True
    )
    _WORLD.group_count = before
    return group


def check_torch_internals() -> dict[str, str]:
    """What vescale-checkpoint found of the torch internals it relies on.

    Returns:
        ``{internal: status}``, statuses as in ``vescale.dtensor.compat.check_torch_internals``.
    """
    return _INTERNALS.report()
