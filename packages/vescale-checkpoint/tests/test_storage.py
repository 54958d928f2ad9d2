"""Raw chunk format: checksums computed while writing, direct reads, staging reuse, cleanup, rotation."""

import os
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import vescale.checkpoint as vckpt
from vescale.checkpoint import VescaleFileSystemReader, VescaleFileSystemWriter
from vescale.checkpoint._commit import SaveLock
from vescale.checkpoint._format import RAW_DESCRIPTOR

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state():
    torch.manual_seed(0)
    return {
        "model": nn.Linear(16, 8),
        "t": torch.randn(32, 32),
        "bf": torch.randn(5, 3).to(torch.bfloat16),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "strided": torch.randn(6, 4).t(),  # not contiguous
        "step": 1,
    }


def _zeros_like(state):
    return {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for k, v in state.items()
    }


def test_checksums_are_computed_over_the_written_bytes(tmp_path, monkeypatch):
    from vescale.checkpoint import _format

    def no_reread(*a, **k):  # the metadata file is the only one re-read at commit
        assert str(a[0]).endswith(".metadata"), f"data file re-read for a checksum: {a[0]}"
        return orig(*a, **k)

    orig = _format._crc_range
    monkeypatch.setattr(_format, "_crc_range", no_reread)
    path = tmp_path / "c"
    h = vckpt.save(path, _state())
    manifest = vckpt.read_manifest(path)
    assert manifest["checksum"] == "crc32" and manifest["version"] == 2
    total = 0
    for rec in manifest["chunks"]:
        raw = (path / rec["file"]).read_bytes()[rec["offset"] : rec["offset"] + rec["length"]]
        assert zlib.crc32(raw) == rec["crc32"], rec["fqn"]
        total += rec["length"]
    assert h.bytes_written == total
    # raw row-major bytes: the chunk of "t" is exactly the tensor's bytes
    rec = next(r for r in manifest["chunks"] if r["fqn"] == "t")
    raw = (path / rec["file"]).read_bytes()[rec["offset"] : rec["offset"] + rec["length"]]
    assert raw == _state()["t"].numpy().tobytes()


def test_round_trip_dtypes_and_layouts(tmp_path):
    path = tmp_path / "c"
    src = _state()
    vckpt.save(path, src)
    dst = _state()
    dst.update(_zeros_like({k: v for k, v in dst.items() if k != "model"}))
    dst["strided"] = torch.zeros(4, 6).t().contiguous().t()  # live tensor non-contiguous too
    vckpt.load(path, dst)
    for k in ("t", "bf", "flag", "scalar", "strided"):
        assert torch.equal(dst[k], src[k]), k
    assert torch.equal(dst["model"].weight, src["model"].weight)


def test_whole_chunks_are_read_in_place(tmp_path):
    path = tmp_path / "c"
    vckpt.save(path, {"a": torch.randn(64, 64), "b": torch.randn(100)})
    a, b = torch.zeros(64, 64), torch.zeros(100)
    ptr = a.data_ptr()
    reader = VescaleFileSystemReader(path)
    dcp.load({"a": a, "b": b}, storage_reader=reader, no_dist=True)
    assert a.data_ptr() == ptr and a.abs().sum() > 0
    assert reader.bytes_direct == (64 * 64 + 100) * 4 and reader.bytes_scratch == 0
    # a different dtype goes through a scratch buffer, read and verified once
    reader = VescaleFileSystemReader(path)
    a64 = torch.zeros(64, 64, dtype=torch.float64)
    dcp.load({"a": a64}, storage_reader=reader, no_dist=True)
    assert torch.equal(a64.float(), a) and reader.bytes_scratch == 64 * 64 * 4


