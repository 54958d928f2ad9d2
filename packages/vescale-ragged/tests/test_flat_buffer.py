"""``FlatBuffer`` on 1, 2 and 4 gloo ranks: views, zero-copy all-gather and reduce-scatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from vescale.dtensor import Replicate
from vescale.dtensor.testing import distributed
from vescale.ragged import RaggedShard
from vescale.ragged._flat_buffer import FlatBuffer
from vescale.ragged._planner import ParamSpec, plan_flat_buffers

SPECS = [
    ParamSpec("emb", (37, 8), torch.float32, "row"),
    ParamSpec("scalar", (), torch.float32),
    ParamSpec("w_q", (64, 16), torch.float32, (32, 8)),
    ParamSpec("bias", (13,), torch.float32),
    ParamSpec("cube", (3, 5, 7), torch.float32),
    ParamSpec("half", (9, 4), torch.bfloat16, "row"),
]


def _dense(seed: int = 1) -> dict[str, torch.Tensor]:
    # Small integers: sums are exact in any order, in fp32 and bf16.
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randint(-8, 9, s.shape, generator=g).to(s.dtype) for s in SPECS}


def _check_buffers(mesh, mesh_dim, weights=None, order="given"):
    n = mesh.size(mesh_dim)
    dense = _dense()
    grads = _dense(seed=2)
    for _dtype, layout in plan_flat_buffers(SPECS, n, weights=weights, order=order).items():
        offsets = [p.offset for p in layout.params]
        assert offsets == sorted(offsets)  # params are listed in buffer order
        fb = FlatBuffer(layout, mesh, mesh_dim)
        fb.load_full(dense)
        r = fb.rank
        base = fb.local.data_ptr()
        item = fb.local.element_size()
        # parameter views are the right slices of the dense parameters, views of one storage
        for name in layout.names:
            view = fb.local_view(name)
            assert torch.equal(view, layout.shard_of(name, dense[name], r))
            dt = fb.dtensor(name, requires_grad=True)
            assert (
                dt.to_local().data_ptr() == base + layout.local_range(name, r)[0] * item
                or not view.numel()
            )
            assert isinstance(dt.placements[mesh_dim], RaggedShard)
            assert all(p == Replicate() for i, p in enumerate(dt.placements) if i != mesh_dim)
            assert torch.equal(dt.full_tensor(), dense[name])
        # all-gather: one collective straight into the destination
        out = fb.new_full_buffer()
        ptr = out.data_ptr()
        got = fb.all_gather(out)
        assert got is out and out.data_ptr() == ptr
        views = fb.full_views(out)
        for name in layout.names:
            assert torch.equal(views[name], dense[name])
            assert (
                views[name].data_ptr() == ptr + layout[name].offset * item
                or not views[name].numel()
            )
        if layout.even and n > 1:
            assert fb.extra_copy_bytes == 0
        if n == 1:
            assert fb.all_gather() is fb.local
        # the same gather as broadcasts (gloo's fast path): from a separate slice (one
        # copy in), or packed in place (no copy)
        for in_place in (False, True):
            out2 = torch.full_like(out, -99)
            a, b = layout.rank_ranges[r]
            src = out2[a:b] if in_place else fb.local.clone()
            if in_place:
                src.copy_(fb.local)
            fb.extra_copy_bytes = 0
            work = fb.broadcast_slices(out2, src=src, async_op=True)
            assert work.wait() is out2
            assert fb.extra_copy_bytes == (0 if in_place or a == b else (b - a) * item)
            for name, v in fb.full_views(out2).items():
                assert torch.equal(v, dense[name]), name
        # ... and one broadcast per piece, straight into per-parameter tensors that hold
        # only this rank's pieces
        dst = {}
        for name in layout.names:
            t = torch.full((layout[name].numel,), -99, dtype=layout.dtype)
            lo, hi = layout.piece(name, r)
            off = layout[name].offset
            t[lo - off : hi - off] = fb.local_view(name).reshape(-1)
            dst[name] = t
        assert fb.broadcast_pieces(dst) is None
        assert fb.num_pieces() == sum(
            1 for name in layout.names for q in range(n) if len(range(*layout.piece(name, q)))
        )
        for name in layout.names:
            assert torch.equal(dst[name].view(dense[name].shape), dense[name]), name
        # reduce-scatter: each rank's gradients are (rank + 1) * grads
        gflat = fb.new_full_buffer(zero=True)
        for name, v in fb.full_views(gflat).items():
            v.copy_(grads[name] * (dist.get_rank() + 1))
        shard = torch.empty_like(fb.local)
        sptr = shard.data_ptr()
        fb.extra_copy_bytes = 0
        res = fb.reduce_scatter(gflat, shard)
        assert res is shard and shard.data_ptr() == sptr
        if layout.even and n > 1:
            assert fb.extra_copy_bytes == 0
        scale = sum(q + 1 for q in dist.get_process_group_ranks(mesh.get_group(mesh_dim)))
        for name in layout.names:
            expect = layout.shard_of(name, grads[name] * scale, r)
            torch.testing.assert_close(fb.local_view(name, shard), expect, rtol=0, atol=0)


# Everything runs in the 4-rank worker pool (started once, shared with other test
# files): 1- and 2-rank cases use a mesh dim of that size inside a 2-D mesh.
@distributed(4)
def test_flat_buffer_one_rank():
    mesh = DeviceMesh("cpu", [[0], [1], [2], [3]])
    _check_buffers(mesh, 1)


@distributed(4)
def test_flat_buffer_two_ranks():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    _check_buffers(mesh, 1)


@distributed(4)
def test_flat_buffer_four_ranks():
    _check_buffers(init_device_mesh("cpu", (4,)), 0)


@distributed(4)
def test_flat_buffer_four_ranks_reordered_layout():
    # order="auto" may move parameters inside a buffer: views, gather and
    # reduce-scatter go by each parameter's offset, not by the order of the specs
    _check_buffers(init_device_mesh("cpu", (4,)), 0, order="auto")


@distributed(4)
def test_flat_buffer_weighted_uneven_slices():
    _check_buffers(init_device_mesh("cpu", (4,)), 0, weights=(1, 3, 0, 2))


@distributed(4)
def test_flat_buffer_on_named_dim_of_2d_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # Gradients are summed over dp only: each dp group holds ranks of equal tp coordinate.
    n = 2
    dense = _dense()
    layout = plan_flat_buffers(SPECS, n)[torch.float32]
    fb = FlatBuffer(layout, mesh, "dp")
    assert fb.mesh_dim == 0 and fb.rank == mesh.get_local_rank(0)
    fb.load_full(dense)
    out = fb.all_gather()
    for name, v in fb.full_views(out).items():
        assert torch.equal(v, dense[name])
        dt = fb.dtensor(name)
        assert dt.placements[1] == Replicate()
        assert torch.equal(dt.full_tensor(), dense[name])
    gflat = fb.new_full_buffer(zero=True)
    gflat.fill_(float(mesh.get_local_rank(0) + 1))
    shard = fb.reduce_scatter(gflat)
    for name in layout.names:
        assert torch.all(fb.local_view(name, shard) == 3.0)


@distributed(4)
def test_constructor_validation():
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("pp", "dp"))["dp"]
    layout = plan_flat_buffers(SPECS[:2], 2)[torch.float32]
    with pytest.raises(TypeError, match="FlatLayout"):
        FlatBuffer(object(), mesh)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no dim named 'tp'"):
        FlatBuffer(layout, mesh, "tp")
    with pytest.raises(ValueError, match="planned for 4 ranks"):
        FlatBuffer(plan_flat_buffers(SPECS[:2], 4)[torch.float32], mesh)
    with pytest.raises(ValueError, match="1-D and contiguous"):
        FlatBuffer(layout, mesh, local=torch.zeros(3))
    fb = FlatBuffer(layout, mesh)
    with pytest.raises(ValueError, match="out must be"):
        fb.all_gather(torch.zeros(2))
    with pytest.raises(KeyError, match="'nope'"):
        fb.local_view("nope")


@distributed(4)
def test_load_full_from_scatters_the_source_ranks_values():
    """Every rank's shard holds the source rank's values (each rank has other ones), for
    even and weighted (uneven) layouts, on a named dim of a 2-D mesh; a bad source is a
    ValueError before any communication."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    mine = _dense(seed=10 + dist.get_rank())
    for weights in (None, [1.0, 3.0]):
        for _dtype, layout in plan_flat_buffers(SPECS, 2, weights=weights).items():
            fb = FlatBuffer(layout, mesh, "b")
            for src in (0, 1):
                fb.local.fill_(-100)
                # the source on dim "b" shares this rank's coordinate on "a"
                coord = mesh.get_coordinate()
                want = _dense(seed=10 + mesh.mesh[coord[0], src].item())
                fb.load_full_from(mine if fb.rank == src else None, src)
                for name in layout.names:
                    assert torch.equal(
                        fb.local_view(name), layout.shard_of(name, want[name], fb.rank)
                    ), (weights, src, name)
            with pytest.raises(ValueError, match=r"src=2 is not in \[0, 2\)"):
                fb.load_full_from(mine, 2)
