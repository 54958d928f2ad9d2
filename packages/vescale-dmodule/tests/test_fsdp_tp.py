"""FSDP x TP on a 2x2 ("dp", "tp") mesh: equivalence with single-device AdamW, bytes, clipping.

The model is tensor-parallelised by ``parallelize_module`` (automatic Megatron plan,
with and without sequence parallelism), then ``fully_shard(model, mesh, "dp")``
shards every parameter's TP-local tensor over dp.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.dmodule import parallelize_module
from vescale.dmodule._fsdp import fully_shard, get_dp_engine
from vescale.dtensor import DTensor, Replicate, Shard, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed, load_helper
from vescale.ragged import RaggedShard

H = load_helper(__file__, "_dp_helpers")


def _mesh():
    H.fresh_caches()
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tp_gpt(mesh, sp: bool):
    return parallelize_module(H.make_gpt(), mesh, None, tp_dim="tp", sequence_parallel=sp)


def _loss(model, idx, tgt):
    out = model(idx)
    if isinstance(out, DTensor):
        out = out.to_local()  # Replicate on tp: every tp rank holds the full logits
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _train(sp: bool, *, clip: float | None = None, reshard: bool = True):
    mesh = _mesh()
    data = H.batches()
    ref = H.make_gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    model = fully_shard(_tp_gpt(mesh, sp), mesh, "dp", reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    dp_group = mesh.get_group("dp")
    for idx, tgt in data:
        ref_opt.zero_grad()
        loss = H.gpt_loss(ref, idx, tgt)
        loss.backward()
        ref_losses.append(loss.item())
        opt.zero_grad()
        loss = _loss(model, H.local_slice(idx, mesh), H.local_slice(tgt, mesh))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp_group)
        losses.append(total.item() / 2)
        if clip is not None:
            from vescale.optim import clip_grad_norm_

            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
            norms.append(clip_grad_norm_(model.parameters(), clip).item())
        ref_opt.step()
        opt.step()
    return mesh, model, ref, losses, ref_losses, norms, ref_norms


@pytest.mark.parametrize("sp", [False, True])
@distributed(4)
def test_fsdp_tp_matches_single_device(sp):
    mesh, model, ref, losses, ref_losses, *_ = _train(sp)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    assert model.lm_head.weight is model.wte.weight
    smesh = get_dp_engine(model).shard_mesh
    assert smesh.mesh_dim_names == ("tp", "dp")
    assert smesh.mesh.tolist() == mesh.mesh.t().tolist()
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.is_leaf and p.device_mesh is smesh, name
        assert isinstance(p.placements[1], RaggedShard), (name, p.placements)
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
    assert model.blocks[0].attn.q_proj.weight.placements[0] == Shard(0)
    assert model.blocks[0].attn.o_proj.weight.placements[0] == Shard(1)
    assert model.ln_f.weight.placements[0] == Replicate()


@distributed(4)
def test_fsdp_tp_clip_grad_norm():
    _, model, ref, losses, ref_losses, norms, ref_norms = _train(True, clip=0.5, reshard=False)
    assert ref_norms[0] > 0.5  # the clip is active
    torch.testing.assert_close(norms, ref_norms, **H.TOL)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)


@pytest.mark.parametrize("sp", [False, True])
@distributed(4)
def test_fsdp_tp_bytes(sp):
    mesh = _mesh()
    n = mesh.size(0)
    idx, tgt = H.batches(1)[0]
    idx, tgt = H.local_slice(idx, mesh), H.local_slice(tgt, mesh)
    tp_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("tp")))
    dp_ranks = tuple(dist.get_process_group_ranks(mesh.get_group("dp")))
    # tensor-parallel traffic of the TP-only model (its own grad sync included)
    tp_only = _tp_gpt(mesh, sp)
    with CommDebugMode() as comm:
        _loss(tp_only, idx, tgt).backward()
    tp_bytes = comm.get_comm_bytes_by_group()[tp_ranks]
    p_local = sum(p.to_local().numel() for p in tp_only.parameters())

    model = _tp_gpt(mesh, sp)
    old = weakref.ref(model.blocks[0].mlp.fc1.weight)
    model = fully_shard(model, mesh, "dp")
    gc.collect()
    assert old() is None  # the unsharded TP parameters are released
    engine = get_dp_engine(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    local = torch.tensor(sum(p.to_local().numel() for p in model.parameters()))
    dist.all_reduce(local, group=mesh.get_group("dp"))
    assert local.item() == p_local  # dp shards tile the TP-local tensors, no padding inside
    for _ in range(2):
        opt.zero_grad()
        engine.reset_counters()
        with CommDebugMode() as comm:
            _loss(model, idx, tgt).backward()
        opt.step()
        bound = 3 * (n - 1) / n * p_local * 4
        assert set(comm.get_comm_bytes_by_group()) <= {tp_ranks, dp_ranks}, dict(
            comm.get_comm_bytes_by_group()
        )
        assert bound <= comm.get_comm_bytes_by_group()[dp_ranks] <= 1.02 * bound, (
            comm.get_comm_bytes_by_group()[dp_ranks],
            bound,
        )
        assert comm.get_comm_bytes_by_group()[tp_ranks] == tp_bytes, (
            comm.get_comm_bytes_by_group()[tp_ranks],
            tp_bytes,
        )
        assert engine.extra_copy_bytes == 0


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)


@distributed(4)
def test_fsdp_tp_bad_input():
    mesh = _mesh()
    m = parallelize_module(
        _Odd(), mesh, {"fc.weight": [Replicate(), Shard(0)]}, allow_uneven_shards=True
    )
    with pytest.raises(ValueError, match="'fc.weight'.*different shapes"):
        fully_shard(m, mesh, "dp")
    m = parallelize_module(
        _Odd(), mesh, {"fc.bias": [Shard(0), Replicate()]}, allow_uneven_shards=True
    )
    with pytest.raises(ValueError, match="'fc.bias'.*Replicate\\(\\) on the data-parallel"):
        fully_shard(m, mesh, "dp")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
