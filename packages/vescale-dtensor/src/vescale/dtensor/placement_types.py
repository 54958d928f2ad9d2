"""Placements: torch's built-ins, re-exported, and the base class for plugin placements.

Placement classes contributed by plugins are attributes of this module too, resolved
by name through the placement registry (a module ``__getattr__``), so veScale's
``from vescale.dtensor.placement_types import RaggedShard`` works whenever
vescale-ragged is installed, while vescale-dtensor itself never imports a plugin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "PluginPlacement",
    "OP_FAMILIES",
    "is_plugin_placement",
    "normalize_placements",
]

OP_FAMILIES = frozenset({"pointwise", "foreach", "full_reduction"})
"""Op families a plugin placement may declare as running locally on its shards.

- `"pointwise"`: element-wise ops (`torch.Tag.pointwise`) whose DTensor operands
  all have the same spec (mesh, placements, global shape); scalars and 0-dim plain
  tensors may join. In-place and out-of-place.
- `"foreach"`: `_foreach_*` ops whose i-th DTensor operands share one spec.
- `"full_reduction"`: `sum`/`mean` over all elements; the result is `Partial`
  on the placement's mesh dim. Only valid when every element lives on exactly one rank.
"""


class PluginPlacement(Placement):
    """Base class for placements contributed by plugins.

    Subclass it as a ``@dataclass(frozen=True)`` (which gives ``__eq__`` and
    ``__hash__``), give it a unique ``PLACEMENT_NAME`` and implement the geometry
    below. Register the class through the ``vescale_register_placements`` hook.
    Never subclass `Shard` for a new placement: torch treats ``Shard``
    subclasses as plain ``Shard``.

    A plugin placement on mesh dim ``i`` distributes the *logical tensor* of that mesh
    dim: the global tensor after the placements of mesh dims ``0..i-1`` were applied
    (mesh dims apply left to right, as in torch).

    Attributes:
        PLACEMENT_NAME: Unique name used by checkpoints and configs.
        LOCAL_OP_FAMILIES: Op families (see `OP_FAMILIES`) that run on the local
            shards without communication.
    """

    PLACEMENT_NAME: ClassVar[str]
    LOCAL_OP_FAMILIES: ClassVar[frozenset[str]] = frozenset()

    def __new__(cls, *args: object, **kwargs: object) -> PluginPlacement:
        self = super().__new__(cls)
        # The base is a pybind11 class: its holder must be initialised even though
        # dataclass-generated __init__ methods never call super().__init__().
        Placement.__init__(self)
        return self

    # Placements are immutable values: copies are the object itself, and pickling
    # rebuilds from the dataclass fields (the pybind11 base cannot pickle itself).
    def __copy__(self) -> PluginPlacement:
        return self

    def __deepcopy__(self, memo: dict) -> PluginPlacement:
        return self

    def __reduce__(self) -> tuple:
        if dataclasses.is_dataclass(self):
            kwargs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        else:
            kwargs = {}
        return (_rebuild_placement, (type(self), kwargs))

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.LOCAL_OP_FAMILIES) - OP_FAMILIES
        if unknown:
            raise TypeError(
                f"{cls.__qualname__}.LOCAL_OP_FAMILIES has unknown families {sorted(unknown)}; "
                f"expected a subset of {sorted(OP_FAMILIES)}"
            )

    # ----------------------------------------------------------------- geometry
    def check_shape(self, logical_shape: tuple[int, ...], num_ranks: int) -> None:
        """Raise ``ValueError`` if this placement cannot distribute ``logical_shape``.

        Args:
            logical_shape: Shape of the logical tensor on this mesh dim.
            num_ranks: Size of the mesh dim.
        """

    def local_shape(
        self, logical_shape: tuple[int, ...], num_ranks: int, rank: int
    ) -> tuple[int, ...]:
        """Shape of the local tensor of ``rank`` (coordinate on this mesh dim)."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement local_shape")

    def shard(self, tensor: torch.Tensor, num_ranks: int, rank: int) -> torch.Tensor:
        """Select ``rank``'s local tensor from the full logical tensor (no communication).

        This is the ``Replicate() -> self`` step. Return a tensor that does not alias
        ``tensor`` (or ``tensor`` itself only if unchanged).
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement shard")

    def unshard(
        self,
        local: torch.Tensor,
        mesh: DeviceMesh,
        mesh_dim: int,
        logical_shape: tuple[int, ...],
    ) -> torch.Tensor:
        """Rebuild the full logical tensor on every rank of the mesh dim (a collective).

        This is the ``self -> Replicate()`` step. Use functional collectives or
        `vescale.dtensor.collectives` so that ``CommDebugMode`` sees the traffic.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must implement unshard")

    def logical_shape(self, local_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The logical shape, given every rank's local shape (in coordinate order).

        Used by ``from_local`` without ``shape=``. Optional: without it, callers must
        pass the global shape.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} cannot infer the global shape from local shapes; "
            "pass shape= to from_local"
        )

    def local_dim(self, dim: int, logical_ndim: int) -> int | None:
        """Where dim ``dim`` of the logical tensor lives in the local tensor.

        Used when a ``Shard(dim)`` on a later mesh dim acts on this placement's local
        tensor. Return ``None`` if the dim was cut through (then such a ``Shard`` is an
        error). The default is the identity: local tensors keep all dims.
        """
        return dim

    def local_flat_ranges(
        self, logical_shape: tuple[int, ...], num_ranks: int, rank: int
    ) -> list[tuple[int, int]] | None:
        """Row-major element ranges ``[start, stop)`` of the logical tensor held by ``rank``.

        In local storage order: the local tensor, flattened, is the concatenation of
        these ranges. Checkpointing uses it to describe a rank's data as boxes of the
        global tensor with no communication (see `vescale.dtensor.chunks`).
        Return ``None`` (the default) if the local data is not a union of ranges;
        such tensors are saved after a redistribution to ``Replicate()``.
        """
        return None

    # ----------------------------------------------------------------- op contract
    def fallback_placement(self, logical_shape: tuple[int, ...]) -> Placement:
        """Placement that operands are converted to for ops outside ``LOCAL_OP_FAMILIES``.

        The default, ``Replicate()``, is always correct.
        """
        return Replicate()

    def __str__(self) -> str:
        return repr(self)


