"""Large-model init: a model built on the meta device is materialised into local shards."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vescale.dmodule import parallelize_module
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed, run_on_ranks


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
    # every rank cuts its own shards; the one communication is the broadcast of rank 0's
    # generator states (broadcast_object_list: its size, then its bytes)
    assert all("broadcast" in str(k) for k in cm.get_comm_counts()), cm.get_comm_counts()
    assert cm.get_total_counts() == 2 and cm.get_total_bytes() < 8 * 1024, cm.get_comm_bytes()
    for (n1, p1), (n2, p2) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert n1 == n2 and p2.device.type == "cpu"
        assert tuple(p1.placements) == tuple(p2.placements), n1
        assert torch.equal(p1.to_local(), p2.to_local()), n1
    if tie:
        assert lazy.lm_head.weight is lazy.wte.weight
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    assert torch.equal(eager(x).full_tensor(), lazy(x).full_tensor())


def _unseeded_ranks(mode: str) -> None:
    """Ranks whose generators differ (torchrun processes seed theirs at random) build on
    ``meta``: every rank initialises rank 0's values, so replicated parameters agree and
    every parameter equals rank 0's eager construction (a 1-D mesh; the GPT's
    position embedding and norms are replicated under the automatic TP plan)."""
    cfg = GPTConfig()
    torch.manual_seed(0)
    eager = GPT(cfg)  # rank 0's eager construction, on every rank
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    if rank == 0:
        torch.manual_seed(0)
    with torch.device("meta"):
        lazy = GPT(cfg)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",) if mode == "fsdp" else ("tp",))
    opts = {"data_parallel": {"dp": "fsdp"}} if mode == "fsdp" else {}
    lazy = parallelize_module(lazy, mesh, {} if mode == "fsdp" else None, **opts)
    want = dict(eager.named_parameters())
    replicated = 0
    for n, p in lazy.named_parameters():
        assert torch.equal(p.full_tensor(), want[n]), n
        if all(pl.is_replicate() for pl in p.placements):
            replicated += 1
            # every rank computes with its own copy: the copies agree
            local = p.to_local().detach().contiguous()
            copies = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(copies, local)
            assert torch.equal(copies[0], copies[1]), n
    assert replicated > 0 or mode == "fsdp"
    # and the generators now agree (rank 0's, advanced by the initialisation)
    after = torch.rand(3)
    both = [torch.empty(3) for _ in range(2)]
    dist.all_gather(both, after)
    assert torch.equal(both[0], both[1])


@pytest.mark.parametrize("mode", ["tp", "fsdp"])
def test_meta_init_of_ranks_with_different_seeds_gives_rank_0s_values(mode):
    run_on_ranks(_unseeded_ranks, 2, mode)


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
