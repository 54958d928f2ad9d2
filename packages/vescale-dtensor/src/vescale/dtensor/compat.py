"""The compatibility surface that sibling packages and plugin authors build on.

vescale-dtensor probes the torch internals it relies on once, at import (see
[torch versions](../torch_versions.md)). Packages that build on it (vescale-ragged,
-dmodule, -optim, -checkpoint, third-party placements) reach those probed pieces
through this public module, never through `vescale.dtensor._compat`, so a torch
release that moves an internal is handled in one place:

- `TorchInternals`: the record of one package's probes (`probe`, `pick`, `adopt`,
  `report`); each package keeps its own, made by `sibling_internals`, which adopts the
  entries it shares with vescale-dtensor from `dtensor_internals()`.
- `check_torch_internals()`: vescale-dtensor's report, `{internal: status}`.
- Probed pieces with their fallbacks: `StridedShard` (torch's strided shard placement,
  or `None`), `local_tensor`, `default_group`, `queue_callback`, `all_gather_single`,
  `reduce_scatter_single`, `shard_size_and_offset`.
- `refusing_getattr` and `UnsupportedVeScaleName`: a module `__getattr__` for veScale
  module paths that resolves names late and refuses the ones vescale does not provide.
"""

from __future__ import annotations

from collections.abc import Iterable

from vescale.dtensor import _compat
from vescale.dtensor._compat import (
    StridedShard,
    TorchInternals,
    TorchInternalsWarning,
    all_gather_single,
    check_torch_internals,
    default_group,
    local_tensor,
    queue_callback,
    reduce_scatter_single,
    shard_size_and_offset,
)
from vescale.dtensor._vescale_names import UnsupportedVeScaleName, refusing_getattr

__all__ = [
    "StridedShard",
    "TorchInternals",
    "TorchInternalsWarning",
    "UnsupportedVeScaleName",
    "all_gather_single",
    "check_torch_internals",
    "default_group",
    "dtensor_internals",
    "local_tensor",
    "queue_callback",
    "reduce_scatter_single",
    "refusing_getattr",
    "shard_size_and_offset",
    "sibling_internals",
]


def dtensor_internals() -> TorchInternals:
    """vescale-dtensor's own probe record, for `TorchInternals.adopt` in sibling packages.

    Returns:
        The `TorchInternals` that vescale-dtensor filled at import.
    """
    return _compat._INTERNALS


def sibling_internals(package: str, shared: Iterable[str] = ()) -> TorchInternals:
    """A new probe record for a package built on vescale-dtensor.

    Args:
        package: The distribution name (``"vescale-ragged"``), used in warnings.
        shared: Internals vescale-dtensor probes (with their fallbacks) that the
            package uses too, through this module; each starts with the status
            vescale-dtensor found (`TorchInternals.adopt`, no second warning).

    Returns:
        The package's `TorchInternals`, for its own probes and its
        ``check_torch_internals()``.
    """
    internals = TorchInternals(package)
    for name in shared:
        internals.adopt(name, _compat._INTERNALS)
    return internals
