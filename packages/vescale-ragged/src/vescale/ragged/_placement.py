"""The ``RaggedShard`` placement: arbitrary-proportion shards of flattened storage."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vescale.dtensor import PluginPlacement
from vescale.dtensor.collectives import all_gather_uneven

__all__ = ["RaggedShard"]


@dataclass(frozen=True)
class RaggedShard(PluginPlacement):
    """Shard the flattened leading dims ``dims`` of a tensor in proportions ``local_units``.

    The leading dims ``dims`` (a prefix ``(0, 1, ..., k-1)``) are flattened into one
    dim of ``P = prod(shape[:k])`` slices, each slice carrying the trailing block
    ``shape[k:]``. ``P`` is cut into ``sum(local_units)`` equal units and rank ``r``
    of the mesh dim holds the ``local_units[r]`` units after those of ranks ``< r``:
    one contiguous range of the tensor's storage. Its local tensor has shape
    ``(P // sum(units) * local_units[r], *shape[k:])``.

    - ``dims=(0,)`` keeps whole rows (the cut never goes through dims ``>= 1``, so a
      ``Shard(d)`` for ``d >= 1`` can compose with it on another mesh dim);
    - ``dims=(0, ..., ndim-1)`` is element granularity (1-D local storage);
    - ``dims=()`` is unsharded storage owned by the single rank whose unit is 1
      (``local_units`` one-hot), e.g. the root of a Muon update.

    Args:
        dims: Leading dims that are flattened and sharded.
        local_units: Relative share of each rank on the mesh dim (zeros allowed).
    """

    dims: tuple[int, ...]
    local_units: tuple[int, ...]

    PLACEMENT_NAME: ClassVar[str] = "RaggedShard"
    LOCAL_OP_FAMILIES: ClassVar[frozenset[str]] = frozenset(
        {"pointwise", "foreach", "full_reduction"}
    )

    def __post_init__(self) -> None:
        # map/min instead of generators: the planner builds one per parameter with
        # one unit per rank (1,000 x 1,024 on a cluster-sized plan)
        dims = tuple(map(int, self.dims))
        units = tuple(map(int, self.local_units))
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", units)
        if dims != tuple(range(len(dims))):
            raise ValueError(
                f"RaggedShard dims must be a leading prefix (0, 1, ..., k-1), got {dims}"
            )
        if not units:
            raise ValueError("RaggedShard local_units must have one entry per rank, got ()")
        if min(units) < 0:
            raise ValueError(f"RaggedShard local_units must be >= 0, got {units}")
        if sum(units) == 0:
            raise ValueError(f"RaggedShard local_units must not be all zero, got {units}")

    @classmethod
    def _checked_by_caller(cls, dims: tuple[int, ...], local_units: tuple[int, ...]) -> RaggedShard:
        """The placement of fields the caller has already made valid, without re-checking.

        For the flat-buffer planner, which builds one per parameter with one unit per
        rank (1,000 x 1,024 on a cluster-sized plan): converting and checking the units
        again cost more than the whole rest of the plan. ``dims`` must be ``(0, ..., k-1)``
        and ``local_units`` a tuple of ints ``>= 0``, not all zero.
        """
        self = cls.__new__(cls)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "local_units", local_units)
        return self

    def __str__(self) -> str:
        return f"RS({','.join(map(str, self.dims))};{','.join(map(str, self.local_units))})"

    # ------------------------------------------------------------------ geometry
    @property
    def total_units(self) -> int:
        return sum(self.local_units)

    def unit_size(self, logical_shape: tuple[int, ...]) -> int:
        """Slices of the flattened prefix in one unit."""
        return math.prod(logical_shape[: len(self.dims)]) // self.total_units

    def ranges(self, logical_shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """``(start, stop)`` of every rank's range, in flattened-prefix slices."""
        u = self.unit_size(logical_shape)
        out, start = [], 0
        for units in self.local_units:
            out.append((start, start + u * units))
            start += u * units
        return out

    def check_shape(self, logical_shape: tuple[int, ...], num_ranks: int) -> None:
        if len(self.local_units) != num_ranks:
            raise ValueError(
                f"{self} has {len(self.local_units)} local_units for a mesh dim of "
                f"{num_ranks} ranks (expected one unit count per rank)"
            )
        if len(self.dims) > len(logical_shape):
            raise ValueError(
                f"{self} flattens dims {self.dims} but the tensor has shape {tuple(logical_shape)}"
            )
        prefix = math.prod(logical_shape[: len(self.dims)])
        rem = prefix % self.total_units
        if rem:
            raise ValueError(
                f"{self}: the flattened dims {self.dims} of shape {tuple(logical_shape)} hold "
                f"{prefix} slices, which does not divide evenly by sum(local_units)="
                f"{self.total_units} (remainder {rem})"
            )

    def local_shape(self, logical_shape, num_ranks, rank):
        k = len(self.dims)
        return (self.unit_size(logical_shape) * self.local_units[rank], *logical_shape[k:])

    def local_dim(self, dim: int, logical_ndim: int) -> int | None:
        k = len(self.dims)
        return None if dim < k else dim - k + 1

    def logical_shape(self, local_shapes):
        if len(self.dims) != 1:
            raise NotImplementedError(
                f"{self}: the global shape cannot be inferred when {len(self.dims)} dims are "
                "flattened; pass shape="
            )
        return (sum(s[0] for s in local_shapes), *local_shapes[0][1:])

    def local_flat_ranges(self, logical_shape, num_ranks, rank):
        trailing = math.prod(logical_shape[len(self.dims) :])
        a, b = self.ranges(tuple(logical_shape))[rank]
        return [(a * trailing, b * trailing)] if b > a else []

    def _flat(self, tensor: torch.Tensor) -> torch.Tensor:
        k = len(self.dims)
        return tensor.reshape(math.prod(tensor.shape[:k]), *tensor.shape[k:])

    def shard(self, tensor, num_ranks, rank):
        start, stop = self.ranges(tuple(tensor.shape))[rank]
        return self._flat(tensor)[start:stop].clone()

    def unshard(self, local, mesh, mesh_dim, logical_shape):
        # the one uneven all-gather (gloo has none: padded, one even gather)
        sizes = [b - a for a, b in self.ranges(tuple(logical_shape))]
        flat = all_gather_uneven(local, (mesh, mesh_dim), 0, sizes=sizes, method="pad")
        return flat.reshape(logical_shape)
