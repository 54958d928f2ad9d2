"""DistributedOptimizer (ZeRO-1/2) against single-device torch.optim over 5 steps."""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import distributed, run_on_ranks
from vescale.optim import DistributedOptimizer

SHAPES = [(8, 6), (8,), (5, 8), (3,), (7, 3)]
# tensor-parallel placement of each parameter (on the "tp" dim when there is one)
TP = [Shard(0), Shard(0), Shard(1), Replicate(), Shard(0)]
OPTIMS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}),
    "sgd": (torch.optim.SGD, {"lr": 1e-1, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-1}),
}
STATE_KEYS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",), "adagrad": ("sum",)}


def _init_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _grads(step: int, dp: int) -> list[torch.Tensor]:
    """Per-dp-rank gradients of step ``step``: shape (dp, *param_shape) each."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn((dp, *s), generator=g) for s in SHAPES]


def _clear_dtensor_caches() -> None:
    """torch's sharding-propagation caches (Python and the C++ fast path) keep output
    specs, with their DeviceMesh and so its process-group names, across tests; the
    pool destroys those groups between tests, so an equal mesh in a later test would
    resolve to a dead group (e.g. in ``nn.Parameter(dtensor)``)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from vescale.dtensor import _redistribute

    _clear_sharding_prop_cache()
    _redistribute._clear_caches()  # vescale's plan cache is keyed by mesh *value* too


def _mesh(dp: int, tp: int):
    _clear_dtensor_caches()
    if tp == 1:
        return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _placements(mesh, i: int):
    if mesh.ndim == 1:
        return [Replicate()]
    return [Replicate(), TP[i]]


def _dparams(mesh, full: list[torch.Tensor], dtype=torch.float32):
    out = []
    for i, t in enumerate(full):
        d = distribute_tensor(t.detach().to(dtype), mesh, _placements(mesh, i))
        out.append(torch.nn.Parameter(d))
    return out


def _set_grads(mesh, params, step: int, dp: int, dtype):
    dpr = mesh.get_local_rank("dp")
    for i, (p, g) in enumerate(zip(params, _grads(step, dp))):
        mine = g[dpr].to(dtype)
        # every dp rank has its own gradient (not synchronized): the optimizer averages
        p.grad = distribute_tensor(mine, mesh, _placements(mesh, i), src_data_rank=None)


def _reference(opt_name: str, steps: int, dp: int, clip: float | None, dtype=torch.float32):
    """Single-device torch: params in ``dtype``, gradient = mean over dp ranks."""
    cls, kw = OPTIMS[opt_name]
    ref = [torch.nn.Parameter(t.to(dtype)) for t in _init_params()]
    opt = cls(ref, **kw)
    norms = []
    for s in range(steps):
        for p, g in zip(ref, _grads(s, dp)):
            # per-rank grads in `dtype` (as the model would produce), averaged in fp32
            p.grad = g.to(dtype).float().mean(0).to(dtype)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref, clip)))
        opt.step()
    return ref, opt, norms


def _run(dp, tp, opt_name, clip, bf16=False, steps=5, paths=None):
    mesh = _mesh(dp, tp)
    cls, kw = OPTIMS[opt_name]
    dtype = torch.bfloat16 if bf16 else torch.float32
    params = _dparams(mesh, _init_params(), dtype)
    extra = {"master_dtype": torch.float32, "grad_reduce_dtype": torch.float32} if bf16 else {}
    opt = DistributedOptimizer(
        params, cls, mesh=mesh, dp_dim="dp", clip_grad_norm=clip, **extra, **kw
    )
    if paths is not None:  # (backend, gather): force a communication path
        opt._plan_paths(*paths)
    norms = []
    for s in range(steps):
        _set_grads(mesh, params, s, dp, dtype)
        out = opt.step()
        if clip is not None:
            norms.append(float(out))
        opt.zero_grad()
    return mesh, params, opt, norms


def _check_state(opt, ref_opt, ref_params, opt_name, rtol=1e-5, atol=1e-6):
    sd = opt.state_dict()
    for i, rp in enumerate(ref_params):
        rst = ref_opt.state[rp]
        st = sd["state"][opt.param_names[i]]  # keyed by name ("param[i]" without a model)
        for k in STATE_KEYS[opt_name]:
            got = st[k].full_tensor()
            torch.testing.assert_close(got, rst[k].float(), rtol=rtol, atol=atol, msg=f"{k}[{i}]")
        if "step" in rst:
            assert float(st["step"]) == float(rst["step"])


