"""Run a function on N threads joined by torch's threaded process group.

This is the only module that touches torch's private
``torch.testing._internal.distributed.multi_threaded_pg``. The threaded group
has real numerics but is more permissive than gloo (it accepts uneven
``all_gather``/``all_to_all`` lists), and ranks share the RNG and every other
global: ``torch.manual_seed(0)`` is called once before the threads start.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ._report import RankOutcome

__all__ = ["run_threaded"]

_LOCK = threading.Lock()


def run_threaded(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float
) -> list[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` threads.

    Args:
        fn: The body; every thread sees an initialised default process group.
        world_size: Number of ranks (threads).
        args: Positional arguments shared by all ranks.
        kwargs: Keyword arguments shared by all ranks.
        timeout: Seconds before unfinished ranks count as hung.

    Returns:
        One outcome per rank.
    """
    import torch
    import torch.distributed as dist

    from vescale.dtensor import _compat

    mtpg = _compat.threaded_pg()

    with _LOCK:  # the threaded world is process-global state
        outcomes = [RankOutcome(r, ok=False, finished=False) for r in range(world_size)]
        world = mtpg._install_threaded_pg()
        store = dist.HashStore()
        _compat.set_thread_isolation(True)

        def body(rank: int) -> None:
            outcome = outcomes[rank]
            try:
                dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
                value = fn(*args, **kwargs)
                dist.barrier()
                outcome.value, outcome.ok, outcome.finished = value, True, True
            except SystemExit as exc:
                # Raised inside a collective when another rank failed.
                outcome.error = f"rank {rank} was stopped inside a collective ({exc})"
            except BaseException as exc:  # noqa: BLE001
                outcome.error, outcome.finished = traceback.format_exc(), True
                mtpg.ProcessLocalGroup.exception_handle(exc)
            finally:
                if _compat.current_world() is world and dist.is_initialized():
                    try:
                        dist.destroy_process_group()
                    except Exception:  # noqa: BLE001
                        pass

        try:
            torch.manual_seed(0)
            threads = [
                threading.Thread(
                    target=body, args=(r,), name=f"vescale-thread-rank{r}", daemon=True
                )
                for r in range(world_size)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if any(t.is_alive() for t in threads):
                # Wake ranks blocked in a collective so that they exit.
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError("timeout"))
                for t in threads:
                    t.join(1.0)
            for o in outcomes:
                if not o.finished and not o.error:
                    o.error = f"rank {o.rank} did not finish within {timeout:g} s"
        finally:
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            _compat.set_thread_isolation(False)
        return outcomes
