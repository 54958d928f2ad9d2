"""A persistent pool of spawned worker processes joined by a real gloo process group.

One pool exists per world size and lives until a run fails or the interpreter
exits. Each worker

* redirects its stdout/stderr (file descriptors 1 and 2) into a private log
  file, so that nothing reaches the test output unless a run fails;
* initialises the default gloo process group once (``OMP_NUM_THREADS=1``);
* then loops: receive a task, seed ``torch.manual_seed(0)``, call the body,
  run a barrier to detect desynchronised ranks, destroy the process groups the
  body created, and report the (pickled) return value or the traceback.

The parent waits for every rank. A failure or a missed deadline kills the pool;
the next run starts a fresh one, since ranks may be desynchronised.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

from ._funcref import FuncRef
from ._report import RankOutcome

__all__ = ["ProcessPool", "get_pool", "shutdown_pools"]

#: Seconds to wait for the remaining ranks after one rank failed.
FAILURE_GRACE_S = 1.5
#: Seconds a hung worker is given to write its stacks (SIGUSR1) before its log is read.
STACK_DUMP_WAIT_S = 1.0
#: Seconds allowed for a pool to start (imports + process group set-up).
STARTUP_TIMEOUT_S = 180.0
#: Process-group timeout used while idle; each task narrows it to its own timeout.
IDLE_PG_TIMEOUT_S = 600.0

_POOLS: dict[int, ProcessPool] = {}


# --------------------------------------------------------------------------- worker side


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _reset_distributed_state() -> None:
    """Destroy every non-default process group (local, no communication) and the caches
    (torch's sharding propagation, C++ fast path included, and vescale's plans) that
    remember meshes whose groups were just destroyed; DTensor's RNG tracker too."""
    from vescale.dtensor import _compat

    destroyed = _compat.destroy_subgroups()
    _compat.clear_dtensor_caches()
    redist = sys.modules.get("vescale.dtensor._redistribute")
    if redist is not None:
        redist._clear_caches()
    # A destroyed group lives on while garbage in a reference cycle (a DTensor's autograd
    # graph, a traceback) still holds it, and every live gloo group keeps a thread that
    # wakes every few milliseconds: hundreds of them, left by earlier tests, ate the CPU
    # that later tests needed. Collect now (a full collection costs a few tenths of a
    # second in a worker that has torch loaded: only after a task that made groups).
    if destroyed:
        gc.collect()


def _trace(name: str) -> None:
    path = os.environ.get("VESCALE_POOL_TRACE")
    if not path:
        return
    task_dir = f"/proc/{os.getpid()}/task"
    n = 0
    for t in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{t}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass
    with open(f"{path}.{os.getpid()}", "a") as f:
        f.write(f"{n} {name}\n")


