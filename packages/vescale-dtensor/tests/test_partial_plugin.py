"""``Partial`` on one mesh dim beside a plugin placement on another, against dense values."""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor import (
    Partial,
    Replicate,
    distribute_tensor,
    from_local,
    init_device_mesh,
    placement_registry,
)
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


def _setup():
    mesh = init_device_mesh("cpu", (2, 2))
    RS = placement_registry()["RaggedShard"]
    torch.manual_seed(0)
    terms = [torch.randn(4, 3) for _ in range(2)]  # the pending sum's terms, per dp coordinate
    c0, c1 = mesh.get_coordinate()
    rows = slice(2 * c1, 2 * c1 + 2)
    local = terms[c0][rows].clone().requires_grad_()
    dense = (terms[0] + terms[1]).requires_grad_()
    dt = from_local(local, mesh, [Partial(), RS((0,), (1, 1))], shape=(4, 3))
    return mesh, dt, local, dense, rows


@pytest.mark.parametrize("op", ["identity", "linear", "exp", "square"])
@distributed(4)
def test_partial_beside_plugin_forward_and_backward(op):
    mesh, dt, local, dense, rows = _setup()
    fns = {
        "identity": lambda t: t,
        "linear": lambda t: (t * 2 - t / 4).neg() + t,  # runs on the local terms
        "exp": lambda t: t.exp(),  # needs the reduced value first
        "square": lambda t: t * t,
    }
    w = torch.arange(12.0).reshape(4, 3)
    out = fns[op](dt).full_tensor()
    (out * w).sum().backward()
    ref = fns[op](dense)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    # every rank's term gets the whole gradient of its rows (d sum / d term = 1)
    torch.testing.assert_close(local.grad, dense.grad[rows], atol=1e-4, rtol=1e-5)


@distributed(4)
def test_linear_ops_on_pending_sums_need_no_communication():
    mesh, dt, _, _, _ = _setup()
    with CommDebugMode() as cm:
        y = (dt * 3.0) + dt
    assert cm.get_total_counts() == 0
    assert tuple(y.placements) == tuple(dt.placements)


@distributed(2)
def test_distribute_tensor_validates_before_any_collective():
    mesh = init_device_mesh("cpu", (2,))
    RS = placement_registry()["RaggedShard"]
    with CommDebugMode() as cm:
        with pytest.raises(ValueError, match="3 local_units for a mesh dim of 2 ranks"):
            distribute_tensor(torch.ones(6, 2), mesh, [RS((0,), (1, 1, 1))])
        with pytest.raises(ValueError, match=r"Shard\(dim=2\) on mesh dim 0 is out of range"):
            distribute_tensor(torch.ones(6, 2), mesh, [torch.distributed.tensor.Shard(2)])
        with pytest.raises(ValueError, match="at most one placement per mesh dim"):
            distribute_tensor(torch.ones(6, 2), mesh, [Replicate(), Replicate()])
    assert cm.get_total_counts() == 0


@distributed(4)
def test_short_placement_lists_are_padded_with_replicate():
    mesh = init_device_mesh("cpu", (2, 2))
    x = torch.arange(8.0).reshape(4, 2)
    d = distribute_tensor(x, mesh, [torch.distributed.tensor.Shard(0)])
    assert tuple(d.placements) == (torch.distributed.tensor.Shard(0), Replicate())
    torch.testing.assert_close(d.full_tensor(), x)
