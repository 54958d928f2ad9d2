"""What drawing random values as one device would costs each rank.

vescale draws a random op on a sharded DTensor (or, inside ``data_parallel_rng``,
on a rank's part of the batch) by drawing the whole tensor on every rank and keeping
the rank's boxes, so each rank does the random work of the full tensor. This runs
dropout on an activation-sized tensor on N gloo ranks and prints, per placement,
the time per call against the PyTorch baseline: plain ``F.dropout`` on a tensor of
the local shard's shape (what each rank draws without vescale), and torch's own
DTensor path (vescale's drawing turned off), with the ratio and the bytes of the
full-size temporary.

Usage::

    python benchmarks/rng_bench.py [--world 4] [--shape 8 128 1024] [--iters 20]
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp
from _summary import emit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _best(fn, iters: int, rounds: int = 5) -> float:
    for _ in range(2):
        fn()
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3  # ms


def _rank(rank: int, world: int, port: int, shape: list[int], iters: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from vescale.dtensor import random as vrandom

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",))
    full = torch.randn(shape)
    rows = []
    cases = [
        ("Shard(0) (batch / FSDP x TP rows)", [Shard(0)]),
        ("Shard(1) (sequence parallel)", [Shard(1)]),
        (f"Shard({len(shape) - 1}) (tensor-parallel hidden)", [Shard(len(shape) - 1)]),
        ("Replicate", [Replicate()]),
    ]
    for name, placements in cases:
        x = distribute_tensor(full, mesh, placements, src_data_rank=None)
        local = x.to_local().clone()
        plain = _best(lambda: F.dropout(local, 0.1), iters)  # noqa: B023
        ours = _best(lambda: F.dropout(x, 0.1), iters)  # noqa: B023
        vrandom.set_single_device_rng(False)
        try:
            torch_own = _best(lambda: F.dropout(x, 0.1), iters)  # noqa: B023
        finally:
            vrandom.set_single_device_rng(True)
        rows.append((name, tuple(local.shape), plain, torch_own, ours))
    # data parallelism: a plain tensor that is this rank's part of the batch
    local = full.chunk(world)[rank].clone()
    plain = _best(lambda: F.dropout(local, 0.1), iters)

    def dp():
        with vrandom.data_parallel_rng(mesh, "x"):
            F.dropout(local, 0.1)

    rows.append(
        ("data_parallel_rng (plain batch part)", tuple(local.shape), plain, plain, _best(dp, iters))
    )
    q.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--shape", type=int, nargs="+", default=[8, 128, 1024])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, args.shape, args.iters, q))
        for r in range(args.world)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    rows = results[0]
    numel = math.prod(args.shape)
    full_mib = numel * 4 / 2**20
    print(
        f"dropout(p=0.1) on a float32 tensor of shape {tuple(args.shape)} ({full_mib:.1f} MiB) "
        f"over {args.world} ranks, torch {torch.__version__}; ms per call, best of 5, rank 0"
    )
    print(
        f"{'placement':<40} {'local shape':<18} {'plain local':>11} {'torch DTensor':>13} "
        f"{'vescale':>8} {'vs plain':>8}  full-size temporary"
    )
    for name, shape, plain, torch_own, ours in rows:
        extra = "none (local = full)" if name == "Replicate" else f"{full_mib:.1f} MiB"
        print(
            f"{name:<40} {str(shape):<18} {plain:>11.3f} {torch_own:>13.3f} {ours:>8.3f} "
            f"{ours / plain:>7.2f}x  {extra}"
        )
        emit(
            "rng",
            f"dropout, {name}, {args.world} ranks",
            "ms per call (vs plain dropout on the local shard)",
            round(ours, 3),
            round(plain, 3),
            unit=" ms",
            memory=extra,
            target=f"~{args.world}x (full-size draw)" if name != "Replicate" else "1x",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
