"""Contract test: a third-party placement, installed through a real ``vescale`` entry point.

``vescale-toy-placement`` (tests/contract/toy_placement) is a separate distribution
that declares ``[project.entry-points.vescale]``; nothing in vescale imports it. These
tests prove that such a plugin gets registration, ``distribute_tensor``,
``from_local``, ``redistribute`` in every direction, ``full_tensor``, autograd, local
pointwise ops and fallback ops through the normal DTensor API.
"""

from __future__ import annotations

import itertools
from importlib.metadata import entry_points

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
    redistribute,
)
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


def _bc(dim=0, block=1):
    from vescale_toy_placement import BlockCyclic

    return BlockCyclic(dim, block)


def test_registered_only_through_entry_point():
    eps = [ep for ep in entry_points(group="vescale") if ep.name == "toy_placement"]
    assert len(eps) == 1 and eps[0].value == "vescale_toy_placement.plugin"
    reg = placement_registry()
    assert reg["toy.BlockCyclic"].__module__ == "vescale_toy_placement.placement"
    assert {"Shard", "Replicate", "Partial"} <= set(reg)


def _counts(cm) -> dict[str, int]:
    return {str(k).split(".")[-1].rstrip("')"): v for k, v in cm.get_comm_counts().items()}


def _placements_1d():
    return [Replicate(), Shard(0), Shard(1), _bc(0, 1), _bc(0, 2), _bc(1, 1)]


def _make(x: torch.Tensor, mesh, placements) -> DTensor:
    """Distribute ``x``; a Partial mesh dim gets values that sum to ``x``."""
    if any(p.is_partial() for p in placements):
        base = [Replicate() if p.is_partial() else p for p in placements]
        d = distribute_tensor(x, mesh, base)
        local = d.to_local()
        coord = mesh.get_coordinate()
        for i, p in enumerate(placements):
            if p.is_partial() and coord[i] != 0:
                local = torch.zeros_like(local)  # the value lives on coordinate 0
        return DTensor.from_local(local, mesh, placements, shape=x.shape, stride=x.stride())
    return distribute_tensor(x, mesh, placements)


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)])
@distributed(4)
def test_redistribute_all_pairs_1d(shape):
    mesh = init_device_mesh("cpu", (4,))
    x = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    srcs = _placements_1d() + [Partial()]
    for a, b in itertools.product(srcs, _placements_1d()):
        d = _make(x, mesh, [a])
        out = d.redistribute(mesh, [b])
        assert out.placements == (b,), (a, b)
        assert torch.equal(out.full_tensor(), x), (a, b)
        # and back, unless the source was Partial (not a valid target)
        if not a.is_partial():
            back = redistribute(out, mesh, [a])
            assert torch.equal(back.to_local(), d.to_local()), (a, b)


@distributed(4)
def test_gradients_come_back_in_source_placement():
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x = torch.randn(7, 5)
    w = torch.randn(7, 5)
    for a, b in itertools.product(_placements_1d(), _placements_1d()):
        leaf = distribute_tensor(x, mesh, [a]).requires_grad_()
        y = leaf.redistribute(mesh, [b])
        (y.full_tensor() * w).sum().backward()
        assert leaf.grad is not None and leaf.grad.placements == (a,), (a, b)
        assert torch.allclose(leaf.grad.full_tensor(), w), (a, b)


@distributed(4)
def test_comm_volume_of_plugin_steps():
    mesh = init_device_mesh("cpu", (4,))
    x = torch.arange(32.0).reshape(8, 4)
    rep = distribute_tensor(x, mesh, [Replicate()])
    with CommDebugMode() as cm:
        bc = rep.redistribute(mesh, [_bc(0, 1)])
    assert cm.get_total_counts() == 0  # Replicate -> plugin is a local selection
    with CommDebugMode() as cm:
        bc.full_tensor()
    assert cm.get_total_counts() == 1 and _counts(cm) == {"all_gather_into_tensor": 1}
    part = DTensor.from_local(x * (dist.get_rank() + 1), mesh, [Partial()])
    with CommDebugMode() as cm:
        out = part.redistribute(mesh, [_bc(0, 2)])
    # the plugin's own direct step: a reduce-scatter, not all-reduce + slice
    assert _counts(cm) == {"reduce_scatter_tensor": 1}
    assert torch.equal(out.full_tensor(), x * 10)


@distributed(4)
def test_from_local_with_and_without_shape():
    mesh = init_device_mesh("cpu", (4,))
    x = torch.arange(40.0).reshape(10, 4)
    p = _bc(0, 3)
    local = p.shard(x, 4, dist.get_rank())
    a = DTensor.from_local(local, mesh, [p])  # global shape inferred from local shapes
    b = DTensor.from_local(local, mesh, [p], shape=x.shape, stride=x.stride())
    assert a.shape == b.shape == x.shape
    assert torch.equal(a.full_tensor(), x) and torch.equal(b.full_tensor(), x)
    with pytest.raises(ValueError, match="does not match placements"):
        DTensor.from_local(local[:0], mesh, [p], shape=x.shape)
    # differentiable: the gradient of from_local is the local gradient
    leaf = local.clone().requires_grad_()
    (DTensor.from_local(leaf, mesh, [p], shape=x.shape).full_tensor() * 3).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(local, 3.0))


