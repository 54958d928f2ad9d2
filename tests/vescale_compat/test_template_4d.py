"""veScale's 4-D template, unchanged, on 4 CPU ranks: equal to single device and to DModule.

``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("DP", "TP"))`` ->
``parallelize_module(m, mesh["TP"], plan)`` -> ``DDP(m, mesh["DP"], ...)`` ->
``DistributedOptimizer(torch.optim.AdamW, models=[ddp], clip_grad=1.0, ...)`` -> the loop
``ddp.zero_grad_buffer(); loss.backward(); ddp.finish_grad_sync(); opt.step()``.
"""

from __future__ import annotations

import pytest
import torch

import vescale.checkpoint as vckpt
from vescale.ddp.distributed_data_parallel import DistributedDataParallel as DDP
from vescale.dmodule import DModule
from vescale.dmodule.api import parallelize_module
from vescale.dtensor.device_mesh import init_device_mesh
from vescale.dtensor.placement_types import Replicate, Shard
from vescale.dtensor.testing import distributed, load_helper
from vescale.optim import clip_grad_norm_
from vescale.optim.base_optimizer import BasicOptimizer
from vescale.optim.distributed_optimizer import DistributedOptimizer

M = load_helper(__file__, "_models")

STEPS = 3
ADAMW = {"lr": 0.05, "betas": (0.9, 0.95), "weight_decay": 0.1}
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _batches():
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def _reference(clip: float | None):
    torch.manual_seed(0)
    model = M.RegressionMLP()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


def _mine(x: torch.Tensor, dp: int) -> torch.Tensor:
    return x.chunk(2)[dp]  # each data-parallel rank gets half of the batch


def _check(model, ref, losses, ref_losses):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        torch.testing.assert_close(full, q.detach(), **TOL, msg=name)
    # each dp rank's loss is the mean over its half: their mean is the full-batch loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)


def _dp_mean(loss) -> float:
    t = loss.to_local().detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / 4  # 2 dp ranks x 2 tp ranks, every tp rank holding the same value


def _train(ddp, opt, dp: int, zero, batches=None) -> list[float]:
    """veScale's loop: zero, forward, backward, finish_grad_sync, step."""
    losses = []
    for x, y in batches or _batches():
        zero()
        loss = ddp(_mine(x, dp), _mine(y, dp))
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(_dp_mean(loss))
    return losses


@pytest.mark.parametrize("form", ["class", "instance"])
@distributed(4, timeout=300)
def test_template_with_distributed_optimizer(form):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    dp = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = parallelize_module(M.RegressionMLP(), mesh["TP"], M.mlp_plan())
    ddp = DDP(
        model,
        mesh["DP"],
        accumulate_allreduce_grads_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
    )
    if form == "class":
        opt = DistributedOptimizer(
            torch.optim.AdamW, models=[ddp], clip_grad=1.0, optimizer_kwargs=ADAMW
        )
    else:
        opt = DistributedOptimizer(
            torch.optim.AdamW(ddp.parameters(), **ADAMW), models=[ddp], clip_grad=1.0
        )
    losses = _train(ddp, opt, dp, ddp.zero_grad_buffer)
    ref, ref_losses = _reference(clip=1.0)
    _check(model, ref, losses, ref_losses)
    # parameters stay on the tensor-parallel mesh, as in veScale
    assert model.fc1.weight.device_mesh == mesh["TP"]
    assert tuple(model.fc1.weight.placements) == (Shard(0),)


@distributed(4, timeout=300)
def test_template_with_ddp_allreduce_and_basic_optimizer():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    dp = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = parallelize_module(M.RegressionMLP(), mesh["TP"], M.mlp_plan())
    ddp = DDP(model, mesh["DP"], use_distributed_optimizer=False)
    opt = BasicOptimizer(torch.optim.AdamW(model.parameters(), **ADAMW), models=ddp)
    losses = _train(ddp, opt, dp, opt.zero_grad)
    ref, ref_losses = _reference(clip=None)
    _check(model, ref, losses, ref_losses)


