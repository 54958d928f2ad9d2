"""veScale's module path ``vescale.optim.distributed_optimizer``."""

from vescale.optim._vescale import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
