"""The one place where vescale-checkpoint touches torch internals.

Probed by feature when imported (see ``vescale.dtensor._compat.TorchInternals``):
DCP's filesystem ``_StorageInfo`` (the location of a chunk in a data file, which the
checked reader and writer extend with a CRC32) and ``torch._utils._element_size``.
A missing one is replaced by a public equivalent where one exists, with one
``TorchInternalsWarning``; `check_torch_internals` reports what was found.
"""

from __future__ import annotations

import dataclasses

import torch

from vescale.dtensor import _compat as _dtensor_compat
from vescale.dtensor._compat import StridedShard, TorchInternals, default_group, local_tensor

__all__ = [
    "StorageInfo",
    "StridedShard",
    "check_torch_internals",
    "default_group",
    "element_size",
    "local_tensor",
]

_INTERNALS = TorchInternals("vescale-checkpoint")
# Probed (with their fallbacks) by vescale-dtensor, used here too.
for _name in (
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.distributed_c10d._get_default_group",
    "DTensor._local_tensor",
):
    _INTERNALS.adopt(_name, _dtensor_compat._INTERNALS)


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


def check_torch_internals() -> dict[str, str]:
    """What vescale-checkpoint found of the torch internals it relies on.

    Returns:
        ``{internal: status}``, statuses as in ``vescale.dtensor._compat.check_torch_internals``.
    """
    return _INTERNALS.report()
