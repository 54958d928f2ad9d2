import pytest
import torch
import torch.distributed as dist
from torch import nn

from vescale.debug import GradientSyncError, enable_gradient_sync_debug
from vescale.dtensor import Replicate, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import distributed


def _model(mesh):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    for lin in m:
        for name, p in list(lin.named_parameters()):
            setattr(lin, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    return m


def _step(m, mesh, desync: bool):
    x = distribute_tensor(torch.ones(3, 4), mesh, [Replicate()])
    y = m(x).sum()
    if desync:
        # a rank-dependent extra term on a replicated parameter: what a missed
        # all-reduce or a non-deterministic kernel would look like
        w = m[1].weight
        y = y + (w * float(1 + dist.get_rank())).sum()
    y.backward()


@distributed(2)
def test_in_sync_gradients_pass_and_desync_is_named():
    mesh = init_device_mesh("cpu", (2,))
    m = _model(mesh)
    with enable_gradient_sync_debug(m):
        _step(m, mesh, desync=False)  # nothing raised
        m.zero_grad()
        with pytest.raises(GradientSyncError) as err:
            _step(m, mesh, desync=True)
    msg = str(err.value)
    assert "1.weight" in msg and "[1]" in msg and "1.bias" not in msg and "0.weight" not in msg
    # off again: the same desync goes unnoticed (zero cost when off)
    m.zero_grad()
    _step(m, mesh, desync=True)


@distributed(2)
def test_global_discovery_without_model():
    mesh = init_device_mesh("cpu", (2,))
    m = _model(mesh)
    with enable_gradient_sync_debug():
        with pytest.raises(GradientSyncError, match=r"Linear\.weight"):
            _step(m, mesh, desync=True)
