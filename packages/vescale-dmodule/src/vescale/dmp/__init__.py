"""veScale's ``vescale.dmp``: ``auto_parallelize_module`` with the Megatron policy.

The plan comes from vescale's automatic Megatron tensor(+sequence)-parallel plan
(``vescale.dmodule.default_sharding_plan``).
"""

from vescale.dmp._dmp import auto_parallelize_module
from vescale.dtensor.compat import refusing_getattr

__all__ = ["auto_parallelize_module"]

__getattr__ = refusing_getattr(
    __name__,
    {
        "set_plan_overriding_policy": "pass your plan keys to "
        "vescale.dmodule.parallelize_module(model, mesh, plan, auto_plan=True): the user keys "
        "win over the automatic plan",
        "get_plan_overriding_policy": "see set_plan_overriding_policy: plans are passed to "
        "parallelize_module, not stored on modules",
    },
)
