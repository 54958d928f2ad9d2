"""The scaffold the multi-rank benchmarks share: launch ranks, collect, time alternately.

A benchmark writes one ``bench_worker(*args)`` that builds its sides (vescale and the
PyTorch baseline) on every rank and returns a picklable result; `run_worlds` runs it
on each world size and hands back every rank's result, and `time_alternating` steps
the sides in turns inside the worker so that load on a shared machine hits every
side alike (only ratios within one run compare).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["run_worlds", "time_alternating"]


def run_worlds(
    fn: Callable[..., Any],
    worlds: Iterable[int],
    *args: Any,
    timeout: float = 1800,
    fresh: bool = False,
) -> list[tuple[int, list[Any]]]:
    """Run ``fn(*args)`` on CPU gloo ranks, once per world size.

    Args:
        fn: A module-level function (it is pickled by reference), run on every rank
            with the default process group initialised.
        worlds: World sizes, run one after another.
        *args: Passed to ``fn`` on every rank.
        timeout: Seconds one world size may take (pool launch only; a failure or a
            missed deadline raises with every rank's traceback).
        fresh: Spawn new processes for each world size (no start-up deadline, nothing
            reused) instead of the persistent worker pool of
            ``vescale.dtensor.testing.run_on_ranks`` (start-up limited to a few
            minutes, which a heavily loaded machine can miss).

    Returns:
        ``[(world, [result of rank 0, rank 1, ...]), ...]`` in the order of ``worlds``.
    """
    from vescale.dtensor.testing import run_on_ranks, shutdown_pools

    out = []
    try:
        for n in worlds:
            if fresh:
                out.append((n, _spawn(fn, n, args)))
            else:
                out.append((n, list(run_on_ranks(fn, n, *args, timeout=timeout))))
    finally:
        shutdown_pools()
    return out


def time_alternating(
    sides: Mapping[str, Callable[[], Any]],
    steps: int,
    *,
    after: Mapping[str, Callable[[], Any]] | None = None,
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median milliseconds per call of each side, the sides called in turns.

    Every round calls each side once, after a barrier of the default process group;
    every other round runs in reverse order, so that no side always follows another.
    Call from inside the worker, after the warm-up steps.

    Args:
        sides: ``{name: step}``, each ``step()`` one timed unit (e.g. a training step).
        steps: Rounds (timed calls per side).
        after: ``{name: fn}``: ``fn()`` runs right after each timed call of that side,
            untimed (e.g. the backward that prepares the next timed unit).
        samples: Filled with every timed call's seconds per side (for a spread).

    Returns:
        ``{name: median ms}``.
    """
    import torch.distributed as dist

    order = list(sides)
    times: dict[str, list[float]] = {name: [] for name in order}
    for i in range(steps):
        for name in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
            if after is not None and name in after:
                after[name]()
    if samples is not None:
        samples.update(times)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, fn(*args)))
    finally:
        dist.destroy_process_group()


def _spawn(fn: Callable, world: int, args: tuple) -> list[Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(
        _rank_main, args=(world, port, fn, args, queue), nprocs=world, start_method="spawn"
    )
    got = dict(queue.get() for _ in range(world))
    return [got[r] for r in range(world)]
