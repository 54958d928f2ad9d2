"""A wrapped model is freed once the user drops it: no engine, hook or debug state keeps it
(and its process groups, each with a polling gloo thread) alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from vescale.debug import enable_gradient_sync_debug
from vescale.dmodule import parallelize_module
from vescale.dtensor import Shard, init_device_mesh
from vescale.dtensor.testing import distributed
from vescale.optim import DistributedOptimizer


def _train_and_drop(kind: str) -> bool:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = {"0.weight": [Shard(0)], "2.weight": [Shard(1)]} if kind == "tp" else {}
    dp = {"dp": kind} if kind in ("ddp", "fsdp") else None
    if kind == "debug":
        dp = {"dp": "ddp"}
    model = parallelize_module(model, mesh, plan, data_parallel=dp)
    handle = enable_gradient_sync_debug(model) if kind == "debug" else None
    if kind == "zero":
        opt = DistributedOptimizer(model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        out = model(torch.randn(4, 8))
        (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
        opt.step()
        opt.zero_grad()
    ref = weakref.ref(model)
    del model, opt, out
    gc.collect()
    alive = ref() is not None
    if handle is not None:
        handle.remove()
    return alive


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "tp", "zero", "debug"])
@distributed(2)
def test_model_is_freed_after_training(kind):
    assert not _train_and_drop(kind), f"{kind}: the model outlived every user reference"
