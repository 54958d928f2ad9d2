"""Tests of ``vescale.dtensor.debug.CommDebugMode``: counts and exact bytes per rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

from vescale.dtensor import collectives as vc
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.dtensor.testing import distributed, run_on_ranks

funcol = torch.ops.c10d_functional
c10d = torch.ops.c10d
F32 = 4


def _redistribute_body():
    n, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", list(range(n)))
    full = torch.arange(32.0).view(8, 4)
    full_bytes = full.numel() * F32
    shard_bytes = full_bytes // n

    # Shard(0) -> Replicate: one all-gather; each rank sends (N-1)/N of the output.
    dt = distribute_tensor(full, mesh, [Shard(0)])
    with CommDebugMode() as comm:
        out = dt.redistribute(mesh, [Replicate()]).to_local()
    assert torch.equal(out, full)
    assert comm.get_comm_counts() == {funcol.all_gather_into_tensor: 1}
    assert comm.get_comm_bytes() == {funcol.all_gather_into_tensor: (n - 1) * shard_bytes}
    assert comm.get_total_bytes() == (n - 1) * full_bytes // n
    assert comm.get_total_counts() == 1

    # Partial -> Replicate: one all-reduce, 2 (N-1)/N of the bytes.
    local = full * (rank + 1)
    partial = DTensor.from_local(local, mesh, [Partial()])
    with CommDebugMode() as comm:
        out = partial.redistribute(mesh, [Replicate()]).to_local()
    assert torch.equal(out, full * sum(range(1, n + 1)))
    assert comm.get_comm_counts() == {funcol.all_reduce: 1}
    assert comm.get_comm_bytes() == {funcol.all_reduce: 2 * (n - 1) * full_bytes // n}

    # Partial -> Shard(0): one reduce-scatter, (N-1)/N of the input.
    with CommDebugMode() as comm:
        out = partial.redistribute(mesh, [Shard(0)]).to_local()
    assert torch.equal(out, (full * sum(range(1, n + 1))).chunk(n)[rank])
    assert comm.get_comm_counts() == {funcol.reduce_scatter_tensor: 1}
    assert comm.get_comm_bytes() == {funcol.reduce_scatter_tensor: (n - 1) * full_bytes // n}

    # Same counts as torch's own CommDebugMode.
    with TorchCommDebugMode() as theirs:
        partial.redistribute(mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    with CommDebugMode() as ours:
        partial.redistribute(mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    assert dict(ours.get_comm_counts()) == dict(theirs.get_comm_counts())
    assert ours.get_total_bytes() == (n - 1) * full_bytes // n + (n - 1) * shard_bytes


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtensor_redistribute_bytes(world_size):
    run_on_ranks(_redistribute_body, world_size)


def _vescale_collectives_body():
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.ones(3, 5)  # 60 bytes
    with CommDebugMode() as comm:
        vc.all_reduce(x, op="avg")
    assert comm.get_comm_counts() == {funcol.all_reduce: 1}
    assert comm.get_comm_bytes() == {funcol.all_reduce: 2 * (n - 1) * 60 // n}

    sizes = [3, 0, 2, 5][:n] if n == 4 else [3, 1]
    piece = torch.ones(sizes[rank], 2)  # 8 bytes per row
    biggest = max(sizes)
    with CommDebugMode() as comm:
        vc.all_gather_uneven(piece, sizes=sizes, method="pad")
    assert comm.get_comm_bytes() == {funcol.all_gather_into_tensor: (n - 1) * biggest * 8}
    with CommDebugMode() as comm:
        vc.all_gather_uneven(piece, sizes=sizes, method="all_to_all")
    assert comm.get_comm_counts() == {funcol.all_to_all_single: 1}
    assert comm.get_comm_bytes() == {funcol.all_to_all_single: (n - 1) * sizes[rank] * 8}
    with CommDebugMode() as comm:  # sizes exchanged first: a 2-element int64 all-gather
        vc.all_gather_uneven(piece, method="pad")
    assert comm.get_comm_counts() == {funcol.all_gather_into_tensor: 2}
    assert comm.get_comm_bytes() == {funcol.all_gather_into_tensor: (n - 1) * (16 + biggest * 8)}

    full = torch.ones(sum(sizes), 2)
    with CommDebugMode() as comm:
        vc.reduce_scatter_uneven(full, sizes)
    assert comm.get_comm_bytes() == {funcol.reduce_scatter_tensor: (n - 1) * biggest * 8}

    rows_to = [1 if j != rank else 4 for j in range(n)]
    with CommDebugMode() as comm:
        vc.all_to_all_single_uneven(
            torch.ones(sum(rows_to), 3), [1 if j != rank else 4 for j in range(n)], rows_to
        )
    assert comm.get_comm_bytes() == {funcol.all_to_all_single: (n - 1) * 12}

    tensors = [torch.ones(4, 3), torch.ones(8)]  # 48 + 32 = 80 bytes
    with CommDebugMode() as comm:
        vc.all_gather_coalesced(tensors)
        vc.reduce_scatter_coalesced(tensors)
        vc.all_reduce_coalesced(tensors)
    assert comm.get_comm_counts() == {
        funcol.all_gather_into_tensor: 1,
        funcol.reduce_scatter_tensor: 1,
        funcol.all_reduce: 1,
    }
    assert comm.get_comm_bytes() == {
        funcol.all_gather_into_tensor: (n - 1) * 80,
        funcol.reduce_scatter_tensor: (n - 1) * 80 // n,
        funcol.all_reduce: 2 * (n - 1) * 80 // n,
    }
    with CommDebugMode() as comm:  # one collective per dtype
        vc.all_reduce_coalesced(
            [*tensors, torch.ones(2, dtype=torch.bfloat16)], async_op=True
        ).wait()
    assert comm.get_comm_counts() == {funcol.all_reduce: 2}
    assert comm.get_comm_bytes() == {
        funcol.all_reduce: 2 * (n - 1) * 80 // n + 2 * (n - 1) * 4 // n
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_vescale_collectives_bytes(world_size):
    run_on_ranks(_vescale_collectives_body, world_size)


@distributed(4)
def test_eager_torch_distributed_calls_are_counted():
    rank = dist.get_rank()
    with CommDebugMode() as comm:
        dist.all_reduce(torch.ones(10))  # 40 bytes
        dist.broadcast(torch.ones(6), src=0)  # 24 bytes
        splits = [4 if j == rank else 1 for j in range(4)]  # 4 rows stay, 1 row to each other rank
        dist.all_to_all_single(torch.empty(7), torch.ones(7), splits, splits)
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(2))
    assert comm.get_comm_counts() == {
        c10d.allreduce_: 1,
        c10d.broadcast_: 1,
        c10d.alltoall_base_: 1,
        c10d._allgather_base_: 1,
    }
    assert comm.get_comm_bytes() == {
        c10d.allreduce_: 60,
        c10d.broadcast_: 24,
        c10d.alltoall_base_: 12,
        c10d._allgather_base_: 24,
    }
    assert comm.get_total_bytes() == 120
    # a fresh context starts from zero
    with comm:
        pass
    assert comm.get_total_bytes() == 0 and comm.get_total_counts() == 0


@distributed(4)
def test_bytes_split_by_process_group():
    from vescale.dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0), Shard(1)])  # local 4x4 fp32 = 64 B
    with CommDebugMode() as comm:
        x.full_tensor()
    dp = tuple(dist.get_process_group_ranks(mesh.get_group("dp")))
    tp = tuple(dist.get_process_group_ranks(mesh.get_group("tp")))
    by_group = comm.get_comm_bytes_by_group()
    # gather on tp first: (2-1)/2 * 2*64 B; then dp: (2-1)/2 * 4*64 B
    assert by_group == {tp: 64, dp: 128}, dict(by_group)
    assert sum(by_group.values()) == comm.get_total_bytes()
