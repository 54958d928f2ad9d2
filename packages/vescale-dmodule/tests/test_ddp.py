"""DDP with bucketed, overlapped all-reduce: equivalence with single-device AdamW, bytes, views."""

from __future__ import annotations

import pytest
import torch

from vescale.debug import enable_gradient_sync_debug
from vescale.dmodule._ddp import replicate
from vescale.dmodule._dp_common import dp_memory_bytes
from vescale.dmodule._fsdp import fully_shard, get_dp_engine, no_sync
from vescale.dtensor import DTensor
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed, load_helper

H = load_helper(__file__, "_dp_helpers")

SMALL_BUCKETS = 0.004  # MiB: several buckets for the test GPT


def _ddp_train(n, *, micro=1, two_d=False, bucket_cap_mb=SMALL_BUCKETS):
    return H.train_dp(
        lambda m, mesh: replicate(m, mesh, "dp", bucket_cap_mb=bucket_cap_mb),
        n,
        micro=micro,
        two_d=two_d,
    )


@pytest.mark.parametrize("n", [2, 4])
@distributed(4)
def test_ddp_matches_single_device(n):
    model, ref, losses, ref_losses = _ddp_train(n)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)
    assert len(get_dp_engine(model).buckets) > 2
    assert model.lm_head.weight is model.wte.weight  # tied weights stay tied
    for p in model.parameters():  # plain replicas: the optimizer runs on plain tensors
        assert type(p) is torch.nn.Parameter and not isinstance(p, DTensor)
        assert type(p.grad) is torch.Tensor


@distributed(4)
def test_ddp_grad_accumulation_and_2d_mesh():
    model, ref, losses, ref_losses = _ddp_train(2, micro=2, two_d=True)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)


@distributed(4)
def test_ddp_unused_parameter_some_steps():
    H.train_sometimes(lambda m, mesh: replicate(m, mesh, "dp", bucket_cap_mb=0.0005))


@distributed(4)
def test_ddp_bytes_views_and_overlap():
    n = 4
    mesh = H.mesh_for(n)
    model = replicate(H.make_gpt(), mesh, "dp", bucket_cap_mb=SMALL_BUCKETS)
    engine, opt, nparams, idx, tgt = H.one_batch(model, mesh)
    for _ in range(2):
        opt.zero_grad()
        with CommDebugMode() as comm:
            H.gpt_loss(model, idx, tgt).backward()
        opt.step()
        bound = 2 * (n - 1) / n * nparams * 4
        sent = comm.get_total_bytes()
        assert bound <= sent <= 1.02 * bound, (
            sent,
            bound,
            dict(comm.get_comm_bytes()),
            comm.get_comm_counts(),
        )
        assert engine.extra_copy_bytes == 0
        # every bucket but the last-ready one started before backward ended
        log = engine.launch_log
        assert log.index(-1) >= len(engine.buckets) - 1, log
    for b in engine.buckets:
        for p, (a, _), gv in zip(b.params, b.ranges, b.grad_views):
            assert p.grad is gv
            assert p.grad.data_ptr() == b.buf.data_ptr() + a * 4
    mem = dp_memory_bytes(model, opt)
    assert mem["params"] == 4 * nparams and mem["optim"] >= 8 * nparams


@distributed(4)
def test_ddp_gradient_sync_debug_catches_desync():
    from vescale.debug import GradientSyncError

    mesh = H.mesh_for(2)
    model = replicate(H.make_gpt(), mesh, "dp")
    handle = enable_gradient_sync_debug(model)
    idx, tgt = H.batches(1)[0]
    idx, tgt = H.local_slice(idx, mesh), H.local_slice(tgt, mesh)
    H.gpt_loss(model, idx, tgt).backward()  # synchronised: no error
    model.zero_grad()
    with pytest.raises(GradientSyncError, match="wte.weight"):
        with no_sync(model):  # a replica whose gradients were never synchronised
            H.gpt_loss(model, idx, tgt).backward()
    handle.remove()


@distributed(4)
def test_ddp_bad_input():
    H.check_bad_input(replicate, fully_shard)
