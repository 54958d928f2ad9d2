"""veScale's module path ``vescale.optim.base_optimizer``."""

from vescale.optim._vescale import (
    BasicOptimizer,
    BasicOptimizerHook,
    GradOptimizerHookBase,
    OptimizerBase,
)

__all__ = ["BasicOptimizer", "BasicOptimizerHook", "GradOptimizerHookBase", "OptimizerBase"]