def test_plain_dcp_reader_refuses_raw_chunks(tmp_path):
    path = tmp_path / "c"
    vckpt.save(path, {"t": torch.ones(4)})
    md = VescaleFileSystemReader(path).read_metadata()
    assert all(si.transform_descriptors == [RAW_DESCRIPTOR] for si in md.storage_data.values())
    with pytest.raises(CheckpointException) as e:
        dcp.load({"t": torch.zeros(4)}, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    ((inner, _tb),) = e.value.failures.values()
    assert "Unknown extension" in str(inner)


def test_threaded_writer_files(tmp_path):
    st = {f"x{i}": torch.full((100 + i,), float(i)) for i in range(5)}
    w = VescaleFileSystemWriter(tmp_path / "c", thread_count=3)
    dcp.save(st, storage_writer=w, no_dist=True)
    assert len([f for f in os.listdir(tmp_path / "c") if f.endswith(".distcp")]) == 3
    out = {k: torch.zeros_like(v) for k, v in st.items()}
    # (not committed by save(): read with checksums from the writer's records)
    md_crc = zlib.crc32((tmp_path / "c" / ".metadata").read_bytes())
    manifest = {"chunks": w.chunk_records, "metadata_crc32": md_crc}
    dcp.load(out, storage_reader=VescaleFileSystemReader(tmp_path / "c", manifest), no_dist=True)
    assert all(torch.equal(out[k], st[k]) for k in st)


def test_async_staging_reuses_buffers(tmp_path):
    from vescale.checkpoint import _api

    st = {"t": torch.randn(128, 128), "u": torch.randn(10)}
    vckpt.save(tmp_path / "a", st, async_op=True).result()
    first = _api._stager.bytes_allocated
    st["t"].add_(1.0)
    at_save = st["t"].clone()
    h = vckpt.save(tmp_path / "b", st, async_op=True)
    assert _api._stager.bytes_allocated == 0 and _api._stager.bytes_copied == first
    st["t"].add_(1.0)  # after staging: must not reach the checkpoint
    h.result()
    out = {"t": torch.zeros(128, 128), "u": torch.zeros(10)}
    vckpt.load(tmp_path / "b", out)
    assert torch.equal(out["t"], at_save) and torch.equal(out["u"], st["u"])
    st["t"] = torch.randn(64, 64)  # another shape: a new buffer
    vckpt.save(tmp_path / "c", st, async_op=True).result()
    assert _api._stager.bytes_allocated == 64 * 64 * 4
    vckpt.free_staging_buffers()
    assert not _api._stager._buffers


def test_stale_staging_dirs_cleaned_but_live_ones_kept(tmp_path):
    path = tmp_path / "ckpt"
    dead = tmp_path / "ckpt.tmp-aaaaaaaaaaaa"
    lock = SaveLock(dead, "aaaaaaaaaaaa")
    (dead / "__0_0.distcp").write_bytes(b"x")
    lock.release()  # its saver "died": the lock is free
    live = tmp_path / "ckpt.tmp-bbbbbbbbbbbb"
    held = SaveLock(live, "bbbbbbbbbbbb")  # a save in progress
    old = tmp_path / "ckpt.old-cccccccccccc"
    old.mkdir()
    other = tmp_path / "ckpt2.tmp-dddddddddddd"
    SaveLock(other, "dddddddddddd").release()
    unrelated = tmp_path / "ckpt.tmp-notanid"
    unrelated.mkdir()
    try:
        vckpt.save(path, {"step": 1})
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == ["ckpt", "ckpt.tmp-bbbbbbbbbbbb", "ckpt.tmp-notanid", other.name]
        assert not (path / ".vescale-save.lock").exists()
    finally:
        held.release()
    vckpt.save(path, {"step": 2})
    assert not live.exists()


def test_keep_last_rotates_only_the_same_series(tmp_path):
    for name in ("step_1", "step_2", "best_1", "latest", "step_x"):
        vckpt.save(tmp_path / name, {"step": 0})
    (tmp_path / "step_0").mkdir()  # not a checkpoint: never touched
    vckpt.save(tmp_path / "step_3", {"step": 3}, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["best_1", "latest", "step_0", "step_2", "step_3", "step_x"]
    vckpt.save(tmp_path / "latest", {"step": 4}, keep_last=1)  # no trailing number: no series
    assert "best_1" in {p.name for p in tmp_path.iterdir()}


def test_stager_copies_big_tensors_in_parallel_slices():
    from vescale.checkpoint._staging import Stager

    g = torch.Generator().manual_seed(0)
    big = torch.randn(5 << 20, generator=g)  # 20 MiB: sliced over the threads
    strided = torch.randn(1024, 5 << 10, generator=g).t()  # 20 MiB, not contiguous: one task
    small = torch.randn(10, generator=g)
    st = Stager(copy_threads=3)
    for _ in range(2):  # the second staging reuses every buffer
        st.begin()
        bufs = [st.copy(k, t) for k, t in (("big", big), ("strided", strided), ("small", small))]
        st.finish()
        assert all(torch.equal(b, t) for b, t in zip(bufs, (big, strided, small)))
        assert bufs[1].is_contiguous() and st.threads_used == 3
    assert st.bytes_allocated == 0 and st.bytes_copied == (2 * (5 << 20) + 10) * 4
    one = Stager(copy_threads=1)
    one.begin()
    buf = one.copy("big", big)
    assert torch.equal(buf, big)  # copied at once when there is a single thread
    one.finish()
    assert one.threads_used == 1


def test_crc32_implementations_agree(tmp_path, monkeypatch):
    from vescale.checkpoint import _format, _storage

    data = torch.randn(1000).numpy().tobytes()
    assert _storage.crc32(data) == zlib.crc32(data)
    assert _storage.crc32(data[500:], _storage.crc32(data[:500])) == zlib.crc32(data)
    monkeypatch.setenv("VESCALE_CHECKPOINT_CRC32", "zlib")
    assert _format._select_crc32() == (zlib.crc32, "zlib")
    monkeypatch.setenv("VESCALE_CHECKPOINT_CRC32", "bogus")
    with pytest.raises(ValueError, match="auto, isal or zlib"):
        _format._select_crc32()
    # a checkpoint written with one implementation verifies with the other
    isal = pytest.importorskip("isal.isal_zlib")
    src = _state()
    for write, read in ((isal.crc32, zlib.crc32), (zlib.crc32, isal.crc32)):
        monkeypatch.setattr(_storage, "crc32", write)
        path = tmp_path / f"c_{write.__module__}"
        vckpt.save(path, src)
        monkeypatch.setattr(_storage, "crc32", read)
        dst = _state()
        dst.update(_zeros_like({k: v for k, v in dst.items() if k != "model"}))
        vckpt.load(path, dst)
        assert torch.equal(dst["t"], src["t"])


def test_async_handle_reports_when_done(tmp_path):
    h = vckpt.save(tmp_path / "a", {"t": torch.ones(1000)}, async_op=True)
    assert h.result() == str(tmp_path / "a")
    assert h.total_seconds is not None and h.total_seconds >= h.blocking_seconds
    assert h.bytes_written == 4000 and 0 < h.blocking_fraction <= 1


def test_staging_a_freed_tensor_names_it(tmp_path):
    base = torch.randn(1000)
    live = base.view(10, 100)
    base.untyped_storage().resize_(0)  # as FSDP frees an unsharded buffer
    with pytest.raises(ValueError, match=r"opt\.buf: the tensor's storage holds 0 bytes"):
        vckpt.save(tmp_path / "c", {"opt": {"buf": live}}, async_op=True)
    assert not (tmp_path / "c").exists()
