"""Hook specifications owned by vescale-dmodule.

Added to the ``vescale`` plugin manager through ``vescale_addhooks`` by
vescale-dmodule's own plugin module (`vescale.dmodule._plugin`, entry point
``dmodule``). They are called once per `vescale.dmodule.parallelize_module`
call, never per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vescale.dtensor import hookspec

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["vescale_sharding_plan"]


@hookspec(firstresult=True)
def vescale_sharding_plan(
    model: nn.Module,
    device_mesh: DeviceMesh,
    tp_dim: int,
    sequence_parallel: bool,
) -> dict[str, Any] | None:
    """Return a sharding plan for ``model`` when the user gave none, or ``None``.

    vescale-dmodule answers ``trylast`` with a Megatron-style plan derived from
    module names and types (see `vescale.dmodule._auto_plan`); a plugin that
    knows a model family better answers first. Implementations may accept any
    subset of the arguments.

    Args:
        model: The module about to be parallelized (parameters still plain tensors).
        device_mesh: The mesh it is parallelized over.
        tp_dim: Index of the tensor-parallel mesh dim.
        sequence_parallel: Whether activations should be sharded on the sequence
            dim between blocks.

    Returns:
        A plan in the format of `vescale.dmodule.parallelize_module`, or ``None``.
    """
