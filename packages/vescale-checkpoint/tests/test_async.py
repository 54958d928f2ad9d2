"""Async save: what blocks, what runs in the background, and on which process group."""

import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import vescale.checkpoint as vckpt
from vescale.checkpoint import _api
from vescale.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    register_plugin,
    unregister_plugin,
)
from vescale.dtensor.testing import run_on_ranks
from vescale.dtensor.testing.placements import OwnerOnly, OwnerPlugin
from vescale.ragged import RaggedShard

_COLLECTIVES = (
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all_single",
)


class _Recorder:
    """Records (thread name, group) of every top-level torch.distributed collective call."""

    def __init__(self):
        self.calls = []
        self._orig = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(*a, _orig=orig, _name=name, **k):
                self.calls.append((threading.current_thread().name, _name, k.get("group")))
                return _orig(*a, **k)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _model(mesh):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    layout = {"0.weight": [Shard(0)], "0.bias": [RaggedShard((0,), (1, 2))], "1.weight": [Shard(1)]}
    for name, p in list(m.named_parameters()):
        mod, leaf = name.rsplit(".", 1)
        dt = distribute_tensor(p.data, mesh, layout.get(name, [Replicate()]))
        setattr(m.get_submodule(mod), leaf, nn.Parameter(dt))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return m, opt


def no_collective_on_caller_body(path):
    mesh = init_device_mesh("cpu", (2,))
    model, opt = _model(mesh)
    state = {"model": model, "optimizer": opt, "step": 3}
    vckpt.save(f"{path}_warmup", state, async_op=True).result()  # creates the async group
    with _Recorder() as rec:
        h = vckpt.save(path, state, async_op=True)
        # the background thread may already be at work: keep this thread's calls only
        me = threading.current_thread().name
        on_caller = [c for c in rec.calls if c[0] == me]
        h.result()
    assert not on_caller, f"collectives on the caller's thread during an async save: {on_caller}"
    background = [c for c in rec.calls if c[0] != threading.current_thread().name]
    assert background and all(t.startswith("vescale-ckpt-save") for t, _, _ in background)
    default = dist.distributed_c10d._get_default_group()
    groups = {id(g) for _, _, g in background}
    assert id(None) not in groups and id(default) not in groups, background
    assert h.total_seconds is not None and h.bytes_written > 0  # ready once result() returns
    return True


def test_async_save_issues_no_collective_on_the_callers_thread(tmp_path):
    run_on_ranks(no_collective_on_caller_body, 2, str(tmp_path / "c"))


def snapshot_body(path):
    register_plugin(OwnerPlugin(), name="test-owner-ckpt")
    stager_threads = _api._stager.copy_threads
    _api._stager.copy_threads = 3  # big tensors staged by several threads
    try:
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(0)
        big = torch.randn(4096, 1024, generator=g)  # 16 MiB: sliced over the copy threads
        state = {
            "big": distribute_tensor(big, mesh, [Shard(1)]),
            "bigrep": distribute_tensor(big, mesh, [Replicate()]),
            "rag": distribute_tensor(
                torch.randn(6, 5, generator=g), mesh, [RaggedShard((0, 1), (2, 1))]
            ),
            "owner": distribute_tensor(torch.randn(4, 3, generator=g), mesh, [OwnerOnly(1)]),
            "t": torch.randn(6, 4, generator=g).t(),  # a non-contiguous plain tensor
            "step": 1,
        }
        part = torch.full((3, 3), float(dist.get_rank() + 1))
        state["partial"] = DTensor.from_local(part, mesh, [Partial()])
        expect = {
            k: (v.full_tensor().clone() if isinstance(v, DTensor) else v.clone())
            for k, v in state.items()
            if isinstance(v, torch.Tensor)
        }
        h = vckpt.save(path, state, async_op=True)
        # the next optimizer step: mutate everything in place before the write runs
        for v in state.values():
            if isinstance(v, DTensor):
                v._local_tensor.add_(100.0)
            elif isinstance(v, torch.Tensor):
                v.add_(100.0)
        state["step"] = 2
        h.result()
        assert _api._stager.threads_used == 3
        mesh_out = {
            "big": [Replicate()],
            "bigrep": [Shard(0)],
            "rag": [Shard(0)],
            "owner": [Replicate()],
            "partial": [Replicate()],
        }
        out = {
            k: distribute_tensor(torch.zeros_like(expect[k]), mesh, p) for k, p in mesh_out.items()
        }
        out["t"] = torch.zeros(4, 6)
        out["step"] = 0
        vckpt.load(path, out)
        assert out["step"] == 1
        for k, v in expect.items():
            got = out[k].full_tensor() if isinstance(out[k], DTensor) else out[k]
            assert torch.equal(got, v), f"{k}: the checkpoint does not hold the values at save time"
    finally:
        _api._stager.copy_threads = stager_threads
        unregister_plugin(name="test-owner-ckpt")
    return True