@distributed(4)
def test_local_ops_and_fallback_ops():
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x, y = torch.randn(9, 4), torch.randn(9, 4)
    p = _bc(0, 2)
    dx, dy = distribute_tensor(x, mesh, [p]), distribute_tensor(y, mesh, [p])
    with CommDebugMode() as cm:
        z = dx * dy + 2.0
        z.mul_(0.5)
        s = z.sum()
    assert cm.get_total_counts() == 0  # pointwise and full reductions are local
    assert z.placements == (p,) and s.placements == (Partial(),)
    assert torch.allclose(z.full_tensor(), (x * y + 2.0) * 0.5)
    assert torch.allclose(s.full_tensor(), ((x * y + 2.0) * 0.5).sum())
    assert torch.allclose(dx.mean().full_tensor(), x.mean())
    # fallback: matmul against a replicated weight runs through torch's dispatch
    w = torch.randn(4, 3)
    out = dx @ distribute_tensor(w, mesh, [Replicate()])
    assert torch.allclose(out.full_tensor(), x @ w, atol=1e-6)
    # different specs never compute locally by accident
    dz = distribute_tensor(y, mesh, [_bc(0, 1)])
    assert torch.allclose((dx + dz).full_tensor(), x + y)
    # in-place fallback writes back into the plugin-placed tensor
    c = distribute_tensor(x, mesh, [p])
    c.copy_(distribute_tensor(y, mesh, [Replicate()]))
    assert c.placements == (p,) and torch.equal(c.full_tensor(), y)
    c.add_(distribute_tensor(x, mesh, [Shard(1)]))
    assert c.placements == (p,) and torch.allclose(c.full_tensor(), x + y)
    # dtype changes keep the placement
    h = dx > 0
    assert h.dtype == torch.bool and h.placements == (p,) and torch.equal(h.full_tensor(), x > 0)
    # backward through a pointwise op and a fallback op
    leaf = distribute_tensor(x, mesh, [p]).requires_grad_()
    ((leaf * leaf) @ distribute_tensor(w, mesh, [Replicate()])).sum().backward()
    assert torch.allclose(leaf.grad.full_tensor(), 2 * x * w.sum(1), atol=1e-5)


_2D = [Replicate(), Shard(0), Shard(1), "bc0", "bc1"]


def _p2(p):
    return {"bc0": _bc(0, 1), "bc1": _bc(1, 2)}.get(p, p) if isinstance(p, str) else p


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1), (1, 4)])
@distributed(4, timeout=240)
def test_redistribute_all_pairs_2d(mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    x = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    layouts = [tuple(_p2(p) for p in pl) for pl in itertools.product(_2D, repeat=2)]
    for a in layouts:
        d = distribute_tensor(x, mesh, a)
        assert torch.equal(d.full_tensor(), x), a
        for b in layouts:
            out = d.redistribute(mesh, b)
            assert torch.equal(out.full_tensor(), x), (a, b)
            assert torch.equal(out.redistribute(mesh, a).to_local(), d.to_local()), (a, b)


@distributed(4)
def test_three_dim_mesh_and_partial_mix():
    mesh = init_device_mesh("cpu", (2, 1, 2))
    x = torch.arange(60.0).reshape(10, 6)
    for a in [(_bc(0, 1), Replicate(), Shard(1)), (Shard(1), _bc(0, 2), _bc(0, 1))]:
        d = distribute_tensor(x, mesh, a)
        assert torch.equal(d.full_tensor(), x)
        for b in [
            (Replicate(),) * 3,
            (Shard(0), Shard(1), Replicate()),
            (_bc(1, 1), Shard(0), _bc(0, 1)),
        ]:
            assert torch.equal(d.redistribute(mesh, b).full_tensor(), x), (a, b)
    # Partial on one mesh dim, plugin placement on another
    coord = mesh.get_coordinate()
    local = x if coord[0] == 0 else torch.zeros_like(x)
    part = DTensor.from_local(local, mesh, [Partial(), Replicate(), Replicate()])
    out = part.redistribute(mesh, [_bc(0, 1), Replicate(), _bc(1, 1)])
    assert torch.equal(out.full_tensor(), x)


@distributed(2)
def test_bad_input_errors():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="one placement per mesh dim"):
        distribute_tensor(x, mesh, [_bc(), Replicate()])
    with pytest.raises(ValueError, match="more than 2 dims"):
        distribute_tensor(x, mesh, [_bc(2, 1)])
    d = distribute_tensor(x, mesh, [_bc()])
    with pytest.raises(ValueError, match="Partial"):
        d.redistribute(mesh, [Partial()])
    with pytest.raises(TypeError, match="Placement"):
        distribute_tensor(x, mesh, ["Shard(0)"])


@distributed(4)
def _dcp_roundtrip(path: str):
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(9 * 6, dtype=torch.float32).reshape(9, 6)
    dcp.save({"x": distribute_tensor(x, mesh, [_bc(0, 2), _bc(1, 1)])}, checkpoint_id=path)
    out = {"x": distribute_tensor(torch.zeros(9, 6), mesh, [Shard(0), _bc(0, 1)])}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["x"].full_tensor(), x)


def test_plain_dcp_saves_plugin_placements(tmp_path):
    """torch.distributed.checkpoint saves a plugin placement from its flat ranges."""
    _dcp_roundtrip(str(tmp_path / "ckpt"))
