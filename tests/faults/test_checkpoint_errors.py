"""Failures inside a save or load surface as ``CheckpointError`` (an ``Exception``) naming the culprit.

torch's DCP wraps per-rank failures in ``CheckpointException``, which derives only from
``BaseException``: ``except Exception`` would not catch it.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import vescale.checkpoint as vckpt
from vescale.checkpoint import CheckpointCorruptError, CheckpointError
from vescale.dtensor import Shard, distribute_tensor, init_device_mesh
from vescale.dtensor.testing import distributed


def _saved(tmp_path):
    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    vckpt.save(path, {"t": torch.randn(64, 64), "u": torch.randn(8), "step": 1})
    rec = next(r for r in vckpt.read_manifest(path)["chunks"] if r["fqn"] == "t")
    return path, rec


def _fresh():
    return {"t": torch.zeros(64, 64), "u": torch.zeros(8), "step": 0}


def test_deleted_data_file_names_the_file_and_tensor(tmp_path):
    path, rec = _saved(tmp_path)
    (path / rec["file"]).unlink()
    try:
        vckpt.load(path, _fresh())
    except Exception as e:  # noqa: BLE001 - the point: `except Exception` catches it
        err = e
    assert isinstance(err, CheckpointCorruptError), repr(err)
    assert rec["file"] in str(err) and "missing" in str(err) and "'t'" in str(err)


def test_huge_chunk_length_is_refused_before_allocating(tmp_path, tamper):
    path, rec = _saved(tmp_path)

    def grow(md):
        for idx, si in md.storage_data.items():
            if idx.fqn == "t":
                si.length = 1 << 50

    tamper.edit_metadata(path, grow)
    with pytest.raises(CheckpointCorruptError) as e:
        vckpt.load(path, _fresh())
    msg = str(e.value)
    assert rec["file"] in msg and "'t'" in msg and str(1 << 50) in msg


def test_file_too_large_during_save_is_a_checkpoint_error(tmp_path):
    """A real EFBIG: the save runs under RLIMIT_FSIZE (SIGXFSZ ignored, so write fails)."""
    script = textwrap.dedent(
        f"""
        import resource, signal, torch
        import vescale.checkpoint as vckpt
        from vescale.checkpoint import CheckpointError
        path = {str(tmp_path / "ckpt")!r}
        vckpt.save(path, {{"t": torch.ones(16), "step": 1}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
        try:
            vckpt.save(path, {{"t": torch.zeros(1 << 16), "step": 2}})
        except Exception as e:
            assert isinstance(e, CheckpointError), type(e).__mro__
            print("CAUGHT", type(e).__name__, str(e))
        state = {{"t": torch.zeros(16), "step": 0}}
        vckpt.load(path, state)
        assert state["step"] == 1 and torch.equal(state["t"], torch.ones(16))
        print("PREVIOUS_OK")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert "PREVIOUS_OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
    caught = next(line for line in out.stdout.splitlines() if line.startswith("CAUGHT"))
    assert "File too large" in caught and ".distcp" in caught and "'t'" in caught, caught


@distributed(2, timeout=60)
def test_write_error_on_one_rank_raises_checkpoint_error_on_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    mesh = init_device_mesh("cpu", (2,))
    t = distribute_tensor(torch.arange(64.0).view(8, 8), mesh, [Shard(0)])
    vckpt.save(path, {"t": t, "step": 1})
    from vescale.checkpoint import VescaleFileSystemWriter

    original = VescaleFileSystemWriter._write_file
    if dist.get_rank() == 1:

        def fail(self, file_name, items, planner):
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), file_name)

        VescaleFileSystemWriter._write_file = fail
    try:
        with pytest.raises(CheckpointError) as e:
            vckpt.save(path, {"t": t * 2, "step": 2})
    finally:
        VescaleFileSystemWriter._write_file = original
    assert "rank 1" in str(e.value) and "File too large" in str(e.value), str(e.value)
    state = {"t": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)]), "step": 0}
    vckpt.load(path, state)
    assert state["step"] == 1 and torch.equal(
        state["t"].full_tensor(), torch.arange(64.0).view(8, 8)
    )


def test_export_of_a_corrupt_checkpoint_raises_checkpoint_corrupt_error(tmp_path):
    path, rec = _saved(tmp_path)
    data = path / rec["file"]
    raw = bytearray(data.read_bytes())
    raw[rec["offset"] + 7] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as e:
        vckpt.export(path, tmp_path / "out", prefix=None)
    assert rec["file"] in str(e.value) and "'t'" in str(e.value) and "checksum" in str(e.value)
