"""vescale.dmodule: distributed modules for vescale.

:func:`parallelize_module` (or :class:`DModule`, the same call) shards an unmodified
``nn.Module`` over a device mesh by a plain-dict sharding plan: parameters become
DTensors with the planned placements, forward hooks move planned module inputs and
outputs to their placements, plain tensors created inside ``forward`` act as
replicated, and ``Partial`` gradients (sequence parallelism) are reduced, bucketed,
after every backward. With no plan, a Megatron tensor(+sequence)-parallel plan is
derived from the model's structure through the ``vescale_sharding_plan`` hook.
"""

from vescale.dmodule.__about__ import __version__
from vescale.dmodule._api import DModule, dump_plan, is_dmodule, parallelize_module
from vescale.dmodule._auto_plan import default_sharding_plan
from vescale.dmodule._loss import vocab_parallel_cross_entropy
from vescale.dmodule._plan import SECTIONS

__all__ = [
    "__version__",
    "DModule",
    "parallelize_module",
    "dump_plan",
    "is_dmodule",
    "default_sharding_plan",
    "vocab_parallel_cross_entropy",
    "SECTIONS",
]
