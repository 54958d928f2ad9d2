"""RaggedShard: validation, geometry, DTensor API, ops and optimizers against dense torch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    placement_registry,
)
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed
from vescale.ragged import RaggedShard


def test_registered_through_entry_point_only():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vescale")}
    assert eps.get("ragged") == "vescale.ragged._plugin"
    assert placement_registry()["RaggedShard"] is RaggedShard
    import vescale.dtensor as vd

    src = open(vd.__file__).read() + open(vd.api.__file__).read()
    assert "vescale.ragged" not in src  # the host never imports the plugin


def test_validation_errors():
    with pytest.raises(ValueError, match="leading prefix"):
        RaggedShard((1,), (1, 1))
    with pytest.raises(ValueError, match=">= 0"):
        RaggedShard((0,), (1, -1))
    with pytest.raises(ValueError, match="all zero"):
        RaggedShard((0,), (0, 0))
    with pytest.raises(ValueError, match="one entry per rank"):
        RaggedShard((0,), ())
    p = RaggedShard((0,), (1, 2, 1, 1))
    with pytest.raises(ValueError, match=r"shape \(7, 3\).*sum\(local_units\)=5 \(remainder 2\)"):
        p.check_shape((7, 3), 4)
    with pytest.raises(ValueError, match="4 local_units for a mesh dim of 2 ranks"):
        p.check_shape((10, 3), 2)
    with pytest.raises(ValueError, match="flattens dims"):
        RaggedShard((0, 1, 2), (1,)).check_shape((4, 4), 1)
    assert str(p) == "RS(0;1,2,1,1)"
    assert repr(p) == "RaggedShard(dims=(0,), local_units=(1, 2, 1, 1))"
    assert eval(repr(p)) == p and hash(eval(repr(p))) == hash(p)


def test_geometry():
    p = RaggedShard((0, 1), (1, 0, 3))
    assert p.ranges((4, 2, 5)) == [(0, 2), (2, 2), (2, 8)]
    assert p.local_shape((4, 2, 5), 3, 0) == (2, 5)
    assert p.local_shape((4, 2, 5), 3, 1) == (0, 5)
    assert p.local_dim(2, 3) == 1 and p.local_dim(1, 3) is None
    x = torch.arange(40).reshape(4, 2, 5)
    assert torch.equal(p.shard(x, 3, 2), x.reshape(8, 5)[2:8])
    root = RaggedShard((), (0, 1, 0))
    assert root.local_shape((3, 4), 3, 1) == (1, 3, 4)
    assert root.local_shape((3, 4), 3, 0) == (0, 3, 4)


DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_distribute_from_local_full_tensor(world):
    distributed(world)(_api_body)()


def _api_body():
    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    units = tuple(range(n)) if n > 1 else (1,)  # rank 0 owns nothing when n > 1
    for dtype in DTYPES:
        x = (torch.arange(6 * 4 * sum(units)) % 7).reshape(6 * sum(units), 4).to(dtype)
        for dims in [(0,), (0, 1)]:
            p = RaggedShard(dims, units)
            d = distribute_tensor(x, mesh, [p])
            a, b = p.ranges(tuple(x.shape))[dist.get_rank()]
            flat = x.reshape(-1, *x.shape[len(dims) :])
            assert torch.equal(d.to_local(), flat[a:b]), (dtype, dims)
            assert torch.equal(d.full_tensor(), x), (dtype, dims)
            e = DTensor.from_local(d.to_local(), mesh, [p], shape=x.shape, stride=x.stride())
            assert torch.equal(e.full_tensor(), x)
            if dims == (0,):  # whole rows: the global shape can be inferred
                assert DTensor.from_local(d.to_local(), mesh, [p]).shape == x.shape


@distributed(4)
def test_backward_and_comm_volume():
    mesh = init_device_mesh("cpu", (4,))
    x = torch.randn(12, 5)
    w = torch.randn(12, 5)
    p = RaggedShard((0,), (2, 0, 1, 3))
    rep = distribute_tensor(x, mesh, [Replicate()])
    with CommDebugMode() as cm:
        d = rep.redistribute(mesh, [p])
    assert cm.get_total_counts() == 0  # Replicate -> RaggedShard moves no data
    leaf = d.detach().requires_grad_()
    with CommDebugMode() as cm:
        y = leaf.redistribute(mesh, [RaggedShard((0, 1), (1, 1, 1, 1))])
    assert cm.get_total_counts() == 1  # RaggedShard -> RaggedShard: one all-to-all
    (y.full_tensor() * w).sum().backward()
    assert leaf.grad.placements == (p,)
    assert torch.equal(leaf.grad.full_tensor(), w)
    part = DTensor.from_local(x * (dist.get_rank() + 1), mesh, [Partial()])
    with CommDebugMode() as cm:
        rs = part.redistribute(mesh, [p])
    counts = {str(k).split(".")[-1].rstrip("')"): v for k, v in cm.get_comm_counts().items()}
    assert counts == {"reduce_scatter_tensor": 1}  # not all_reduce + slice
    assert torch.allclose(rs.full_tensor(), x * 10)


@distributed(4)
def test_ops_norms_and_clip_grad_norm():
    mesh = init_device_mesh("cpu", (4,))
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    p = RaggedShard((0, 1), (3, 0, 2, 3))
    dx, dy = distribute_tensor(x, mesh, [p]), distribute_tensor(y, mesh, [p])
    with CommDebugMode() as cm:
        z = (dx * dy - dx).abs()
        z.add_(1.0).mul_(dy)
        parts = torch._foreach_add([dx, dy], [dy, dx])
        s, m = dx.sum(), dx.mean()
        norms = [torch.linalg.vector_norm(dx, o) for o in (2, 1, 3, float("inf"), 0)]
    assert cm.get_total_counts() == 0  # all local
    ref_z = ((x * y - x).abs() + 1.0) * y
    assert torch.allclose(z.full_tensor(), ref_z)
    assert all(torch.equal(t.full_tensor(), x + y) for t in parts)
    assert torch.allclose(s.full_tensor(), x.sum(), atol=1e-5)
    assert torch.allclose(m.full_tensor(), x.mean(), atol=1e-6)
    for o, nrm in zip((2, 1, 3, float("inf"), 0), norms):
        assert torch.allclose(nrm.full_tensor(), torch.linalg.vector_norm(x, o), rtol=1e-6), o
    # norms over a dim fall back (correct, with communication)
    assert torch.allclose(torch.linalg.vector_norm(dx, 2, dim=1).full_tensor(), x.norm(dim=1))
    assert torch.allclose(dx.sum(0).full_tensor(), x.sum(0), atol=1e-6)
    # clip_grad_norm_ on RaggedShard gradients equals the dense result
    ref = [torch.nn.Parameter(x.clone()), torch.nn.Parameter(y.clone())]
    ref[0].grad, ref[1].grad = y.clone(), x.clone()
    ps = [torch.nn.Parameter(distribute_tensor(t, mesh, [p])) for t in (x, y)]
    ps[0].grad, ps[1].grad = dy.clone(), dx.clone()
    for norm_type in (2.0, float("inf")):
        for foreach in (False, True):
            g0 = [q.grad.clone() for q in ps]
            n_ref = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type)
            n = torch.nn.utils.clip_grad_norm_(ps, 0.5, norm_type=norm_type, foreach=foreach)
            assert abs(n.full_tensor().item() - n_ref.item()) <= 1e-6 * n_ref.item()
            for q, r in zip(ps, ref):
                assert torch.allclose(q.grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)
            for q, g in zip(ps, g0):  # restore for the next variant
                q.grad = g
            ref[0].grad, ref[1].grad = y.clone(), x.clone()


@pytest.mark.parametrize(
    "opt", ["adamw", "adamw-foreach", "adamw-fused", "sgd", "sgd-foreach", "adam-amsgrad"]
)
@distributed(4)
def test_optimizers_step_on_ragged_parameters(opt):
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(1)
    shapes = [(8, 6), (6,), (4, 3, 2)]
    dense = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    units = [(1, 2, 0, 1), (3, 0, 0, 3), (0, 1, 1, 0)]
    placements = [RaggedShard(tuple(range(len(s))), u) for s, u in zip(shapes, units)]
    sharded = [
        torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [pl]))
        for p, pl in zip(dense, placements)
    ]
    kind, _, variant = opt.partition("-")
    kw = {"foreach": variant == "foreach"} if variant != "fused" else {"fused": True}
    if variant == "amsgrad":
        kw = {"amsgrad": True}
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adam": torch.optim.Adam}[kind]
    extra = {"momentum": 0.9} if kind == "sgd" else {}
    o_ref = cls(dense, lr=0.05, **extra, **kw)
    o = cls(sharded, lr=0.05, **extra, **kw)
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(dense, grads):
            p.grad = g
        for p, g, pl in zip(sharded, grads, placements):
            p.grad = distribute_tensor(g, mesh, [pl])
        o_ref.step()
        o.step()
    for p, q, pl in zip(dense, sharded, placements):
        assert q.placements == (pl,)
        assert torch.allclose(q.full_tensor(), p.detach(), atol=1e-6), opt
    st = o.state[sharded[0]]
    if "exp_avg" in st:
        assert st["exp_avg"].placements == (placements[0],)
        assert torch.allclose(st["exp_avg"].full_tensor(), o_ref.state[dense[0]]["exp_avg"])


@distributed(2)
def test_torch_picks_foreach_for_ragged_parameters_like_dtensors():
    """torch chooses foreach kernels by exact type: RaggedShard DTensors must qualify."""
    from unittest import mock

    import torch.optim.optimizer as optim_mod

    mesh = init_device_mesh("cpu", (2,))
    ragged = torch.nn.Parameter(
        distribute_tensor(torch.randn(4, 3), mesh, [RaggedShard((0,), (1, 1))])
    )
    builtin = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    # as on a GPU: pretend CPU has foreach kernels, then ask torch what it would pick
    with mock.patch.object(optim_mod, "_get_foreach_kernels_supported_devices", lambda: ["cpu"]):
        assert optim_mod._default_to_fused_or_foreach([builtin], False) == (False, True)
        assert optim_mod._default_to_fused_or_foreach([ragged], False) == (False, True)
    from torch.utils._foreach_utils import _has_foreach_support

    assert _has_foreach_support([ragged.detach()], torch.device("cpu"))


def test_placements_pickle_and_copy():
    import copy
    import pickle

    p = RaggedShard((0, 1), (2, 0, 1))
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) is p and copy.copy(p) is p
    assert pickle.loads(pickle.dumps([p, Shard(1)])) == [p, Shard(1)]


@distributed(2)
def test_deepcopy_of_ragged_parameter():
    import copy

    mesh = init_device_mesh("cpu", (2,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [RaggedShard((0,), (1, 1))]))
    q = copy.deepcopy(p)
    assert q.placements == p.placements and q.to_local().data_ptr() != p.to_local().data_ptr()
    assert torch.equal(q.full_tensor(), p.full_tensor())
