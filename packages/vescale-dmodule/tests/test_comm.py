"""Collectives of one transformer block under TP=2: exactly Megatron's, no hidden extras."""

from __future__ import annotations

import torch

from vescale.dmodule import parallelize_module
from vescale.dmodule.testing import Block, GPTConfig
from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


def _kinds(cm) -> dict[str, int]:
    out: dict[str, int] = {}
    for k, v in cm.get_comm_counts().items():
        name = str(k).split(".")[-1].rstrip("')").strip("_")
        name = {"allreduce": "all_reduce"}.get(name, name)
        out[name] = out.get(name, 0) + v
    return {k: v for k, v in out.items() if v}


def _block_comms(sp: bool):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    block = parallelize_module(Block(GPTConfig()), mesh, None, sequence_parallel=sp)
    x = torch.randn(2, 8, 32)
    x = distribute_tensor(x, mesh, [Shard(1) if sp else Replicate()], src_data_rank=None)
    x.requires_grad_(True)
    with CommDebugMode() as fwd:
        y = block(x)
    with CommDebugMode() as bwd:
        y.to_local().sum().backward()
    return _kinds(fwd), _kinds(bwd)


@distributed(2)
def test_block_tp_collectives():
    fwd, bwd = _block_comms(sp=False)
    # Row-parallel outputs (attn o_proj, mlp fc2): one all-reduce each.
    assert fwd == {"all_reduce": 2}, fwd
    # Column-parallel inputs: the Partial input gradients are summed once each.
    assert bwd == {"all_reduce": 2}, bwd


@distributed(2)
def test_block_sp_collectives():
    fwd, bwd = _block_comms(sp=True)
    # Gather after each norm, reduce-scatter after each row-parallel linear.
    assert fwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, fwd
    # Their transposes in backward, plus ONE bucketed all-reduce for every Partial
    # gradient (ln_1/ln_2 weight+bias, o_proj/fc2 bias).
    assert bwd == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 1}, bwd
