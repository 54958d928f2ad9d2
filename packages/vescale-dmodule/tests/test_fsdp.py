"""FSDP on RaggedShard flat buffers: equivalence with single-device AdamW, bytes, copies, memory."""

from __future__ import annotations

import pytest
import torch

from vescale.dmodule._dp_common import MixedPrecision, dp_memory_bytes
from vescale.dmodule._fsdp import fully_shard, get_dp_engine
from vescale.dtensor import DTensor, Replicate
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed, load_helper
from vescale.ragged import RaggedShard

H = load_helper(__file__, "_dp_helpers")


def _fsdp_train(n, *, reshard=True, prefetch=True, micro=1, two_d=False, mp=None):
    return H.train_dp(
        lambda m, mesh: fully_shard(
            m,
            mesh,
            "dp",
            reshard_after_forward=reshard,
            prefetch=prefetch,
            mixed_precision=mp,
        ),
        n,
        micro=micro,
        two_d=two_d,
        mp=mp,
    )


@pytest.mark.parametrize(
    "n,reshard,prefetch",
    [(4, True, True), (4, False, True), (4, True, False), (4, False, False), (2, True, True)],
)
@distributed(4)
def test_fsdp_matches_single_device(n, reshard, prefetch):
    model, ref, losses, ref_losses = _fsdp_train(n, reshard=reshard, prefetch=prefetch)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    # tied weights stay one parameter
    assert model.lm_head.weight is model.wte.weight
    # sharded params are leaf DTensors, RaggedShard on dp
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.is_leaf
        assert isinstance(p.placements[0 if n == 4 else 1], RaggedShard)


@distributed(4)
def test_fsdp_grad_accumulation_no_sync():
    model, ref, losses, ref_losses = _fsdp_train(2, micro=2)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)


@distributed(4)
def test_fsdp_dp2_x_replicated_2d_mesh():
    model, ref, losses, ref_losses = _fsdp_train(2, two_d=True)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    p = model.wte.weight
    assert isinstance(p.placements[0], RaggedShard) and p.placements[1] == Replicate()


@distributed(4)
def test_fsdp_unused_parameter_some_steps():
    H.train_sometimes(lambda m, mesh: fully_shard(m, mesh, "dp", find_unused_parameters=True))


@pytest.mark.parametrize("reshard", [True, False])
@distributed(4)
def test_fsdp_bytes_copies_and_views(reshard):
    n = 4
    mesh = H.mesh_for(n)
    model = fully_shard(H.make_gpt(), mesh, "dp", reshard_after_forward=reshard)
    engine, opt, nparams, idx, tgt = H.one_batch(model, mesh)
    # zero padding: local elements over ranks == parameter count (+ planner padding)
    local = torch.tensor(sum(p.to_local().numel() for p in model.parameters()))
    torch.distributed.all_reduce(local)
    assert local.item() == nparams
    assert engine.padding_numel() <= len(engine.groups) * (n - 1)
    ptrs = {name: p.to_local().data_ptr() for name, p in model.named_parameters()}
    for _step in range(3):
        opt.zero_grad()
        engine.reset_counters()
        with CommDebugMode() as comm:
            H.gpt_loss(model, idx, tgt).backward()
        opt.step()
        sent = comm.get_total_bytes()
        factor = 3 if reshard else 2
        bound = factor * (n - 1) / n * nparams * 4
        assert bound <= sent <= 1.02 * bound, (sent, bound)
        assert engine.extra_copy_bytes == 0 and engine.cast_copy_bytes == 0
    # shards, their grads and the unsharded views are views of the flat buffers
    for _gname, fb in engine.flat_buffers():
        for pname in fb.layout.names:
            a, b = fb.layout.local_range(pname, fb.rank)
            if b > a:
                assert fb.local_view(pname).data_ptr() == fb.local.data_ptr() + 4 * a
    for name, p in model.named_parameters():
        assert (
            p.to_local().numel() == 0 or p.to_local().data_ptr() == ptrs[name]
        )  # the optimizer stepped the shards in place
    for g in engine.groups:
        for b in g.bufs:
            for pname in b.trainable:
                a, _ = b.fb.layout.local_range(pname, b.fb.rank)
                gl = b.sharded[pname].grad.to_local()
                assert gl.numel() == 0 or gl.data_ptr() == b.gshard.data_ptr() + 4 * a
                leaf = b.leaves[pname]
                off = b.fb.layout[pname].offset
                assert leaf.data_ptr() == b.full.data_ptr() + 4 * off
                assert leaf.grad.data_ptr() == b.gfull.data_ptr() + 4 * off


@distributed(4)
def test_fsdp_memory_accounting():
    n = 4
    mesh = H.mesh_for(n)
    model = fully_shard(H.make_gpt(), mesh, "dp")
    engine, opt, nparams, idx, tgt = H.one_batch(model, mesh)
    for _ in range(2):
        opt.zero_grad()
        H.gpt_loss(model, idx, tgt).backward()
        opt.step()
    mem = dp_memory_bytes(model, opt)
    nstate = len(list(model.parameters()))
    # max over ranks: slices differ by at most one element per buffer
    slack = 16 * len(engine.flat_buffers()) + 4 * nstate  # padding elements, AdamW step scalars
    assert mem["total"] <= 16 * nparams / n + slack + engine.largest_group_bytes(), mem
    assert mem["engine"] == 0, mem  # no unsharded buffer outlives a step
    assert mem["params"] + mem["grads"] <= 8 * nparams / n + slack


@distributed(4)
def test_fsdp_bf16_mixed_precision():
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, ref, losses, ref_losses = _fsdp_train(4, mp=mp)
    # masters stay fp32, compute in bf16: within single-device bf16 autocast tolerance
    assert all(p.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(losses, ref_losses, atol=3e-2, rtol=3e-2)
    H.assert_params_close(model, ref, atol=3e-2, rtol=3e-2)
    engine = get_dp_engine(model)
    assert engine.extra_copy_bytes == 0 and engine.cast_copy_bytes > 0


@distributed(4)
def test_fsdp_bad_input():
    from vescale.dmodule import replicate

    mesh = H.check_bad_input(fully_shard, replicate)
    with pytest.raises(ValueError, match="matches no submodule"):
        fully_shard(H.make_gpt(), mesh, "dp", groups=["nope"])
