"""Single-process checks: atomic commit under a crash, checksums, safe metadata, keys, rotation, hook."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import vescale.checkpoint as vckpt
from vescale.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    IncompleteCheckpointError,
)


def _state(seed=0):
    torch.manual_seed(seed)
    return {"model": nn.Linear(16, 8), "t": torch.randn(32, 32), "step": seed}


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        import vescale.checkpoint as vckpt
        from vescale.checkpoint import VescaleFileSystemWriter
        vckpt.save({str(path)!r}, {{"t": torch.ones(64, 64), "step": 1}})
        original = VescaleFileSystemWriter.write_data
        def write_then_die(self, plan, planner):
            fut = original(self, plan, planner)
            os.kill(os.getpid(), signal.SIGKILL)  # the rank dies after writing, before commit
        VescaleFileSystemWriter.write_data = write_then_die
        vckpt.save({str(path)!r}, {{"t": torch.zeros(64, 64), "step": 2}})
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    staging = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(staging) == 1 and any(staging[0].iterdir())
    state = {"t": torch.empty(64, 64), "step": 0}
    vckpt.load(path, state)
    assert state["step"] == 1 and torch.equal(state["t"], torch.ones(64, 64))
    with pytest.raises(IncompleteCheckpointError, match="incomplete"):
        vckpt.load(staging[0], state)
    with pytest.raises(IncompleteCheckpointError, match="no checkpoint"):
        vckpt.load(tmp_path / "never_written", state)
    # the next successful save of the same path removes the crashed save's staging dir
    vckpt.save(path, {"t": torch.full((64, 64), 3.0), "step": 3})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_flipped_byte_names_file_and_tensor(tmp_path):
    path = tmp_path / "ckpt"
    vckpt.save(path, _state())
    rec = next(r for r in vckpt.read_manifest(path)["chunks"] if r["fqn"] == "t")
    data_file = path / rec["file"]
    raw = bytearray(data_file.read_bytes())
    raw[rec["offset"] + rec["length"] - 100] ^= 0x01
    data_file.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError) as e:
        vckpt.load(path, _state(1))
    assert rec["file"] in str(e.value) and "'t'" in str(e.value)


def test_tampered_metadata_and_manifest_are_rejected(tmp_path):
    path = tmp_path / "ckpt"
    vckpt.save(path, _state())
    md = path / ".metadata"
    raw = md.read_bytes()
    md.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(CheckpointCorruptError, match="metadata"):
        vckpt.load(path, _state(1))
    man = path / "vescale_manifest.json"
    man.write_text(man.read_text().replace('"step": 0', '"step": 5'))
    with pytest.raises(CheckpointCorruptError, match="does not match the checksum"):
        vckpt.load(path, _state(1))


def test_metadata_unpickler_refuses_arbitrary_objects():
    import pickle

    from vescale.checkpoint._safe_io import safe_load_metadata

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(CheckpointCorruptError, match="not an allowed"):
        safe_load_metadata(pickle.dumps(Evil()))


def test_paths_cannot_escape_checkpoint_dir(tmp_path):
    from vescale.checkpoint._safe_io import _safe_name

    assert _safe_name("__0_0.distcp", tmp_path) == "__0_0.distcp"
    for bad in ["../x", "/etc/passwd", "..", "a/b", ""]:
        with pytest.raises(CheckpointCorruptError):
            _safe_name(bad, tmp_path)


def test_missing_unexpected_mismatched_keys(tmp_path):
    path = tmp_path / "ckpt"
    vckpt.save(path, {"model": nn.Linear(4, 3), "extra": torch.ones(2), "step": 3})
    torch.manual_seed(1)
    live = {"model": nn.Linear(4, 5), "other": torch.zeros(2), "step": 0}
    with pytest.raises(CheckpointMismatchError) as e:
        vckpt.load(path, live)
    msg = str(e.value)
    assert "other" in msg and "extra" in msg and "model.weight: [3, 4] vs [5, 4]" in msg
    res = vckpt.load(path, live, strict=False)
    assert res.missing == ["other"] and res.unexpected == ["extra"]
    assert [k for k, _, _ in res.mismatched] == ["model.bias", "model.weight"]
    assert live["step"] == 3 and torch.equal(live["other"], torch.zeros(2))


def test_keep_last_never_deletes_newest(tmp_path):
    for i in range(4):
        vckpt.save(tmp_path / f"step_{i}", {"step": i}, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    vckpt.save(tmp_path / "step_1", {"step": 1}, keep_last=1)  # newest by commit time
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_overwrite_same_path(tmp_path):
    vckpt.save(tmp_path / "c", {"step": 1})
    vckpt.save(tmp_path / "c", {"step": 2})
    state = {"step": 0}
    vckpt.load(tmp_path / "c", state)
    assert state["step"] == 2 and [p.name for p in tmp_path.iterdir()] == ["c"]


def test_storage_hook_answers_first(tmp_path):
    from vescale.dtensor import hookimpl, register_plugin, unregister_plugin

    seen = []

    class MemPlugin:
        @hookimpl
        def vescale_checkpoint_storage(self, uri):
            if not uri.startswith("mem://"):
                return None
            seen.append(uri)
            local = tmp_path / uri[len("mem://") :]
            return vckpt.VescaleFileSystemWriter(local), vckpt.VescaleFileSystemReader(local)

    vckpt.storage_for(tmp_path / "warmup")  # registers the built-in plugin if needed
    register_plugin(MemPlugin(), name="test-mem-storage")
    try:
        vckpt.save("mem://x", {"step": 4})
        state = {"step": 0}
        vckpt.load("mem://x", state)
    finally:
        unregister_plugin(name="test-mem-storage")
    assert state["step"] == 4 and seen == ["mem://x", "mem://x"]


def test_cli_export(tmp_path):
    vckpt.save(tmp_path / "c", _state())
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vescale.checkpoint",
            "export",
            str(tmp_path / "c"),
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "o" / "model.safetensors")) == {"weight", "bias"}
    assert json.loads((tmp_path / "c" / "COMPLETE").read_text())["created_ns"] > 0