def _worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    tasks: Any,
    results: Any,
    log_path: str,
    parent_pid: int,
) -> None:
    """Entry point of one pool worker (runs in a spawned process)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    _redirect_output(log_path)
    # A crash in native code (SIGSEGV, SIGABRT, ...) dumps every thread's Python stack
    # into the rank's log, which the failure report of the task includes.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # A rank that does not finish in time is sent SIGUSR1 by the parent, which dumps where
    # each of its threads is into the log: a hang report says where every rank waits.
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore(
            "127.0.0.1",
            store_port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=IDLE_PG_TIMEOUT_S),
        )
        results.put(("ready", rank, True, b""))
    except BaseException:
        results.put(("ready", rank, False, traceback.format_exc()))
        return

    from vescale.dtensor import _compat

    from ._funcref import resolve

    _compat.keep_redistribution_plans_across_meshes()

    while True:
        try:
            msg = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return  # the parent died; do not linger
            continue
        if msg is None:
            break
        task_id, ref, payload, timeout = msg
        print(f"===== task {task_id}: {ref.qualname} =====", flush=True)
        restart = False
        try:
            fn = resolve(ref)
            args, kwargs = pickle.loads(payload)
            _compat.set_pg_timeout(timedelta(seconds=timeout))
            torch.manual_seed(0)
            value = fn(*args, **kwargs)
            if not dist.is_initialized():
                raise RuntimeError("the body destroyed the default process group")
            dist.barrier()
            try:
                out = pickle.dumps(value)
            except Exception as exc:  # noqa: BLE001
                raise TypeError(
                    f"the return value of rank {rank} is not picklable: {exc!r}"
                ) from exc
            _reset_distributed_state()
            _trace(ref.qualname)
            _compat.set_pg_timeout(timedelta(seconds=IDLE_PG_TIMEOUT_S))
            reply = (task_id, rank, True, out)
        except BaseException:
            restart = True
            reply = (task_id, rank, False, traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        results.put(reply)
        if restart:
            # The parent tears the pool down after a failure; keep serving
            # until told to stop so that the reply above is not lost.
            continue
    # Leave at once: tearing down gloo and the interpreter costs about a second
    # per worker and there is nothing to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- parent side


class ProcessPool:
    """``world_size`` spawned workers with an initialised gloo process group.

    Args:
        world_size: Number of ranks.
    """

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self._ctx = mp.get_context("spawn")
        self._logdir = tempfile.mkdtemp(prefix=f"vescale-pool{world_size}-")
        self._logs = [os.path.join(self._logdir, f"rank{r}.log") for r in range(world_size)]
        self._store = dist.TCPStore(
            "127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False
        )
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = []
        self._next_task = 0
        self.alive = True
        env_backup = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned interpreters
        try:
            for rank in range(world_size):
                p = self._ctx.Process(
                    target=_worker_main,
                    args=(
                        rank,
                        world_size,
                        self._store.port,
                        self._tasks[rank],
                        self._results,
                        self._logs[rank],
                        os.getpid(),
                    ),
                    name=f"vescale-rank{rank}",
                    daemon=True,
                )
                p.start()
                self._procs.append(p)
        finally:
            if env_backup is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_backup
        self._wait_ready()

    # ----------------------------------------------------------------- helpers

    def _read_log(self, rank: int, start: int) -> str:
        try:
            with open(self._logs[rank], "rb") as f:
                f.seek(start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _log_size(self, rank: int) -> int:
        try:
            return os.path.getsize(self._logs[rank])
        except OSError:
            return 0

    def _wait_ready(self) -> None:
        ready: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < self.world_size:
            try:
                kind, rank, ok, info = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in ready]
                if dead or time.monotonic() > deadline:
                    break
                continue
            if kind == "ready":
                ready[rank] = (ok, info)
        bad = {r: info for r, (ok, info) in ready.items() if not ok}
        missing = [r for r in range(self.world_size) if r not in ready]
        if bad or missing:
            details = "\n".join(f"rank {r}:\n{tb}" for r, tb in sorted(bad.items()))
            logs = "\n".join(f"rank {r} output:\n{self._read_log(r, 0)}" for r in missing)
            self.close(kill=True)
            raise RuntimeError(
                f"could not start a {self.world_size}-rank gloo worker pool; "
                f"failed: {sorted(bad)}, not ready: {missing}\n{details}\n{logs}"
            )

    # ----------------------------------------------------------------- API

    def run(self, ref: FuncRef, args: tuple, kwargs: dict, timeout: float) -> list[RankOutcome]:
        """Run ``ref(*args, **kwargs)`` on every rank.

        Args:
            ref: The function to run.
            args: Positional arguments (picklable).
            kwargs: Keyword arguments (picklable).
            timeout: Seconds before unfinished ranks count as hung.

        Returns:
            One outcome per rank. The pool closes itself when any rank failed.
        """
        try:
            payload = pickle.dumps((args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"arguments for {ref.qualname} must be picklable to reach other ranks: {exc!r}"
            ) from exc
        self._next_task += 1
        task_id = self._next_task
        starts = [self._log_size(r) for r in range(self.world_size)]
        for q in self._tasks:
            q.put((task_id, ref, payload, float(timeout)))

        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                tid, rank, ok, info = self._results.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in outcomes and not p.is_alive():
                        outcomes[r] = RankOutcome(
                            r, ok=False, error=f"worker process exited with code {p.exitcode}"
                        )
                        deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
                continue
            if tid != task_id:
                continue
            if ok:
                outcomes[rank] = RankOutcome(rank, ok=True, value=pickle.loads(info))
            else:
                outcomes[rank] = RankOutcome(rank, ok=False, error=info)
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)

        result = []
        for r in range(self.world_size):
            o = outcomes.get(r)
            if o is None:
                o = RankOutcome(
                    r,
                    ok=False,
                    finished=False,
                    error=f"rank {r} did not finish (hang or still running)",
                )
            result.append(o)
        if not all(o.ok for o in result):
            self._dump_stacks([o.rank for o in result if not o.finished])
            for o in result:
                if not o.ok:
                    o.output = self._read_log(o.rank, starts[o.rank])
            self.close(kill=True)
        return result

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Have the workers of ``ranks`` write their Python stacks into their logs."""
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return
        for r in ranks:
            p = self._procs[r]
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)

    def request_stop(self) -> None:
        """Ask every worker to leave its loop (non-blocking)."""
        for q in self._tasks:
            with contextlib.suppress(Exception):
                q.put(None)

    def close(self, kill: bool = False, grace: float = 2.0) -> None:
        """Stop the workers and remove the logs.

        Args:
            kill: Kill the workers at once instead of asking them to stop.
            grace: Seconds a polite stop may take before the workers are killed.
        """
        if not self.alive:
            return
        self.alive = False
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]
        if not kill:
            self.request_stop()
            deadline = time.monotonic() + grace
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for q in [*self._tasks, self._results]:
            with contextlib.suppress(Exception):
                q.cancel_join_thread()
                q.close()
        shutil.rmtree(self._logdir, ignore_errors=True)
        self._store = None


def get_pool(world_size: int) -> ProcessPool:
    """Return the live pool for ``world_size``, starting one if needed."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive:
        pool = ProcessPool(world_size)
        _POOLS[world_size] = pool
    return pool


def shutdown_pools() -> None:
    """Stop every worker pool of this process (registered with `atexit`)."""
    pools = list(_POOLS.values())
    for pool in pools:  # all pools wind down in parallel
        if pool.alive:
            pool.request_stop()
    for pool in pools:
        pool.close(kill=False, grace=1.5)


atexit.register(shutdown_pools)