@distributed(4, timeout=300)
def test_template_equals_native_dmodule_data_parallel():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    dp = mesh.get_coordinate()[0]
    # native: one DModule over the 2-D mesh, DDP chosen per mesh dim
    torch.manual_seed(0)
    native = DModule(
        M.RegressionMLP(),
        mesh,
        {
            "parameter": {
                "fc1.weight": [Replicate(), Shard(0)],
                "fc1.bias": [Replicate(), Shard(0)],
                "fc2.weight": [Replicate(), Shard(1)],
            },
            "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]},
        },
        data_parallel={"DP": "ddp"},
    )
    nopt = torch.optim.AdamW(native.parameters(), **ADAMW)
    # veScale's template
    torch.manual_seed(0)
    model = parallelize_module(M.RegressionMLP(), mesh["TP"], M.mlp_plan())
    ddp = DDP(model, mesh["DP"], use_distributed_optimizer=True)
    opt = DistributedOptimizer(
        torch.optim.AdamW, models=[ddp], clip_grad=1.0, optimizer_kwargs=ADAMW
    )
    for x, y in _batches():
        nopt.zero_grad()
        native(_mine(x, dp), _mine(y, dp)).backward()
        clip_grad_norm_(list(native.parameters()), 1.0)
        nopt.step()
    _train(ddp, opt, dp, ddp.zero_grad_buffer)
    for (name, p), (_, q) in zip(model.named_parameters(), native.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **TOL, msg=name)


@distributed(4, timeout=300)
def _save_and_reload(path: str):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    dp = mesh.get_coordinate()[0]

    def build(seed):
        torch.manual_seed(seed)
        m = parallelize_module(M.RegressionMLP(), mesh["TP"], M.mlp_plan())
        d = DDP(m, mesh["DP"], use_distributed_optimizer=True)
        o = DistributedOptimizer(
            torch.optim.AdamW, models=[d], clip_grad=1.0, optimizer_kwargs=ADAMW
        )
        return m, d, o

    model, ddp, opt = build(0)
    _train(ddp, opt, dp, ddp.zero_grad_buffer, _batches()[:2])
    handle = vckpt.save(path, {"model": ddp, "optimizer": opt}, async_checkpoint=True)
    handle.result(timeout=120)
    # resume: model and optimizer state come back; the next step matches an unbroken run
    model2, ddp2, opt2 = build(5)
    vckpt.load(path, {"model": ddp2, "optimizer": opt2}, broadcast_checkpoint=False)
    for d, o in ((ddp, opt), (ddp2, opt2)):
        _train(d, o, dp, d.zero_grad_buffer, _batches()[2:])
    for (name, p), (_, q) in zip(model.named_parameters(), model2.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **TOL, msg=name)
    # the model alone, from the full training checkpoint, on a plain TP model
    torch.manual_seed(7)
    alone = parallelize_module(M.RegressionMLP(), mesh["TP"], M.mlp_plan())
    res = vckpt.load(path, {"model": alone})
    assert not (res.missing or res.unexpected or res.mismatched), res
    # the checkpoint holds the state after 2 steps: compare with 2 single-device steps
    torch.manual_seed(0)
    two = M.RegressionMLP()
    o2 = torch.optim.AdamW(two.parameters(), **ADAMW)
    for x, y in _batches()[:2]:
        o2.zero_grad()
        two(x, y).backward()
        torch.nn.utils.clip_grad_norm_(two.parameters(), 1.0)
        o2.step()
    for (name, p), (_, q) in zip(alone.named_parameters(), two.named_parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL, msg=name)


def test_template_checkpoint_resume_and_model_only_load(tmp_path):
    _save_and_reload(str(tmp_path / "step_2"))


@distributed(4, timeout=300)
def test_joint_mesh_without_torch_root_lookup():
    from vescale.dtensor import _compat
    from vescale.dtensor._submesh import is_complement, joint_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    joint, dim = joint_mesh(mesh["DP"], mesh["TP"])
    assert joint is mesh and dim == 0
    saved = _compat.root_mesh
    _compat.root_mesh = lambda m: None  # a torch without the private root lookup
    try:
        rebuilt, dim = joint_mesh(mesh["DP"], mesh["TP"])
    finally:
        _compat.root_mesh = saved
    assert dim == 0 and rebuilt.mesh.tolist() == mesh.mesh.tolist()
    assert rebuilt.mesh_dim_names == ("DP", "TP") and is_complement(mesh["TP"], rebuilt, 0)
    with pytest.raises(ValueError, match="share ranks"):
        joint_mesh(mesh["DP"], mesh)  # not orthogonal slices
