"""``F.scaled_dot_product_attention`` on DTensors on CPU (torch 2.13 has no rule for its
CPU flash kernel; vescale-dtensor registers torch's CUDA flash rules for it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


@distributed(2)
def test_sdpa_sharded_on_heads_or_batch_matches_dense():
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.square().sum().backward()
    for placement in (Shard(1), Shard(0), Replicate()):
        ins = [distribute_tensor(t, mesh, [placement]).detach().requires_grad_() for t in (q, k, v)]
        with CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(*ins, is_causal=True)
            out.to_local().square().sum().backward()
        assert comm.get_total_counts() == 0, (placement, comm.get_comm_counts())
        assert out.placements == (placement,)
        torch.testing.assert_close(out.full_tensor(), ref, atol=1e-5, rtol=1e-5)
        for t, r in zip(ins, ref_in):
            assert t.grad.placements == (placement,)
            # sharded: the ranks' losses sum to the dense one; replicated: each is it
            torch.testing.assert_close(t.grad.full_tensor(), r.grad, atol=1e-5, rtol=1e-5)


@distributed(2)
def test_sdpa_with_a_mask_says_what_to_do():
    mesh = init_device_mesh("cpu", (2,))
    q = distribute_tensor(torch.randn(2, 4, 6, 8), mesh, [Shard(1)])
    mask = distribute_tensor(torch.ones(6, 6, dtype=torch.bool).tril(), mesh, [Replicate()])
    with pytest.raises(NotImplementedError, match="is_causal=True"):
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
