"""The flat-buffer engine's collectives: async, other dtypes, all-reduce, buckets.

One 4-rank body on a 2x2 mesh (``dp`` x ``rep``) checks what FSDP, DDP and
DistributedOptimizer ask of `FlatBuffer` beyond `test_flat_buffer.py`: a gather of a
compute-dtype copy of the shard, async reduce-scatter with ``avg``, all-reduce of an
unsharded buffer (trailing padding not sent) and of a slice over another mesh dim, and
the uneven (weighted) path through ``vescale.dtensor.collectives``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor import init_device_mesh
from vescale.dtensor.testing import distributed
from vescale.ragged import FlatBuffer, FlatWork, ParamSpec, bucket_specs, plan_flat_buffers

SPECS = [
    ParamSpec("w", (5, 3), torch.float32),
    ParamSpec("b", (8,), torch.float32),
    ParamSpec("v", (2, 2), torch.float32),
]


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randint(-8, 9, s.shape, generator=g).float() for s in SPECS}


def test_bucket_specs_groups_by_dtype_and_cap():
    specs = [
        ParamSpec("a", (4,), torch.float32),  # 16 B
        ParamSpec("h", (4,), torch.bfloat16),  # 8 B
        ParamSpec("c", (4,), torch.float32),  # a + c = 32 B: fits a 32 B cap
        ParamSpec("d", (1,), torch.float32),  # would make 36 B: new bucket
        ParamSpec("big", (100,), torch.float32),  # larger than the cap: a bucket of its own
    ]
    names = [[s.name for s in b] for b in bucket_specs(specs, 32)]
    assert names == [["a", "c"], ["h"], ["d"], ["big"]]
    assert [[s.name for s in b] for b in bucket_specs(specs)] == [["a", "c", "d", "big"], ["h"]]


@distributed(4)
def test_flat_buffer_engine_collectives():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "rep"))
    dp = mesh.get_local_rank(0)
    dense = _full(1)
    (layout,) = plan_flat_buffers(SPECS, 2).values()
    assert layout.even and layout.padding > 0  # 27 elements in 2 slices of 14
    fb = FlatBuffer(layout, mesh, "dp")
    fb.load_full(dense)

    # all-gather of a bf16 copy of the shard, async, straight into a bf16 buffer
    src = fb.local.to(torch.bfloat16)
    out = fb.new_full_buffer(dtype=torch.bfloat16)
    work = fb.all_gather(out, src=src, async_op=True)
    assert isinstance(work, FlatWork)
    assert work.wait() is out and work.is_completed()
    for name, v in fb.full_views(out).items():
        assert torch.equal(v, dense[name].bfloat16())
    with pytest.raises(ValueError, match="dtype"):
        fb.all_gather(fb.new_full_buffer(), src=src)

    # async reduce-scatter (avg) of an fp32 gradient buffer into a new slice
    grads = fb.new_full_buffer(zero=True)
    for name, v in fb.full_views(grads).items():
        v.copy_(dense[name] * (dp + 1))
    shard = fb.reduce_scatter(grads, op="avg", async_op=True).wait()
    for name in layout.names:
        expect = layout.shard_of(name, dense[name] * 1.5, dp)
        assert torch.equal(fb.local_view(name, shard), expect)

    # all-reduce of an unsharded buffer over dp: the trailing padding is not sent
    buf = fb.new_full_buffer()
    buf.fill_(float(dist.get_rank()))
    assert fb.all_reduce(buf, op="sum") is buf
    stop = max(p.stop for p in layout.params)
    peer = dist.get_process_group_ranks(mesh.get_group("dp"))
    assert torch.all(buf[:stop] == float(sum(peer)))
    assert torch.all(buf[stop:] == float(dist.get_rank()))
    # ... and of a slice over the other mesh dim (HSDP's replicate dim), async
    piece = fb.new_slice()
    piece.fill_(float(dist.get_rank()))
    reps = dist.get_process_group_ranks(mesh.get_group("rep"))
    assert fb.all_reduce(piece, op="avg", mesh_dim="rep", async_op=True).wait() is piece
    assert torch.all(piece == sum(reps) / 2)
    with pytest.raises(ValueError, match="expected the unsharded buffer"):
        fb.all_reduce(torch.zeros(3))
    with pytest.raises(ValueError, match="op must be one of"):
        fb.all_reduce(buf, op="prod")

    # uneven (weighted) slices: the same calls, through vescale.dtensor.collectives
    (wl,) = plan_flat_buffers(SPECS, 2, weights=(1, 3)).values()
    assert not wl.even
    wfb = FlatBuffer(wl, mesh, 0)
    wfb.load_full(dense)
    full = wfb.all_gather(async_op=True).wait()
    for name, v in wfb.full_views(full).items():
        assert torch.equal(v, dense[name])
    wgrads = wfb.new_full_buffer()
    for name, v in wfb.full_views(wgrads).items():
        v.copy_(dense[name] * (dp + 1))
    wshard = wfb.reduce_scatter(wgrads, op="sum", async_op=True).wait()
    for name in wl.names:
        assert torch.equal(wfb.local_view(name, wshard), wl.shard_of(name, dense[name] * 3, dp))