def _matches_torch(dp, tp, opt_name, clip, paths=None):
    """5 steps of `_run` against `_reference`: parameters, optimizer state, gradient norms."""
    _, params, opt, norms = _run(dp, tp, opt_name, clip, paths=paths)
    ref, ref_opt, ref_norms = _reference(opt_name, 5, dp, clip)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6)
    _check_state(opt, ref_opt, ref, opt_name)
    for a, b in zip(norms, ref_norms):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    return params, opt


@pytest.mark.parametrize(
    "dp,tp,opt_name,clip",
    [
        (2, 1, "adamw", None),
        (2, 1, "adamw", 0.5),
        (2, 1, "sgd", None),
        (2, 1, "adagrad", 0.5),
    ],
)
@distributed(2)
def test_dp2_matches_torch(dp, tp, opt_name, clip):
    _matches_torch(dp, tp, opt_name, clip)


@pytest.mark.parametrize(
    "dp,tp,opt_name,clip",
    [
        (4, 1, "adamw", None),
        (4, 1, "adamw", 0.5),
        (2, 2, "adamw", None),
        (2, 2, "adamw", 0.5),
        (2, 2, "sgd", 0.5),
    ],
)
@distributed(4)
def test_dp4_and_tp_matches_torch(dp, tp, opt_name, clip):
    params, opt = _matches_torch(dp, tp, opt_name, clip)
    # each dp rank holds ~1/dp of the optimizer state
    local = sum(s.numel() for s in opt.local_shards())
    total = sum(p.to_local().numel() for p in params)
    assert local <= total // dp + 1
    if clip is not None and opt_name == "adamw":
        # gloo picks all-reduce + broadcasts; NCCL's reduce-scatter + all-gather and
        # the in-place per-piece broadcasts give the same training
        assert [b.gather for b in opt._buckets] == ["slices"]
        for paths in (("nccl", None), ("gloo", "pieces")):
            _matches_torch(dp, tp, opt_name, clip, paths=paths)


@pytest.mark.parametrize("clip", [None, 0.5])
@distributed(4)
def test_bf16_params_fp32_master(clip):
    # with clipping: the in-place per-piece broadcasts (the masters are cast into the
    # parameters first); without: gloo's default for small buckets
    paths = ("gloo", "pieces") if clip is not None else None
    mesh, params, opt, norms = _run(2, 2, "adamw", clip, bf16=True, paths=paths)
    # the reference sees the same bf16-rounded per-rank gradients
    ref, ref_opt, ref_norms = _reference_bf16_grads(clip)
    sd = opt.state_dict()
    bf16_single, _, _ = _reference("adamw", 5, 2, clip, dtype=torch.bfloat16)
    for i, (p, r) in enumerate(zip(params, ref)):
        master = sd["state"][f"param[{i}]"]["master_param"].full_tensor()
        torch.testing.assert_close(master, r.detach(), rtol=1e-5, atol=1e-6)
        assert p.dtype == torch.bfloat16
        # params are the rounded masters: within one bf16 ulp of the fp32 result
        torch.testing.assert_close(p.full_tensor().float(), r.detach(), rtol=2**-8, atol=1e-6)
        # ... which is tighter than what single-device bf16 AdamW reaches
        err_ours = (p.full_tensor().float() - r.detach()).abs().max()
        err_bf16 = (bf16_single[i].detach().float() - r.detach()).abs().max()
        assert err_ours <= err_bf16 + 1e-6
    for a, b in zip(norms, ref_norms):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)


def _reference_bf16_grads(clip):
    cls, kw = OPTIMS["adamw"]
    ref = [torch.nn.Parameter(t.to(torch.bfloat16).float()) for t in _init_params()]
    opt = cls(ref, **kw)
    norms = []
    for s in range(5):
        for p, g in zip(ref, _grads(s, 2)):
            p.grad = g.to(torch.bfloat16).float().mean(0)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref, clip)))
        opt.step()
    return ref, opt, norms


# ---------------------------------------------------------------- state dict / resharding
def _save_after(dp, steps):
    mesh = _mesh(dp, 1)
    _, params, opt, _ = _run(dp, 1, "adamw", 0.5, steps=steps)
    sd = opt.state_dict()
    full = {
        i: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in st.items()}
        for i, st in sd["state"].items()
    }
    del mesh
    return {"state": full, "param_groups": sd["param_groups"]}, [p.full_tensor() for p in params]


def _resume(dp, saved, saved_params, steps_done, steps_total):
    mesh = _mesh(dp, 1)
    cls, kw = OPTIMS["adamw"]
    params = _dparams(mesh, saved_params)
    opt = DistributedOptimizer(params, cls, mesh=mesh, dp_dim="dp", clip_grad_norm=0.5, **kw)
    opt.load_state_dict(saved)
    for s in range(steps_done, steps_total):
        # same global gradients as the saving run: the mean over the *saving* dp size
        g2 = _grads(s, 2)
        for _i, (p, g) in enumerate(zip(params, g2)):
            p.grad = distribute_tensor(g.mean(0), mesh, [Replicate()], src_data_rank=None)
        opt.step()
    ref, ref_opt, _ = _reference("adamw", steps_total, 2, 0.5)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6)
    _check_state(opt, ref_opt, ref, "adamw")
    return True


