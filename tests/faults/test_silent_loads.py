"""Loads that used to succeed with wrong values: dtype changes and chunks missing from metadata."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vescale.checkpoint as vckpt
from vescale.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from vescale.dtensor import Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import run_on_ranks


def _save_fp32(tmp_path):
    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    w = torch.randn(4, 6) * 10
    vckpt.save(path, {"w": w, "b": torch.randn(3)})
    return path, w


def test_float_into_int_is_refused_even_when_casts_are_allowed(tmp_path):
    path, _w = _save_fp32(tmp_path)
    for allow in (False, True, {"w": torch.int32}):
        live = {"w": torch.full((4, 6), 7, dtype=torch.int32), "b": torch.zeros(3)}
        with pytest.raises(CheckpointMismatchError) as e:
            vckpt.load(path, live, allow_dtype_cast=allow)
        assert "w: float32 vs int32" in str(e.value) and "never" in str(e.value)
        assert torch.equal(live["w"], torch.full((4, 6), 7, dtype=torch.int32))  # untouched


def test_dtype_change_needs_an_opt_in(tmp_path):
    path, w = _save_fp32(tmp_path)

    def live():
        return {"w": torch.zeros(4, 6, dtype=torch.bfloat16), "b": torch.zeros(3)}

    with pytest.raises(CheckpointMismatchError, match=r"w: float32 vs bfloat16") as e:
        vckpt.load(path, live())
    assert "allow_dtype_cast" in str(e.value) and "b:" not in str(e.value)
    state = live()
    vckpt.load(path, state, allow_dtype_cast=True)
    assert torch.equal(state["w"], w.to(torch.bfloat16))
    state = live()
    vckpt.load(path, state, allow_dtype_cast={r"w": torch.bfloat16})  # a per-key cast map
    assert torch.equal(state["w"], w.to(torch.bfloat16))
    with pytest.raises(CheckpointMismatchError, match=r"w: float32 vs bfloat16"):
        vckpt.load(path, live(), allow_dtype_cast={"w": torch.float16})  # another target
    with pytest.raises(ValueError, match=r"'model\\.nope' matches no tensor"):
        vckpt.load(path, live(), allow_dtype_cast={r"model\.nope": torch.bfloat16})


def _save_sharded(path):
    mesh = init_device_mesh("cpu", (2,))
    t = distribute_tensor(torch.arange(32.0).view(8, 4), mesh, [Shard(0)])
    vckpt.save(path, {"t": t})


def _load_sharded(path):
    mesh = init_device_mesh("cpu", (2,))
    live = {"t": distribute_tensor(torch.full((8, 4), -1.0), mesh, [Shard(0)])}
    try:
        vckpt.load(path, live)
    except CheckpointCorruptError as e:
        return f"rank {dist.get_rank()} raised: {e}"
    return f"rank {dist.get_rank()} loaded {live['t'].to_local().tolist()}"


def _drop_second_half(md):
    tmd = md.state_dict_metadata["t"]
    tmd.chunks = [c for c in tmd.chunks if list(c.offsets) != [4, 0]]


def test_chunk_removed_from_metadata_is_detected(tmp_path, tamper):
    """Saved on 2 ranks (two chunks), one chunk dropped from .metadata, loaded into a plain tensor."""
    path = tmp_path / "ckpt"
    run_on_ranks(_save_sharded, 2, str(path), timeout=60)
    tamper.edit_metadata(path, _drop_second_half)
    live = {"t": torch.full((8, 4), -1.0)}
    with pytest.raises(CheckpointCorruptError) as e:
        vckpt.load(path, live)
    msg = str(e.value)
    assert "'t'" in msg and "offsets [4, 0]" in msg and "sizes [4, 4]" in msg, msg


def test_uncovered_shard_raises_on_every_rank(tmp_path, tamper):
    """Rank 1's shard lost its chunk: every rank raises, before any rank reads."""
    path = tmp_path / "ckpt"
    run_on_ranks(_save_sharded, 2, str(path), timeout=60)
    tamper.edit_metadata(path, _drop_second_half)
    outcomes = run_on_ranks(_load_sharded, 2, str(path), timeout=60)
    for out in outcomes:
        assert "raised" in out and "'t'" in out and "offsets [4, 0]" in out, outcomes
