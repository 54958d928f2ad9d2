"""vescale-dmodule's plugin module (entry point ``dmodule`` in group ``vescale``).

It adds vescale-dmodule's hook specifications to the plugin manager and answers
``vescale_sharding_plan`` last, with the structural default plan.
"""

from __future__ import annotations

from vescale.dtensor import hookimpl


@hookimpl
def vescale_addhooks(pluginmanager):
    from vescale.dmodule import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@hookimpl(trylast=True)
def vescale_sharding_plan(model, device_mesh, tp_dim, sequence_parallel):
    from vescale.dmodule._auto_plan import default_sharding_plan

    return default_sharding_plan(model, device_mesh, tp_dim, sequence_parallel)
