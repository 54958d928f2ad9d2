"""Only regular files inside the checkpoint are read; malformed manifests name their file."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

import vescale.checkpoint as vckpt
from vescale.checkpoint import CheckpointCorruptError


def _saved(tmp_path):
    path = tmp_path / "ckpt"
    torch.manual_seed(0)
    vckpt.save(path, {"t": torch.randn(16, 16), "step": 1})
    rec = next(r for r in vckpt.read_manifest(path)["chunks"] if r["fqn"] == "t")
    return path, rec["file"]


def _fresh():
    return {"t": torch.zeros(16, 16), "step": 0}


def _load_with_deadline(path, unblock, seconds=20.0):
    """``load`` in a thread; if it blocks, ``unblock()`` releases it and the test fails."""
    box = {}

    def run():
        try:
            vckpt.load(path, _fresh())
            box["result"] = "loaded"
        except BaseException as e:  # noqa: BLE001 - reported below
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        unblock()
        th.join(10)
        pytest.fail(f"load blocked for more than {seconds:g} s")
    return box


def test_fifo_in_place_of_a_data_file_is_refused(tmp_path):
    path, name = _saved(tmp_path)
    (path / name).unlink()
    os.mkfifo(path / name)

    def unblock():  # a writer that opens and closes lets the blocked reader see EOF
        fd = os.open(path / name, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    box = _load_with_deadline(path, unblock)
    err = box.get("error")
    assert isinstance(err, CheckpointCorruptError), box
    assert name in str(err) and "not a regular file" in str(err)


def test_directory_in_place_of_a_data_file_is_refused(tmp_path):
    path, name = _saved(tmp_path)
    (path / name).unlink()
    (path / name).mkdir()
    with pytest.raises(CheckpointCorruptError, match=rf"{name}.*not a regular file"):
        vckpt.load(path, _fresh())


@pytest.mark.parametrize("which", ["metadata", "data"])
def test_symlink_leaving_the_checkpoint_is_refused(tmp_path, which):
    path, name = _saved(tmp_path)
    target = ".metadata" if which == "metadata" else name
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (path / target).rename(outside / target)  # identical bytes: the checksums still match
    (path / target).symlink_to(outside / target)
    with pytest.raises(CheckpointCorruptError, match=rf"{target}.*outside the checkpoint"):
        vckpt.load(path, _fresh())


def test_symlinked_checkpoint_directory_still_loads(tmp_path):
    path, _ = _saved(tmp_path)
    (tmp_path / "latest").symlink_to(path)
    state = _fresh()
    vckpt.load(tmp_path / "latest", state)
    assert state["step"] == 1 and state["t"].abs().sum() > 0


@pytest.mark.parametrize(
    "content, culprit",
    [
        (b"{not json", "not valid JSON"),
        (json.dumps({"format": "vescale-checkpoint", "version": 2}).encode(), "'chunks'"),
        (b"[1, 2]", "not a JSON object"),
    ],
)
def test_malformed_manifest_names_the_file(tmp_path, tamper, content, culprit):
    path, _ = _saved(tmp_path)
    tamper.reseal(path, content)  # consistent: COMPLETE carries the new manifest's CRC
    with pytest.raises(CheckpointCorruptError) as e:
        vckpt.load(path, _fresh())
    assert "vescale_manifest.json" in str(e.value) and culprit in str(e.value), str(e.value)


def test_malformed_complete_marker_names_the_file(tmp_path):
    path, _ = _saved(tmp_path)
    (path / "COMPLETE").write_text("garbage")
    with pytest.raises(CheckpointCorruptError, match=r"COMPLETE.*not valid JSON"):
        vckpt.load(path, _fresh())
