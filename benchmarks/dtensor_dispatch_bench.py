"""Per-op dispatch time of built-in DTensors with and without vescale imported.

vescale must add no measurable overhead to DTensors that carry only torch's
placements: they stay torch's own objects on torch's own dispatch path. This runs
the same op loop in two fresh single-rank gloo processes, one that never imports
vescale and one that does, alternating several rounds, and prints the median
per-op time and the ratio. A third column shows a DTensor with a plugin placement
(vescale's ``PluginDTensor``) for reference.

Usage::

    python benchmarks/dtensor_dispatch_bench.py [--iters 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

from _summary import emit

CHILD = textwrap.dedent(
    r"""
    import json, os, sys, time
    import torch, torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = sys.argv[3]
    dist.init_process_group("gloo", rank=0, world_size=1)
    use_vescale, iters = sys.argv[1] == "1", int(sys.argv[2])
    if use_vescale:
        import vescale.dtensor  # noqa: F401  (installs vescale's patches)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    a = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(64, 64), mesh, [Replicate()])
    ops = {
        "add": lambda: a + b,
        "mul_": lambda: a.mul_(1.0),
        "mm": lambda: a @ w,
        "sum": lambda: a.sum(),
        "redistribute": lambda: a.redistribute(mesh, [Replicate()]),
    }
    if use_vescale:
        from vescale.dtensor import distribute_tensor as vdist
        from vescale.dtensor.testing.placements import OwnerOnly
        p = vdist(torch.randn(64, 64), mesh, [OwnerOnly(0)])
        q = vdist(torch.randn(64, 64), mesh, [OwnerOnly(0)])
        ops["plugin add"] = lambda: p + q
    out = {}
    for name, fn in ops.items():
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(5):  # best of 5: the least disturbed measurement
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter() - t0) / iters * 1e6)
        out[name] = best
    print("RESULT " + json.dumps(out))
    dist.destroy_process_group()
    """
)


def _run(use_vescale: bool, iters: int, port: int) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if use_vescale else "0", str(iters), str(port)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"benchmark child failed:\n{res.stdout}\n{res.stderr}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch_only: dict[str, list[float]] = {}
    with_vescale: dict[str, list[float]] = {}
    for r in range(args.rounds):  # alternate to cancel drift
        for use, sink in ((False, torch_only), (True, with_vescale)):
            for k, v in _run(use, args.iters, 29600 + 2 * r + int(use)).items():
                sink.setdefault(k, []).append(v)
    print(
        f"per-op dispatch time (us): best of 5 x {args.iters} calls per process, "
        f"median over {args.rounds} alternating process pairs"
    )
    print(f"{'op':<14}{'torch only':>12}{'+ vescale':>12}{'ratio':>8}")
    for k in with_vescale:
        v = statistics.median(with_vescale[k])
        if k in torch_only:
            t = statistics.median(torch_only[k])
            print(f"{k:<14}{t:>12.2f}{v:>12.2f}{v / t:>8.3f}")
            emit(
                "dtensor dispatch",
                f"built-in DTensor `{k}`",
                "us per op, torch only vs + vescale imported",
                v,
                t,
                unit="us",
                target="≈ 1 (no overhead)",
            )
        else:
            print(f"{k:<14}{'-':>12}{v:>12.2f}{'':>8}")


if __name__ == "__main__":
    main()
