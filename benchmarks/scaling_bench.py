"""Scaling: how vescale FSDP's cost grows with ranks and model size (vs torch FSDP2).

One table, 1, 2 and 4 CPU ranks (gloo) x three GPT sizes (``vescale.dmodule.testing.GPT``,
tied embeddings, AdamW, the same per-rank batch: weak scaling), for vescale FSDP
(``fully_shard``) and torch FSDP2 (``fully_shard`` per block, then the root), stepped
alternately in the same workers:

* median step time (forward + backward + optimizer step), and per million parameters;
* bytes each rank sends per step (``CommDebugMode``'s ring model) against the ring lower
  bound ``3 (N - 1) / N * 4P`` (all-gather in forward and backward, reduce-scatter);
* per-rank bytes of parameters + gradients + AdamW state when all are live
  (``dp_memory_bytes``), against ``16 P / N``.

With perfect scaling the time per step stays flat as N grows at a fixed per-rank batch
(plus the communication, which grows as ``(N - 1) / N``), and memory per rank falls as
``1 / N``.

    OMP_NUM_THREADS=1 python benchmarks/scaling_bench.py [--ranks 1 2 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _summary import emit, human_bytes

#: name -> (layers, hidden, vocab)
SIZES = {"S": (2, 128, 2048), "M": (4, 256, 4096), "L": (6, 384, 8192)}


def worker(sizes: dict, steps: int, batch: int, seq: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale.dmodule import dp_memory_bytes, fully_shard
    from vescale.dmodule.testing import GPT, GPTConfig
    from vescale.dtensor import init_device_mesh
    from vescale.dtensor.debug import CommDebugMode

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    out = {}
    for name, (layers, hidden, vocab) in sizes.items():
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=4, n_embd=hidden)
        base = GPT(cfg)
        nparams = sum(p.numel() for p in base.parameters())
        ours = fully_shard(copy.deepcopy(base), mesh, "dp")
        theirs = copy.deepcopy(base)
        for blk in theirs.blocks:
            torch_fully_shard(blk, mesh=mesh)
        torch_fully_shard(theirs, mesh=mesh)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        sides = {}
        for side, model in (("vescale FSDP", ours), ("torch FSDP2", theirs)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(mem=None, model=model, opt=opt, x=x, y=y):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                if mem is not None:
                    mem.append(dp_memory_bytes(model, opt)["total"])
                opt.step()
                opt.zero_grad()

            step()  # warm-up: optimizer state
            mem: list[int] = []
            with CommDebugMode() as cm:
                step(mem)
            sides[side] = {"step": step, "bytes": cm.get_total_bytes(), "mem": mem[0], "t": []}
        for i in range(steps):
            for side in sides if i % 2 == 0 else list(sides)[::-1]:
                dist.barrier()
                t0 = time.perf_counter()
                sides[side]["step"]()
                sides[side]["t"].append(time.perf_counter() - t0)
        out[name] = {"P": nparams}
        for side, s in sides.items():
            out[name][side] = {
                "ms": 1e3 * statistics.median(s["t"]),
                "bytes": s["bytes"],
                "mem": s["mem"],
            }
        del ours, theirs, sides
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = ap.parse_args()

    from vescale.dtensor.testing import run_on_ranks, shutdown_pools

    sizes = {k: SIZES[k] for k in args.sizes}
    results = {}
    try:
        for n in args.ranks:
            per_rank = run_on_ranks(
                worker, n, sizes, args.steps, args.batch, args.seq, timeout=1800
            )
            results[n] = per_rank
    finally:
        shutdown_pools()
    print(
        f"weak scaling: per-rank batch {args.batch}x{args.seq}, AdamW, median of {args.steps} "
        "alternating steps (CPU, gloo); ring bound 3 (N-1)/N * 4P; memory: params + grads + "
        "AdamW state per rank (largest rank) vs 16P/N"
    )
    head = (
        f"{'model':<5} {'params':>10} {'N':>2} | {'vescale ms':>10} {'ms/Mparam':>9} "
        f"{'FSDP2 ms':>9} {'ratio':>5} | {'B sent/rank':>12} {'/ring':>6} | "
        f"{'mem/rank':>10} {'/(16P/N)':>8} {'FSDP2 mem':>10}"
    )
    print(head)
    print("-" * len(head))
    for name in sizes:
        for n in args.ranks:
            per_rank = results[n]
            r = per_rank[0][name]
            P = r["P"]
            v, t = r["vescale FSDP"], r["torch FSDP2"]
            mem = max(pr[name]["vescale FSDP"]["mem"] for pr in per_rank)
            tmem = max(pr[name]["torch FSDP2"]["mem"] for pr in per_rank)
            ring = 3 * (n - 1) / n * 4 * P
            ring_ratio = f"{v['bytes'] / ring:>6.3f}" if ring else f"{'-':>6}"
            print(
                f"{name:<5} {P:>10,} {n:>2} | {v['ms']:>10.1f} {v['ms'] / (P / 1e6):>9.1f} "
                f"{t['ms']:>9.1f} {v['ms'] / t['ms']:>5.2f} | {v['bytes']:>12,} {ring_ratio} | "
                f"{mem:>10,} {mem / (16 * P / n):>8.3f} {tmem:>10,}"
            )
            emit(
                "scaling",
                f"GPT {name} ({P / 1e6:.1f} M params), N={n}",
                "ms/step, vescale FSDP vs torch FSDP2",
                v["ms"],
                t["ms"],
                unit="ms",
                comm=f"{v['bytes'] / ring:.3f}" if ring else "0 (N=1)",
                memory=f"{human_bytes(mem)} (torch {human_bytes(tmem)}; 16P/N {human_bytes(16 * P / n)})",
                target="time flat in N; memory ∝ 1/N",
            )


if __name__ == "__main__":
    main()
