"""The vescale plugin system (pluggy project ``"vescale"``, entry-point group ``"vescale"``).

Third-party packages declare:

```
[project.entry-points.vescale]
myplugin = "mypackage.vescale_plugin"
```

and implement hooks in that module with `hookimpl`.
"""

from vescale.dtensor.plugin.hookspecs import PROJECT_NAME, hookimpl, hookspec
from vescale.dtensor.plugin.manager import (
    get_plugin_manager,
    placement_registry,
    register_plugin,
    unregister_plugin,
)

__all__ = [
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "get_plugin_manager",
    "placement_registry",
    "register_plugin",
    "unregister_plugin",
]
