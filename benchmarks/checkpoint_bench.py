"""Checkpoint throughput: vescale.checkpoint vs plain DCP vs the disk, on 2 and 4 CPU ranks.

Every rank holds the same model-like state (three DTensors sharded on dim 0, one
RaggedShard tensor); both checkpointers save and load that same state in the same run,
alternating (plain DCP saves the RaggedShard tensor through vescale's DCP protocol).
vescale writes CRC32 checksums and commits atomically; DCP does neither. Both fsync
every data file and the metadata (DCP's default ``sync_files=True``); vescale also
fsyncs its manifest, its ``COMPLETE`` marker and the directories it renames. The disk
baseline writes one file of the same total size with fsync from one process.
Columns: throughput of each, the ratio DCP time / vescale time, vescale save as a
fraction of the disk's bandwidth, and the async save's blocking time as a fraction of
a synchronous vescale save (after one untimed async save that allocates the staging
buffers, which later saves reuse), for ``staging="blocking"`` (the call copies the
state) and ``staging="background"`` (the call flattens; the copy runs on the save
thread, and "bg staged" is when it finished: an optimizer step before then waits). Best of ``--reps`` (a second table gives medians);
the load average before and after each world size tells how busy the machine was.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_bench.py --mb 256 --ranks 2 4

``VESCALE_CHECKPOINT_CRC32=zlib`` forces the zlib checksum (default: ISA-L's when the
``isal`` package is installed). ``--small N`` adds N small sharded tensors
(256 KiB each) to the state, which weighs the per-tensor cost of flattening and
staging in the async save's blocking time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _summary import emit


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(mesh, total_mb: int, small: int = 0):
    from vescale.dtensor import Shard, distribute_tensor
    from vescale.ragged import RaggedShard

    n = mesh.size()
    rows = max(n * 4, int(total_mb * 2**20 / 4 / 1024 / 4))  # 4 tensors of [rows, 1024] fp32
    rows -= rows % n
    torch.manual_seed(0)
    state = {}
    for i in range(3):
        state[f"w{i}"] = distribute_tensor(
            torch.randn(rows, 1024), mesh, [Shard(0)], src_data_rank=None
        )
    units = tuple(range(1, n + 1))
    rag_rows = rows - rows % sum(units)
    state["ragged"] = distribute_tensor(
        torch.randn(rag_rows, 1024), mesh, [RaggedShard((0, 1), units)], src_data_rank=None
    )
    for i in range(small):
        state[f"s{i}"] = distribute_tensor(
            torch.randn(n * 64, 1024), mesh, [Shard(0)], src_data_rank=None
        )
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return state, nbytes


def _plain_dcp_state(state):
    # Plain DCP saves the same DTensors, the RaggedShard one included (vescale's plugin
    # DTensor implements DCP's __create_write_items__/__create_chunk_list__ protocol).
    return dict(state)


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, world: int, port: int, root: str, total_mb: int, reps: int, small, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    import vescale.checkpoint as vckpt
    from vescale.dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    state, nbytes = _state(mesh, total_mb, small)
    dcp_state = _plain_dcp_state(state)
    keys = ("v_save", "v_load", "d_save", "d_load", "a_block", "a_total", "b_block", "b_staged")
    res = {k: [] for k in (*keys, "disk")}
    # Untimed: the first async save allocates its staging buffers (page faults); every
    # later one reuses them, as in training.
    vckpt.save(f"{root}/warmup", {"m": state}, async_op=True).result()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(f"{root}/warmup", ignore_errors=True)
    for r in range(reps):
        vp, dp = f"{root}/v{r}", f"{root}/d{r}"
        res["v_save"].append(_timed(lambda vp=vp: vckpt.save(vp, {"m": state})))
        res["d_save"].append(
            _timed(lambda dp=dp: dcp.save(dcp_state, storage_writer=dcp.FileSystemWriter(dp)))
        )
        res["v_load"].append(_timed(lambda vp=vp: vckpt.load(vp, {"m": state})))
        res["d_load"].append(
            _timed(lambda dp=dp: dcp.load(dcp_state, storage_reader=dcp.FileSystemReader(dp)))
        )
        dist.barrier()
        ap = f"{root}/a{r}"
        h = vckpt.save(ap, {"m": state}, async_op=True)
        h.result()
        dist.barrier()
        res["a_block"].append(h.blocking_seconds)
        res["a_total"].append(h.total_seconds)
        bp = f"{root}/b{r}"
        h = vckpt.save(bp, {"m": state}, async_op=True, staging="background")
        h.result()
        dist.barrier()
        res["b_block"].append(h.blocking_seconds)
        res["b_staged"].append(h.staged_seconds)
        if rank == 0:
            buf = torch.empty(nbytes // 4, dtype=torch.float32).numpy().tobytes()
            t0 = time.perf_counter()
            with open(f"{root}/disk{r}", "wb") as f:
                f.write(buf)
                f.flush()
                os.fsync(f.fileno())
            res["disk"].append(time.perf_counter() - t0)
            for p in (vp, dp, ap, bp, f"{root}/disk{r}"):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
        dist.barrier()
    vckpt.wait_pending()
    if rank == 0:
        out.put((world, nbytes, {k: v for k, v in res.items() if v}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256, help="total state size in MiB")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--small", type=int, default=0, help="extra small tensors (256 KiB each)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for world in args.ranks:
        root = tempfile.mkdtemp(prefix="vckpt-bench-", dir=args.dir)
        q = ctx.SimpleQueue()
        load0 = os.getloadavg()[0]
        mp.start_processes(
            worker,
            args=(world, _port(), root, args.mb, args.reps, args.small, q),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        world_, nbytes, res = q.get()
        rows.append((world_, nbytes, res, load0, os.getloadavg()[0]))
        shutil.rmtree(root, ignore_errors=True)
    from vescale.checkpoint import _storage

    impl = getattr(_storage, "CRC32_IMPL", "zlib")
    print(f"checksum: CRC32 ({impl}); {args.reps} reps; cpus: {os.cpu_count()}")
    for name, pick in (("best", min), ("median", statistics.median)):
        print(f"-- {name} of {args.reps} reps")
        _table(rows, pick, emit_rows=name == "median")
    print(
        "throughput in GB/s (higher is better); ratio = DCP time / vescale time (>1: vescale "
        "faster); save/disk = vescale save throughput / disk write throughput; load = load "
        "average before -> after; bg = staging='background'"
    )


def _table(rows, pick, emit_rows: bool = False) -> None:
    gb = 1e9
    print(
        f"{'ranks':>5} {'GB':>6} | {'vescale save':>12} {'DCP save':>9} {'ratio':>6} | "
        f"{'vescale load':>12} {'DCP load':>9} {'ratio':>6} | {'disk write':>10} "
        f"{'save/disk':>9} | {'async block':>11} {'/sync save':>10} | "
        f"{'bg block':>8} {'/sync':>6} {'bg staged':>9} | {'load':>11}"
    )
    for world, nbytes, res, l0, l1 in rows:
        r = {k: pick(v) for k, v in res.items()}
        g = nbytes / gb
        print(
            f"{world:>5} {g:>6.3f} | {g / r['v_save']:>10.2f}/s {g / r['d_save']:>7.2f}/s "
            f"{r['d_save'] / r['v_save']:>6.2f} | {g / r['v_load']:>10.2f}/s "
            f"{g / r['d_load']:>7.2f}/s {r['d_load'] / r['v_load']:>6.2f} | "
            f"{g / r['disk']:>8.2f}/s {r['disk'] / r['v_save']:>9.2f} | "
            f"{r['a_block']:>10.3f}s {r['a_block'] / r['v_save']:>10.2f} | "
            f"{r['b_block']:>7.3f}s {r['b_block'] / r['v_save']:>6.3f} {r['b_staged']:>8.3f}s | "
            f"{l0:>4.1f}->{l1:<5.1f}"
        )
        if emit_rows:
            gbs = f"{g:.3f} GB"
            emit(
                "checkpoint",
                f"save {gbs}, {world} ranks (save/disk {r['disk'] / r['v_save']:.2f})",
                "GB/s, vescale vs DCP (ratio > 1: faster)",
                g / r["v_save"],
                g / r["d_save"],
                unit="GB/s",
                target="≥ 1; save/disk ≥ 0.7",
            )
            emit(
                "checkpoint",
                f"load {gbs}, {world} ranks",
                "GB/s, vescale vs DCP (ratio > 1: faster)",
                g / r["v_load"],
                g / r["d_load"],
                unit="GB/s",
                target="≥ 1",
            )
            emit(
                "checkpoint",
                f"async save, {world} ranks",
                "blocking s vs a sync save",
                r["a_block"],
                r["v_save"],
                unit="s",
                target="< 0.10",
            )
            emit(
                "checkpoint",
                f"async save, background staging, {world} ranks "
                f"(copy done {r['b_staged'] * 1e3:.0f} ms after the call)",
                "blocking s vs a sync save",
                r["b_block"],
                r["v_save"],
                unit="s",
                target="< 0.10",
            )


if __name__ == "__main__":
    main()
