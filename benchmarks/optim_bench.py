"""vescale.optim benchmarks on CPU ranks (gloo).

1. ZeRO: ``DistributedOptimizer(AdamW)`` vs torch's own ZeRO-1 peer,
   ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)`` after DDP's gradient
   all-reduce, and vs DDP-like plain replication (every rank runs ``torch.optim.AdamW``
   on the full parameters after the same all-reduce); same parameters and per-rank
   gradients, one step of each in turn, median step time over ``4 * --iters`` steps
   (and the min-max spread). DistributedOptimizer runs twice: with the collectives it
   picks for the backend (gloo: gradient all-reduce, broadcasts of the updated pieces)
   and forced onto NCCL's (reduce-scatter + all-gather: what it ran on gloo before).
   Reports bytes sent per rank per step (``CommDebugMode``), per-rank optimizer-state
   bytes (+ master) against ``8 * P`` (replicated fp32 AdamW state), the ratios, and
   the largest parameter difference between the sides after the same steps.
2. Muon: ``vescale.optim.Muon`` (each matrix gathered to one load-balanced root rank)
   vs the naive approach where every rank all-gathers every matrix and runs
   Newton–Schulz on all of them. Reports step time and the ratio.
3. Overlap: ``DistributedOptimizer(..., overlap_param_gather=True)`` vs off on a stack of
   linear layers: time of ``step()`` + the next forward (where the overlapped gathers are
   waited for), for overlap off with one bucket (the default), off with
   ``--bucket-mb`` buckets and on with the same buckets. Same parameters afterwards.

    OMP_NUM_THREADS=1 python benchmarks/optim_bench.py --ranks 2 4 --mparams 4 --iters 5
    OMP_NUM_THREADS=1 python benchmarks/optim_bench.py --parts zero --iters 10  # ZeRO only
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _launch import run_worlds, time_alternating
from _summary import emit, human_bytes


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for k, v in st.items()
        if torch.is_tensor(v) and k != "step"
    )


def _zero_body(mparams: float, iters: int):
    """ZeRO-1 peers, each timed per step in turn (alternating), median over ``iters``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from vescale.dtensor import Replicate, distribute_tensor, from_local, init_device_mesh
    from vescale.dtensor.debug import CommDebugMode
    from vescale.optim import DistributedOptimizer

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    width = 1024
    rows = max(1, int(mparams * 1e6 / width / 8))
    shapes = [(rows, width)] * 8 + [(width,)] * 4
    torch.manual_seed(0)
    full = [torch.randn(s) * 0.02 for s in shapes]
    torch.manual_seed(1 + dist.get_rank())  # every rank its own gradient (its data)
    grads = [torch.randn(s) for s in shapes]
    P = sum(t.numel() for t in full)

    def vescale_side(paths):
        # distribute_tensor may keep the local tensor's storage: one copy per side
        ps = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Replicate()])) for t in full]
        opt = DistributedOptimizer(
            ps, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=1e-3, zero_stage=1
        )
        if paths is not None:
            opt._plan_paths(paths)  # force NCCL's collectives (this backend's old path)
        dgrads = [from_local(g, mesh, [Replicate()]) for g in grads]  # this rank's term

        def step():
            for p, g in zip(ps, dgrads):
                p.grad = g
            opt.step()

        return step, opt, lambda: [p.full_tensor() for p in ps]

    ours, opt, ours_params = vescale_side(None)
    rsag, opt_rsag, rsag_params = vescale_side("nccl")

    # torch's peer: ZeroRedundancyOptimizer(AdamW) (ZeRO-1: each rank steps its shard of
    # the parameters, then broadcasts it) after DDP's gradient all-reduce (average) of
    # the gradients packed into one bucket
    zs = [torch.nn.Parameter(t.clone()) for t in full]
    zero_opt = ZeroRedundancyOptimizer(zs, optimizer_class=torch.optim.AdamW, lr=1e-3)

    def zero():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for z, piece in zip(zs, flat.split([g.numel() for g in grads])):
            z.grad = piece.view(z.shape)
        zero_opt.step()

    # DDP-like baseline: the same all-reduce, full AdamW on every rank
    bs = [torch.nn.Parameter(t.clone()) for t in full]
    base_opt = torch.optim.AdamW(bs, lr=1e-3)

    def base():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for b, piece in zip(bs, flat.split([g.numel() for g in grads])):
            b.grad = piece.view(b.shape)
        base_opt.step()

    sides = {"ours": ours, "rsag": rsag, "zero": zero, "base": base}
    sent = {}
    for k, fn in sides.items():  # warm-up step (creates the state), bytes counted
        with CommDebugMode() as comm:
            fn()
        sent[k] = comm.get_total_bytes()
    times: dict[str, list[float]] = {}
    medians = time_alternating(sides, iters, samples=times)
    # every side ran the same steps on the same gradients: same parameters
    ref = [b.detach() for b in bs]
    diffs = {
        k: max((a - b).abs().max().item() for a, b in zip(side, ref))
        for k, side in (
            ("ours", ours_params()),
            ("rsag", rsag_params()),
            ("zero", [z.detach() for z in zs]),
        )
    }
    max_diff = max(diffs.values())
    gathered = [None] * n  # ZeroRedundancyOptimizer's shards are uneven: report the largest
    dist.all_gather_object(gathered, _state_bytes(zero_opt.optim))
    return {
        "P": P,
        **{f"{k}_s": ms / 1e3 for k, ms in medians.items()},
        **{f"{k}_spread": (min(v), max(v)) for k, v in times.items()},
        **{f"{k}_sent": v for k, v in sent.items()},
        "state_ours": _state_bytes(opt),
        "state_base": _state_bytes(base_opt),
        "state_zero": max(gathered),
        "max_param_diff": max_diff,
        "diffs": diffs,
    }


