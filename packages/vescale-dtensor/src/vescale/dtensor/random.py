"""Random numbers on distributed tensors that equal one device's.

With one ``torch.manual_seed(s)`` on every rank, random ops on DTensors (dropout,
``rand_like``, ``randn_like``, ``randint_like``, ``bernoulli``, ``uniform_``,
``normal_``, ``exponential_``, ...) give every rank exactly its slice of the values
one device would draw for the whole tensor, for every placement (``Shard``, nested
``Shard`` on several mesh dims, ``Replicate``, ``Partial`` where the op is linear,
plugin placements such as ``RaggedShard``), on CPU and on CUDA; the generator then
stands where one device's would, so later random ops match too. Each rank draws
the full tensor once per op and keeps its part: see ``docs/consistency.md`` for the
cost and `set_single_device_rng` to turn it off.

Data parallelism splits the batch between ranks outside any DTensor; wrap the
forward in `data_parallel_rng` to draw the global batch's values there too.
`microbatch_rng` does the same for one micro-batch of a batch (pipeline parallelism,
gradient accumulation); the two nest.

``manual_seed(seed, device_mesh)`` is veScale's entry: it checks that every rank
passes the same seed, then seeds the default generator (and torch's DTensor tracker
where the device has one).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vescale.dtensor import _compat, _rng

__all__ = [
    "manual_seed",
    "set_single_device_rng",
    "is_single_device_rng",
    "data_parallel_rng",
    "microbatch_rng",
    "RandomOpCount",
]

#: What `microbatch_rng` yields: ``random_ops``, the number of random ops run inside.
RandomOpCount = _rng.RegionStats

_LAYOUTS = ("block", "interleaved")


def manual_seed(seed: int, device_mesh: DeviceMesh, tp_dim: int = 0) -> None:
    """Seed random numbers for DTensor ops on ``device_mesh`` (a collective).

    Args:
        seed: The seed; must be the same on every rank.
        device_mesh: The mesh the random DTensors live on; must include this rank.
        tp_dim: veScale's tensor-parallel mesh dim. Accepted for veScale programs:
            vescale draws random DTensor values as one device would, the same on
            every rank, so it changes nothing.

    Raises:
        TypeError: ``seed`` is not an int or ``device_mesh`` not a DeviceMesh.
        ValueError: This rank is not in ``device_mesh``, ``tp_dim`` is not a mesh dim,
            or ranks passed different seeds (every rank raises, naming them).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed must be an int, got {seed!r}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"manual_seed: expected a DeviceMesh, got {type(device_mesh).__name__}")
    if device_mesh.get_coordinate() is None:
        raise ValueError(f"manual_seed: this rank is not part of {device_mesh}")
    if not -device_mesh.ndim <= tp_dim < device_mesh.ndim:
        raise ValueError(
            f"manual_seed: tp_dim={tp_dim} is not a dim of the {device_mesh.ndim}-dim mesh"
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        seeds: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seeds, seed)
        if len(set(seeds)) != 1:
            raise ValueError(
                f"manual_seed: every rank must pass the same seed, got {seeds} (by rank)"
            )
    torch.manual_seed(seed)
    _compat.seed_dtensor_rng(seed, device_mesh)


