"""The vescale plugin manager: one per process, loaded lazily, answers cached."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any

import pluggy
from torch.distributed.tensor import Placement

from vescale.dtensor.plugin import hookspecs

__all__ = [
    "get_plugin_manager",
    "register_plugin",
    "unregister_plugin",
    "placement_registry",
    "add_cache_invalidation_callback",
]

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_registry: dict[str, type[Placement]] | None = None
_invalidation_callbacks: list[Callable[[], None]] = []


def _skip_plugin(name: str, where: str, exc: Exception) -> None:
    warnings.warn(
        f"vescale plugin entry point {name!r} ({where}) failed to load and is skipped; "
        f"the other plugins keep working: {type(exc).__name__}: {exc}",
        RuntimeWarning,
        stacklevel=3,
    )


def _load_entry_points(pm: pluggy.PluginManager) -> dict[str, str]:
    """Register every ``vescale`` entry point; one that fails to import or register is skipped.

    Returns:
        ``{plugin name: entry point description}`` of the registered entry points.
    """
    loaded: dict[str, str] = {}
    for ep in metadata.entry_points(group=hookspecs.PROJECT_NAME):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue  # the same distribution found twice on sys.path
        where = f"{ep.value} from {getattr(ep.dist, 'name', None) or 'an unknown distribution'}"
        try:
            pm.register(ep.load(), name=ep.name)
        except Exception as exc:  # noqa: BLE001 - reported, the built-ins keep working
            _skip_plugin(ep.name, where, exc)
            continue
        loaded[ep.name] = where
    return loaded


def _new_manager() -> pluggy.PluginManager:
    from vescale.dtensor.plugin import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    # Built-ins go through the very same hooks as third parties.
    pm.register(builtin, name="vescale.dtensor.builtin")
    loaded = _load_entry_points(pm)
    pm.hook.vescale_addhooks.call_historic(kwargs={"pluginmanager": pm})
    while True:
        try:
            pm.check_pending()
            break
        except pluggy.PluginValidationError as exc:
            # A hook implementation without a spec: drop its entry point, keep the rest.
            name = pm.get_name(exc.plugin)
            if name not in loaded:
                raise
            pm.unregister(exc.plugin)
            _skip_plugin(name, loaded.pop(name), exc)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, creating it on first use.

    On creation it registers vescale-dtensor's built-in plugin, loads every
    ``vescale`` entry point and checks that all hook implementations match a spec.
    An entry point that fails to import or register, or whose hook implementations
    match no spec, is skipped with one ``RuntimeWarning`` naming it; the built-ins
    and the other plugins keep working.
    """
    global _pm
    if _pm is None:
        with _lock:
            if _pm is None:
                _pm = _new_manager()
    return _pm


def add_cache_invalidation_callback(fn: Callable[[], None]) -> None:
    """Register ``fn`` to be called whenever the set of plugins changes.

    Modules that cache hook answers (the redistribution planner) clear their
    caches through this.
    """
    _invalidation_callbacks.append(fn)


def _invalidate() -> None:
    global _registry
    _registry = None
    for fn in _invalidation_callbacks:
        fn()


def register_plugin(plugin: Any, name: str | None = None) -> str:
    """Register a plugin object (a module or an instance with hook implementations).

    Entry points are the normal way in; this is for programmatic and test use.
    Cached hook answers are dropped.

    Returns:
        The name the plugin was registered under.
    """
    pm = get_plugin_manager()
    with _lock:
        registered = pm.register(plugin, name=name)
        if registered is None:
            raise ValueError(f"plugin {name or plugin!r} is blocked or already registered")
        pm.check_pending()
        _invalidate()
    return registered


def unregister_plugin(plugin: Any = None, name: str | None = None) -> None:
    """Unregister a plugin registered with `register_plugin`."""
    pm = get_plugin_manager()
    with _lock:
        pm.unregister(plugin, name=name)
        _invalidate()


def placement_registry() -> dict[str, type[Placement]]:
    """Map every registered ``PLACEMENT_NAME`` to its placement class.

    Built-in names are ``"Shard"``, ``"Replicate"`` and ``"Partial"``.

    Raises:
        ValueError: Two classes claim the same name (both are named).
        TypeError: A plugin returned something that is not a placement class.
    """
    global _registry
    reg = _registry
    if reg is not None:
        return dict(reg)
    with _lock:
        pm = get_plugin_manager()
        reg = {}
        for answer in pm.hook.vescale_register_placements():
            classes = answer if isinstance(answer, (list, tuple)) else [answer]
            for cls in classes:
                if not (isinstance(cls, type) and issubclass(cls, Placement)):
                    raise TypeError(
                        f"vescale_register_placements returned {cls!r}; expected a Placement "
                        "subclass"
                    )
                name = _placement_name(cls)
                other = reg.get(name)
                if other is not None and other is not cls:
                    raise ValueError(
                        f"placement name {name!r} is registered twice: by "
                        f"{other.__module__}.{other.__qualname__} and "
                        f"{cls.__module__}.{cls.__qualname__}"
                    )
                reg[name] = cls
        _registry = reg
    return dict(reg)


def _placement_name(cls: type[Placement]) -> str:
    name = getattr(cls, "PLACEMENT_NAME", None)
    if name is None:
        # torch's built-ins carry no PLACEMENT_NAME; their class name is the name.
        from vescale.dtensor.placement_types import PluginPlacement

        if issubclass(cls, PluginPlacement):
            raise TypeError(f"{cls.__qualname__} has no PLACEMENT_NAME")
        name = cls.__name__
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__qualname__}.PLACEMENT_NAME must be a non-empty str")
    return name
