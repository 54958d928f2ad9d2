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


@distributed(2)
def test_declared_plain_replicas_are_checked():
    from vescale.debug import declare_replicated

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))  # plain tensors, as vescale DDP keeps
    declare_replicated(m[1].weight, mesh, (0,))
    with enable_gradient_sync_debug(m):
        m(torch.ones(3, 4)).sum().backward()  # in sync: nothing raised
        m.zero_grad()
        with pytest.raises(GradientSyncError, match=r"1\.weight: gradient on ranks \[1\]") as err:
            (m(torch.ones(3, 4)).sum() * float(1 + dist.get_rank())).backward()
    # undeclared plain parameters are not replicas the tool knows of
    assert "0.weight" not in str(err.value) and "1.bias" not in str(err.value)
    with pytest.raises(TypeError, match="plain tensors"):
        declare_replicated(distribute_tensor(torch.ones(2), mesh, [Replicate()]), mesh, (0,))
    with pytest.raises(ValueError, match="mesh dim 1 out of range"):
        declare_replicated(m[0].weight, mesh, (1,))