def set_single_device_rng(enabled: bool) -> bool:
    """Turn one-device-equal random DTensor ops on (the default) or off.

    Off, torch's own behaviour returns: on CUDA its offset-based tracker draws only
    the local shard (cheaper; the values differ from one device's), on CPU every rank
    draws its local shape from its own generator.

    Args:
        enabled: ``True`` to draw as one device would.

    Returns:
        The previous setting.

    Raises:
        TypeError: ``enabled`` is not a bool.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"set_single_device_rng: expected a bool, got {enabled!r}")
    return _rng.enable(enabled)


def is_single_device_rng() -> bool:
    """Whether random DTensor ops draw as one device would (``False`` also where this
    torch lacks the hook; see ``vescale.dtensor._compat.check_torch_internals()``)."""
    return _rng.is_enabled()


@contextlib.contextmanager
def data_parallel_rng(
    device_mesh: DeviceMesh,
    dims: str | int | Sequence[str | int],
    *,
    batch_dim: int = 0,
    layout: str = "block",
) -> Iterator[None]:
    """Draw random values inside the block as one device running the global batch would.

    Under data parallelism (DDP, FSDP, HSDP; alone or with TP/SP) each rank computes
    on its part of the batch, so its activations are plain tensors (or DTensors
    replicated over the data dims) whose shape holds only the local batch. Inside this
    context every random op's tensor is taken as this rank's part of the global batch
    along ``batch_dim``: the op draws the global batch's values (on every rank) and
    keeps this rank's rows, so masks equal a single device's on the whole batch.

    Args:
        device_mesh: The mesh whose ``dims`` split the batch.
        dims: The data-parallel mesh dim(s), by name or index; with several, the
            batch is split over them in the order given (row-major).
        batch_dim: The batch dim of every tensor that random ops run on.
        layout: ``"block"``: data rank ``r`` of ``n`` holds global rows
            ``[r*b, (r+1)*b)`` (``tensor.chunk(n)[r]``); ``"interleaved"``: its row
            ``j`` is global row ``j*n + r`` (``DistributedSampler`` without shuffling
            inside a step, as in ``examples/gpt``).

    Raises:
        ValueError: An unknown dim or layout, or this rank is not in ``device_mesh``.
        NotImplementedError: This torch lacks the dispatch-mode hook it needs.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(
            f"data_parallel_rng: expected a DeviceMesh, got {type(device_mesh).__name__}"
        )
    if layout not in _LAYOUTS:
        raise ValueError(f"data_parallel_rng: layout must be one of {_LAYOUTS}, got {layout!r}")
    names = tuple(device_mesh.mesh_dim_names or ())
    idx = []
    for d in [dims] if isinstance(dims, (str, int)) else list(dims):
        if isinstance(d, str):
            if d not in names:
                raise ValueError(
                    f"data_parallel_rng: {d!r} is not a mesh dim; the mesh dims are {list(names)}"
                )
            d = names.index(d)
        if not -device_mesh.ndim <= d < device_mesh.ndim:
            raise ValueError(
                f"data_parallel_rng: mesh dim {d} is out of range for a {device_mesh.ndim}-dim mesh"
            )
        idx.append(d % device_mesh.ndim)
    n, r = _rng.rank_in_dims(device_mesh, idx)
    dim_names = [names[d] for d in idx] if names else []
    with _rng.data_parallel_region(n, r, batch_dim, layout, dim_names):
        yield


@contextlib.contextmanager
def microbatch_rng(index: int, microbatches: int, *, batch_dim: int = 0) -> Iterator[RandomOpCount]:
    """Draw random values inside the block as for the whole batch; keep one micro-batch's.

    The batch is cut into ``microbatches`` equal micro-batches along ``batch_dim``
    (``batch.chunk(microbatches)``); the code inside computes micro-batch ``index``.
    Every random op inside draws the values one device would draw for the whole
    batch (its tensor's ``batch_dim`` widened ``microbatches`` times) and keeps rows
    ``[index * b, (index + 1) * b)``. Run every micro-batch from the same generator
    state (``torch.get_rng_state()`` before the first, ``torch.set_rng_state`` before
    each) and the masks are exactly the whole batch's: this is how
    ``vescale.dmodule.pipeline_parallelize`` matches one device under pipeline
    parallelism. Inside `data_parallel_rng` the two compose (micro-batch of this
    rank's part of the global batch, in that rank's layout).

    Args:
        index: The micro-batch computed inside (``0 <= index < microbatches``).
        microbatches: How many micro-batches the batch is cut into; ``1`` draws as
            usual and only counts.
        batch_dim: The batch dim of every tensor that random ops run on.

    Yields:
        A `RandomOpCount` whose ``random_ops`` counts the random ops run inside.

    Raises:
        ValueError: ``index`` or ``microbatches`` out of range.
        NotImplementedError: This torch lacks the dispatch-mode hook it needs.
    """
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatch_rng: microbatches must be an int >= 1, got {microbatches!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < microbatches:
        raise ValueError(
            f"microbatch_rng: index must be an int in [0, {microbatches}), got {index!r}"
        )
    with _rng.data_parallel_region(microbatches, index, batch_dim, "block") as stats:
        yield stats
