"""HSDP: ``data_parallel={"rep": "ddp", "shard": "fsdp"}``.

Parameters are ``RaggedShard`` on the shard dim and ``Replicate()`` on the rep dim;
each group's gradient is reduce-scattered over shard, then all-reduced over rep.
Equivalence with single-device AdamW (losses and parameters after 5 steps, 1e-5),
bytes per group, ``no_sync``, mixed precision, TP on a third dim (8 ranks), and
the errors for bad ``data_parallel`` specs.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vescale.dmodule import DModule, MixedPrecision, get_dp_engine, no_sync
from vescale.dmodule._activation_checkpoint import is_checkpointed
from vescale.dmodule._fsdp import fully_shard
from vescale.dmodule.testing import MLP
from vescale.dtensor import DeviceMesh, DTensor, Replicate, Shard, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed, load_helper
from vescale.ragged import RaggedShard

H = load_helper(__file__, "_dp_helpers")


def hsdp_mesh(tp: bool = False) -> DeviceMesh:
    H.fresh_caches()
    if tp:
        return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))


def dp_slice(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's part of the global batch: data-parallel index rep * S + shard."""
    r, s = mesh.get_local_rank("rep"), mesh.get_local_rank("shard")
    n = mesh.size(mesh.mesh_dim_names.index("rep")) * mesh.size(mesh.mesh_dim_names.index("shard"))
    k = t.shape[0] // n
    i = r * mesh.size(mesh.mesh_dim_names.index("shard")) + s
    return t[i * k : (i + 1) * k]


def dp_ranks(mesh: DeviceMesh, dim: str) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(mesh.get_group(dim)))


def loss_fn(model, idx, tgt):
    out = model(idx)
    if isinstance(out, DTensor):
        out = out.to_local()  # Replicate on tp
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), tgt.reshape(-1))


def train_hsdp(
    *, tp=False, micro=1, mp=None, ac=None, sp=False, **fsdp
) -> tuple[torch.nn.Module, torch.nn.Module, list[float], list[float]]:
    mesh = hsdp_mesh(tp)
    data = H.batches()
    ref = H.make_gpt()
    ref_losses = H.train_reference(ref, data, micro=micro, autocast=mp is not None)
    shard = {"mode": "fsdp", **fsdp}
    if mp is not None:
        shard["mixed_precision"] = mp
    opts = {"data_parallel": {"rep": "ddp", "shard": shard}}
    if ac is not None:
        opts["activation_checkpointing"] = ac
    if tp:
        model = DModule(H.make_gpt(), mesh, None, tp_dim="tp", sequence_parallel=sp, **opts)
    else:
        model = DModule(H.make_gpt(), mesh, **opts)
    # tp ranks hold equal losses: the mean over all ranks
    losses, _ = H.train_steps(
        model, mesh, data, micro=micro, batch_slice=dp_slice, loss=loss_fn, group=None
    )
    return model, ref, losses, ref_losses


@pytest.mark.parametrize(
    "reshard,prefetch", [(True, True), (False, True), (True, False), (False, False)]
)
@distributed(4)
def test_hsdp_matches_single_device(reshard, prefetch):
    model, ref, losses, ref_losses = train_hsdp(reshard_after_forward=reshard, prefetch=prefetch)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    assert model.lm_head.weight is model.wte.weight
    engine = get_dp_engine(model)
    assert engine.rep_world == 2 and engine.world == 2
    mesh = engine.mesh
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.is_leaf and p.device_mesh is mesh, name
        assert p.placements[0] == Replicate(), (name, p.placements)
        assert isinstance(p.placements[1], RaggedShard), (name, p.placements)
        assert p.grad.placements == p.placements
    # replicas along "rep" hold the same shards; shards along "shard" tile the parameter
    w = model.blocks[0].mlp.fc1.weight.to_local().detach().clone()
    peers = [torch.empty_like(w) for _ in range(2)]
    dist.all_gather(peers, w, group=mesh.get_group("rep"))
    torch.testing.assert_close(peers[0], peers[1], atol=0, rtol=0)


@distributed(4)
def test_hsdp_grad_accumulation_no_sync():
    model, ref, losses, ref_losses = train_hsdp(micro=2)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)


