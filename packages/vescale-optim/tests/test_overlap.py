"""``overlap_param_gather``: all-gathers launched by step(), waited for in forward pre-hooks.

Same losses and parameters (bitwise) as without overlap; the gathers are provably pending
when step() returns and each bucket is waited for right before the first module using it
runs; everything else that reads parameters waits first.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import distributed
from vescale.dtensor.testing.models import GatheredLinear as Lin
from vescale.optim import DistributedOptimizer

BATCH = 8
WIDTHS = (6, 8, 8, 8, 4)  # 4 layers
# one bucket per layer: local layer sizes are 224, 288, 288 and 144 bytes (fp32), or
# 128, 160, 160 and 80 bytes with the weights sharded over tp=2
ONE_LAYER_PER_BUCKET_MB = 300 / 2**20
ONE_LAYER_PER_BUCKET_MB_TP2 = 170 / 2**20
ADAMW = {"lr": 0.05, "weight_decay": 0.1, "betas": (0.9, 0.95)}


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.layers = nn.ModuleList(Lin(a, b, g) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return x


def _clear_dtensor_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from vescale.dtensor import _redistribute

    _clear_sharding_prop_cache()
    _redistribute._clear_caches()


def _setup(mesh_shape, **opt_kw):
    _clear_dtensor_caches()
    names = ("dp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = Stack()
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            # on a (dp, tp) mesh: weights sharded over tp, so the forward gathers over
            # tp while the dp parameter gathers are in flight
            tp = Shard(0) if pname == "weight" else Replicate()
            pls = [Replicate()] if mesh.ndim == 1 else [Replicate(), tp]
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, pls)))
    opt = DistributedOptimizer(model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", **ADAMW, **opt_kw)
    return mesh, model, opt


def _loss(model, mesh, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(BATCH, WIDTHS[0], generator=g), torch.randn(BATCH, WIDTHS[-1], generator=g)
    n, r = mesh.size(0), mesh.get_local_rank("dp")
    per = BATCH // n
    return (model(x[r * per : (r + 1) * per]) - y[r * per : (r + 1) * per]).pow(2).mean()


def _run(mesh_shape, steps=5, gather=None, **opt_kw):
    mesh, model, opt = _setup(mesh_shape, **opt_kw)
    if gather is not None:  # force a parameter-gather path
        opt._plan_paths(gather=gather)
    losses = []
    for s in range(steps):
        loss = _loss(model, mesh, s)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh.get_group("dp"))
        losses.append(value)
    opt.wait_param_gather()
    params = [p.full_tensor() for p in model.parameters()]
    return losses, params, opt


def _check_same_training(mesh_shape):
    mb = ONE_LAYER_PER_BUCKET_MB if len(mesh_shape) == 1 else ONE_LAYER_PER_BUCKET_MB_TP2
    cap = {"bucket_cap_mb": mb}
    off_losses, off_params, off = _run(mesh_shape, **cap)
    on_losses, on_params, on = _run(mesh_shape, overlap_param_gather=True, **cap)
    assert on.num_buckets == off.num_buckets == len(WIDTHS) - 1
    for a, b in zip(on_losses, off_losses):
        assert torch.equal(a, b), (on_losses, off_losses)
    for a, b in zip(on_params, off_params):
        assert torch.equal(a, b)
    # every gather but the last step's was waited for in a forward pre-hook
    assert on.param_gather_waits["forward"] == 4 * on.num_buckets
    assert on.param_gather_waits["explicit"] == on.num_buckets
    assert off.param_gather_waits["forward"] == 0
    # and the default layout (one bucket per dtype) without overlap: other bucket
    # boundaries change which gloo ring chunk an element is reduced in, so the order of
    # the dp sum (and its last bit) may differ on more than 2 ranks
    one_losses, one_params, one = _run(mesh_shape)
    assert one.num_buckets == 1
    for a, b in zip(on_losses, one_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    for a, b in zip(on_params, one_params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


@distributed(2)
def test_overlap_matches_no_overlap_2_ranks():
    _check_same_training((2,))
    # the other gather paths (one all-gather; one broadcast per piece, in place, still
    # in flight while the earlier layers run forward) move the same bytes
    mb = {"bucket_cap_mb": ONE_LAYER_PER_BUCKET_MB}
    _, off_params, _ = _run((2,), **mb)
    for gather in ("all_gather", "pieces"):
        losses, params, on = _run((2,), gather=gather, overlap_param_gather=True, **mb)
        assert on.param_gather_waits["forward"] == 4 * on.num_buckets
        for a, b in zip(params, off_params):
            assert torch.equal(a, b), gather


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["dp4", "dp2xtp2"])
@distributed(4)
def test_overlap_matches_no_overlap_4_ranks(mesh_shape):
    _check_same_training(mesh_shape)


@distributed(2)
def test_gathers_pending_after_step_and_waited_inside_forward():
    mesh, model, opt = _setup(
        (2,), overlap_param_gather=True, bucket_cap_mb=ONE_LAYER_PER_BUCKET_MB
    )
    layers = list(model.layers)
    seen: list[tuple[int, int]] = []
    stale: list[bool] = []

    def probe(mod, args):  # runs after the optimizer's (prepended) pre-hook
        seen.append((opt.num_pending_param_gathers, opt.param_gather_waits["forward"]))

    for layer in layers:
        layer.register_forward_pre_hook(probe)

    _loss(model, mesh, 0).backward()  # nothing pending before the first step
    assert seen == [(0, 0)] * 4
    opt.step()
    opt.zero_grad()
    # step() returned with every bucket's all-gather in flight ...
    assert opt.num_pending_param_gathers == opt.num_buckets == 4
    assert opt.param_gather_waits["forward"] == 0
    # ... and the last layer's parameters not updated yet (the gathered values are
    # copied in by the wait): its local tensor still holds the peer rank's old slice
    before = layers[-1].weight.to_local().clone()

    def probe_last(mod, args):
        stale.append(not torch.equal(mod.weight.to_local(), before))

    layers[-1].register_forward_pre_hook(probe_last)
    seen.clear()
    _loss(model, mesh, 1).backward()
    # layer k's pre-hook waited for bucket k only: the later layers' gathers were still
    # pending while the earlier layers ran
    assert seen == [(3, 1), (2, 2), (1, 3), (0, 4)], seen
    assert stale == [True]  # the wait inside forward updated the parameters
    assert opt.num_pending_param_gathers == 0
    # a second forward before the next step waits for nothing
    _loss(model, mesh, 1)
    assert opt.param_gather_waits["forward"] == 4
    opt.zero_grad()


@distributed(2)
def test_everything_that_reads_parameters_waits():
    mesh, model, opt = _setup(
        (2,), overlap_param_gather=True, bucket_cap_mb=ONE_LAYER_PER_BUCKET_MB
    )
    n = opt.num_buckets

    def train_step(s):
        _loss(model, mesh, s).backward()
        opt.step()
        opt.zero_grad()
        assert opt.num_pending_param_gathers == n

    train_step(0)
    sd = opt.state_dict()
    assert opt.num_pending_param_gathers == 0 and opt.param_gather_waits["state_dict"] == n
    assert set(sd["state"]) == {name for name, _ in model.named_parameters()}

    train_step(1)
    msd = {k: v.clone() for k, v in model.state_dict().items()}
    assert opt.num_pending_param_gathers == 0 and opt.param_gather_waits["model_state_dict"] == n
    assert all(torch.equal(msd[k].to_local(), p.to_local()) for k, p in model.named_parameters())

    train_step(2)
    opt.wait_param_gather()
    assert opt.param_gather_waits["explicit"] == n

    train_step(3)
    opt.step()  # no forward since the last step: the next step waits for the old gathers
    assert opt.param_gather_waits["step"] == n and opt.num_pending_param_gathers == n

    # loading the model waits first, so a gather in flight cannot overwrite loaded values
    model.load_state_dict(msd)
    assert opt.param_gather_waits["model_load_state_dict"] == n
    assert opt.num_pending_param_gathers == 0
    for k, p in model.named_parameters():
        assert torch.equal(p.to_local(), msd[k].to_local()), k

    train_step(4)
    opt.load_state_dict(sd)
    assert opt.param_gather_waits["load_state_dict"] == n
    train_step(5)
    params = opt.params  # the parameter list is only handed out up to date
    assert opt.num_pending_param_gathers == 0 and len(params) == 8
