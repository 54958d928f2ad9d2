"""``CommDebugMode``: torch's collective counter, plus the bytes each rank sends.

`CommDebugMode` subclasses
`torch.distributed.tensor.debug.CommDebugMode`, so ``get_total_counts()``
and ``get_comm_counts()`` behave exactly as torch's (keys are the functional
collective op packets, e.g. ``torch.ops.c10d_functional.all_gather_into_tensor``,
or ``torch.ops.c10d.allreduce_`` for eager ``torch.distributed`` calls). It
additionally records, under the same keys, the bytes this rank sends.

"Bytes sent per rank" is the cost of the standard ring algorithm on a group of
``N`` ranks (rounded down to an integer):

| collective | bytes this rank sends |
| --- | --- |
| all_gather | `(N-1)/N * output bytes` (= `(N-1) *` input bytes) |
| reduce_scatter | `(N-1)/N * input bytes` |
| all_reduce | `2 * (N-1)/N * bytes` |
| all_to_all | bytes of the input destined to *other* ranks |
| broadcast | `bytes` (on every rank) |
| gather / scatter | non-root: input bytes / root: `(N-1)/N *` input bytes |
| reduce | `bytes` |

Coalesced variants add up their tensors. This covers torch's functional
collectives (what DTensor redistribution issues), the eager
``torch.distributed`` collectives (seen as ``c10d`` ops) and therefore
everything in `vescale.dtensor.collectives`.

``visualize_sharding`` is torch's, re-exported for veScale programs (built-in
placements only).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode as _TorchCommDebugMode
from torch.distributed.tensor.debug import visualize_sharding

from vescale.dtensor._compat import COMM_OP_ALIASES, resolve_group_name

__all__ = ["CommDebugMode", "collective_bytes_sent", "visualize_sharding"]

_GATHER = {
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "allgather",
    "allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
}
_REDUCE_SCATTER = {
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter",
    "reduce_scatter_base",
}
_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced", "allreduce", "allreduce_coalesced"}
_INPUT_NAMES = (
    "input",
    "inputs",
    "input_tensor",
    "input_tensors",
    "input_list",
    "shard",
    "self",
    "tensors",
    "tensor",
)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(kwargs)
    for arg, value in zip(func._schema.arguments, args):
        bound[arg.name] = value
    return bound


def _process_group(bound: dict[str, Any]) -> dist.ProcessGroup | None:
    pg = bound.get("process_group")
    if pg is None and "group_name" in bound:
        name = bound["group_name"]
        pg = name if isinstance(name, dist.ProcessGroup) else resolve_group_name(name)
    if pg is not None and not isinstance(pg, dist.ProcessGroup):
        pg = dist.ProcessGroup.unbox(pg)  # c10d ops carry a boxed TorchScript object
    return pg


def _group(bound: dict[str, Any]) -> tuple[int, int]:
    """Return (group size, this rank's index in the group)."""
    pg = _process_group(bound)
    if pg is not None:
        return pg.size(), pg.rank()
    ranks = list(bound.get("ranks") or [])
    size = int(bound.get("group_size") or len(ranks) or 1)
    me = ranks.index(dist.get_rank()) if ranks and dist.get_rank() in ranks else 0
    return size, me


def collective_bytes_sent(func: Any, args: tuple, kwargs: dict | None = None) -> int:
    """Bytes this rank sends for one collective call, by the ring cost model above.

    Args:
        func: The op overload (functional ``_c10d_functional``/``c10d_functional``
            collective or eager ``c10d`` op).
        args: Its positional arguments.
        kwargs: Its keyword arguments.

    Returns:
        The byte count (``0`` for ops it does not know).
    """
    bound = _bind(func, args, kwargs or {})
    name = func._schema.name.split("::")[-1].strip("_")
    n, me = _group(bound)
    inputs = next((bound[k] for k in _INPUT_NAMES if k in bound), None)
    size = _nbytes(inputs)
    if n <= 1:
        return 0
    if name in _GATHER:
        return (n - 1) * size
    if name in _REDUCE_SCATTER:
        return (n - 1) * size // n
    if name in _ALL_REDUCE:
        return 2 * (n - 1) * size // n
    if name in ("all_to_all_single", "alltoall_base"):
        x = inputs if isinstance(inputs, torch.Tensor) else _tensors(inputs)[0]
        splits = list(bound.get("input_split_sizes") or [])
        if not splits or x.ndim == 0 or x.shape[0] == 0:
            return (n - 1) * size // n
        row = size // x.shape[0]
        return row * (sum(splits) - splits[me])
    if name == "alltoall":
        pieces = _tensors(inputs)
        return sum(_nbytes(t) for j, t in enumerate(pieces) if j != me)
    if name == "shard_dim_alltoall":
        return (n - 1) * size // n
    if name in ("broadcast", "reduce"):
        return size
    if name == "gather":
        return 0 if bound.get("root_rank") == me else size
    if name == "scatter":
        return (n - 1) * size // n if bound.get("root_rank") == me else 0
    return 0


class CommDebugMode(_TorchCommDebugMode):
    """Count collectives (as torch does) and the bytes this rank sends.

    Example:
        ```python
        with CommDebugMode() as comm:
            dt.redistribute(mesh, [Replicate()])
        comm.get_comm_counts()  # {c10d_functional.all_gather_into_tensor: 1}
        comm.get_comm_bytes()   # {c10d_functional.all_gather_into_tensor: 3 * local_bytes} (N = 4)
        ```
    """

    def __init__(self) -> None:
        super().__init__()
        self.comm_bytes: dict[Any, int] = defaultdict(int)
        self.comm_bytes_by_group: dict[tuple[int, ...], int] = defaultdict(int)

    def __enter__(self) -> CommDebugMode:
        self.comm_bytes.clear()
        self.comm_bytes_by_group.clear()
        super().__enter__()
        return self

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() != before:
            packet = func._overloadpacket
            key = COMM_OP_ALIASES.get(packet, packet)
            sent = collective_bytes_sent(func, args, kwargs)
            self.comm_bytes[key] += sent
            pg = _process_group(_bind(func, args, kwargs or {}))
            ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else ()
            self.comm_bytes_by_group[ranks] += sent
        return out

    def get_comm_bytes(self) -> dict[Any, int]:
        """Bytes this rank sent per collective op (same keys as ``get_comm_counts``)."""
        return self.comm_bytes

    def get_comm_bytes_by_group(self) -> dict[tuple[int, ...], int]:
        """Bytes this rank sent per process group, keyed by the group's global ranks.

        Separates, e.g., the data-parallel traffic of a ``("dp", "tp")`` mesh from its
        tensor-parallel traffic.
        """
        return self.comm_bytes_by_group

    def get_total_bytes(self) -> int:
        """Bytes this rank sent over all collectives."""
        return sum(self.comm_bytes.values())
