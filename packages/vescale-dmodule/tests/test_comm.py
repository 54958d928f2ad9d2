"""Collectives of one transformer block under TP=2: exactly Megatron's, no hidden extras."""

from __future__ import annotations

import torch

from vescale.dmodule import parallelize_module
from vescale.dmodule.testing import Block, GPTConfig
from vescale.dtensor import Replicate, Shard, _compat, distribute_tensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed

# Where torch's strict view rule cannot flatten (batch, heads) with the heads sharded
# (torch 2.11), vescale-dtensor's compat module falls back to the reshape rule: the
# attention's 4-D matmuls then gather their head-sharded operands, 3 all-gathers forward
# and 1 backward (see docs/torch_versions.md). Elsewhere the block is exactly Megatron's.
_VIEW_FALLBACK = _compat.check_torch_internals()[
    "DTensor _unsafe_view flattening a sharded inner dim (4-D matmuls)"
].startswith("fallback")
FWD_EXTRA, BWD_EXTRA = (3, 1) if _VIEW_FALLBACK else (0, 0)


def _plus_gathers(counts: dict[str, int], extra: int) -> dict[str, int]:
    out = dict(counts)
    if extra:
        out["all_gather_into_tensor"] = out.get("all_gather_into_tensor", 0) + extra
    return out


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
    assert fwd == _plus_gathers({"all_reduce": 2}, FWD_EXTRA), fwd
    # Column-parallel inputs: the Partial input gradients are summed once each.
    assert bwd == _plus_gathers({"all_reduce": 2}, BWD_EXTRA), bwd


@distributed(2)
def test_block_sp_collectives():
    fwd, bwd = _block_comms(sp=True)
    # Gather after each norm, reduce-scatter after each row-parallel linear.
    assert fwd == _plus_gathers(
        {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, FWD_EXTRA
    ), fwd
    # Their transposes in backward, plus ONE bucketed all-reduce for every Partial
    # gradient (ln_1/ln_2 weight+bias, o_proj/fc2 bias).
    assert bwd == _plus_gathers(
        {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2, "all_reduce": 1}, BWD_EXTRA
    ), bwd
