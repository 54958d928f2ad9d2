"""Hook implementations of the toy plugin, loaded through the ``vescale`` entry point."""

from __future__ import annotations

from torch.distributed.tensor import Partial

from vescale.dtensor import hookimpl
from vescale_toy_placement.placement import BlockCyclic, reduce_scatter_step


@hookimpl
def vescale_register_placements():
    return BlockCyclic


@hookimpl
def vescale_redistribute_step(src, dst):
    if isinstance(dst, BlockCyclic) and isinstance(src, Partial) and src.reduce_op == "sum":
        return reduce_scatter_step
    return None
