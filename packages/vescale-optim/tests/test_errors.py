"""Bad input gives clear errors."""

from __future__ import annotations

import pytest
import torch

from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import distributed
from vescale.optim import DistributedOptimizer, Muon


@pytest.mark.parametrize("cls", [torch.optim.Muon, torch.optim.LBFGS, torch.optim.SparseAdam])
def test_non_elementwise_optimizer_refused(cls):
    with pytest.raises(TypeError, match="vescale.optim.Muon"):
        DistributedOptimizer([torch.zeros(2)], cls, mesh=None, dp_dim=0)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="Optimizer subclass"):
        DistributedOptimizer([torch.zeros(2)], object, mesh=None, dp_dim=0)


def test_muon_rejects_forced_non_matrix():
    with pytest.raises(ValueError, match="2-D"):
        Muon([{"params": [torch.nn.Parameter(torch.zeros(3))], "use_muon": True}])


def _clear_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from vescale.dtensor import _redistribute

    _clear_sharding_prop_cache()
    _redistribute._clear_caches()


@distributed(2)
def test_bad_params_and_dims():
    _clear_caches()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    good = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="is not in the mesh"):
        DistributedOptimizer([good], torch.optim.AdamW, mesh=mesh, dp_dim="tp")
    with pytest.raises(ValueError, match="out of range"):
        DistributedOptimizer([good], torch.optim.AdamW, mesh=mesh, dp_dim=3)
    with pytest.raises(TypeError, match="plain tensor, not a DTensor"):
        DistributedOptimizer(
            [torch.nn.Parameter(torch.zeros(3))], torch.optim.AdamW, mesh=mesh, dp_dim="dp"
        )
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="replicated over the data-parallel dim"):
        DistributedOptimizer([sharded], torch.optim.AdamW, mesh=mesh, dp_dim="dp")
    other = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="not on the optimizer's mesh"):
        DistributedOptimizer([good], torch.optim.AdamW, mesh=other, dp_dim="dp")
    # overlap needs the model (its forward pre-hooks wait for the gathers)
    with pytest.raises(ValueError, match="overlap_param_gather=True needs the model"):
        DistributedOptimizer(
            [good], torch.optim.AdamW, mesh=mesh, dp_dim="dp", overlap_param_gather=True
        )
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        DistributedOptimizer([good], torch.optim.AdamW, mesh=mesh, dp_dim="dp", bucket_cap_mb=0)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        DistributedOptimizer([good], torch.optim.AdamW, mesh=mesh, dp_dim="dp", model=model)