def test_async_save_snapshots_before_returning(tmp_path):
    run_on_ranks(snapshot_body, 2, str(tmp_path / "snap"))


def commit_failure_body(path, async_op):
    rank = dist.get_rank()
    orig = _api.commit

    def broken(*a, **k):
        raise OSError("disk full (injected)")

    if rank == 0:
        _api.commit = broken
    try:
        h = None
        try:
            h = vckpt.save(path, {"t": torch.ones(4)}, async_op=async_op)
            h.result()
        except vckpt.CheckpointError as e:
            if rank == 0:  # its own error, with the root cause's message
                assert "injected" in str(e) and isinstance(e.__cause__, OSError), repr(e)
            else:
                assert "rank 0 failed to commit" in str(e), str(e)
        else:
            raise AssertionError(f"rank {rank}: a failed commit was not reported")
    finally:
        _api.commit = orig
    # every rank is still in step: the next save works
    vckpt.save(path, {"t": torch.full((4,), 2.0)}, async_op=async_op).result()
    out = {"t": torch.zeros(4)}
    vckpt.load(path, out)
    assert torch.equal(out["t"], torch.full((4,), 2.0))
    return True


@pytest.mark.parametrize("async_op", [False, True])
def test_commit_failure_on_rank_0_is_raised_on_every_rank(tmp_path, async_op):
    run_on_ranks(commit_failure_body, 2, str(tmp_path / "c"), async_op)


def subgroup_body(path):
    pg = dist.new_group([0, 1])  # every rank creates it; only 0 and 1 save
    if dist.get_rank() < 2:
        _save_on_the_subgroup(path, pg)
    # Groups that every rank creates afterwards still rendezvous: the members' own async
    # group left every rank's group naming as it was (on torch 2.15 this hung).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    for dim in ("a", "b"):
        x = torch.ones(1)
        dist.all_reduce(x, group=mesh.get_group(dim))
        assert x.item() == 2.0
    return True


def _save_on_the_subgroup(path, pg):
    t = torch.arange(10.0)
    h = vckpt.save(path, {"t": t}, async_op=True, process_group=pg)
    h.result()
    own = _api._async_groups[(0, 1)][1]
    assert own is not pg and dist.get_process_group_ranks(own) == [0, 1]
    vckpt.save(path, {"t": t + 1}, async_op=True, process_group=pg).result()
    assert _api._async_groups[(0, 1)][1] is own  # cached
    out = {"t": torch.zeros(10)}
    vckpt.load(path, out, process_group=pg)
    assert torch.equal(out["t"], t + 1)


def test_async_save_on_a_subgroup_uses_a_group_of_its_own(tmp_path):
    run_on_ranks(subgroup_body, 4, str(tmp_path / "sub"), timeout=90)


def _slow_complete(delay: float):
    """Make the background copies start ``delay`` s late (so the next step must wait)."""
    orig = _api.Stager.complete

    def slow(self):
        import time

        time.sleep(delay)
        return orig(self)

    return orig, slow


