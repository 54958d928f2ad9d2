"""Large-model init: a model built on the meta device is materialised into local shards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vescale.dmodule import parallelize_module
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


@pytest.mark.parametrize("tie", [True, False])
@distributed(2)
def test_meta_init_matches_eager_init(tie):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cfg = GPTConfig(tie_embeddings=tie)
    torch.manual_seed(0)
    eager = parallelize_module(GPT(cfg), mesh)
    torch.manual_seed(0)
    with torch.device("meta"):
        lazy = GPT(cfg)
    with CommDebugMode() as cm:
        lazy = parallelize_module(lazy, mesh)
    assert cm.get_total_counts() == 0  # every rank cuts its own shards
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2 and p2.device.type == "cpu"
        assert tuple(p1.placements) == tuple(p2.placements), n1
        assert torch.equal(p1.to_local(), p2.to_local()), n1
    if tie:
        assert lazy.lm_head.weight is lazy.wte.weight
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    assert torch.equal(eager(x).full_tensor(), lazy(x).full_tensor())


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.w


@distributed(2)
def test_meta_init_needs_an_initialiser():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        m = NoReset()
    with (
        CommDebugMode() as cm,
        pytest.raises(ValueError, match=r"w on the meta device.*param_init_fn"),
    ):
        parallelize_module(m, mesh, {"w": [torch.distributed.tensor.Shard(0)]})
    assert cm.get_total_counts() == 0
    with torch.device("meta"):
        m = NoReset()

    def init(mod):
        if isinstance(mod, NoReset):
            nn.init.constant_(mod.w, 3.0)

    from torch.distributed.tensor import Shard

    m = parallelize_module(m, mesh, {"w": [Shard(0)]}, param_init_fn=init)
    assert m.w.placements == (Shard(0),) and torch.equal(m.w.full_tensor(), torch.full((4, 4), 3.0))
