"""vescale.ragged: the ``RaggedShard`` placement, the flat-buffer engine and pack kernels.

``RaggedShard(dims, local_units)`` shards the flattened storage of a tensor in
arbitrary proportions, so that many parameters can live as views of one buffer
and be gathered with no padding and no extra copies. `FlatLayout` + `FlatBuffer`
are the one flat-buffer engine of vescale: FSDP, DDP's gradient buckets and
``DistributedOptimizer`` lay parameters out and move them with it. It joins ``vescale.dtensor``
only through the ``vescale`` entry point (``vescale.ragged._plugin``).
"""

from vescale.ragged.__about__ import __version__
from vescale.ragged._compat import check_torch_internals
from vescale.ragged._flat_buffer import FlatBuffer, FlatWork, bucket_specs
from vescale.ragged._pack import PackKernels, TorchPackKernels, get_pack_kernels
from vescale.ragged._placement import RaggedShard
from vescale.ragged._planner import (
    FlatLayout,
    ParamSlot,
    ParamSpec,
    layouts_from_tensors,
    plan_flat_buffers,
)

__all__ = [
    "__version__",
    "check_torch_internals",
    "RaggedShard",
    "ParamSpec",
    "ParamSlot",
    "FlatLayout",
    "plan_flat_buffers",
    "layouts_from_tensors",
    "FlatBuffer",
    "FlatWork",
    "bucket_specs",
    "PackKernels",
    "TorchPackKernels",
    "get_pack_kernels",
]
