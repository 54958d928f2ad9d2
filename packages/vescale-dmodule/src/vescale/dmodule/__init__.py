"""vescale.dmodule: distributed modules for vescale.

`parallelize_module` (or `DModule`, the same call) shards an unmodified
``nn.Module`` over a device mesh by a plain-dict sharding plan: parameters become
DTensors with the planned placements, forward hooks move planned module inputs and
outputs to their placements, plain tensors created inside ``forward`` act as
replicated, and ``Partial`` gradients (sequence parallelism) are reduced, bucketed,
after every backward. With no plan, a Megatron tensor(+sequence)-parallel plan is
derived from the model's structure through the ``vescale_sharding_plan`` hook. torch's
``ParallelStyle`` plans (``{"fc1": ColwiseParallel(), ...}``) are accepted too.

Data parallelism is chosen per named mesh dim with ``data_parallel={"dp": "ddp"}`` or
``{"dp": "fsdp"}`` (or directly with `replicate` / `fully_shard`): DDP with
bucketed, overlapped all-reduces, and FSDP whose parameters are ``RaggedShard`` views of
padding-free flat buffers gathered and reduce-scattered with no extra copies. HSDP is
``{"rep": "ddp", "shard": "fsdp"}``: sharded over one dim, replicated over the other.

``activation_checkpointing=True`` (or regexes, or a predicate) recomputes the chosen
submodules' activations in backward (`apply_activation_checkpointing`).

`pipeline_parallelize` splits an unmodified model into pipeline stages over a ``pp``
mesh dim and runs torch's pipelining schedules (GPipe, 1F1B, interleaved 1F1B); each
stage is parallelized with the above over the rest of the mesh.
"""

from vescale.dmodule.__about__ import __version__
from vescale.dmodule._activation_checkpoint import apply_activation_checkpointing
from vescale.dmodule._api import DModule, dump_plan, is_dmodule, parallelize_module
from vescale.dmodule._auto_plan import default_sharding_plan
from vescale.dmodule._compat import check_torch_internals
from vescale.dmodule._cost_model import (
    DeviceSpec,
    Estimate,
    Layout,
    Link,
    ModelProfile,
    estimate,
    probe_device,
    profile_model,
    saved_activation_bytes,
)
from vescale.dmodule._ddp import replicate
from vescale.dmodule._dp_common import MixedPrecision, dp_memory_bytes
from vescale.dmodule._dp_module import FullyShardedModule, ReplicatedModule
from vescale.dmodule._fsdp import fully_shard, get_dp_engine, no_sync
from vescale.dmodule._loss import vocab_parallel_cross_entropy
from vescale.dmodule._pipeline import PipelineParallel, pipeline_parallelize
from vescale.dmodule._pipeline_split import PipelineSplitError
from vescale.dmodule._plan import SECTIONS, PlanSectionError
from vescale.dmodule._reshard import ReshardError, reshard
from vescale.dmodule._strategy import (
    NoLayoutFitsError,
    StrategyChoice,
    apply_layout,
    candidates,
    get_strategy,
    layout_of,
    search,
)
from vescale.dmodule._torch_styles import TorchStyleError

__all__ = [
    "__version__",
    "check_torch_internals",
    "DModule",
    "parallelize_module",
    "dump_plan",
    "is_dmodule",
    "default_sharding_plan",
    "vocab_parallel_cross_entropy",
    "SECTIONS",
    "PlanSectionError",
    "TorchStyleError",
    "fully_shard",
    "replicate",
    "no_sync",
    "get_dp_engine",
    "MixedPrecision",
    "FullyShardedModule",
    "ReplicatedModule",
    "dp_memory_bytes",
    "apply_activation_checkpointing",
    "pipeline_parallelize",
    "PipelineParallel",
    "PipelineSplitError",
    "Layout",
    "Link",
    "DeviceSpec",
    "ModelProfile",
    "Estimate",
    "StrategyChoice",
    "NoLayoutFitsError",
    "profile_model",
    "probe_device",
    "estimate",
    "search",
    "candidates",
    "apply_layout",
    "get_strategy",
    "layout_of",
    "saved_activation_bytes",
    "reshard",
    "ReshardError",
]
