"""vescale.checkpoint: distributed checkpointing with resharding, on torch.distributed.checkpoint.

```python
import vescale.checkpoint as vckpt

vckpt.save("ckpt/step_100", {"model": model, "optimizer": opt, "step": 100})
vckpt.load("ckpt/step_100", {"model": model, "optimizer": opt, "step": 0})
```

``load`` reshards to whatever mesh and placements the live objects have. DTensors with
plugin placements (e.g. ``RaggedShard``) are saved as boxes of the global tensor, so
they load into any other placement, mesh or a plain tensor. Placements are recorded
by ``PLACEMENT_NAME`` plus dataclass fields in a JSON manifest; every chunk carries a
CRC32; commits are atomic. Every error is a ``CheckpointError`` (an ``Exception``)
naming the file, tensor or rank concerned; a load verifies that every element of every
tensor it loads is saved somewhere and refuses silent dtype changes.
"""

from vescale.checkpoint.__about__ import __version__
from vescale.checkpoint._api import (
    CheckpointMismatchError,
    LoadResult,
    SaveHandle,
    free_staging_buffers,
    load,
    save,
    storage_for,
    wait_pending,
)
from vescale.checkpoint._chunked import ChunkedTensor
from vescale.checkpoint._compat import check_torch_internals
from vescale.checkpoint._export import export
from vescale.checkpoint._hf import load_hf
from vescale.checkpoint._storage import (
    CheckpointCorruptError,
    CheckpointError,
    IncompleteCheckpointError,
    VescaleFileSystemReader,
    VescaleFileSystemWriter,
    is_complete,
    read_manifest,
    resolve_checkpoint,
)
from vescale.dtensor.chunks import flat_range_boxes, local_boxes

__all__ = [
    "__version__",
    "check_torch_internals",
    "save",
    "load",
    "export",
    "load_hf",
    "wait_pending",
    "free_staging_buffers",
    "SaveHandle",
    "LoadResult",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "IncompleteCheckpointError",
    "ChunkedTensor",
    "VescaleFileSystemWriter",
    "VescaleFileSystemReader",
    "storage_for",
    "is_complete",
    "read_manifest",
    "resolve_checkpoint",
    "local_boxes",
    "flat_range_boxes",
]
