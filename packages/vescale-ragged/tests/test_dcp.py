"""Plain torch.distributed.checkpoint on RaggedShard DTensors: no gathering, exact resharding."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed
from vescale.ragged import RaggedShard

SHAPE = (12, 5, 3)


def _dense(name: str) -> torch.Tensor:
    seed = {"a": 1, "b": 2, "c": 3}[name]
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _save_layouts(mesh):
    return {
        "a": [RaggedShard((0, 1, 2), (1, 2, 0, 1))],  # element ranges: not box-shaped
        "b": [RaggedShard((0,), (0, 1, 0, 2))],  # whole rows, zeros allowed
        "c": [RaggedShard((0, 1), (1, 1, 1, 1))],
    }


@distributed(4)
def _save_and_reshard(path: str):
    mesh = init_device_mesh("cpu", (4,))
    sd = {k: distribute_tensor(_dense(k), mesh, pl) for k, pl in _save_layouts(mesh).items()}
    with CommDebugMode() as cm:
        dcp.save(sd, checkpoint_id=path)
    kinds = {str(k) for k in cm.get_comm_counts()}
    # DCP's own planning exchanges small objects; no tensor data is gathered
    assert not any(("all_gather_into_tensor" in k or "all_reduce" in k) for k in kinds), kinds
    # load into other layouts: other units, Shard, Replicate
    targets = {
        "a": [RaggedShard((0,), (3, 0, 1, 2))],
        "b": [Shard(1)],
        "c": [Replicate()],
    }
    out = {k: distribute_tensor(torch.zeros(SHAPE), mesh, pl) for k, pl in targets.items()}
    dcp.load(out, checkpoint_id=path)
    for k, v in out.items():
        assert v.placements == tuple(targets[k])
        assert torch.equal(v.full_tensor(), _dense(k)), k
    # and back into RaggedShard from a Shard-saved checkpoint
    dcp.save({"s": distribute_tensor(_dense("a"), mesh, [Shard(0)])}, checkpoint_id=path + "-s")
    back = {"s": distribute_tensor(torch.zeros(SHAPE), mesh, [RaggedShard((0, 1), (2, 1, 1, 0))])}
    dcp.load(back, checkpoint_id=path + "-s")
    assert torch.equal(back["s"].full_tensor(), _dense("a"))
    dist.barrier()


@distributed(2)
def _load_on_two(path: str):
    mesh = init_device_mesh("cpu", (2,))
    out = {"a": distribute_tensor(torch.zeros(SHAPE), mesh, [RaggedShard((0, 1), (1, 3))])}
    dcp.load(out, checkpoint_id=path)
    assert torch.equal(out["a"].full_tensor(), _dense("a"))


def test_dcp_save_ragged_and_reshard(tmp_path):
    path = str(tmp_path / "ckpt")
    _save_and_reshard(path)
    _load_on_two(path)
    # a single process with plain tensors
    plain = {k: torch.zeros(SHAPE) for k in ("a", "b", "c")}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for k, v in plain.items():
        assert torch.equal(v, _dense(k)), k
