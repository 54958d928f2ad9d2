"""The layout cost model against reality: predicted vs measured step time and memory.

For the benchmarks' GPT (``vescale.dmodule.testing.GPT``) at three sizes and every
layout of 1, 2 and 4 ranks that the search enumerates and that fits (data-parallel
mode, tensor parallelism, sequence parallelism, activation checkpointing, micro-batch
size; pipeline layouts are predicted only and not measured here), the workers

* probe the device constants once (`vescale.dmodule.probe_device`),
* predict each layout (`vescale.dmodule.estimate`),
* build the layouts (`vescale.dmodule.apply_layout`) of one size together (in chunks
  that fit ``--budget-mb`` per rank) and train them with AdamW on the same data
  (micro-batches accumulated: DDP under ``no_sync``): warm-up steps first, then
  ``--rounds`` rounds in which every layout of the chunk runs ``--steps`` steps in
  turn (A B C, B C A, ...), so that a change of the machine's load hits every
  layout alike. A step's time is the slowest rank's; a layout's time is the fastest
  of its timed steps (what the layout costs when nothing else runs), its spread
  the median over that minimum; the CPU time of the step (``time.process_time``, the
  largest over the ranks, fastest step) is printed too: unlike wall time it does not
  grow when other processes take the cores, but it leaves out time spent waiting for
  other ranks, and
* measure the per-rank memory the model predicts: parameters + gradients + optimizer
  state + engine buffers (`vescale.dmodule.dp_memory_bytes`, after backward) plus the
  activations autograd keeps from forward to backward (`saved_activation_bytes`,
  with the kept block inputs under checkpointing), on the last warm-up step. The
  transient recomputation of one checkpointed block is predicted separately and not
  part of this comparison.

It prints one table per (size, world) and the ranking check: the measured time of the
layout the model ranks first against the measured-best layout (target: within 10 %),
and the time and memory prediction errors (memory target: within 10 %).

``--log FILE`` appends every measured row (with the layout, all step times and the
probe's figures) as JSON lines; ``--from-log FILE`` prints the tables again from such
a file, predicting again with the current cost model from the probe figures measured
in that run (the measurements are not repeated).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/strategy_bench.py [--world 1 2 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from _summary import emit

SIZES = {
    "S": dict(n_layer=2, n_embd=64, vocab_size=1024),
    "M": dict(n_layer=4, n_embd=128, vocab_size=2048),
    "L": dict(n_layer=6, n_embd=256, vocab_size=4096),
}
N_HEAD = 4


def _device_from(d: dict):
    from vescale.dmodule import DeviceSpec, Link

    d = dict(d)
    d["links"] = tuple(Link(**lk) for lk in d["links"])
    for k in ("matmul_by_size", "copy_by_size"):
        d[k] = tuple(tuple(x) for x in d.get(k, ()))
    return DeviceSpec(**d)


def _model(size: str, seq: int):
    import torch

    from vescale.dmodule.testing import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=seq, n_head=N_HEAD, **SIZES[size]))


def worker(
    sizes: list[str],
    seq: int,
    global_batch: int,
    rounds: int,
    steps: int,
    warmup: int,
    budget_mb: float,
    log: str | None = None,
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
    from vescale.dtensor import DTensor

    world = dist.get_world_size()
    rank = dist.get_rank()
    warmup = max(warmup, 2)  # memory is measured once the optimizer state exists
    device = probe_device()
    dev_row = {"world": world, "device": dataclasses.asdict(device)}
    rows = [dev_row]
    if log and rank == 0:
        with open(log, "a") as f:
            f.write(json.dumps(dev_row) + "\n")

    def one_step(run: dict, idx, tgt, measure: bool) -> float:
        model, opt, lay = run["model"], run["opt"], run["layout"]
        r = rank // lay.tp
        per = global_batch // lay.dp_degree
        idx, tgt = idx[r * per : (r + 1) * per], tgt[r * per : (r + 1) * per]
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        for m0 in range(0, per, lay.micro_batch):
            x = idx[m0 : m0 + lay.micro_batch]
            y = tgt[m0 : m0 + lay.micro_batch]
            final = m0 + lay.micro_batch >= per
            meter = saved_activation_bytes(model) if (measure and final) else None
            hooks = []
            if meter is not None:
                hooks = [
                    b.register_forward_pre_hook(lambda mod, args, m=meter: m.count(args[0]))
                    for b in model.blocks
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
                run["act"] = meter.bytes
            loss = loss * (lay.micro_batch / per)
            if lay.dp_mode == "ddp" and not final:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            del out, loss
        if measure:
            run["state"] = dp_memory_bytes(model, opt)["total"]
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt[0]), float(dt[1])

    for size in sizes:
        base = _model(size, seq)
        prof = profile_model(base, seq)
        vocab = SIZES[size]["vocab_size"]
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, vocab, (global_batch, seq), generator=g)
        tgt = torch.randint(0, vocab, (global_batch, seq), generator=g)
        ests = [
            estimate(prof, c, device, global_batch) for c in candidates(prof, world, global_batch)
        ]
        ests = [e for e in ests if e.fits]
        # chunks of layouts that are alive together (interleaved within a chunk)
        chunks, cur, used = [], [], 0.0
        for e in ests:
            mib = e.memory["total"] / 2**20
            if cur and used + mib > budget_mb:
                chunks.append(cur)
                cur, used = [], 0.0
            cur.append(e)
            used += mib
        if cur:
            chunks.append(cur)
        for chunk in chunks:
            runs = []
            for e in chunk:
                model = apply_layout(copy.deepcopy(base), e.layout)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                runs.append(
                    {
                        "layout": e.layout,
                        "est": e,
                        "model": model,
                        "opt": opt,
                        "times": [],
                        "cpu": [],
                    }
                )
            for run in runs:
                for w in range(warmup):
                    one_step(run, idx, tgt, measure=w == warmup - 1)
            for rnd in range(rounds):
                k = rnd % len(runs)
                for run in runs[k:] + runs[:k]:
                    for _ in range(steps):
                        wall, cpu = one_step(run, idx, tgt, measure=False)
                        run["times"].append(wall)
                        run["cpu"].append(cpu)
            for run in runs:
                peak = torch.tensor([float(run["state"] + run["act"])])
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                e = run["est"]
                row = {
                    "world": world,
                    "size": size,
                    "params": prof.num_params,
                    "layout": dataclasses.asdict(run["layout"]),
                    "label": run["layout"].describe(),
                    "times_ms": [t * 1e3 for t in run["times"]],
                    "cpu_ms": [t * 1e3 for t in run["cpu"]],
                    "pred_ms": e.time["total"] * 1e3,
                    "pred_mib": (e.memory["total"] - e.memory["recompute"]) / 2**20,
                    "meas_mib": float(peak) / 2**20,
                }
                rows.append(row)
                if log and rank == 0:  # kept even if a later layout hangs or the run is cut
                    with open(log, "a") as f:
                        f.write(json.dumps(row) + "\n")
            del runs
            gc.collect()
    return rows


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100


def _repredict(results: dict[int, list[dict]], seq: int, batch: int) -> None:
    """Predict every row again with the current cost model and its run's probe figures."""
    from vescale.dmodule import Layout, estimate, profile_model

    profiles: dict[str, object] = {}
    for rows in results.values():
        dev = next((_device_from(r["device"]) for r in rows if "device" in r), None)
        for r in rows:
            if "size" not in r or dev is None:
                continue
            if r["size"] not in profiles:
                profiles[r["size"]] = profile_model(_model(r["size"], seq), seq)
            e = estimate(profiles[r["size"]], Layout(**r["layout"]), dev, batch)
            r["pred_ms"] = e.time["total"] * 1e3
            r["pred_mib"] = (e.memory["total"] - e.memory["recompute"]) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per layout per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per layout (>= 2)")
    ap.add_argument("--budget-mb", type=float, default=1024.0, help="layouts alive at once")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="global batch")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES))
    ap.add_argument("--log", help="append each measured row (JSON lines) to this file")
    ap.add_argument("--from-log", help="print the tables of a --log file (predicted again)")
    args = ap.parse_args()

    results: dict[int, list[dict]] = {}
    if args.from_log:
        with open(args.from_log) as f:
            for line in f:
                row = json.loads(line)
                if row.get("world") in args.world:
                    results.setdefault(row["world"], []).append(row)
        _repredict(results, args.seq, args.batch)
    else:
        from vescale.dtensor.testing import run_on_ranks, shutdown_pools

        try:
            for n in args.world:
                res = run_on_ranks(
                    worker,
                    n,
                    args.sizes,
                    args.seq,
                    args.batch,
                    args.rounds,
                    args.steps,
                    args.warmup,
                    args.budget_mb,
                    args.log,
                    timeout=7200,
                )
                results[n] = res[0]
        finally:
            shutdown_pools()
    t_errs, c_errs, m_errs, checks, cchecks = [], [], [], [], []
    for n, rows in sorted(results.items()):
        dev = [r for r in rows if "device" in r]
        print(f"\n## {n} rank(s)")
        if dev:
            d = _device_from(dev[-1]["device"])
            print(
                f"\nprobe: matmul {d.matmul_flops / 1e9:.1f} GFLOP/s peak "
                f"({', '.join(f'{s}: {f / 1e9:.1f}' for s, f in d.matmul_by_size)}), copy "
                f"{d.copy_bandwidth / 1e9:.1f} GB/s, op {d.op_overhead * 1e6:.1f} us "
                f"(DTensor {d.dtensor_op_overhead * 1e6:.1f} us), AdamW per tensor "
                f"{d.optimizer_param_overhead * 1e6:.1f} us (DTensor "
                f"{d.optimizer_dtensor_param_overhead * 1e6:.1f} us), all-reduce "
                f"{d.links[0].bandwidth / 1e9:.2f} GB/s + {d.links[0].latency * 1e6:.0f} us "
                f"per ring step + {d.links[0].call_latency * 1e6:.0f} us per call (DTensor "
                f"+{d.dtensor_collective_overhead * 1e6:.0f} us), "
                f"{d.cores} cores for {d.ranks_per_node} rank(s)"
            )
        for size in SIZES:
            sel = [r for r in rows if r.get("size") == size]
            if not sel:
                continue
            for r in sel:
                ts = sorted(r["times_ms"])
                r["meas_ms"] = ts[0]
                r["spread"] = (statistics.median(ts) / ts[0] - 1) * 100
                r["cpu_min"] = min(r.get("cpu_ms") or [float("nan")])
            print(
                f"\n{size} ({sel[0]['params'] / 1e6:.2f} M params), {n} rank(s), global batch "
                f"{args.batch}, seq {args.seq}; measured: fastest of "
                f"{len(sel[0]['times_ms'])} interleaved steps (spread: median over it)\n"
            )
            print(
                "| layout | predicted ms | measured ms | spread | CPU ms | time error | "
                "predicted MiB | measured MiB | memory error |\n|---|---|---|---|---|---|---|---|---|"
            )
            for r in sorted(sel, key=lambda r: r["pred_ms"]):
                te, me = _err(r["pred_ms"], r["meas_ms"]), _err(r["pred_mib"], r["meas_mib"])
                t_errs.append(abs(te))
                m_errs.append(abs(me))
                if r["cpu_min"] == r["cpu_min"]:  # not NaN
                    c_errs.append(abs(_err(r["pred_ms"], r["cpu_min"])))
                print(
                    f"| {r['label']} | {r['pred_ms']:.1f} | {r['meas_ms']:.1f} | "
                    f"+{r['spread']:.0f} % | {r['cpu_min']:.1f} | {te:+.0f} % | {r['pred_mib']:.2f} | "
                    f"{r['meas_mib']:.2f} | {me:+.1f} % |"
                )
            picked = min(sel, key=lambda r: r["pred_ms"])
            best = min(sel, key=lambda r: r["meas_ms"])
            gap = (picked["meas_ms"] / best["meas_ms"] - 1) * 100
            ok = gap <= 10
            checks.append(ok)
            cbest = min(sel, key=lambda r: r["cpu_min"])
            cgap = (picked["cpu_min"] / cbest["cpu_min"] - 1) * 100
            cchecks.append(cgap <= 10)
            print(
                f"\nranking: predicted best {picked['label']} measured {picked['meas_ms']:.1f} ms; "
                f"measured best {best['label']} {best['meas_ms']:.1f} ms: "
                f"{gap:+.0f} % ({'within' if ok else 'NOT within'} 10 %); by CPU time: "
                f"{picked['cpu_min']:.1f} ms vs {cbest['label']} {cbest['cpu_min']:.1f} ms, "
                f"{cgap:+.0f} %"
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
        if c_errs:
            print(
                f"against CPU time: step-time error median {statistics.median(c_errs):.0f} %, "
                f"max {max(c_errs):.0f} %; ranking within 10 % of the best by CPU time: "
                f"{sum(cchecks)}/{len(cchecks)}"
            )


if __name__ == "__main__":
    main()
