"""vescale.optim: optimizers for parameters with any placements.

- `DistributedOptimizer`: ZeRO-1/2 sharding of optimizer state (and fp32
  master weights) over a data-parallel mesh dim, for element-wise optimizers;
- `clip_grad_norm_`: gradient clipping over DTensor gradients with any mix of
  placements and meshes (each element counted once);
- `Muon`: Muon for sharded matrices (each matrix orthogonalized on one
  load-balanced root rank), AdamW for the rest.
"""

from vescale.optim.__about__ import __version__
from vescale.optim._clip import clip_grad_norm_, clip_grads_with_norm_, get_total_norm
from vescale.optim._compat import check_torch_internals
from vescale.optim._muon import Muon
from vescale.optim._zero import (
    ELEMENTWISE_OPTIMIZERS,
    DistributedOptimizer,
    GradientsReleasedError,
)

__all__ = [
    "__version__",
    "check_torch_internals",
    "DistributedOptimizer",
    "ELEMENTWISE_OPTIMIZERS",
    "GradientsReleasedError",
    "Muon",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "get_total_norm",
]