def test_state_dict_reshard_dp2_to_dp4_and_dp1():
    saved, saved_params = run_on_ranks(_save_after, 2, 2, 3)[0]
    assert all(run_on_ranks(_resume, 4, 4, saved, saved_params, 3, 5))
    assert all(run_on_ranks(_resume, 1, 1, saved, saved_params, 3, 5))


@distributed(4)
def test_state_dict_dtensor_roundtrip_and_reshard():
    # same layout: loads without communication and continues identically
    mesh, params, opt, _ = _run(2, 2, "adamw", 0.5, steps=3)
    sd = opt.state_dict()
    st0 = sd["state"]["param[0]"]["exp_avg"]
    assert st0.shape == params[0].shape
    assert "RaggedShard" in type(st0.placements[-1]).__name__
    cls, kw = OPTIMS["adamw"]
    params2 = _dparams(mesh, [p.full_tensor() for p in params])
    opt2 = DistributedOptimizer(params2, cls, mesh=mesh, dp_dim="dp", clip_grad_norm=0.5, **kw)
    opt2.load_state_dict(sd)
    # a different dp size: a 1-D dp=4 mesh, loading the 2x2 DTensors (resharded via full tensors)
    mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    params4 = [
        torch.nn.Parameter(distribute_tensor(p.full_tensor().detach(), mesh4, [Replicate()]))
        for p in params
    ]
    opt4 = DistributedOptimizer(params4, cls, mesh=mesh4, dp_dim="dp", clip_grad_norm=0.5, **kw)
    opt4.load_state_dict(sd)
    for s in range(3, 5):
        _set_grads(mesh, params, s, 2, torch.float32)
        _set_grads(mesh, params2, s, 2, torch.float32)
        for p, g in zip(params4, _grads(s, 2)):
            p.grad = distribute_tensor(g.mean(0), mesh4, [Replicate()], src_data_rank=None)
        opt.step()
        opt2.step()
        opt4.step()
    for a, b, c in zip(params, params2, params4):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=0, atol=0)
        torch.testing.assert_close(a.full_tensor(), c.full_tensor(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- fresh state / masters
@pytest.mark.parametrize("opt_name", ["adamw", "sgd", "adagrad"])
@distributed(2)
def test_fresh_state_dict_is_a_complete_load_target(opt_name):
    # a never-stepped optimizer's state dict has every entry (what a checkpoint load
    # needs as targets), is what a first step starts from, and leaves the optimizer as is
    mesh = _mesh(2, 1)
    cls, kw = OPTIMS[opt_name]
    params = _dparams(mesh, _init_params())
    opt = DistributedOptimizer(params, cls, mesh=mesh, dp_dim="dp", **kw)
    had_state = len(opt.state)  # Adagrad creates its state in __init__
    sd = opt.state_dict()
    assert len(opt.state) == had_state
    assert set(sd["state"]) == {f"param[{i}]" for i in range(len(SHAPES))}
    for st in sd["state"].values():
        for k in STATE_KEYS[opt_name]:
            assert st[k].shape == st[k].full_tensor().shape
        if "step" in st:
            assert float(st["step"]) == 0
    opt.load_state_dict(sd)
    for s in range(5):
        _set_grads(mesh, params, s, 2, torch.float32)
        opt.step()
        opt.zero_grad()
    ref, ref_opt, _ = _reference(opt_name, 5, 2, None)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6)
    _check_state(opt, ref_opt, ref, opt_name)


@distributed(2)
def test_masters_refreshed_from_params_without_master_state():
    # e.g. a checkpoint of a torch optimizer: the model was loaded, the masters follow it
    mesh, params, opt, _ = _run(2, 1, "adamw", None, bf16=True, steps=2)
    sd = opt.state_dict()
    for st in sd["state"].values():
        del st["master_param"]
    new = [t * 0.5 for t in _init_params()]
    with torch.no_grad():
        for p, t in zip(params, new):
            p._local_tensor.copy_(t.to(torch.bfloat16))  # replicated: the full value
    opt.load_state_dict(sd)
    sd2 = opt.state_dict()
    for i, t in enumerate(new):
        master = sd2["state"][f"param[{i}]"]["master_param"].full_tensor()
        assert torch.equal(master, t.to(torch.bfloat16).float())
