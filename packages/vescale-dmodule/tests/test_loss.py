"""vocab_parallel_cross_entropy matches F.cross_entropy in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vescale.dmodule import vocab_parallel_cross_entropy
from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


@distributed(2)
def test_matches_cross_entropy():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    full = torch.randn(3, 5, 16) * 4
    target = torch.randint(0, 16, (3, 5))
    target[0, :2] = -100
    for reduction in ("mean", "sum", "none"):
        ref_logits = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), reduction=reduction)
        ref = ref.view(3, 5) if reduction == "none" else ref
        logits = distribute_tensor(full, mesh, [Shard(-1)], src_data_rank=None).requires_grad_()
        with CommDebugMode() as fwd:
            loss = vocab_parallel_cross_entropy(logits, target, reduction=reduction)
        assert fwd.get_total_counts() == 2  # max, then (sum-exp, target logit) stacked
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        w = torch.randn_like(ref)
        with CommDebugMode() as bwd:
            (loss * w).sum().backward()
        assert bwd.get_total_counts() == 0
        (ref * w).sum().backward()
        assert logits.grad.placements == (Shard(2),)
        assert logits.grad.to_local().shape == (3, 5, 8)  # never the full vocab
        torch.testing.assert_close(logits.grad.full_tensor(), ref_logits.grad, atol=1e-5, rtol=1e-5)


@distributed(2)
def test_rejects_bad_layouts():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0)], src_data_rank=None)
    with pytest.raises(ValueError, match="Shard on the last"):
        vocab_parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long))
    y = distribute_tensor(torch.randn(4, 8), mesh, [Replicate()], src_data_rank=None)
    with pytest.raises(ValueError, match="exactly one mesh dim"):
        vocab_parallel_cross_entropy(y, torch.zeros(4, dtype=torch.long))
    z = distribute_tensor(torch.randn(4, 8), mesh, [Shard(1)], src_data_rank=None)
    with pytest.raises(ValueError, match="does not match"):
        vocab_parallel_cross_entropy(z, torch.zeros(5, dtype=torch.long))
