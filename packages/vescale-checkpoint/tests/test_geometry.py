"""Box decomposition of flat ranges and of composed placements (no process group)."""

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from vescale.checkpoint import flat_range_boxes, local_boxes
from vescale.dtensor import application_order
from vescale.dtensor.chunks import UnsupportedLayout
from vescale.ragged import RaggedShard


def _gather(full: torch.Tensor, boxes) -> torch.Tensor:
    parts = []
    for b in boxes:
        offsets, sizes = (b.offsets, b.sizes) if hasattr(b, "offsets") else b
        idx = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        parts.append(full[idx].reshape(-1))
    return torch.cat(parts) if parts else full.new_empty(0)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (2, 1, 3, 2)])
def test_flat_range_boxes_exhaustive(shape):
    full = torch.arange(math.prod(shape)).reshape(shape)
    n = full.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            boxes = flat_range_boxes(shape, a, b)
            assert torch.equal(_gather(full, boxes), torch.arange(a, b))
            assert len(boxes) <= 2 * len(shape) - 1 or b == a


def _expected_local(full, mesh_shape, coord, placements):
    """Apply each placement's local selection to an index tensor (no communication).

    In application order: a Shard applies before a plugin placement that would cut
    through its (global) dim.
    """
    t = full
    for i in application_order(placements, full.ndim):
        p = placements[i]
        n, c = mesh_shape[i], coord[i]
        if isinstance(p, Replicate):
            continue
        if type(p) is Shard:
            t = list(torch.chunk(t, n, dim=p.dim))
            t = t[c] if c < len(t) else full.new_empty(0)
            continue
        t = p.shard(t, n, c)
    return t


CASES = [
    ((6, 5), (2, 2), [Replicate(), RaggedShard((0, 1), (1, 2))]),
    ((8, 6), (2, 2), [Shard(1), RaggedShard((0,), (3, 1))]),
    ((8, 6), (2, 2), [Shard(0), Shard(1)]),
    ((6, 5), (2, 2), [RaggedShard((0,), (1, 1)), Shard(1)]),
    ((4, 6, 2), (3, 2), [RaggedShard((0, 1), (1, 0, 2)), Shard(1)]),  # Shard(1) first
    ((4, 6), (2, 2), [RaggedShard((0,), (1, 1)), Shard(0)]),  # veScale's FSDP x TP
    ((4, 6), (2, 3), [RaggedShard((0, 1), (1, 3)), RaggedShard((0,), (2, 1, 0))]),
    ((5, 3), (3,), [RaggedShard((), (0, 1, 0))]),
    ((10,), (4,), [Shard(0)]),
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES)
def test_local_boxes_match_local_selection(shape, mesh_shape, placements):
    full = torch.arange(math.prod(shape)).reshape(shape)
    seen = torch.zeros(full.numel(), dtype=torch.int64)
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        local = _expected_local(full, mesh_shape, coord, placements)
        boxes, local_shape = local_boxes(shape, mesh_shape, coord, placements)
        assert tuple(local.shape) == tuple(local_shape)
        assert torch.equal(_gather(full, boxes), local.reshape(-1))
        for b in boxes:
            assert local.reshape(-1)[b.local_start] == _gather(full, [b])[0]
        seen[local.reshape(-1)] += 1
    replication = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
    assert torch.all(seen == replication)


def test_unsupported_layout_is_reported():
    with pytest.raises(UnsupportedLayout, match="cannot be saved as boxes"):
        local_boxes((4, 6), (2, 2), (0, 0), [RaggedShard((0,), (1, 1)), Partial()])
