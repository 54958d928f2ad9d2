"""Tests of the multi-rank harness in ``vescale.dtensor.testing``."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from vescale.dtensor.testing import (
    RankFailure,
    TorchrunError,
    distributed,
    run_on_ranks,
    run_torchrun,
)

SCRIPTS = Path(__file__).parent / "scripts"


# --------------------------------------------------------------------------- passing bodies


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_on_n_ranks(world_size):
    values = run_on_ranks(_all_reduce_body, world_size, 3)
    expected = sum(3.0 * (r + 1) for r in range(world_size))
    assert values == [(r, world_size, expected) for r in range(world_size)]


def _all_reduce_body(scale):
    t = torch.tensor([scale * (dist.get_rank() + 1.0)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@distributed(4)
def test_decorated_four_ranks_all_gather():
    rank = dist.get_rank()
    out = [torch.empty(2) for _ in range(4)]
    dist.all_gather(out, torch.tensor([rank, rank * 10.0]))
    assert torch.equal(torch.stack(out), torch.tensor([[r, r * 10.0] for r in range(4)]))


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("op", ["sum", "max"])
@distributed(2)
def test_parametrized_values_reach_every_rank(n, op):
    rank = dist.get_rank()
    t = torch.arange(n, dtype=torch.float32) + rank
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    expected = (
        2 * torch.arange(n, dtype=torch.float32) + 1 if op == "sum" else torch.arange(n) + 1.0
    )
    assert torch.equal(t, expected)


def test_wrapper_exposes_signature_and_original():
    sig = inspect.signature(test_parametrized_values_reach_every_rank)
    assert list(sig.parameters) == ["n", "op"]
    assert not hasattr(test_parametrized_values_reach_every_rank, "__wrapped__")
    assert (
        test_parametrized_values_reach_every_rank.__name__
        == "test_parametrized_values_reach_every_rank"
    )


@distributed(2)
def test_fixture_values_are_shared(tmp_path):
    rank = dist.get_rank()
    (tmp_path / f"rank{rank}.txt").write_text(str(rank))
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.txt", "rank1.txt"]


@distributed(2)
def test_seed_is_reset_before_each_body():
    # Every rank starts from torch.manual_seed(0): same draw on all ranks.
    draw = torch.rand(3)
    expected = torch.Generator().manual_seed(0)
    assert torch.equal(draw, torch.rand(3, generator=expected))
    gathered = [torch.empty(3) for _ in range(2)]
    dist.all_gather(gathered, draw)
    assert torch.equal(gathered[0], gathered[1])


@distributed(2)
def test_subgroups_do_not_leak_between_tests_a():
    group = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2.0


@distributed(2)
def test_subgroups_do_not_leak_between_tests_b():
    world = dist.distributed_c10d._world
    assert len(world.pg_map) == 1, "groups of earlier tests must be destroyed"


def test_pool_is_reused():
    # The same worker processes serve run after run (no start-up per test); timing it here
    # would fail on a loaded box, so the pids say it.
    first = run_on_ranks(_pid_body, 2)
    for _ in range(5):
        assert run_on_ranks(_all_reduce_body, 2, 1)[1][2] == 3.0
    assert run_on_ranks(_pid_body, 2) == first


def _pid_body():
    return os.getpid()


def _print_and_return(marker):
    print(marker, flush=True)
    os.write(2, marker.encode())
    return os.getpid()


def test_worker_output_does_not_reach_the_test(capfd):
    pids = run_on_ranks(_print_and_return, 2, "spam-from-a-worker")
    out, err = capfd.readouterr()
    assert "spam-from-a-worker" not in out + err
    assert len(set(pids)) == 2 and os.getpid() not in pids


def _return_rank_times(k):
    return dist.get_rank() * k


def test_thread_mode_returns_per_rank_values():
    assert run_on_ranks(_return_rank_times, 4, 5, mode="thread") == [0, 5, 10, 15]
    assert run_on_ranks(_all_reduce_body, 4, 2, mode="thread") == [(r, 4, 20.0) for r in range(4)]


@distributed(4, mode="thread")
def test_decorated_thread_mode():
    t = torch.tensor([1.0 + dist.get_rank()])
    dist.all_reduce(t)
    assert t.item() == 10.0


# --------------------------------------------------------------------------- failures


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on one rank")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 waits here for a rank that never comes


def test_failure_names_rank_and_traceback():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fail_on_rank_one, 2, timeout=30)
    msg = str(info.value)
    assert "rank 1" in msg
    assert "ValueError: deliberate failure on one rank" in msg
    assert "_fail_on_rank_one" in msg and "Traceback" in msg
    assert info.value.failed_ranks == [1]
    assert info.value.unfinished_ranks == [0]
    assert isinstance(info.value, AssertionError)
    # The pool was torn down and a fresh one serves the next run.
    assert run_on_ranks(_all_reduce_body, 2, 1)[0][2] == 3.0


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(600)


def _segfault_on_rank_one():
    if dist.get_rank() == 1:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV in native code
    dist.all_reduce(torch.ones(1))


def test_native_crash_reports_the_python_stack():
    # faulthandler in the workers: the report of a rank killed by a signal shows the
    # exit code and where in Python it crashed (all threads)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_segfault_on_rank_one, 2, timeout=30)
    msg = str(info.value)
    assert 1 in info.value.failed_ranks  # rank 0 may fail too: its peer's socket closed
    assert "exited with code -11" in msg
    assert "Segmentation fault" in msg and "_segfault_on_rank_one" in msg
    assert run_on_ranks(_all_reduce_body, 2, 1)[0][2] == 3.0


def test_hang_becomes_timeout_failure_and_pool_recovers():
    run_on_ranks(_all_reduce_body, 2, 1)  # a started pool: time the timeout only
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_hang_on_rank_zero, 2, timeout=3)
    elapsed = time.monotonic() - start
    assert elapsed < 10, f"a 3 s timeout took {elapsed:.1f} s"
    assert info.value.unfinished_ranks == [0, 1]
    msg = str(info.value)
    assert "did not finish" in msg
    # each hung rank's report has its Python stack at the time of the timeout
    for o in info.value.outcomes:
        assert "_hang_on_rank_zero" in o.output, o.output
    assert "all_reduce" in info.value.outcomes[0].output
    assert run_on_ranks(_all_reduce_body, 2, 1)[1][2] == 3.0


def test_thread_mode_failure_is_reported():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fail_on_rank_one, 2, mode="thread", timeout=20)
    assert info.value.failed_ranks == [1]
    assert "ValueError: deliberate failure on one rank" in str(info.value)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_return_rank_times, 0, 1)
    with pytest.raises(ValueError, match="mode"):
        distributed(2, mode="fork")
    with pytest.raises(ValueError, match="module-level"):
        run_on_ranks(lambda: None, 2)
    with pytest.raises(TypeError, match="picklable"):
        run_on_ranks(_return_rank_times, 2, lambda: None)


# --------------------------------------------------------------------------- torchrun


@pytest.mark.torchrun
def test_run_torchrun_marker_overrides_exit_code():
    script = str(SCRIPTS / "marker_then_fail.py")
    result = run_torchrun([script], nproc=1, timeout=120, expect_marker="MARKER-OK")
    assert "MARKER-OK" in result.stdout and result.returncode != 0
    with pytest.raises(TorchrunError, match="exit code"):
        run_torchrun([script], nproc=1, timeout=120)


# --------------------------------------------------------------------------- no leaked groups


def _gloo_loop_threads_after_2d_gather() -> int:
    """Gloo threads alive now (those of earlier tasks' groups included), after a 2-D gather."""
    from vescale.dtensor import Shard, distribute_tensor, init_device_mesh

    task_dir = Path(f"/proc/{os.getpid()}/task")
    n = sum((d / "comm").read_text().strip() == "gloo_tcp_loop" for d in task_dir.iterdir())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)]).full_tensor()
    return n


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_groups_of_finished_tasks_do_not_stay_alive():
    # Each live gloo group keeps a thread that wakes every few milliseconds; the groups a
    # task created (here the 2-D mesh's, held in a reference cycle by the gather) must be
    # gone by the next task, or a long suite slows down as they pile up.
    # (Groups leaked by earlier tests may still be collected meanwhile: counts may fall.)
    counts = [run_on_ranks(_gloo_loop_threads_after_2d_gather, 4) for _ in range(4)]
    for before, after in zip(counts[1:], counts[2:]):
        assert all(a <= b for a, b in zip(after, before)), counts


def test_load_helper_loads_a_sibling_once(tmp_path):
    from vescale.dtensor.testing import load_helper

    (tmp_path / "_sibling.py").write_text("import itertools\nCOUNT = itertools.count()\n")
    test_file = str(tmp_path / "test_x.py")
    first = load_helper(test_file, "_sibling")
    assert load_helper(test_file, "_sibling") is first  # one module per process
    assert next(first.COUNT) == 0 and next(load_helper(test_file, "_sibling").COUNT) == 1
    with pytest.raises(FileNotFoundError, match="_missing.py"):
        load_helper(test_file, "_missing")
