"""veScale's ``vescale.ddp``: ``DistributedDataParallel`` over vescale's DDP engine.

``DDP(model, mesh["DP"], accumulate_allreduce_grads_in_fp32=True,
overlap_grad_reduce=True, use_distributed_optimizer=True)`` wraps a model that
``vescale.dmodule.api.parallelize_module`` sharded over ``mesh["TP"]`` (or a plain
model) and makes it data parallel over ``mesh["DP"]``. Without
``use_distributed_optimizer`` the gradients are averaged by
``vescale.dmodule.replicate`` (bucketed, overlapped all-reduces); with it they are
reduce-scattered by ``vescale.optim.distributed_optimizer.DistributedOptimizer``
in ``step()``. See ``docs/migrating.md``.
"""

from vescale.ddp._adapter import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
