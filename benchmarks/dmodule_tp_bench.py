"""One GPT training step under tensor parallelism: vescale's DModule vs torch's parallelize_module.

Both sides shard the same GPT (``vescale.dmodule.testing.GPT``, untied embeddings)
with the same Megatron plan: vocabulary-parallel token embedding, column-parallel
q/k/v/fc1/lm_head (logits gathered), row-parallel o_proj/fc2 (outputs
all-reduced). vescale derives the plan automatically; torch gets the equivalent
``ColwiseParallel``/``RowwiseParallel`` plan (plus ``distribute_module`` to
replicate the remaining parameters) (``use_local_output=False`` so the
unmodified model, which uses global head counts, runs on DTensors; its step runs
under ``implicit_replication`` for the causal mask made in ``forward``). The two
models are stepped alternately in the same worker processes (CPU, gloo), and the
table reports the median step time, the ratio, and the bytes each rank sends
per step (``vescale.dtensor.debug.CommDebugMode``'s ring cost model).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/dmodule_tp_bench.py [--tp 2 4] [--steps 6]
"""

from __future__ import annotations

import argparse

from _launch import run_worlds, time_alternating
from _summary import emit, human_bytes


def _torch_plan(model):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col = ColwiseParallel(use_local_output=False)
    row = RowwiseParallel(input_layouts=Shard(-1), use_local_output=False)
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), use_local_output=False),
        "lm_head": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
    }
    for i in range(len(model.blocks)):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{name}"] = col
        plan[f"blocks.{i}.attn.o_proj"] = row
        plan[f"blocks.{i}.mlp.fc1"] = col
        plan[f"blocks.{i}.mlp.fc2"] = row
    return plan


def bench_worker(steps: int, cfg_kwargs: dict, batch: int, seq: int) -> dict:
    import contextlib
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, distribute_module
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    from vescale.dmodule import parallelize_module
    from vescale.dmodule.testing import GPT, GPTConfig
    from vescale.dtensor import init_device_mesh
    from vescale.dtensor.debug import CommDebugMode

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    cfg = GPTConfig(**cfg_kwargs)
    base = GPT(cfg)
    ours = parallelize_module(copy.deepcopy(base), mesh)
    theirs = torch_parallelize(copy.deepcopy(base), mesh, _torch_plan(base))
    distribute_module(theirs, mesh)  # replicate the unplanned params (norms, wpe, biases)
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.vocab_size, (batch, seq))

    def make_step(model, ctx):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            with ctx():
                logits = model(x)
                if isinstance(logits, DTensor):
                    logits = logits.to_local()
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        return step

    sides = {
        "vescale": make_step(ours, contextlib.nullcontext),
        "torch": make_step(theirs, implicit_replication),
    }
    stats = {}
    for name, step in sides.items():
        step()  # warm up
        with CommDebugMode() as cm:
            loss = step()
        stats[name] = {
            "bytes": cm.get_total_bytes(),
            "collectives": cm.get_total_counts(),
            "loss": loss,
        }
    for name, ms in time_alternating(sides, steps).items():
        stats[name]["median_ms"] = ms
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
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
    rows = [
        (tp, per_rank[0])
        for tp, per_rank in run_worlds(
            bench_worker, args.tp, args.steps, cfg, args.batch, args.seq, timeout=900
        )
    ]
    print(
        f"GPT {args.layers}x{args.hidden}, vocab {args.vocab}, batch {args.batch}x{args.seq}, "
        f"{args.steps} alternating steps per side (CPU, gloo)"
    )
    head = (
        f"{'TP':>3} | {'vescale ms':>10} | {'torch ms':>9} | {'ratio':>5} | "
        f"{'vescale B/rank':>14} | {'torch B/rank':>12} | {'colls v/t':>9} | loss equal"
    )
    print(head)
    print("-" * len(head))
    for tp, r in rows:
        v, t = r["vescale"], r["torch"]
        print(
            f"{tp:>3} | {v['median_ms']:>10.1f} | {t['median_ms']:>9.1f} | "
            f"{v['median_ms'] / t['median_ms']:>5.2f} | {v['bytes']:>14,} | {t['bytes']:>12,} | "
            f"{v['collectives']:>4}/{t['collectives']:<4} | {abs(v['loss'] - t['loss']) < 1e-5}"
        )
        emit(
            "tensor parallel",
            f"GPT train step, TP={tp}",
            "ms/step vs torch parallelize_module",
            v["median_ms"],
            t["median_ms"],
            unit="ms",
            comm=f"{human_bytes(v['bytes'])} (torch {human_bytes(t['bytes'])})",
            target="≤ 1",
        )


if __name__ == "__main__":
    main()
