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
        for _ in range(3):  # several steps: parameters seen again are not re-hooked
            _step(m, mesh, desync=False)
            m.zero_grad()
        # named as in the outermost module called (the model), not by class name
        with pytest.raises(GradientSyncError, match=r"1\.weight") as err:
            _step(m, mesh, desync=True)
    assert "0.weight" not in str(err.value)


@distributed(2)
def test_enabled_before_the_model_exists():
    handle = enable_gradient_sync_debug()  # the seed guide's order: no model yet
    try:
        mesh = init_device_mesh("cpu", (2,))
        m = _model(mesh)
        for _ in range(2):
            _step(m, mesh, desync=False)
            m.zero_grad()
        with pytest.raises(GradientSyncError, match=r"1\.weight: gradient on ranks \[1\]"):
            _step(m, mesh, desync=True)
    finally:
        handle.remove()


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


@distributed(4)
def test_every_rank_of_a_2d_mesh_raises_when_one_replica_diverges():
    # Rank 1 out of step on a 2x2 mesh: the groups {0, 1} (dim 1) and {1, 3} (dim 0) see
    # it; rank 2 sees nothing in its groups {0, 2} and {2, 3} but must raise too (its next
    # collective would wait for the others for ever), with the same message.
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    for name, p in list(m.named_parameters()):
        setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()] * 2)))
    x = distribute_tensor(torch.ones(3, 4), mesh, [Replicate()] * 2)
    with enable_gradient_sync_debug(m):
        m(x).sum().backward()  # in sync: nothing raised
        m.zero_grad()
        scale = 2.0 if dist.get_rank() == 1 else 1.0
        with pytest.raises(GradientSyncError) as err:
            (m(x).sum() * scale).backward()
    msg = str(err.value)
    assert "weight: gradient on ranks [1] differs from rank 0 (mesh dim 1" in msg, msg
    assert "weight: gradient on ranks [3] differs from rank 1 (mesh dim 0" in msg, msg
    everyone = [None] * 4
    dist.all_gather_object(everyone, msg)
    assert everyone == [msg] * 4
