"""Data parallelism: vescale FSDP / DDP vs torch FSDP2 (``fully_shard``) / DDP, one GPT step.

All four sides train the same ~10M-parameter GPT (``vescale.dmodule.testing.GPT``,
tied embeddings) with AdamW on the same per-rank batch, stepped alternately in the
same worker processes (CPU, gloo). Per side and world size the table reports:

* median step time (forward + backward + optimizer step) and its ratio to the
  matching torch baseline (vescale FSDP / torch FSDP2, vescale DDP / torch DDP);
* bytes each rank sends per step (``vescale.dtensor.debug.CommDebugMode``'s ring
  model) against the ring lower bound (FSDP: ``3 (N-1)/N P`` with reshard after
  forward; DDP: ``2 (N-1)/N P``; ``P`` the fp32 parameter bytes);
* bytes copied per step besides the collectives: measured for vescale
  (``extra_copy_bytes``); for torch, the copies its algorithm makes (FSDP2:
  all-gather copy-in ``P/N`` and copy-out ``P`` per gather, reduce-scatter copy-in
  ``P``; DDP: gradients into and out of the buckets, ``2P``), marked ``model``;
* per-rank bytes of parameters + gradients + AdamW state after backward, when all
  of them are live (``vescale.dmodule._dp_common.dp_memory_bytes``), against
  ``16 P / N``; torch DDP's internal reducer buckets are not included.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/dp_bench.py [--world 2 4] [--steps 4]
"""

from __future__ import annotations

import argparse

from _launch import run_worlds, time_alternating
from _summary import emit, human_bytes


def bench_worker(steps: int, cfg_kwargs: dict, batch: int, seq: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from vescale.dmodule._ddp import replicate
    from vescale.dmodule._dp_common import dp_memory_bytes
    from vescale.dmodule._fsdp import fully_shard, get_dp_engine
    from vescale.dmodule.testing import GPT, GPTConfig
    from vescale.dtensor import init_device_mesh
    from vescale.dtensor.debug import CommDebugMode

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kwargs)
    base = GPT(cfg)
    nparams = sum(p.numel() for p in base.parameters())
    pbytes = 4 * nparams

    v_fsdp = fully_shard(copy.deepcopy(base), mesh, "dp")
    t_fsdp = copy.deepcopy(base)
    for blk in t_fsdp.blocks:
        torch_fully_shard(blk, mesh=mesh)
    torch_fully_shard(t_fsdp, mesh=mesh)
    v_ddp = replicate(copy.deepcopy(base), mesh, "dp")
    t_ddp = DistributedDataParallel(copy.deepcopy(base), process_group=mesh.get_group(0))

    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)

    def make_step(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(mem: list | None = None):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            if mem is not None:  # all state live: params, grads, optimizer state
                mem.append(dp_memory_bytes(model, opt)["total"])
            opt.step()
            opt.zero_grad()
            return loss.item()

        return step, opt

    models = {
        "vescale FSDP": v_fsdp,
        "torch FSDP2": t_fsdp,
        "vescale DDP": v_ddp,
        "torch DDP": t_ddp,
    }
    sides = {name: make_step(m) for name, m in models.items()}
    copied_model = {
        "torch FSDP2": 3 * pbytes // n + 2 * pbytes + pbytes,  # 2 gathers (in + out) + RS in
        "torch DDP": 2 * pbytes,
    }
    stats = {}
    for name, (step, _opt) in sides.items():
        step()  # warm up (optimizer state allocated)
        engine = get_dp_engine(models[name])
        if engine is not None and hasattr(engine, "reset_counters"):
            engine.reset_counters()
        mem: list[int] = []
        with CommDebugMode() as cm:
            loss = step(mem)
        if engine is not None:
            copied = f"{engine.extra_copy_bytes:,}"
        else:
            copied = f"{copied_model[name]:,} (model)"
        stats[name] = {
            "bytes": cm.get_total_bytes(),
            "copied": copied,
            "mem": mem[0],
            "loss": loss,
        }
    medians = time_alternating({name: step for name, (step, _opt) in sides.items()}, steps)
    for name, ms in medians.items():
        stats[name]["median_ms"] = ms
    stats["_P"] = nparams
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    cfg = dict(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=4,
        n_embd=args.hidden,
        tie_embeddings=True,
    )
    rows = run_worlds(bench_worker, args.world, args.steps, cfg, args.batch, args.seq)
    P = rows[0][1][0]["_P"]
    print(
        f"GPT {args.layers}x{args.hidden}, vocab {args.vocab} (tied), P = {P:,} params, per-rank "
        f"batch {args.batch}x{args.seq}, {args.steps} alternating steps per side (CPU, gloo)"
    )
    head = (
        f"{'N':>2} | {'side':<12} | {'ms/step':>8} | {'ratio':>5} | {'B sent/rank':>12} | "
        f"{'/ring':>5} | {'B copied/step':>18} | {'state B/rank':>12} | {'/(16P/N)':>8}"
    )
    print(head)
    print("-" * len(head))
    baseline = {"vescale FSDP": "torch FSDP2", "vescale DDP": "torch DDP"}
    for n, per_rank in rows:
        r = per_rank[0]
        for name in ("vescale FSDP", "torch FSDP2", "vescale DDP", "torch DDP"):
            s = r[name]
            mem = max(pr[name]["mem"] for pr in per_rank)
            ring = (3 if "FSDP" in name else 2) * (n - 1) / n * 4 * P
            ratio = s["median_ms"] / r[baseline[name]]["median_ms"] if name in baseline else 1.0
            print(
                f"{n:>2} | {name:<12} | {s['median_ms']:>8.1f} | {ratio:>5.2f} | "
                f"{s['bytes']:>12,} | {s['bytes'] / ring:>5.3f} | {s['copied']:>18} | "
                f"{mem:>12,} | {mem / (16 * P / n):>8.3f}"
            )
            if name in baseline:
                b = r[baseline[name]]
                bmem = max(pr[baseline[name]]["mem"] for pr in per_rank)
                emit(
                    "data parallel",
                    f"{name} vs {baseline[name]}, N={n}",
                    "ms/step (fwd+bwd+AdamW)",
                    s["median_ms"],
                    b["median_ms"],
                    unit="ms",
                    comm=f"{s['bytes'] / ring:.3f} (torch {b['bytes'] / ring:.3f})",
                    copied=f"{human_bytes(_num(s['copied']))} (torch {human_bytes(_num(b['copied']))})",
                    memory=f"{human_bytes(mem)} (torch {human_bytes(bmem)})",
                    target="≤ 0.8" if "FSDP" in name else "≤ 1",
                )


def _num(copied) -> float:
    """Bytes of a ``B copied/step`` cell (an int, or ``"123 (model)"``)."""
    return float(str(copied).split()[0].replace(",", ""))


if __name__ == "__main__":
    main()
