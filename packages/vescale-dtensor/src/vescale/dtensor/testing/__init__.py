"""Multi-rank test harness shared by every vescale package.

Two ways to run a body on N ranks with the default process group initialised:

* ``mode="process"`` (default): a persistent pool of ``N`` spawned worker
  processes joined by a real gloo process group. The pool for a world size is
  created on first use (a few seconds) and reused by later runs (tens of
  milliseconds each). Any failure or hang kills the pool; the next run starts
  a fresh one.
* ``mode="thread"``: torch's threaded process group, ``N`` threads in this
  process. Faster to start, real numerics, but more permissive than gloo and
  ranks share globals (including the RNG).

Before every body, each rank calls ``torch.manual_seed(0)`` (thread mode: once,
since the RNG is shared). After the body, every rank runs ``dist.barrier()``,
which turns ranks that issued different collectives into a failure rather
than silent corruption of the next test. Process groups a body creates (for
example a `DeviceMesh`'s dimension groups) are destroyed afterwards.

Example:
    ```python
    import pytest
    import torch
    import torch.distributed as dist
    from vescale.dtensor.testing import distributed


    @pytest.mark.parametrize("n", [1, 3])
    @distributed(4)
    def test_sum(n):
        t = torch.full((n,), float(dist.get_rank()))
        dist.all_reduce(t)
        assert t.tolist() == [6.0] * n
    ```
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

from ._funcref import ORIGINAL_ATTR, make_ref, unwrap
from ._internals import expected_torch_internals
from ._pool import get_pool, shutdown_pools
from ._report import RankOutcome, failure_message
from ._support import check_package, load_helper
from ._torchrun import TorchrunError, run_torchrun

__all__ = [
    "RankFailure",
    "TorchrunError",
    "check_package",
    "distributed",
    "expected_torch_internals",
    "load_helper",
    "run_on_ranks",
    "run_torchrun",
    "shutdown_pools",
]

F = TypeVar("F", bound=Callable[..., Any])
_MODES = ("process", "thread")


class RankFailure(AssertionError):
    """One or more ranks raised or did not finish.

    The message names every failing rank (``rank N``) with its traceback and,
    for ranks that did not finish, says so.

    Attributes:
        outcomes: One `RankOutcome` per rank.
    """

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that raised."""
        return [o.rank for o in self.outcomes if o.finished and not o.ok]

    @property
    def unfinished_ranks(self) -> list[int]:
        """Ranks that did not finish before the deadline."""
        return [o.rank for o in self.outcomes if not o.finished]


def _check_args(world_size: int, timeout: float, mode: str) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")


def _run(
    fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, timeout: float, mode: str
) -> list[Any]:
    body = unwrap(fn)
    if mode == "thread":
        from ._threaded import run_threaded

        outcomes = run_threaded(body, world_size, args, kwargs, timeout)
    else:
        ref = make_ref(body)
        outcomes = get_pool(world_size).run(ref, args, kwargs, timeout)
    if not all(o.ok for o in outcomes):
        name = getattr(body, "__qualname__", repr(body))
        raise RankFailure(failure_message(name, world_size, timeout, outcomes), outcomes)
    return [o.value for o in outcomes]


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    mode: str = "process",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return every rank's result.

    Args:
        fn: The body. In process mode it must be a module-level function of an
            importable module or of a file (test files without ``__init__.py``
            are fine); a `distributed` wrapper is unwrapped.
        world_size: Number of ranks.
        *args: Positional arguments (picklable in process mode).
        timeout: Seconds before unfinished ranks count as hung.
        mode: ``"process"`` (gloo worker pool) or ``"thread"`` (threaded group).
        **kwargs: Keyword arguments (picklable in process mode).

    Returns:
        The return values, indexed by rank (picklable in process mode).

    Raises:
        RankFailure: If any rank raised or did not finish in time.
        ValueError: On an invalid ``world_size``, ``timeout`` or ``mode``.
    """
    _check_args(world_size, timeout, mode)
    return _run(fn, world_size, tuple(args), dict(kwargs), timeout, mode)


def distributed(
    world_size: int, *, timeout: float = 120.0, mode: str = "process"
) -> Callable[[F], F]:
    """Decorate a pytest test function so that its body runs on ``world_size`` ranks.

    The decorated function must be defined at module level. The wrapper keeps
    the original signature (so fixtures and ``pytest.mark.parametrize`` work)
    and sends the argument values, which must be picklable in process mode, to
    every rank. Return values are ignored; any rank that raises, or does not
    finish within ``timeout`` seconds, fails the test with a
    `RankFailure` (an ``AssertionError``) naming the ranks with their
    tracebacks.

    Args:
        world_size: Number of ranks.
        timeout: Seconds before unfinished ranks count as hung.
        mode: ``"process"`` (gloo worker pool) or ``"thread"`` (threaded group).

    Returns:
        The decorator.
    """
    _check_args(world_size, timeout, mode)

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        def wrapper(*args: Any, **kwargs: Any) -> None:
            bound = signature.bind(*args, **kwargs)
            _run(fn, world_size, tuple(bound.args), dict(bound.kwargs), timeout, mode)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(wrapper, attr, getattr(fn, attr, None))
        wrapper.__dict__.update(fn.__dict__)  # keeps marks applied below this decorator
        # pytest reads the signature; no __wrapped__, so nothing unwraps to the body.
        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        setattr(wrapper, ORIGINAL_ATTR, fn)
        wrapper.world_size = world_size  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
