"""``BlockCyclic(dim, block)``: blocks of ``block`` slices along ``dim`` dealt round-robin.

Rank ``r`` of an ``N``-rank mesh dim owns blocks ``r, r + N, r + 2N, ...`` and keeps
them, in order, concatenated along ``dim``. Shards are not contiguous ranges of the
global tensor, so torch's ``Shard`` cannot express this layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from vescale.dtensor import PluginPlacement
from vescale.dtensor.collectives import all_gather_uneven, reduce_scatter_uneven


@dataclass(frozen=True)
class BlockCyclic(PluginPlacement):
    """Block-cyclic placement of ``dim`` with blocks of ``block`` slices."""

    dim: int = 0
    block: int = 1

    PLACEMENT_NAME: ClassVar[str] = "toy.BlockCyclic"
    LOCAL_OP_FAMILIES: ClassVar[frozenset[str]] = frozenset(
        {"pointwise", "foreach", "full_reduction"}
    )

    def __post_init__(self) -> None:
        if self.dim < 0:
            raise ValueError(f"BlockCyclic dim must be >= 0, got {self.dim}")
        if self.block < 1:
            raise ValueError(f"BlockCyclic block must be >= 1, got {self.block}")

    def __str__(self) -> str:
        return f"BC({self.dim};{self.block})"

    # geometry -----------------------------------------------------------------
    def owned_indices(self, length: int, num_ranks: int, rank: int) -> torch.Tensor:
        """Indices along ``dim`` owned by ``rank``, in local order."""
        idx = torch.arange(length)
        return idx[(idx // self.block) % num_ranks == rank]

    def check_shape(self, logical_shape: tuple[int, ...], num_ranks: int) -> None:
        if self.dim >= len(logical_shape):
            raise ValueError(
                f"{self} needs a tensor with more than {self.dim} dims, got shape {logical_shape}"
            )

    def local_shape(self, logical_shape, num_ranks, rank):
        n = int(self.owned_indices(logical_shape[self.dim], num_ranks, rank).numel())
        return tuple(logical_shape[: self.dim]) + (n,) + tuple(logical_shape[self.dim + 1 :])

    def logical_shape(self, local_shapes):
        first = local_shapes[0]
        total = sum(s[self.dim] for s in local_shapes)
        return tuple(first[: self.dim]) + (total,) + tuple(first[self.dim + 1 :])

    def local_flat_ranges(self, logical_shape, num_ranks, rank):
        outer = math.prod(logical_shape[: self.dim])
        length = logical_shape[self.dim]
        inner = math.prod(logical_shape[self.dim + 1 :])
        idx = self.owned_indices(length, num_ranks, rank).tolist()
        runs: list[tuple[int, int]] = []  # consecutive owned indices along dim
        for i in idx:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        out: list[tuple[int, int]] = []
        for o in range(outer):
            base = o * length * inner
            for a, b in runs:
                start, stop = base + a * inner, base + b * inner
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], stop)
                elif stop > start:
                    out.append((start, stop))
        return out

    def shard(self, tensor, num_ranks, rank):
        idx = self.owned_indices(tensor.shape[self.dim], num_ranks, rank).to(tensor.device)
        return tensor.index_select(self.dim, idx)

    def unshard(self, local, mesh, mesh_dim, logical_shape):
        n = mesh.size(mesh_dim)
        length = logical_shape[self.dim]
        counts = [int(self.owned_indices(length, n, r).numel()) for r in range(n)]
        gathered = all_gather_uneven(local, (mesh, mesh_dim), self.dim, sizes=counts)
        out = local.new_empty(logical_shape)
        offset = 0
        for r in range(n):
            idx = self.owned_indices(length, n, r).to(local.device)
            out.index_copy_(self.dim, idx, gathered.narrow(self.dim, offset, counts[r]))
            offset += counts[r]
        return out


def reduce_scatter_step(local: torch.Tensor, ctx) -> torch.Tensor:
    """Direct ``Partial("sum") -> BlockCyclic`` step: one reduce-scatter, no all-reduce."""
    p: BlockCyclic = ctx.dst
    n, length = ctx.num_ranks, ctx.logical_shape[p.dim]
    owned = [p.owned_indices(length, n, r).to(local.device) for r in range(n)]
    # every rank's blocks, rank by rank: one (uneven) reduce-scatter hands each its own
    ordered = local.index_select(p.dim, torch.cat(owned))
    sizes = [int(o.numel()) for o in owned]
    out = reduce_scatter_uneven(ordered, sizes, (ctx.mesh, ctx.mesh_dim), p.dim, op="sum")
    return out.contiguous()
