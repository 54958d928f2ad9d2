"""vescale-dtensor's built-in plugin: torch's placements and their steps.

Registered through the same hooks as third-party plugins, ``trylast`` so that any
plugin can override a built-in answer.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from vescale.dtensor._redistribute import RedistributeStep, builtin_step
from vescale.dtensor.plugin.hookspecs import hookimpl


@hookimpl(trylast=True)
def vescale_register_placements() -> list[type[Placement]]:
    return [Shard, Replicate, Partial]


@hookimpl(trylast=True)
def vescale_redistribute_step(src: Placement, dst: Placement) -> RedistributeStep | None:
    return builtin_step(src, dst)
