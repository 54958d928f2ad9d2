"""Core hook specifications of vescale (owned by vescale-dtensor).

Every package of vescale and every third-party plugin talks to the others through
these hooks. They are called at registration or planning time only; their answers
are cached, never asked per tensor operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

    from vescale.dtensor._redistribute import RedistributeStep

PROJECT_NAME = "vescale"
"""pluggy project name of every vescale hook, and the name of the entry-point group."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""`pluggy.HookspecMarker("vescale")`: marks a hook specification (in a `hookspecs.py`)."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""`pluggy.HookimplMarker("vescale")`: marks a plugin's hook implementation.

Example:
    ```python
    from vescale.dtensor import hookimpl


    @hookimpl
    def vescale_register_placements():
        return [MyPlacement]
    ```
"""


@hookspec(historic=True)
def vescale_addhooks(pluginmanager: pluggy.PluginManager) -> None:
    """Add another package's hook specifications.

    Called once for every registered plugin (historic: plugins registered later
    still see it). A package that owns hooks calls
    ``pluginmanager.add_hookspecs(its_hookspecs_module)`` here.

    Args:
        pluginmanager: The vescale plugin manager.
    """


@hookspec
def vescale_register_placements() -> type[Placement] | list[type[Placement]]:
    """Return the placement classes a plugin contributes.

    Each class must subclass `vescale.dtensor.PluginPlacement` (or be one of
    torch's built-in placements, registered by vescale-dtensor itself) and carry a
    unique ``PLACEMENT_NAME``. Checkpoints and configs refer to placements by that
    name plus their dataclass fields.

    Returns:
        One placement class or a list of them.
    """


@hookspec(firstresult=True)
def vescale_redistribute_step(src: Placement, dst: Placement) -> RedistributeStep | None:
    """Say how to move a local shard from ``src`` to ``dst`` on one mesh dimension.

    Asked once per ``(src, dst)`` pair; the answer is cached. Built-in pairs are
    answered ``trylast``, so a plugin can override them. Return ``None`` when the
    plugin has no direct step: the planner then routes through ``Replicate()``.

    Args:
        src: Placement of the local tensor on the mesh dimension now.
        dst: Placement wanted on that mesh dimension.

    Returns:
        A `vescale.dtensor.RedistributeStep` or ``None``.
    """