def _naive_muon_step(params, bufs, lr, wd, mu):
    from vescale.dtensor import DTensor, distribute_tensor
    from vescale.optim._muon import adjust_lr, newton_schulz

    for p, buf in zip(params, bufs):
        g = p.grad
        buf.to_local().lerp_(g.to_local(), 1 - mu)
        u = DTensor.from_local(
            g.to_local().lerp(buf.to_local(), mu),
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
        full = u.full_tensor()  # every rank gathers every matrix
        o = newton_schulz(full, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        mine = distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None).to_local()
        x = p.to_local()
        x.mul_(1 - lr * wd)
        x.add_(mine, alpha=-adjust_lr(lr, None, p.shape))


def _muon_body(dim: int, nmat: int, iters: int):
    from vescale.dtensor import Shard, distribute_tensor, init_device_mesh
    from vescale.optim import Muon

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    shapes = [(dim, dim), (dim, 4 * dim), (4 * dim, dim)] * (nmat // 3 + 1)
    shapes = shapes[:nmat]
    full = [torch.randn(s) * 0.02 for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    ps = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    qs = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    opt = Muon(ps, lr=0.02)
    bufs = [torch.zeros_like(q) for q in qs]

    def ours():
        for p, g in zip(ps, grads):
            p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
        opt.step()

    def naive():
        for q, g in zip(qs, grads):
            q.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
        with torch.no_grad():
            _naive_muon_step(qs, bufs, 0.02, 0.1, 0.95)

    ours(), naive()  # warm-up (creates optimizer state)
    ms = time_alternating({"ours": ours, "naive": naive}, iters)
    for p, q in zip(ps, qs):  # same math
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=1e-4, atol=1e-5)
    return {"ours_s": ms["ours"] / 1e3, "naive_s": ms["naive"] / 1e3}


def _overlap_body(mparams: float, layers: int, batch: int, iters: int, bucket_mb: float):
    import torch.nn.functional as F
    from torch import nn

    from vescale.dtensor import Replicate, distribute_tensor, init_device_mesh
    from vescale.optim import DistributedOptimizer

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    width = max(8, int((mparams * 1e6 / layers) ** 0.5))

    class Layer(nn.Module):
        def __init__(self, w: torch.Tensor) -> None:
            super().__init__()
            self.weight = nn.Parameter(distribute_tensor(w, mesh, [Replicate()]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(F.linear(x, self.weight.to_local()))

    torch.manual_seed(0)
    init = [torch.randn(width, width) / width**0.5 for _ in range(layers)]
    x = torch.randn(batch, width) + dist.get_rank()
    configs = {
        "off, 1 bucket": {},
        f"off, {bucket_mb:g} MB buckets": {"bucket_cap_mb": bucket_mb},
        f"on, {bucket_mb:g} MB buckets": {"bucket_cap_mb": bucket_mb, "overlap_param_gather": True},
    }
    runs = {}
    for name, kw in configs.items():
        model = nn.Sequential(*(Layer(w.clone()) for w in init))
        opt = DistributedOptimizer(model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=1e-4, **kw)
        model(x).square().mean().backward()
        runs[name] = (model, opt)

    outs: dict[str, torch.Tensor] = {}

    def timed(name):
        model, opt = runs[name]
        opt.step()
        outs[name] = model(x)  # with overlap: waits for each layer's bucket right before it

    def untimed(name):
        runs[name][1].zero_grad()  # ZeRO-2 released the gradients in step()
        outs.pop(name).square().mean().backward()  # gradients for the next step

    for name in runs:  # warm-up round
        timed(name)
        untimed(name)
    ms = time_alternating(
        {name: lambda name=name: timed(name) for name in runs},
        iters,
        after={name: lambda name=name: untimed(name) for name in runs},
    )
    ref = [p.to_local() for p in runs[f"off, {bucket_mb:g} MB buckets"][0].parameters()]
    on = [p.to_local() for p in runs[f"on, {bucket_mb:g} MB buckets"][0].parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ref, on)), "overlap changed the parameters"
    P = layers * width * width
    return {
        "P": P,
        "buckets": {k: v[1].num_buckets for k, v in runs.items()},
        "times": {k: v / 1e3 for k, v in ms.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mparams", type=float, default=4.0, help="millions of parameters (ZeRO)")
    ap.add_argument("--muon-dim", type=int, default=256)
    ap.add_argument("--muon-mats", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5, help="timed steps (ZeRO: 4x as many)")
    ap.add_argument("--layers", type=int, default=8, help="layers of the overlap model")
    ap.add_argument("--batch", type=int, default=256, help="rows per rank (overlap forward)")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="overlap bucket size")
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["zero", "muon", "overlap"],
        choices=["zero", "muon", "overlap"],
    )
    args = ap.parse_args()
    bodies = {
        "zero": (_zero_body, args.mparams, 4 * args.iters),
        "muon": (_muon_body, args.muon_dim, args.muon_mats, args.iters),
        "overlap": (
            _overlap_body,
            args.mparams,
            args.layers,
            args.batch,
            args.iters,
            args.bucket_mb,
        ),
    }
    got = {
        part: {
            n: per_rank[0]
            for n, per_rank in run_worlds(
                bodies[part][0], args.ranks, *bodies[part][1:], timeout=900
            )
        }
        for part in ("zero", "muon", "overlap")
        if part in args.parts
    }
    rows = [
        (n, *(got.get(part, {}).get(n) for part in ("zero", "muon", "overlap"))) for n in args.ranks
    ]
    if "zero" in args.parts:
        _print_zero(rows, args)
    if "muon" in args.parts:
        _print_muon(rows, args)
    if "overlap" in args.parts:
        _print_overlap(rows, args)


def _print_zero(rows, args) -> None:
    print()
    print("ZeRO (DistributedOptimizer(AdamW), fp32) vs DDP-like replicated torch AdamW")
    print(
        f"{'ranks':>5} {'params':>10} {'state/rank ours':>16} {'state/rank DDP':>15} {'8P/N':>12} "
        f"{'mem ratio':>9} {'step ours':>10} {'step DDP':>9} {'time ratio':>10}"
    )
    for n, z, _, _ in rows:
        P = z["P"]
        print(
            f"{n:>5} {P:>10,} {z['state_ours']:>16,} {z['state_base']:>15,} {8 * P // n:>12,} "
            f"{z['state_ours'] / z['state_base']:>9.3f} {z['ours_s'] * 1e3:>8.1f}ms "
            f"{z['base_s'] * 1e3:>7.1f}ms {z['ours_s'] / z['base_s']:>10.2f}"
        )
        emit(
            "optimizer",
            f"DistributedOptimizer(AdamW) vs replicated torch AdamW, N={n}",
            "ms per step (reduce-scatter + step + all-gather vs step)",
            z["ours_s"] * 1e3,
            z["base_s"] * 1e3,
            unit="ms",
            memory=f"{human_bytes(z['state_ours'])} (torch {human_bytes(z['state_base'])})",
            target="state ≈ 1/N of torch",
        )
    print()
    print(
        "ZeRO-1 peers, fp32 AdamW, median step over "
        f"{4 * args.iters} alternating steps (min-max): DistributedOptimizer (gloo: gradient "
        "all-reduce + broadcasts of the updated pieces; 'RS+AG': NCCL's reduce-scatter + "
        "all-gather, forced) vs torch ZeroRedundancyOptimizer after DDP's gradient "
        "all-reduce; bytes sent per rank per step as CommDebugMode counts them"
    )
    print(
        f"{'ranks':>5} {'sent ours':>11} {'sent ZeRO':>11} {'state ours':>11} "
        f"{'state ZeRO':>11} {'step ours':>20} {'step RS+AG':>20} {'step ZeRO':>20} "
        f"{'ours/ZeRO':>9} {'RS+AG/ZeRO':>10} {'max |diff|':>10}"
    )

    def cell(z, k):
        lo, hi = z[f"{k}_spread"]
        return f"{z[f'{k}_s'] * 1e3:.1f}ms ({lo * 1e3:.0f}-{hi * 1e3:.0f})"

    for n, z, _, _ in rows:
        print(
            f"{n:>5} {human_bytes(z['ours_sent']):>11} {human_bytes(z['zero_sent']):>11} "
            f"{human_bytes(z['state_ours']):>11} {human_bytes(z['state_zero']):>11} "
            f"{cell(z, 'ours'):>20} {cell(z, 'rsag'):>20} {cell(z, 'zero'):>20} "
            f"{z['ours_s'] / z['zero_s']:>9.2f} {z['rsag_s'] / z['zero_s']:>10.2f} "
            f"{z['max_param_diff']:>10.1e}"
        )
        emit(
            "optimizer",
            f"DistributedOptimizer(AdamW) vs torch ZeroRedundancyOptimizer(AdamW), N={n}",
            "median ms per step (gradient sync + sharded step + parameter sync)",
            z["ours_s"] * 1e3,
            z["zero_s"] * 1e3,
            unit="ms",
            comm=f"{human_bytes(z['ours_sent'])} (torch {human_bytes(z['zero_sent'])})",
            memory=f"{human_bytes(z['state_ours'])} (torch {human_bytes(z['state_zero'])})",
            target="≤ 1 (no slower at equal bytes)",
        )


def _print_muon(rows, args) -> None:
    print()
    print(
        f"Muon ({args.muon_mats} matrices, dim {args.muon_dim}, Shard(0)): root-rank vs every-rank-gathers-every-matrix"
    )
    print(f"{'ranks':>5} {'step ours':>10} {'step naive':>11} {'ratio':>6}")
    for n, _, m, _ in rows:
        print(
            f"{n:>5} {m['ours_s'] * 1e3:>8.1f}ms {m['naive_s'] * 1e3:>9.1f}ms {m['ours_s'] / m['naive_s']:>6.2f}"
        )
        emit(
            "optimizer",
            f"Muon, {args.muon_mats} matrices {args.muon_dim}², N={n}",
            "ms per step vs every rank gathering every matrix",
            m["ours_s"] * 1e3,
            m["naive_s"] * 1e3,
            unit="ms",
            target="< 1",
        )


def _print_overlap(rows, args) -> None:
    print()
    print(
        f"Overlap: step() + next forward, {args.layers} layers, batch {args.batch}/rank "
        "(median; ratio vs 'off, 1 bucket')"
    )
    print(f"{'ranks':>5} {'params':>10} {'config':>22} {'buckets':>7} {'time':>9} {'ratio':>6}")
    for n, _, _, o in rows:
        base = o["times"]["off, 1 bucket"]
        for name, t in o["times"].items():
            print(
                f"{n:>5} {o['P']:>10,} {name:>22} {o['buckets'][name]:>7} "
                f"{t * 1e3:>7.1f}ms {t / base:>6.2f}"
            )


if __name__ == "__main__":
    main()