def _rebuild_placement(cls: type[PluginPlacement], kwargs: dict) -> PluginPlacement:
    return cls(**kwargs)


def is_plugin_placement(p: Placement) -> bool:
    """True if ``p`` is a plugin placement (not one of torch's)."""
    return isinstance(p, PluginPlacement)


def normalize_placements(placements: Sequence[Placement], mesh_ndim: int) -> tuple[Placement, ...]:
    """One placement per mesh dim: a shorter list is padded with ``Replicate()``.

    veScale's convention: ``[Shard(0)]`` on a 2-D mesh means ``[Shard(0), Replicate()]``.
    A longer list than the mesh has dims, or an entry that is not a ``Placement``, is an
    error.

    Args:
        placements: Placements for the leading mesh dims.
        mesh_ndim: Number of mesh dims.

    Returns:
        A tuple of exactly ``mesh_ndim`` placements.

    Raises:
        TypeError: ``placements`` is not a list/tuple of ``Placement`` instances.
        ValueError: More placements than mesh dims.
    """
    if isinstance(placements, Placement) or not isinstance(placements, (list, tuple)):
        raise TypeError(f"expected a list of placements (one per mesh dim), got {placements!r}")
    for p in placements:
        if not isinstance(p, Placement):
            raise TypeError(f"{p!r} ({type(p).__name__}) is not a Placement")
    if len(placements) > mesh_ndim:
        raise ValueError(
            f"got {len(placements)} placements {[str(p) for p in placements]} for a "
            f"{mesh_ndim}-dim mesh; expected at most one placement per mesh dim (a shorter "
            "list is padded with Replicate())"
        )
    return tuple(placements) + (Replicate(),) * (mesh_ndim - len(placements))


#: Placements that registered plugins usually provide, and the distribution to install.
_PLUGIN_HOMES = {"RaggedShard": "vescale-ragged"}

#: veScale placement names vescale does not provide, with the reason.
_REFUSED = {
    "InterleavedShard": "legacy veScale's interleaved shard is not a vescale placement; "
    "shard fused projections with torch's _StridedShard (what vescale's automatic plans "
    "use) or split the projection into separate parameters",
    "_StridedRaggedShard": "vescale writes veScale's (_StridedRaggedShard, Shard(0)) as "
    "[RaggedShard(dims, local_units), Shard(0)]: a Shard applies before a plugin placement "
    "that would cut through its dim (vescale.dtensor.application_order)",
    "DTensorSpec": "torch internals are not re-exported; use DTensor.placements, "
    "DTensor.device_mesh and DTensor.shape",
    "TensorMeta": "torch internals are not re-exported; use DTensor.shape, DTensor.stride() "
    "and DTensor.dtype",
}


def _registered_placement(name: str) -> type[Placement] | None:
    from vescale.dtensor.plugin.manager import placement_registry

    reg = placement_registry()
    cls = reg.get(name)
    if cls is None:
        cls = next((c for c in reg.values() if c.__name__ == name), None)
    if cls is None and name in _PLUGIN_HOMES:
        from vescale.dtensor._vescale_names import UnsupportedVeScaleName

        raise UnsupportedVeScaleName(
            f"vescale.dtensor.placement_types.{name} is a plugin placement and no installed "
            f"plugin registers it; install {_PLUGIN_HOMES[name]} (pip install "
            f"{_PLUGIN_HOMES[name]}), which registers it through the `vescale` entry point"
        )
    return cls


def _make_getattr():
    from vescale.dtensor._vescale_names import refusing_getattr

    return refusing_getattr(__name__, _REFUSED, _registered_placement)


__getattr__ = _make_getattr()
