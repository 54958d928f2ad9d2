"""DistributedOptimizer state through vescale.checkpoint: save on one dp size (or TP x DP),
load on another, on a 1-D mesh, or into a plain torch AdamW on one process.

Each saving run trains 3 steps, saves ``{"model", "optimizer", "step"}`` and trains 3 more
(the uninterrupted run). Each loading run starts from other initial weights and a fresh
optimizer, loads, checks the full parameters and full optimizer states (``exp_avg``,
``exp_avg_sq``, ``step``) are bitwise those at save time, then trains steps 3..5 and
matches the uninterrupted run's losses (1e-6).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale.checkpoint as vckpt
from vescale.dtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.models import GatheredLinear as Lin
from vescale.optim import DistributedOptimizer

ADAMW = {"lr": 0.05, "weight_decay": 0.1, "betas": (0.9, 0.95)}
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
BATCH = 8  # global batch, split evenly over dp
# tensor-parallel placement of each parameter on a 2-D (dp, tp) mesh: fc1 is evenly
# sharded (ragged state on dp), fc2 unevenly (5 rows over 2: state gathered over dp)
TP_PLAN = {
    "fc1.weight": Shard(0),
    "fc1.bias": Shard(0),
    "fc2.weight": Shard(0),
    "fc2.bias": Shard(0),
    "fc3.weight": Shard(1),
    "fc3.bias": Replicate(),
}
SAVE_STEPS, TOTAL_STEPS = 3, 6


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p


class MLP(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = Lin(6, 8, g)
        self.fc2 = Lin(8, 5, g)
        self.fc3 = Lin(5, 4, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 4, generator=g)


def _clear_dtensor_caches() -> None:
    """Sharding-propagation caches keep meshes (and so process-group names) of earlier
    tests, whose groups the pool destroyed (see vescale-optim's test_zero)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from vescale.dtensor import _redistribute

    _clear_sharding_prop_cache()
    _redistribute._clear_caches()


def _mesh(shape: tuple[int, ...]):
    _clear_dtensor_caches()
    names = ("dp",) if len(shape) == 1 else ("dp", "tp")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _distributed_model(mesh, seed: int) -> MLP:
    model = MLP(seed)
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            pls = [Replicate()] if mesh.ndim == 1 else [Replicate(), TP_PLAN[f"{mname}.{pname}"]]
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach(), mesh, pls)))
    return model


