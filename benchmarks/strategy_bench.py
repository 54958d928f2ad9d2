"""The layout cost model against reality: predicted vs measured step time and memory.

For the benchmarks' GPT (``vescale.dmodule.testing.GPT``) at three sizes and every
layout of 1, 2 and 4 ranks that the search enumerates and that fits (data-parallel
mode, tensor parallelism, sequence parallelism, activation checkpointing, micro-batch
size), the workers

* probe the device constants once (`vescale.dmodule.probe_device`),
* predict each layout (`vescale.dmodule.estimate`),
* build it (`vescale.dmodule.apply_layout`) and train it with AdamW for a few steps
  on the same data (micro-batches accumulated: DDP under ``no_sync``), timing each
  step (the slowest rank's time; the median step is reported), and
* measure the per-rank memory the model predicts: parameters + gradients + optimizer
  state + engine buffers (`vescale.dmodule.dp_memory_bytes`, after backward) plus the
  activations autograd keeps from forward to backward (`saved_activation_bytes`,
  with the kept block inputs under checkpointing). The transient recomputation of one
  checkpointed block is predicted separately and not part of this comparison.

It prints one table per (size, world) and the ranking check: the measured time of the
layout the model ranks first against the measured-best layout (target: within 10 %),
and the time and memory prediction errors (memory target: within 10 %).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/strategy_bench.py [--world 1 2 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _summary import emit

SIZES = {
    "S": dict(n_layer=2, n_embd=64, vocab_size=1024),
    "M": dict(n_layer=4, n_embd=128, vocab_size=2048),
    "L": dict(n_layer=6, n_embd=256, vocab_size=4096),
}


def worker(
    sizes: dict, seq: int, global_batch: int, steps: int, quick: bool, log: str | None = None
) -> list[dict]:
    import copy
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from vescale.dmodule import (
        apply_layout,
        candidates,
        dp_memory_bytes,
        estimate,
        probe_device,
        profile_model,
        saved_activation_bytes,
    )
    from vescale.dmodule.testing import GPT, GPTConfig
    from vescale.dtensor import DTensor

    world = dist.get_world_size()
    rank = dist.get_rank()
    device = probe_device()
    rows = []
    if log and rank == 0:
        with open(log, "a") as f:
            f.write(json.dumps({"world": world, "device": repr(device)}) + "\n")
    for size, kw in sizes.items():
        torch.manual_seed(0)
        base = GPT(GPTConfig(block_size=seq, n_head=4, **kw))
        prof = profile_model(base, seq)
        g = torch.Generator().manual_seed(1)
        data = [
            (
                torch.randint(0, kw["vocab_size"], (global_batch, seq), generator=g),
                torch.randint(0, kw["vocab_size"], (global_batch, seq), generator=g),
            )
            for _ in range(steps + 1)
        ]
        cands = candidates(prof, world, global_batch)
        if quick:
            cands = [c for c in cands if c.micro_batch == global_batch // c.dp_degree][:4]
        for lay in cands:
            est = estimate(prof, lay, device, global_batch)
            if not est.fits:
                continue
            model = apply_layout(copy.deepcopy(base), lay)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            blocks = list(model.blocks)
            r = rank // lay.tp
            per = global_batch // lay.dp_degree
            times, mem, act = [], 0, 0
            for step, (idx, tgt) in enumerate(data):
                idx, tgt = idx[r * per : (r + 1) * per], tgt[r * per : (r + 1) * per]
                last = step == len(data) - 1
                dist.barrier()
                t0 = time.perf_counter()
                for m0 in range(0, per, lay.micro_batch):
                    x = idx[m0 : m0 + lay.micro_batch]
                    y = tgt[m0 : m0 + lay.micro_batch]
                    final = m0 + lay.micro_batch >= per
                    meter = saved_activation_bytes(model) if (last and final) else None
                    hooks = []
                    if meter is not None:
                        hooks = [
                            b.register_forward_pre_hook(lambda mod, args, m=meter: m.count(args[0]))
                            for b in blocks
                        ]
                        meter.__enter__()
                    out = model(x)
                    if isinstance(out, DTensor):
                        out = out.full_tensor()
                    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
                    if meter is not None:
                        meter.__exit__(None, None, None)
                        for h in hooks:
                            h.remove()
                        act = meter.bytes
                    loss = loss * (lay.micro_batch / per)
                    if lay.dp_mode == "ddp" and not final:
                        with model.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                    del out, loss
                if last:
                    mem = dp_memory_bytes(model, opt)["total"]
                opt.step()
                opt.zero_grad()
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if step > 0:  # the first step builds the optimizer state
                    times.append(float(dt))
            peak = torch.tensor([float(mem + act)])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            rows.append(
                {
                    "world": world,
                    "size": size,
                    "params": prof.num_params,
                    "layout": lay.describe(),
                    "pred_ms": est.time["total"] * 1e3,
                    "meas_ms": statistics.median(times) * 1e3,
                    "pred_mib": (est.memory["total"] - est.memory["recompute"]) / 2**20,
                    "meas_mib": float(peak) / 2**20,
                }
            )
            if log and rank == 0:  # kept even if a later layout hangs or the run is cut
                with open(log, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            del model, opt, blocks
            gc.collect()
    if rank == 0:
        rows.append({"world": world, "device": repr(device)})
    return rows


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--quick", action="store_true", help="a few layouts per world")
    ap.add_argument("--log", help="append each measured row (JSON lines) to this file")
    ap.add_argument("--from-log", help="only print the tables of a --log file")
    args = ap.parse_args()

    from vescale.dtensor.testing import run_on_ranks, shutdown_pools

    sizes = {k: SIZES[k] for k in args.sizes}
    results: dict[int, list[dict]] = {}
    if args.from_log:
        with open(args.from_log) as f:
            for line in f:
                row = json.loads(line)
                results.setdefault(row["world"], []).append(row)
    else:
        try:
            for n in args.world:
                res = run_on_ranks(
                    worker,
                    n,
                    sizes,
                    args.seq,
                    args.batch,
                    args.steps,
                    args.quick,
                    args.log,
                    timeout=3600,
                )
                results[n] = res[0]
        finally:
            shutdown_pools()
    t_errs, m_errs, checks = [], [], []
    for n, rows in results.items():
        dev = [r for r in rows if "device" in r]
        print(f"\n## {n} rank(s)" + (f"; probe: {dev[0]['device']}" if dev else ""))
        for size in sizes:
            sel = [r for r in rows if r.get("size") == size]
            if not sel:
                continue
            print(
                f"\n{size} ({sel[0]['params'] / 1e6:.2f} M params), {n} rank(s), global batch "
                f"{args.batch}, seq {args.seq}\n"
            )
            print(
                "| layout | predicted ms | measured ms | time error | predicted MiB "
                "| measured MiB | memory error |\n|---|---|---|---|---|---|---|"
            )
            for r in sorted(sel, key=lambda r: r["pred_ms"]):
                te, me = _err(r["pred_ms"], r["meas_ms"]), _err(r["pred_mib"], r["meas_mib"])
                t_errs.append(abs(te))
                m_errs.append(abs(me))
                print(
                    f"| {r['layout']} | {r['pred_ms']:.1f} | {r['meas_ms']:.1f} | {te:+.0f} % "
                    f"| {r['pred_mib']:.2f} | {r['meas_mib']:.2f} | {me:+.1f} % |"
                )
            picked = min(sel, key=lambda r: r["pred_ms"])
            best = min(sel, key=lambda r: r["meas_ms"])
            gap = (picked["meas_ms"] / best["meas_ms"] - 1) * 100
            ok = gap <= 10
            checks.append(ok)
            print(
                f"\nranking: predicted best {picked['layout']} measured {picked['meas_ms']:.1f} ms; "
                f"measured best {best['layout']} {best['meas_ms']:.1f} ms: "
                f"{gap:+.0f} % ({'within' if ok else 'NOT within'} 10 %)"
            )
            emit(
                "strategy",
                f"{size} on {n} rank(s)",
                "measured time of the predicted-best layout / measured best",
                picked["meas_ms"],
                best["meas_ms"],
                unit=" ms",
                target="<= 1.10",
            )
    if t_errs:
        print(
            f"\nover {len(t_errs)} layouts: step-time error median {statistics.median(t_errs):.0f} %, "
            f"max {max(t_errs):.0f} %; memory error median {statistics.median(m_errs):.1f} %, "
            f"max {max(m_errs):.1f} %, within 10 %: {sum(e <= 10 for e in m_errs)}/{len(m_errs)}; "
            f"ranking within 10 % of the measured best: {sum(checks)}/{len(checks)}"
        )


if __name__ == "__main__":
    main()
