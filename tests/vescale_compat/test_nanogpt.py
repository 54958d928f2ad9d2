"""A nanoGPT-shaped model with veScale's nanoGPT plan, through veScale's names, on 4 ranks."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from vescale.ddp.distributed_data_parallel import DistributedDataParallel as DDP
from vescale.dmodule.api import parallelize_module
from vescale.dmp import auto_parallelize_module
from vescale.dtensor.api import distribute_tensor
from vescale.dtensor.device_mesh import init_device_mesh
from vescale.dtensor.placement_types import Replicate
from vescale.dtensor.testing import distributed
from vescale.initialize import deferred_init, is_deferred
from vescale.optim import clip_grad_norm_
from vescale.optim.base_optimizer import BasicOptimizer
from vescale.optim.distributed_optimizer import DistributedOptimizer

_spec = importlib.util.spec_from_file_location(
    "_vescale_compat_models", pathlib.Path(__file__).with_name("_models.py")
)
M = sys.modules.setdefault("_vescale_compat_models", importlib.util.module_from_spec(_spec))
if not hasattr(M, "TinyGPT"):
    _spec.loader.exec_module(M)

# eps well above the tiniest gradients: with eps=1e-8 an element whose gradient is ~1e-9
# turns float rounding (summation order differs between TP and one device) into a 1e-4
# parameter difference after a step
ADAMW = {"lr": 0.02, "betas": (0.9, 0.95), "weight_decay": 0.1, "eps": 1e-6}
TOL = {"rtol": 1e-5, "atol": 1e-5}
# Parameters after AdamW steps: AdamW divides each gradient by its running RMS (+ eps 1e-6),
# so an element whose gradient is near zero turns the fp32 rounding of a sum added in
# another order (TP shards, dp averages) into an update difference of up to lr * 1e-3.
# Measured: one element of 1,024 at 1.03e-5 on one machine, within 1e-5 on another.
PARAM_TOL = {"rtol": 1e-5, "atol": 3e-5}


def _batches(n: int = 2):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        data = torch.randint(0, 32, (4, 9), generator=g)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


def _reference():
    torch.manual_seed(0)
    model = M.TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("use_do", [True, False])
@distributed(4, timeout=300)
def test_nanogpt_plan_4d_equals_single_device(use_do):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    dp = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="k_proj"):  # no key bias: veScale skips the key
        model = parallelize_module(M.TinyGPT(), mesh["TP"], M.nanogpt_plan())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, still
    ddp = DDP(
        model,
        mesh["DP"],
        accumulate_allreduce_grads_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_do,
    )
    if use_do:
        opt = DistributedOptimizer(
            torch.optim.AdamW, models=[ddp], clip_grad=1.0, optimizer_kwargs=ADAMW
        )
    else:  # veScale's BasicOptimizer; the clipping is vescale's (veScale clipped in its optimizer)
        inner = torch.optim.AdamW(model.parameters(), **ADAMW)

        def clip(optimizer, args, kwargs):
            clip_grad_norm_(list(model.parameters()), 1.0)

        inner.register_step_pre_hook(clip)
        opt = BasicOptimizer(inner, models=ddp)
    losses = []
    for x, y in _batches():
        ddp.zero_grad_buffer()
        # veScale's example feeds replicated DTensors on the TP mesh
        xs = distribute_tensor(x.chunk(2)[dp], mesh["TP"], [Replicate()])
        ys = distribute_tensor(y.chunk(2)[dp], mesh["TP"], [Replicate()])
        logits, loss = ddp(xs, ys)
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.to_local().detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / 4)
    ref, ref_losses = _reference()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(
            p.full_tensor(), q.detach(), **PARAM_TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@distributed(2, timeout=300)
def test_deferred_init_and_auto_parallelize():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    x, y = _batches(1)[0]
    torch.manual_seed(0)
    eager = M.TinyGPT()
    _, want = eager(x, y)
    # deferred: no memory until parallelize_module builds it again (eager values)
    fake = deferred_init(M.TinyGPT)
    assert is_deferred(fake) and fake.lm_head.weight.device.type == "meta"
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="k_proj"):
        model = parallelize_module(fake, mesh, M.nanogpt_plan())
    assert not is_deferred(model)
    for (name, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(p.full_tensor(), q.detach()), name
    _, loss = model(x, y)
    torch.testing.assert_close(loss.full_tensor(), want.detach(), **TOL)
    # veScale's dmp with the Megatron policy: vescale's automatic plan
    torch.manual_seed(0)
    auto = auto_parallelize_module(M.TinyGPT(), mesh, policy="MEGATRON")
    assert any(not p.placements[0].is_replicate() for p in auto.parameters())
    _, loss = auto(x, y)
    torch.testing.assert_close(loss.full_tensor(), want.detach(), **TOL)
