"""veScale's module path ``vescale.ddp.distributed_data_parallel``."""

from vescale.ddp._adapter import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