def _dist_opt(model, mesh, **kw) -> DistributedOptimizer:
    return DistributedOptimizer(model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", **ADAMW, **kw)


def _train(model, opt, mesh, start: int, stop: int) -> list[float]:
    """Steps ``start..stop-1``; returns the global-batch losses."""
    n = 1 if mesh is None else mesh.size(0)
    r = 0 if mesh is None else mesh.get_local_rank("dp")
    per = BATCH // n
    losses = []
    for s in range(start, stop):
        x, y = _batch(s)
        loss = (model(x[r * per : (r + 1) * per]) - y[r * per : (r + 1) * per]).pow(2).mean()
        if mesh is None:
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        value = loss.detach().clone()
        if n > 1:
            dist.all_reduce(value, group=mesh.get_group("dp"))
            value /= n
        losses.append(value.item())
    return losses


def _full_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Full parameters and optimizer states by parameter name."""
    if isinstance(opt, DistributedOptimizer):
        sd = opt.state_dict()
        states = {
            name: {k: _full(st[k]).detach().clone() for k in STATE_KEYS}
            for name, st in sd["state"].items()
        }
    else:
        by_id = {id(p): n for n, p in model.named_parameters()}
        states = {
            by_id[id(p)]: {k: st[k].detach().clone() for k in STATE_KEYS}
            for p, st in opt.state.items()
        }
    return {
        n: {"param": _full(p).detach().clone(), **states[n]} for n, p in model.named_parameters()
    }


def _assert_same(got, want, exact: bool = True) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for n in want:
        for k, w in want[n].items():
            g = got[n][k]
            if exact:
                assert torch.equal(g.float(), w.float()), f"{n}.{k} differs after load"
            else:
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ bodies
def save_body(path: str, mesh_shape: tuple[int, ...], overlap: bool):
    mesh = _mesh(mesh_shape)
    model = _distributed_model(mesh, seed=0)
    kw = {"overlap_param_gather": True, "bucket_cap_mb": 1e-4} if overlap else {}
    opt = _dist_opt(model, mesh, **kw)
    losses = _train(model, opt, mesh, 0, SAVE_STEPS)
    if overlap:
        # the last step's all-gathers are still in flight: the save must wait for them
        assert opt.num_pending_param_gathers == opt.num_buckets > 1
    vckpt.save(path, {"model": model, "optimizer": opt, "step": SAVE_STEPS})
    if overlap:
        assert opt.num_pending_param_gathers == 0
        assert opt.param_gather_waits["model_state_dict"] == opt.num_buckets
    at_save = _full_state(model, opt)
    losses += _train(model, opt, mesh, SAVE_STEPS, TOTAL_STEPS)
    return losses, at_save


def load_body(path: str, mesh_shape: tuple[int, ...], losses, at_save):
    mesh = _mesh(mesh_shape)
    model = _distributed_model(mesh, seed=1)  # other weights: the load must replace them
    opt = _dist_opt(model, mesh)
    state = {"model": model, "optimizer": opt, "step": 0}
    # the direct path: DCP fills the optimizer's own sharded state DTensors; the
    # fallback (full_tensor() + re-slicing via distribute_tensor) must not run
    import vescale.optim._zero as zero_mod

    fallback = []
    orig = zero_mod.distribute_tensor
    zero_mod.distribute_tensor = lambda *a, **k: (fallback.append(1), orig(*a, **k))[1]
    try:
        res = vckpt.load(path, state)
    finally:
        zero_mod.distribute_tensor = orig
    assert not fallback, "optimizer state was loaded through full tensors"
    assert not (res.missing or res.unexpected or res.mismatched), res
    assert state["step"] == SAVE_STEPS
    _assert_same(_full_state(model, opt), at_save)
    got = _train(model, opt, mesh, SAVE_STEPS, TOTAL_STEPS)
    for a, b in zip(got, losses[SAVE_STEPS:]):
        assert abs(a - b) <= 1e-6, (got, losses[SAVE_STEPS:])
    return got


def _load_into_torch(path: str, losses, at_save) -> None:
    """One process, no process group: a plain model and torch.optim.AdamW."""
    model = MLP(seed=1)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    state = {"model": model, "optimizer": opt, "step": 0}
    res = vckpt.load(path, state)
    assert not (res.missing or res.unexpected or res.mismatched), res
    assert state["step"] == SAVE_STEPS
    _assert_same(_full_state(model, opt), at_save)
    for g in opt.param_groups:
        assert g["lr"] == ADAMW["lr"] and tuple(g["betas"]) == ADAMW["betas"]
    got = _train(model, opt, None, SAVE_STEPS, TOTAL_STEPS)
    for a, b in zip(got, losses[SAVE_STEPS:]):
        assert abs(a - b) <= 1e-6, (got, losses[SAVE_STEPS:])


def _reference_losses() -> list[float]:
    model = MLP(seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    return _train(model, opt, None, 0, TOTAL_STEPS)


# ------------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def saved_dp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("optim_dp2") / "step_3")
    out = run_on_ranks(save_body, 2, path, (2,), True)
    losses, at_save = out[0]
    assert out[1][0] == losses
    ref = _reference_losses()  # the data-parallel run is single-device AdamW
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-6, (losses, ref)
    return path, losses, at_save


@pytest.fixture(scope="module")
def saved_dp2_tp2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("optim_dp2tp2") / "step_3")
    losses, at_save = run_on_ranks(save_body, 4, path, (2, 2), False)[0]
    ref = _reference_losses()
    assert max(abs(a - b) for a, b in zip(losses, ref)) <= 1e-6, (losses, ref)
    manifest = vckpt.read_manifest(path)
    placements = manifest["tensors"]["optimizer.state.fc1.weight.exp_avg"]["placements"]
    assert placements[-1]["name"] == "RaggedShard"  # saved sharded, not gathered
    return path, losses, at_save


@pytest.mark.parametrize("mesh_shape", [(4,), (1,)], ids=["dp4", "dp1"])
def test_dp2_checkpoint_loads_on_other_dp_sizes(saved_dp2, mesh_shape):
    path, losses, at_save = saved_dp2
    run_on_ranks(load_body, mesh_shape[0], path, mesh_shape, losses, at_save)


def test_dp2_checkpoint_loads_into_torch_adamw(saved_dp2):
    _load_into_torch(*saved_dp2)


@pytest.mark.parametrize("mesh_shape", [(4, 1), (4,), (2, 2)], ids=["4x1", "dp4", "2x2"])
def test_tp_dp_checkpoint_loads_on_other_meshes(saved_dp2_tp2, mesh_shape):
    path, losses, at_save = saved_dp2_tp2
    n = mesh_shape[0] * (mesh_shape[1] if len(mesh_shape) > 1 else 1)
    run_on_ranks(load_body, n, path, mesh_shape, losses, at_save)


def test_tp_dp_checkpoint_loads_into_torch_adamw(saved_dp2_tp2):
    _load_into_torch(*saved_dp2_tp2)


def _save_torch(path: str) -> tuple[list[float], dict]:
    model = MLP(seed=0)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = _train(model, opt, None, 0, SAVE_STEPS)
    vckpt.save(path, {"model": model, "optimizer": opt, "step": SAVE_STEPS})
    at_save = _full_state(model, opt)
    losses += _train(model, opt, None, SAVE_STEPS, TOTAL_STEPS)
    return losses, at_save


def test_torch_adamw_checkpoint_loads_into_distributed_optimizer(tmp_path):
    path = str(tmp_path / "torch_step_3")
    losses, at_save = _save_torch(path)
    run_on_ranks(load_body, 2, path, (2,), losses, at_save)
