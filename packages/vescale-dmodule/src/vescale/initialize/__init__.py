"""veScale's ``vescale.initialize``: deferred construction of modules and tensors.

``deferred_init(GPT, config)`` builds the module on the ``meta`` device (no memory) and
remembers how; ``materialize_module`` (or ``vescale.dmodule.api.parallelize_module``)
builds it again for real, so the values are exactly those of eager construction with
the generator state at that point. ``materialize_dtensor`` distributes a deferred (or
real) tensor. Unlike veScale (torchdistx), the full module is built on each rank when
it is materialized; see ``docs/migrating.md``.
"""

from vescale.initialize._deferred import (
    deferred_init,
    is_deferred,
    materialize_dparameter,
    materialize_dtensor,
    materialize_module,
)

__all__ = [
    "deferred_init",
    "is_deferred",
    "materialize_module",
    "materialize_dtensor",
    "materialize_dparameter",
]
