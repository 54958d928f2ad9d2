"""Run every package benchmark and write one markdown report (``docs/benchmarks.md``).

Each benchmark compares vescale with the PyTorch baseline in the same run and prints
its own table (step-time ratios, bytes sent vs the ring lower bound, bytes copied,
memory per rank). This script runs them one after another (they would only steal
cores from each other), records the machine and the torch version, and gathers the
tables into one page.

Usage::

    python benchmarks/run_all.py [--quick] [--out docs/benchmarks.md] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from _summary import markdown_table, parse

HERE = Path(__file__).resolve().parent

# name -> (script, what it compares, args for a full run, args for --quick)
BENCHMARKS = {
    "dtensor dispatch": (
        "dtensor_dispatch_bench.py",
        "per-op dispatch time of built-in DTensors with and without vescale imported",
        ["--iters", "2000", "--rounds", "5"],
        ["--iters", "500", "--rounds", "3"],
    ),
    "random ops equal to one device (vs plain local dropout)": (
        "rng_bench.py",
        "dropout on a sharded DTensor per placement vs the same on a plain local tensor",
        ["--world", "4", "--iters", "20"],
        ["--world", "2", "--iters", "5", "--shape", "4", "64", "256"],
    ),
    "ragged pack kernels and planner": (
        "ragged_bench.py",
        "pack/unpack vs one torch.cat / memcpy; planner time for 100/1,000/10,000 params",
        [],
        ["--quick"],
    ),
    "tensor parallel (vs torch parallelize_module)": (
        "dmodule_tp_bench.py",
        "one transformer training step under TP=2 and TP=4, bytes per rank",
        ["--tp", "2", "4", "--steps", "5"],
        ["--tp", "2", "--steps", "2"],
    ),
    "data parallel (vs torch DDP and FSDP2)": (
        "dp_bench.py",
        "step time, bytes sent vs ring bound, bytes copied, state memory per rank",
        ["--world", "2", "4", "--steps", "6"],
        ["--world", "2", "--steps", "2"],
    ),
    "scaling (ranks x model size, vs torch FSDP2)": (
        "scaling_bench.py",
        "1, 2, 4 ranks x 3 GPT sizes: step time, bytes sent per rank, memory per rank",
        ["--ranks", "1", "2", "4", "--steps", "3"],
        ["--ranks", "1", "2", "--sizes", "S", "M", "--steps", "1"],
    ),
    "layout cost model (predicted vs measured)": (
        "strategy_bench.py",
        "predicted vs measured step time and memory of every layout of 1, 2, 4 ranks",
        ["--world", "1", "2", "4", "--steps", "3"],
        ["--world", "1", "2", "--sizes", "S", "--steps", "2", "--quick"],
    ),
    "optimizer (vs torch AdamW, ZeroRedundancyOptimizer, naive Muon)": (
        "optim_bench.py",
        "optimizer-state memory per rank and step time; Muon vs every-rank-gathers",
        ["--ranks", "2", "4"],
        ["--ranks", "2", "--mparams", "1"],
    ),
    "pipeline parallel (torch.distributed.pipelining schedules)": (
        "pipeline_bench.py",
        "idle fraction vs (p-1)/(m+p-1), activation memory per stage, bytes between stages",
        ["--pp", "2", "4", "--microbatches", "4", "8"],
        ["--pp", "2", "--microbatches", "4", "--steps", "2"],
    ),
    "checkpoint (vs DCP and the disk)": (
        "checkpoint_bench.py",
        "save/load GB/s vs plain DCP and sequential disk writes; async blocking",
        ["--ranks", "2", "4", "--mb", "128"],
        ["--ranks", "2", "--mb", "32", "--reps", "1"],
    ),
}


def _machine() -> str:
    import torch

    cores = os.cpu_count()
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.machine()}, {cores} cores{mem}, {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small settings (a smoke run)")
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "benchmarks.md"))
    ap.add_argument("--only", nargs="*", help="substrings of benchmark names to run")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    sections, failed, summary = [], [], []
    for name, (script, what, full, quick) in BENCHMARKS.items():
        if args.only and not any(s in name for s in args.only):
            continue
        cmd = [sys.executable, str(HERE / script), *(quick if args.quick else full)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            out, ok = res.stdout.strip(), res.returncode == 0
            if not ok:
                out += "\n" + res.stderr.strip()[-2000:]
        except subprocess.TimeoutExpired:
            out, ok = f"timed out after {args.timeout:.0f} s", False
        dt = time.perf_counter() - t0
        print(out, flush=True)
        rows, out = parse(out)
        summary += rows
        if not ok:
            failed.append(name)
        sections.append(
            f"## {name}\n\n{what}. `benchmarks/{script} {' '.join(cmd[2:])}`, {dt:.0f} s"
            f"{'' if ok else ' (FAILED)'}.\n\n```text\n{out}\n```\n"
        )
    today = _dt.date.today().isoformat()
    page = (
        "# Benchmarks\n\n"
        "Every benchmark runs vescale and the PyTorch baseline in the same process tree, on "
        "the same model and data, alternating, and prints ratios (vescale / torch), bytes "
        "sent per rank against the ring lower bound, bytes copied and memory per rank. "
        "Regenerate this page with `python benchmarks/run_all.py` (or `hatch run bench:run`).\n\n"
        f"Measured on {today}: {_machine()}"
        f"{' (quick settings)' if args.quick else ''}. On a shared 2-core CPU box the "
        "timings are noisy; byte and memory figures are exact. The CUDA paths have their own "
        "prepared check and page: [GPU check](benchmarks-gpu.md).\n\n"
        "## Summary\n\n"
        "One row per comparison (ratio = vescale / baseline for times: below 1 is faster; "
        "for throughputs the benchmark says which way). The sections below hold each "
        "benchmark's full output.\n\n" + markdown_table(summary) + "\n\n" + "\n".join(sections)
    )
    Path(args.out).write_text(page)
    print(f"wrote {args.out}" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
