"""vescale-ragged micro-benchmarks: pack/unpack kernels and the flat-buffer planner.

Run: ``OMP_NUM_THREADS=1 python benchmarks/ragged_bench.py [--quick]``

Prints one table: pack and unpack time of the selected kernels (and of the other
torch strategies measured) against one ``torch.cat`` and one memcpy of the same
bytes (ratio = kernel time / memcpy time), and planner time and quality for 100, 1,000
and 10,000 parameters (random shapes) and GPT-2 small, in the given order and with
``order="auto"``, on 8 and 64 ranks and (``order="auto"``, up to 1,000 parameters) 256
and 1,024 ranks (planned by simulation; time: CPU process time). Quality: the slice
length ``S`` against the proven lower bound of any order (``even_slice_lower_bound``)
and the max/min rank load.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
from _summary import emit

from vescale.ragged._pack import TorchPackKernels, get_pack_kernels
from vescale.ragged._planner import (
    ParamSpec,
    _cut_rule,
    even_slice_lower_bound,
    plan_flat_buffers,
)


def _time(fn, repeat: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cpu_time(fn, repeat: int) -> float:
    """Best CPU process time of ``repeat`` calls (after one warm-up): the planner is pure
    Python on one thread, so this is what it costs, whatever else the box runs."""
    fn()
    best = math.inf
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


def bench_pack(repeat: int) -> list[tuple[str, ...]]:
    rows = []
    kernels = get_pack_kernels("cpu")
    cases = [("200 x 4096", 200, 4096), ("1000 x 100", 1000, 100), ("20 x 500k", 20, 500_000)]
    for label, count, size in cases:
        rows += _pack_case(kernels, label, count, size, repeat)
    return rows


def _pack_case(kernels, label: str, count: int, size: int, repeat: int) -> list[tuple[str, ...]]:
    rows = []
    ts = [torch.randn(size) for _ in range(count)]
    total = count * size
    out = torch.empty(total)
    src = torch.randn(total)
    out_bf16 = torch.empty(total, dtype=torch.bfloat16)
    views = list(out.split([t.numel() for t in ts]))
    memcpy = _time(lambda: out.copy_(src), repeat)
    cat = _time(lambda: torch.cat(ts, out=out), repeat)
    results = {
        f"pack ({kernels.name})": _time(lambda: kernels.pack(ts, out), repeat),
        f"unpack ({kernels.name})": _time(lambda: kernels.unpack(out, ts), repeat),
        "pack fp32->bf16": _time(lambda: kernels.pack(ts, out_bf16), repeat),
        "unpack bf16->fp32": _time(lambda: kernels.unpack(out_bf16, ts), repeat),
        "pack: torch.cat(out=)": cat,
        "pack: loop of copy_": _time(lambda: [v.copy_(t) for v, t in zip(views, ts)], repeat),
        "unpack: split_with_sizes_copy": _time(
            lambda: torch.split_with_sizes_copy(out, [t.numel() for t in ts], out=ts), repeat
        ),
    }
    gb = total * 4 / 1e9
    for name, t in results.items():
        rows.append(
            (
                label,
                name,
                f"{t * 1e3:.3f}",
                f"{gb / t:.2f}",
                f"{t / cat:.2f}",
                f"{t / memcpy:.2f}",
            )
        )
    return rows


def _specs(count: int, seed: int = 0) -> list[ParamSpec]:
    rng = random.Random(seed)
    dims = [64, 128, 256, 384, 512, 768, 1024]
    out = []
    for i in range(count):
        kind = rng.random()
        if kind < 0.4:
            out.append(ParamSpec(f"p{i}", (rng.choice(dims),), torch.float32))
        elif kind < 0.8:
            out.append(
                ParamSpec(f"p{i}", (rng.choice(dims), rng.choice(dims)), torch.float32, "row")
            )
        else:
            shape = (rng.choice(dims), rng.choice(dims))
            out.append(ParamSpec(f"p{i}", shape, torch.bfloat16, (32, 32)))
    return out


def _gpt2_small(gran) -> list[ParamSpec]:
    """GPT-2 small's parameter shapes (124 M): 2-D weights get ``gran``, the rest elements."""
    d, shapes = 768, [("wte", (50257, 768)), ("wpe", (1024, 768))]
    for i in range(12):
        shapes += [
            (f"h{i}.ln_1.weight", (d,)),
            (f"h{i}.ln_1.bias", (d,)),
            (f"h{i}.attn.c_attn.weight", (d, 3 * d)),
            (f"h{i}.attn.c_attn.bias", (3 * d,)),
            (f"h{i}.attn.c_proj.weight", (d, d)),
            (f"h{i}.attn.c_proj.bias", (d,)),
            (f"h{i}.ln_2.weight", (d,)),
            (f"h{i}.ln_2.bias", (d,)),
            (f"h{i}.mlp.c_fc.weight", (d, 4 * d)),
            (f"h{i}.mlp.c_fc.bias", (4 * d,)),
            (f"h{i}.mlp.c_proj.weight", (4 * d, d)),
            (f"h{i}.mlp.c_proj.bias", (d,)),
        ]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    return [ParamSpec(n, s, torch.float32, gran if len(s) == 2 else "element") for n, s in shapes]


