"""Bad input gets a clear error naming what was wrong, before any collective."""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor import Shard, distribute_tensor, init_device_mesh, redistribute
from vescale.dtensor.testing import distributed


@distributed(2, timeout=60)
def test_shard_dim_out_of_range_is_named_as_given():
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(
        ValueError, match=r"Shard\(dim=-3\) on mesh dim 0 is out of range for a 2-dim tensor"
    ):
        distribute_tensor(torch.ones(4, 4), mesh, [Shard(-3)])
    dt = distribute_tensor(torch.arange(16.0).view(4, 4), mesh, [Shard(-2)])
    assert dt.to_local().shape == (2, 4)
    with pytest.raises(
        ValueError, match=r"Shard\(dim=2\) on mesh dim 0 is out of range for a 2-dim tensor"
    ):
        redistribute(dt, mesh, [Shard(2)])
