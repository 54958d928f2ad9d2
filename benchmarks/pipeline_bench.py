"""Pipeline parallelism: bubble, activation memory and bytes between stages per schedule.

`vescale.dmodule.pipeline_parallelize` runs torch's own schedules (GPipe, 1F1B,
interleaved 1F1B) on stages split from an unmodified GPT. Per schedule, pipeline size
``p`` and micro-batch count ``m`` the table reports, from the same worker processes
(CPU, gloo):

* **idle fraction**: ``1 - busy / step`` per rank, ``busy`` the time spent inside the
  stage's forward and backward compute (``forward_one_chunk`` / ``backward_one_chunk``
  of torch's ``PipelineStage``), ``step`` the wall time of ``schedule.step``; the mean
  over ranks, against the theoretical bubble ``(p-1)/(m+p-1)`` (interleaved with ``v``
  stages per rank: ``(p-1)/(v m + p - 1)``). On a machine with fewer cores than ranks
  the ranks time-share the cores, which hides idle time; compare schedules with each
  other there.
* **activation memory per stage**: bytes the stage saves for backward per micro-batch
  (``saved_tensors_hooks``, each storage counted once per micro-batch; this includes the
  parameters autograd keeps a reference to, which cost no extra memory), the largest number of
  micro-batches in flight (forwarded, not yet backwarded) on the busiest stage, and
  their product, the peak activation memory (GPipe holds ``m``; 1F1B at most ``p``).
* **bytes between stages**: bytes each rank sends per step (the send ops torch's
  ``PipelineStage`` builds: activations forward, their gradients backward), against the
  activation size at the stage boundaries (``2 x boundaries x batch x seq x hidden x 4``
  bytes per pipeline, both directions).
* the step time of vescale's split against a hand-written split of the same model
  into ``nn.Module`` stages driven by the same torch schedule (the PyTorch baseline:
  what torchtitan-style manual splitting costs). Every schedule and the baseline of
  one ``m`` step in turns (`_launch.time_alternating`); a step is the schedule's
  forward and backward plus the SGD update.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/pipeline_bench.py [--pp 2 4] [--microbatches 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _launch import run_worlds, time_alternating
from _summary import emit, human_bytes

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


def bench_worker(steps: int, cfg_kwargs: dict, batch: int, seq: int, micro: list[int]) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from vescale.dmodule import pipeline_parallelize
    from vescale.dmodule.testing import GPT, GPTConfig
    from vescale.dtensor import init_device_mesh

    p = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (p,), mesh_dim_names=("pp",))
    cfg = GPTConfig(**cfg_kwargs)

    def loss_fn(out, tgt):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)

    sent = [0]

    def instrument(stages):
        busy = [0.0]
        live = {"now": 0, "peak": 0}
        saved = {"bytes": 0}
        for st in stages:
            fwd, bwd = st.forward_one_chunk, st.backward_one_chunk
            for attr in ("get_fwd_send_ops", "get_bwd_send_ops"):

                def sends(*a, _get=getattr(st, attr), **k):
                    ops = _get(*a, **k)  # P2POps of torch's schedule, all sends
                    sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                    return ops

                setattr(st, attr, sends)

            def f(*a, _fwd=fwd, **k):
                seen = set()

                def pack(t):
                    key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    if key not in seen:
                        seen.add(key)
                        saved["bytes"] += key[1]
                    return t

                t0 = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = _fwd(*a, **k)
                busy[0] += time.perf_counter() - t0
                live["now"] += 1
                live["peak"] = max(live["peak"], live["now"])
                return out

            def b(*a, _bwd=bwd, **k):
                t0 = time.perf_counter()
                out = _bwd(*a, **k)
                busy[0] += time.perf_counter() - t0
                live["now"] -= 1
                return out

            st.forward_one_chunk, st.backward_one_chunk = f, b
        return busy, live, saved

    def vescale_side(name, m):
        torch.manual_seed(0)
        pp = pipeline_parallelize(
            GPT(cfg),
            mesh,
            example_inputs=(idx,),
            loss_fn=loss_fn,
            microbatches=m,
            schedule=name,
        )
        busy, live, saved = instrument(pp.stages)
        opt = torch.optim.SGD(pp.parameters(), lr=1e-3)
        fracs: list[float] = []

        def step():
            busy[0], live["now"], live["peak"], saved["bytes"], sent[0] = 0.0, 0, 0, 0, 0
            t0 = time.perf_counter()
            pp.step(idx, target=tgt)
            fracs.append(1 - busy[0] / (time.perf_counter() - t0))
            opt.step()
            opt.zero_grad()

        def stats():
            return {
                "idle": statistics.median(fracs[1:]),  # the first step is a warm-up
                "saved_per_mb": saved["bytes"] / (m * len(pp.stages)),
                "peak_in_flight": live["peak"],
                "sent": sent[0],
                "stages": len(pp.stages),
            }

        return step, stats

    # PyTorch baseline: the same blocks split by hand into nn.Module stages, GPipe
    per = cfg.n_layer // p
    mine = list(range(rank * per, (rank + 1) * per))

    class Stage(nn.Module):
        def __init__(self, full) -> None:
            super().__init__()
            self.wte = full.wte if rank == 0 else None
            self.wpe = full.wpe if rank == 0 else None
            self.blocks = nn.ModuleList(full.blocks[i] for i in mine)
            self.ln_f = full.ln_f if rank == p - 1 else None
            self.lm_head = full.lm_head if rank == p - 1 else None

        def forward(self, x):
            if self.wte is not None:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            return self.lm_head(self.ln_f(x)) if self.ln_f is not None else x

    def torch_side(m):
        torch.manual_seed(0)
        mb = batch // m
        h = torch.empty(mb, seq, cfg.n_embd, requires_grad=True)
        ins = (idx[:mb],) if rank == 0 else (h,)
        logits = torch.empty(mb, seq, cfg.vocab_size, requires_grad=True)
        outs = (logits,) if rank == p - 1 else (h,)
        stage = PipelineStage(
            Stage(GPT(cfg)), rank, p, torch.device("cpu"), input_args=ins, output_args=outs
        )
        sched = ScheduleGPipe(stage, m, loss_fn=loss_fn)
        opt = torch.optim.SGD(stage.submod.parameters(), lr=1e-3)

        def step():
            sched.step(*((idx,) if rank == 0 else ()), target=tgt if rank == p - 1 else None)
            opt.step()
            opt.zero_grad()

        return step

    results: dict = {}
    for m in micro:
        sides, stats = {}, {}
        for name in SCHEDULES:
            if name == "interleaved1f1b" and (m % p or cfg.n_layer < 2 * p):
                continue
            sides[name], stats[name] = vescale_side(name, m)
        sides["torch manual gpipe"] = torch_side(m)
        for step in sides.values():  # warm-up
            dist.barrier()
            step()
        # every schedule and the baseline in turns: load hits them alike
        for name, ms in time_alternating(sides, steps).items():
            results[(name, m)] = {"ms": ms, **(stats[name]() if name in stats else {})}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()

    cfg = dict(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=4,
        n_embd=args.hidden,
        tie_embeddings=False,
    )
    act = args.batch * args.seq * args.hidden * 4  # one boundary's activation, fp32
    print(
        f"GPT {args.layers}x{args.hidden}, vocab {args.vocab}, batch {args.batch}x{args.seq}; "
        f"activation at a stage boundary {human_bytes(act)}; {args.steps} steps after a "
        "warm-up (CPU, gloo)"
    )
    head = (
        f"{'p':>2} | {'m':>2} | {'schedule':<16} | {'ms/step':>8} | {'idle':>5} | {'theory':>6} | "
        f"{'saved B/mb/stage':>16} | {'in flight':>9} | {'peak act B':>11} | {'B sent/step':>12} | "
        f"{'/act':>5}"
    )
    for p in args.pp:
        # spawned per pipeline size: a loaded machine can miss the pool's start-up deadline
        ((_, res),) = run_worlds(
            bench_worker, [p], args.steps, cfg, args.batch, args.seq, args.microbatches, fresh=True
        )
        print(head)
        print("-" * len(head))
        for m in args.microbatches:
            base = res[0][("torch manual gpipe", m)]["ms"]
            for name in SCHEDULES:
                if (name, m) not in res[0]:
                    continue
                rows = [r[(name, m)] for r in res]
                v = rows[0]["stages"]
                theory = (p - 1) / (v * m + p - 1)
                idle = statistics.mean(r["idle"] for r in rows)
                ms = max(r["ms"] for r in rows)
                worst = max(rows, key=lambda r: r["saved_per_mb"] * r["peak_in_flight"])
                peak = worst["saved_per_mb"] * worst["peak_in_flight"]
                # both directions over p-1 boundaries, counted at the sender
                sent = sum(r["sent"] for r in rows)
                expect = 2 * (p - 1) * act if v == 1 else 2 * (v * p - 1) * act
                print(
                    f"{p:>2} | {m:>2} | {name:<16} | {ms:>8.1f} | {idle:>5.2f} | {theory:>6.2f} | "
                    f"{worst['saved_per_mb']:>16,.0f} | {worst['peak_in_flight']:>9} | "
                    f"{peak:>11,.0f} | {sent:>12,} | {sent / expect:>5.2f}"
                )
                emit(
                    "pipeline",
                    f"{name}, p={p}, m={m}",
                    "idle fraction (theory in target)",
                    round(idle, 3),
                    None,
                    target=f"{theory:.3f}",
                    comm=f"{sent / expect:.2f} of activations",
                    memory=f"{human_bytes(peak)} peak activations ({worst['peak_in_flight']} mb in flight)",
                )
                if name == "gpipe":
                    emit(
                        "pipeline",
                        f"vescale split vs hand split (torch GPipe), p={p}, m={m}",
                        "ms/step",
                        round(ms, 1),
                        round(max(r[("torch manual gpipe", m)]["ms"] for r in res), 1),
                    )
            print(f"{p:>2} | {m:>2} | {'torch hand split':<16} | {base:>8.1f} |")


if __name__ == "__main__":
    main()