def _slice_vs_bound(specs: list[ParamSpec], layouts) -> float:
    """Largest ``S / bound`` over the buffers: ``S`` the slice length (what every rank
    holds and moves), the bound `even_slice_lower_bound` (no order does better)."""
    worst = 1.0
    for dtype, layout in layouts.items():
        group = [s for s in specs if s.dtype == dtype]
        sizes = [math.prod(s.shape) for s in group]
        steps = [max(_cut_rule(s.shape, s.granularity)[1], 1) for s in group]
        bound = even_slice_lower_bound(sizes, steps, layout.num_ranks)
        if bound:
            worst = max(worst, layout.slice_numel(0) / bound)
    return worst


def bench_planner(repeat: int) -> list[tuple[str, ...]]:
    rows = []
    cases = [(f"{c} params", _specs(c)) for c in (100, 1_000, 10_000)]
    cases += [("GPT-2 row", _gpt2_small("row")), ("GPT-2 (32,32)", _gpt2_small((32, 32)))]
    for label, specs in cases:
        # cluster sizes (planned by simulation: the planner is pure Python)
        ranks = (8, 64) if len(specs) > 1_000 else (8, 64, 256, 1024)
        for n in ranks:
            for order in ("given", "auto") if n <= 64 else ("auto",):
                t = _cpu_time(
                    lambda s=specs, k=n, o=order: plan_flat_buffers(s, k, order=o), repeat
                )
                layouts = plan_flat_buffers(specs, n, order=order)
                imb = max(l.imbalance() for l in layouts.values())
                pad = sum(l.padding for l in layouts.values())
                bound = _slice_vs_bound(specs, layouts)
                rows.append(
                    (
                        label,
                        f"N={n}",
                        order,
                        f"{t * 1e3:.1f}",
                        f"{bound:.4f}",
                        f"{imb:.4f}",
                        str(pad),
                    )
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    repeat = 3 if args.quick else 10
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, kernels "
        f"{get_pack_kernels('cpu').name} (default {TorchPackKernels.name})"
    )
    print()
    header = ("tensors", "op", "ms", "GB/s", "vs cat", "vs memcpy")
    rows = bench_pack(repeat)
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    cat_ms = {r[0]: float(r[2]) for r in rows if r[1] == "pack: torch.cat(out=)"}
    for r in rows:
        if r[1] in ("pack (torch)", "unpack (torch)"):
            emit(
                "ragged pack",
                f"{r[1].split()[0]} {r[0]} fp32",
                "ms vs one torch.cat(out=)",
                float(r[2]),
                cat_ms[r[0]],
                unit="ms",
                target="≈ 1 (memory bound)",
            )
    print()
    print(
        "planner: ms = CPU process time of one plan_flat_buffers call (best of several); "
        "S / bound = each buffer's slice length (what every rank holds and every "
        "collective moves per rank) over the proven lower bound of any order "
        "(even_slice_lower_bound), largest over the dtypes; max/min load: parameter "
        "elements per rank (inf: some rank holds none)"
    )
    header = ("planner", "ranks", "order", "ms", "S / bound", "max/min load", "padding")
    rows = bench_planner(max(1, repeat // 3))
    for r in rows:
        emit(
            "ragged planner",
            f"{r[0]}, {r[1]}, order={r[2]}",
            "CPU ms; slice length / lower bound; max/min rank load",
            f"{float(r[3]):.0f} ms; {float(r[4]):.4f}; {float(r[5]):.3f}",
            None,
            target="≤ 50 ms (1,000 params); ≤ 1.01",
        )
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
