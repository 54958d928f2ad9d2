"""Small example plugin placements for tests (registered per test with ``register_plugin``).

They double as minimal examples of the `PluginPlacement` contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vescale.dtensor import PluginPlacement, hookimpl
from vescale.dtensor.collectives import all_gather_uneven


@dataclass(frozen=True)
class OwnerOnly(PluginPlacement):
    """The whole tensor lives on one rank of the mesh dim; the others hold an empty tensor."""

    owner: int = 0

    PLACEMENT_NAME: ClassVar[str] = "test.OwnerOnly"
    LOCAL_OP_FAMILIES: ClassVar[frozenset[str]] = frozenset({"pointwise", "full_reduction"})

    def local_shape(self, logical_shape, num_ranks, rank):
        return tuple(logical_shape) if rank == self.owner else (0, *logical_shape[1:])

    def shard(self, tensor, num_ranks, rank):
        return tensor.clone() if rank == self.owner else tensor[:0].clone()

    def unshard(self, local, mesh, mesh_dim, logical_shape):
        buf = local if local.shape[0] else local.new_zeros(logical_shape)
        out = all_gather_uneven(
            buf, (mesh, mesh_dim), 0, sizes=[logical_shape[0]] * mesh.size(mesh_dim)
        )
        return out.narrow(0, self.owner * logical_shape[0], logical_shape[0]).clone()


@dataclass(frozen=True)
class NoGeometry(PluginPlacement):
    """A placement that implements no steps at all (for error tests)."""

    PLACEMENT_NAME: ClassVar[str] = "test.NoGeometry"

    def local_shape(self, logical_shape, num_ranks, rank):
        return tuple(logical_shape)


class OwnerPlugin:
    @hookimpl
    def vescale_register_placements(self):
        return [OwnerOnly, NoGeometry]


class Impostor:
    """Claims a name that is already taken."""

    @hookimpl
    def vescale_register_placements(self):
        @dataclass(frozen=True)
        class OtherOwner(PluginPlacement):
            PLACEMENT_NAME: ClassVar[str] = "test.OwnerOnly"

        return OtherOwner


class StepSpy:
    """Counts how often the redistribute-step hook is asked."""

    def __init__(self):
        self.calls: list[tuple] = []

    @hookimpl(tryfirst=True)
    def vescale_redistribute_step(self, src, dst):
        self.calls.append((src, dst))
        return None


def dense(shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)