def background_fence_body(path, fsdp):
    mesh = init_device_mesh("cpu", (2,))
    if fsdp:
        from vescale.dmodule import DModule

        torch.manual_seed(0)
        model = DModule(
            nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
            mesh,
            data_parallel={0: "fsdp"},
        )
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    else:
        torch.manual_seed(0)
        # BatchNorm's forward writes its running statistics without a version bump:
        # buffers are always staged before save() returns
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(dist.get_rank()))

    def train_step():
        out = model(x)
        (out.full_tensor() if isinstance(out, DTensor) else out).square().sum().backward()
        opt.step()
        opt.zero_grad()

    train_step()
    state = {"model": model, "optimizer": opt, "step": 1}
    vckpt.save(f"{path}_blocking", state).result()  # the reference: a blocking save
    orig, slow = _slow_complete(0.5)
    _api.Stager.complete = slow
    try:
        h = vckpt.save(path, state, async_op=True, staging="background")
        assert not h.wait_staged(0)  # returned before the copies ran
        train_step()  # forward + backward overlap the copy; step() waits for it
        assert h.wait_staged(0) and h.fence_wait_seconds > 0.05, h.fence_wait_seconds
        h.result()
    finally:
        _api.Stager.complete = orig
    assert h.staged_seconds >= 0.5 > h.blocking_seconds
    # the checkpoint holds the values at save time, exactly like the blocking one
    with pytest.raises(AssertionError):
        _assert_same_checkpoint(path, f"{path}_blocking_now", state)
    _assert_same_checkpoint(path, f"{path}_blocking", None)
    return True


def _assert_same_checkpoint(a, b, state):
    if state is not None:  # save the live (changed) state to b first
        vckpt.save(b, state).result()
    reader = vckpt.VescaleFileSystemReader
    sa = reader(a).read_metadata().state_dict_metadata
    sb = reader(b).read_metadata().state_dict_metadata
    assert sa.keys() == sb.keys()
    keys = [k for k, m in sa.items() if hasattr(m, "size")]
    assert keys
    for k in keys:
        ta, tb = torch.zeros(sa[k].size), torch.zeros(sb[k].size)
        torch.distributed.checkpoint.load({k: ta}, storage_reader=reader(a))
        torch.distributed.checkpoint.load({k: tb}, storage_reader=reader(b))
        assert torch.equal(ta, tb), k


@pytest.mark.parametrize("fsdp", [False, True])  # FSDP: RaggedShard DTensors; else plain
def test_background_staging_overlaps_the_step_and_saves_the_values_at_save_time(tmp_path, fsdp):
    run_on_ranks(background_fence_body, 2, str(tmp_path / "bg"), fsdp)


def background_mutation_body(path):
    mesh = init_device_mesh("cpu", (2,))
    w = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
    vckpt.save(path, {"w": w}).result()  # the last good checkpoint
    orig, slow = _slow_complete(0.3)
    _api.Stager.complete = slow
    try:
        h = vckpt.save(path, {"w": w}, async_op=True, staging="background")
        if dist.get_rank() == 0:
            w._local_tensor.add_(1.0)  # written in place outside an optimizer step
        with pytest.raises(RuntimeError, match="written in place while being staged") as err:
            h.result()
    finally:
        _api.Stager.complete = orig
    if dist.get_rank() == 0:
        assert "(w)" in str(err.value)
    else:
        assert "on another rank" in str(err.value)
    out = {"w": distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)])}
    vckpt.load(path, out)  # the previous checkpoint is intact
    assert torch.equal(out["w"].full_tensor(), torch.arange(12.0).reshape(6, 2))
    with pytest.raises(ValueError, match="staging must be"):
        vckpt.save(path, {"w": w}, async_op=True, staging="lazy")
    return True


def test_background_staging_refuses_to_commit_a_tensor_written_meanwhile(tmp_path):
    run_on_ranks(background_mutation_body, 2, str(tmp_path / "mut"))
