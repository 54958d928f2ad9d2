"""vescale.dtensor: the distributed tensor layer of vescale.

Re-exports torch's DTensor building blocks and opens DTensor to placements added by
plugins: a placement registered through the ``vescale`` entry point works with
``distribute_tensor``, ``DTensor.from_local``, ``to_local``, ``full_tensor`` and
``redistribute`` exactly like torch's built-ins, forward and backward.
"""

from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from vescale.dtensor.__about__ import __version__
from vescale.dtensor._compat import check_torch_internals
from vescale.dtensor._dispatch import install_patches as _install_patches
from vescale.dtensor._redistribute import (
    RedistributePlan,
    RedistributeStep,
    StepContext,
    application_order,
    get_plan,
    localize,
)
from vescale.dtensor._submesh import drop_dim, joint_mesh, lift_placements
from vescale.dtensor.api import distribute_tensor, from_local, redistribute
from vescale.dtensor.collectives import resolve_mesh_dim
from vescale.dtensor.device_mesh import (
    DeviceMesh,
    MeshMismatchError,
    get_default_timeout,
    init_device_mesh,
    set_default_timeout,
)
from vescale.dtensor.hooks import weak_hook
from vescale.dtensor.placement_types import (
    OP_FAMILIES,
    PluginPlacement,
    is_plugin_placement,
    normalize_placements,
)
from vescale.dtensor.plugin import (
    get_plugin_manager,
    hookimpl,
    hookspec,
    placement_registry,
    register_plugin,
    unregister_plugin,
)

_install_patches()

__all__ = [
    "__version__",
    "check_torch_internals",
    "DeviceMesh",
    "MeshMismatchError",
    "resolve_mesh_dim",
    "init_device_mesh",
    "set_default_timeout",
    "get_default_timeout",
    "DTensor",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "PluginPlacement",
    "OP_FAMILIES",
    "is_plugin_placement",
    "normalize_placements",
    "distribute_tensor",
    "redistribute",
    "from_local",
    "placement_registry",
    "get_plugin_manager",
    "register_plugin",
    "unregister_plugin",
    "hookimpl",
    "hookspec",
    "RedistributeStep",
    "StepContext",
    "RedistributePlan",
    "get_plan",
    "application_order",
    "localize",
    "lift_placements",
    "drop_dim",
    "joint_mesh",
    "weak_hook",
]
