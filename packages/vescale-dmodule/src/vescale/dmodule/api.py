"""veScale's module path ``vescale.dmodule.api``: ``parallelize_module`` by veScale's rules.

The differences from ``vescale.dmodule.parallelize_module`` are veScale's defaults:
no plan means no tensor parallelism (every parameter ``Replicate()``; vescale's own
default is an automatic Megatron plan), a plan key that matches nothing is skipped with
a warning (vescale's own default raises), and a module from
``vescale.initialize.deferred_init`` is materialized by running its constructor
again (eager values). See ``docs/migrating.md``.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from vescale.dmodule._api import DModule, is_dmodule
from vescale.dmodule._api import parallelize_module as _parallelize_module
from vescale.dtensor.compat import refusing_getattr

__all__ = ["parallelize_module", "is_dmodule", "DModule"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    sharding_plan: dict[str, Any] | None = None,
    *,
    is_model_sharded: bool = False,
    factory: Any = False,
    **options: Any,
) -> nn.Module:
    """Shard ``module`` over ``device_mesh`` by ``sharding_plan``, in place (veScale's call).

    Args:
        module: The module; a deferred one (``vescale.initialize.deferred_init``) is
            built for real first, on the mesh's device.
        device_mesh: The mesh (e.g. ``mesh["TP"]``).
        sharding_plan: ``{"parameter": {...}, "forward": {...}}`` as veScale writes it
            (see ``vescale.dmodule.parallelize_module``); ``None``: every parameter
            replicated.
        is_model_sharded: Refused when ``True`` (each rank holding only its shard).
        factory: veScale's factory-function conversion (``True``, or per class / per
            function placements).
        **options: vescale's options of ``vescale.dmodule.parallelize_module``
            (e.g. ``auto_plan=True`` to add the automatic plan under ``sharding_plan``).

    Returns:
        ``module`` itself.

    Raises:
        ValueError: No mesh (vescale has no current-mesh context).
        NotImplementedError: ``is_model_sharded=True``.
    """
    if device_mesh is None:
        raise ValueError(
            "parallelize_module: pass the device mesh (vescale has no current-mesh context)"
        )
    if is_model_sharded:
        raise NotImplementedError(
            "parallelize_module(is_model_sharded=True) is not supported by vescale: build the "
            "full model (or a deferred one, vescale.initialize.deferred_init) and let "
            "parallelize_module cut the shards, or wrap your shards with "
            "vescale.dtensor.api.from_local"
        )
    from vescale.initialize import is_deferred, materialize_module

    if is_deferred(module):
        materialize_module(module, device_mesh.device_type)
    options.setdefault("auto_plan", False)
    options.setdefault("unmatched_plan_keys", "warn")
    return _parallelize_module(module, device_mesh, sharding_plan, factory=factory, **options)


__getattr__ = refusing_getattr(
    __name__,
    {
        "PlacementsInterface": "plan values are placement lists; vescale has no per-tensor "
        "flags (async_op, defer_reshard, run_check, grad placements). Write [Shard(0)] "
        "instead of PlacementsInterface([Shard(0)], ...)",
    },
)