@distributed(4)
def test_hsdp_bf16_mixed_precision():
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, ref, losses, ref_losses = train_hsdp(mp=mp)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(losses, ref_losses, atol=3e-2, rtol=3e-2)
    H.assert_params_close(model, ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("reshard", [True, False])
@distributed(4)
def test_hsdp_bytes(reshard):
    mesh = hsdp_mesh()
    model = DModule(
        H.make_gpt(),
        mesh,
        data_parallel={"rep": "ddp", "shard": {"mode": "fsdp", "reshard_after_forward": reshard}},
    )
    engine = get_dp_engine(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nparams = sum(p.numel() for p in model.parameters())
    shard_elems = sum(b.gshard.numel() for g in engine.groups for b in g.bufs)
    S = R = 2
    idx, tgt = H.batches(1)[0]
    idx, tgt = dp_slice(idx, mesh), dp_slice(tgt, mesh)
    shard_g, rep_g = dp_ranks(mesh, "shard"), dp_ranks(mesh, "rep")
    for _ in range(2):
        opt.zero_grad()
        with CommDebugMode() as comm:
            loss_fn(model, idx, tgt).backward()
        opt.step()
        by_group = comm.get_comm_bytes_by_group()
        assert set(by_group) == {shard_g, rep_g}, dict(by_group)
        factor = 3 if reshard else 2
        bound = factor * (S - 1) / S * nparams * 4
        assert bound <= by_group[shard_g] <= 1.02 * bound, (by_group[shard_g], bound)
        # one all-reduce of this rank's gradient shard (exact), ~ 2(R-1)/R * P/S, and
        # the unused-parameter flags (one fp32 per trainable parameter)
        flags = sum(len(b.trainable) for g in engine.groups for b in g.bufs)
        want = 2 * (R - 1) / R * (shard_elems + flags) * 4
        assert by_group[rep_g] == want, (by_group[rep_g], shard_elems, flags)
        rep_bound = 2 * (R - 1) / R * nparams / S * 4
        assert abs(by_group[rep_g] - rep_bound) <= 0.02 * rep_bound, (by_group[rep_g], rep_bound)
        assert engine.extra_copy_bytes == 0
    # under no_sync: neither the reduce-scatter nor the all-reduce runs
    opt.zero_grad()
    with no_sync(model), CommDebugMode() as comm:
        loss_fn(model, idx, tgt).backward()
    assert rep_g not in comm.get_comm_bytes_by_group()
    gathers = (2 if reshard else 1) * (S - 1) / S * nparams * 4
    assert comm.get_comm_bytes_by_group()[shard_g] <= 1.02 * gathers


def _mlp_3d_body(ac: bool):
    # A tiny MLP keeps DTensor's sharding propagation on a 3-D mesh cheap (the test GPT's
    # 4-D attention matmuls take minutes to plan there on this machine).
    mesh = hsdp_mesh(tp=True)
    torch.manual_seed(0)
    ref = MLP(dim=16, hidden=32)
    torch.manual_seed(0)
    model = DModule(
        MLP(dim=16, hidden=32),
        mesh,
        None,
        tp_dim="tp",
        data_parallel={"rep": "ddp", "shard": "fsdp"},
        activation_checkpointing=[r"fc2"] if ac else None,
    )
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    losses, ref_losses = [], []
    for _ in range(H.STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        opt_r.zero_grad()
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        ref_losses.append(loss.item())
        opt_r.step()
        opt.zero_grad()
        out = model(dp_slice(x, mesh))
        out = out.to_local() if isinstance(out, DTensor) else out
        loss = F.mse_loss(out, dp_slice(y, mesh))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # tp ranks hold equal losses: the mean over all ranks
        losses.append(total.item() / dist.get_world_size())
        opt.step()
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    engine = get_dp_engine(model)
    smesh = engine.shard_mesh
    assert smesh.mesh_dim_names == ("rep", "tp", "shard")
    assert engine.rep_world == 2 and engine.world == 2
    for name, p in model.named_parameters():
        assert p.device_mesh is smesh, name
        assert p.placements[0] == Replicate(), (name, p.placements)
        assert isinstance(p.placements[2], RaggedShard), (name, p.placements)
        assert p.grad.placements == p.placements, name
    assert model.fc1.weight.placements[1] == Shard(0)  # column parallel
    assert model.fc2.weight.placements[1] == Shard(1)  # row parallel


@pytest.mark.slow
@distributed(8, timeout=600)
def test_hsdp_tp_3d_matches_single_device():
    # 8 gloo ranks: (rep 2, shard 2, tp 2) with the automatic Megatron plan
    _mlp_3d_body(ac=False)


@pytest.mark.slow
@distributed(8, timeout=600)
def test_hsdp_tp_3d_activation_checkpointing():
    _mlp_3d_body(ac=True)


@pytest.mark.parametrize("reshard", [True, False])
@distributed(4)
def test_hsdp_activation_checkpointing(reshard):
    model, ref, losses, ref_losses = train_hsdp(ac=True, reshard_after_forward=reshard)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    assert [n for n, m in model.named_modules() if is_checkpointed(m)] == ["blocks.0", "blocks.1"]


@distributed(4)
def test_hsdp_bad_input():
    mesh = hsdp_mesh()
    with pytest.raises(ValueError, match=r"'fsdp' on two mesh dims \('rep' and 'shard'\)"):
        DModule(H.make_gpt(), mesh, data_parallel={"rep": "fsdp", "shard": "fsdp"})
    with pytest.raises(ValueError, match=r"'ddp' on two mesh dims \('rep' and 'shard'\)"):
        DModule(H.make_gpt(), mesh, data_parallel={"rep": "ddp", "shard": "ddp"})
    with pytest.raises(ValueError, match=r"'rep' and 0 are the same mesh dim 'rep'"):
        DModule(H.make_gpt(), mesh, data_parallel={"rep": "ddp", 0: "fsdp"})
    with pytest.raises(ValueError, match=r"replicate dim 'rep' takes no DDP options"):
        DModule(
            H.make_gpt(),
            mesh,
            data_parallel={"rep": {"mode": "ddp", "bucket_cap_mb": 1}, "shard": "fsdp"},
        )
    with pytest.raises(ValueError, match=r"'nope' is not a mesh dim"):
        DModule(H.make_gpt(), mesh, data_parallel={"nope": "ddp", "shard": "fsdp"})
    with pytest.raises(ValueError, match=r"is the sharded dim"):
        fully_shard(H.make_gpt(), mesh, "shard", replicate_dim=1)
    with pytest.raises(ValueError, match=r"'x' is not in the mesh"):
        fully_shard(H.make_gpt(), mesh, "shard", replicate_dim="x")
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    with pytest.raises(ValueError, match=r"3 mesh dims \('a', 'b', 'c'\)"):
        DModule(H.make_gpt(), mesh3, data_parallel={"a": "ddp", "b": "fsdp", "c": "ddp"})
