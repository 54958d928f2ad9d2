"""Filesystem storage on top of DCP's ``FileSystemWriter``/``FileSystemReader``.

This module holds the writer and the reader; the rest of the storage layer lives in one
module per concept, and the names listed in ``__all__`` are re-exported here:

- `vescale.checkpoint._format`: file names, the format version, the errors and the
  CRC-32 (ISA-L's kernel when ``isal`` is installed, else zlib; the same values);
- `vescale.checkpoint._safe_io`: plain file names inside the checkpoint dir, regular
  files only (a FIFO, device, directory or symlink leading outside the checkpoint is
  refused, ``.metadata`` and the manifest included), and DCP's pickled ``.metadata``
  read with an allow-list unpickler (only DCP's metadata classes, ``torch.Size``,
  dtypes, layouts): loading a checkpoint never runs arbitrary code;
- `vescale.checkpoint._coverage`: before DCP reads anything, every requested tensor's
  chunks are checked against the metadata: they cover the whole tensor and their byte
  lengths match their shapes (`VescaleFileSystemReader.validate`);
- `vescale.checkpoint._commit`: atomic commit (data goes to ``<path>.tmp-<id>``; rank 0
  writes the manifest and a ``COMPLETE`` marker there, then renames the directory to
  ``<path>``; a crash between the two renames of an overwrite is recovered by
  `resolve_checkpoint`), cleanup of stale staging directories of crashed saves of the
  same path, and ``keep_last`` rotation over complete checkpoints of the same series
  (same parent directory, same name up to a trailing number).

What the writer and reader add to DCP's filesystem layer: chunks are written as raw
row-major bytes (no pickle, no zip container); the writer computes a CRC32 over exactly
the bytes it hands to the file (no re-read); the reader reads each chunk straight into
the destination tensor when the chunk covers it (one copy, as ``readinto``) and checksums
the bytes as they arrive; a flipped byte raises `CheckpointCorruptError` naming the file
and the tensor. Chunks carry the transform descriptor ``vescale-raw/1`` in DCP's
metadata, so DCP's plain ``FileSystemReader`` refuses them loudly instead of misreading
them. DCP's ``.metadata`` is checksummed too.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import math
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from vescale.checkpoint import _compat
from vescale.checkpoint._commit import (
    clean_stale,
    commit,
    is_complete,
    read_manifest,
    resolve_checkpoint,
    rotate,
    series_pattern,
)
from vescale.checkpoint._compat import StorageInfo as _StorageInfo
from vescale.checkpoint._coverage import check_chunks, uncovered_box
from vescale.checkpoint._format import (
    _VERIFY_BLOCK,
    COMPLETE_NAME,
    CRC32_IMPL,
    DATA_SUFFIX,
    MANIFEST_NAME,
    METADATA_NAME,
    RAW_DESCRIPTOR,
    CheckpointCorruptError,
    CheckpointError,
    IncompleteCheckpointError,
    crc32,
)
from vescale.checkpoint._safe_io import _read_regular, _safe_name, open_regular, safe_load_metadata

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "IncompleteCheckpointError",
    "VescaleFileSystemWriter",
    "VescaleFileSystemReader",
    "MANIFEST_NAME",
    "COMPLETE_NAME",
    "read_manifest",
    "resolve_checkpoint",
    "open_regular",
    "check_chunks",
    "uncovered_box",
    "commit",
    "rotate",
    "clean_stale",
    "series_pattern",
    "is_complete",
    "crc32",
    "CRC32_IMPL",
]


@dataclasses.dataclass
class _CheckedStorageInfo(_StorageInfo):
    """``_StorageInfo`` plus the CRC32 of the chunk's bytes (never pickled to disk)."""

    crc32: int = 0


# --------------------------------------------------------------------------- writer
def check_storage(t: torch.Tensor, key: str) -> None:
    """Raise if ``t``'s storage is smaller than its view (e.g. freed with ``resize_(0)``).

    Reading such a tensor reads freed memory (a crash or garbage), so say which one.
    """
    if t.layout != torch.strided or t.numel() == 0:
        return
    try:
        have = t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001 - no real storage (fake, functional): not ours to judge
        return
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s)
    need = (last + 1) * t.element_size()
    if have < need:
        raise ValueError(
            f"{key}: the tensor's storage holds {have} bytes but its view needs {need} "
            "(was its storage freed, e.g. an FSDP buffer resharded with resize_(0)?)"
        )


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of a CPU tensor as a memoryview (a copy only if not contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    check_storage(t, f"a tensor of shape {tuple(t.shape)}")
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _buckets(items: list, n: int) -> list[list]:
    """Split write items over ``n`` files, largest first onto the lightest file."""
    if n <= 1 or len(items) <= 1:
        return [list(items)]

    def size(it) -> int:
        if it.tensor_data is None:
            return 0
        numel = 1
        for s in it.tensor_data.chunk.sizes:
            numel *= s
        return numel * _compat.element_size(it.tensor_data.properties.dtype)

    out: list[list] = [[] for _ in range(min(n, len(items)))]
    load = [0] * len(out)
    for it in sorted(items, key=size, reverse=True):
        i = load.index(min(load))
        out[i].append(it)
        load[i] += size(it) + 1
    return out


class VescaleFileSystemWriter(FileSystemWriter):
    """DCP's filesystem writer, writing raw chunk bytes with a CRC32 per chunk.

    Each rank writes its chunks as raw row-major bytes into ``thread_count`` files
    (one writer thread per file). The CRC32 is computed over the very buffer that is
    handed to ``write`` (no re-read, no extra copy); `crc32` (ISA-L or zlib) and
    the write both release the GIL, so threads overlap. Every chunk is recorded in DCP's
    metadata with the transform descriptor ``vescale-raw/1``; on the coordinator, `finish`
    moves the CRCs into `chunk_records` before DCP pickles plain metadata.

    Args:
        path: Directory to write (the staging directory during `save`).
        sync_files: ``fsync`` every file (DCP's option).
        thread_count: Files and writer threads per rank (DCP's option).

    Attributes:
        bytes_written: Bytes of chunk data this rank wrote in the last save.
        chunk_records: (coordinator) one record per chunk of every rank, for the manifest.
    """

    def __init__(
        self, path: str | os.PathLike, *, sync_files: bool = True, thread_count: int = 1
    ) -> None:
        super().__init__(
            path,
            single_file_per_rank=True,
            sync_files=sync_files,
            thread_count=thread_count,
            overwrite=True,
        )
        self.chunk_records: list[dict[str, Any]] = []
        self.bytes_written = 0

    def _write_file(self, file_name: str, items: list, planner: SavePlanner) -> list[WriteResult]:
        results = []
        offset = 0
        current: str | None = None  # the tensor being written, for the error message
        try:
            with self.fs.create_stream(self.fs.concat_path(self.path, file_name), "wb") as stream:
                for item in items:
                    current = item.index.fqn
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        buf = memoryview(data.getbuffer()).cast("B")
                    else:
                        buf = tensor_bytes(data)
                    crc = crc32(buf)
                    stream.write(buf)
                    n = buf.nbytes
                    results.append(
                        WriteResult(
                            index=item.index,
                            size_in_bytes=n,
                            storage_data=_CheckedStorageInfo(
                                file_name, offset, n, [RAW_DESCRIPTOR], crc
                            ),
                        )
                    )
                    offset += n
                current = None
                stream.flush()
                if self.sync_files:
                    try:
                        os.fsync(stream.fileno())
                    except (AttributeError, io.UnsupportedOperation):
                        os.sync()
        except OSError as e:
            where = os.path.join(os.fspath(self.path), file_name)
            doing = f"writing tensor {current!r} to" if current else "flushing"
            code = errno.errorcode.get(e.errno, "") if e.errno else ""
            raise CheckpointError(
                f"{doing} checkpoint file {where} failed: {code + ' ' if code else ''}"
                f"{e.strerror or e}"
            ) from e
        return results

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        jobs = [
            (f"{prefix}{i}{DATA_SUFFIX}", bucket)
            for i, bucket in enumerate(_buckets(plan.items, self.thread_count))
        ]
        if len(jobs) == 1:
            per_file = [self._write_file(jobs[0][0], jobs[0][1], planner)]
        else:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="vescale-ckpt-write") as ex:
                per_file = list(ex.map(lambda j: self._write_file(j[0], j[1], planner), jobs))
        results = [wr for rs in per_file for wr in rs]
        self.bytes_written = sum(wr.storage_data.length for wr in results)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: list[dict[str, Any]] = []
        plain: list[list[WriteResult]] = []
        for wr_list in results:
            out = []
            for wr in wr_list:
                si = wr.storage_data
                idx = wr.index
                records.append(
                    {
                        "fqn": idx.fqn,
                        "offsets": None if idx.offset is None else list(idx.offset),
                        "file": si.relative_path,
                        "offset": si.offset,
                        "length": si.length,
                        "crc32": getattr(si, "crc32", None),
                    }
                )
                out.append(
                    dataclasses.replace(
                        wr,
                        storage_data=_StorageInfo(
                            si.relative_path, si.offset, si.length, si.transform_descriptors
                        ),
                    )
                )
            plain.append(out)
        self.chunk_records = records
        super().finish(metadata, plain)


# --------------------------------------------------------------------------- reader
class VescaleFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with checksum verification and safe metadata loading.

    Args:
        path: A complete checkpoint directory.
        manifest: Its manifest (read with `read_manifest` if omitted).
        verify: Check every chunk's CRC32 as it is read.

    Attributes:
        bytes_direct: Chunk bytes read straight into destination tensors (one copy).
        bytes_scratch: Chunk bytes read into a scratch buffer first (resharded or
            converted destinations: one more copy).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        manifest: dict[str, Any] | None = None,
        *,
        verify: bool = True,
    ) -> None:
        super().__init__(path)
        self._manifest = manifest
        self.verify = verify
        self._crc: dict[tuple[str, int], tuple[int | None, str, Any]] | None = None
        self._chunk_meta: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], Any]] = {}
        self.bytes_direct = 0
        self.bytes_scratch = 0

    @property
    def manifest(self) -> dict[str, Any]:
        """The checkpoint's manifest (read and validated on first use)."""
        if self._manifest is None:
            self._manifest = read_manifest(self.path)
        return self._manifest

    @manifest.setter
    def manifest(self, value: dict[str, Any]) -> None:
        self._manifest = value
        self._crc = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id and Path(checkpoint_id) != Path(self.path):
            self._manifest = None
            self._crc = None
        super().reset(checkpoint_id)

    def _checksums(self) -> dict[tuple[str, int], tuple[int | None, str, Any]]:
        if self._crc is None:
            self._crc = {
                (r["file"], r["offset"]): (r["crc32"], r["fqn"], r["offsets"])
                for r in self.manifest["chunks"]
            }
        return self._crc

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA_NAME
        data = _read_regular(self.path, METADATA_NAME, "DCP metadata")
        if crc32(data) != self.manifest.get("metadata_crc32"):
            raise CheckpointCorruptError(
                f"checksum mismatch in file {path} (DCP metadata of the checkpoint)"
            )
        return safe_load_metadata(data, where=path)

    def validate(self, metadata: Metadata, keys: Iterable[str]) -> None:
        """Check the saved chunks of the tensors ``keys`` before DCP reads any of them.

        Only the metadata is read, and every rank of a load reads the same, so a bad
        checkpoint raises the same error on every rank before any collective. Checked per
        tensor: its chunks lie inside it and cover every element (`check_chunks`); each
        chunk has a storage entry in the raw format, in a file with a plain name, whose
        byte length is what the chunk's sizes and dtype need (so a tampered length cannot
        make a reader allocate more than the tensor). The files themselves are checked as
        they are opened (`open_regular`: missing, not a regular file, outside the
        checkpoint) and read (truncated, checksum); DCP reports such a failure on one
        rank to every rank.

        Raises:
            CheckpointCorruptError: Naming the tensor, the chunk and the file.
        """
        for key in keys:
            md = metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                continue
            check_chunks(key, md, self.path)
            itemsize = md.properties.dtype.itemsize
            for c in md.chunks:
                box = f"tensor {key!r} (chunk at offsets {list(c.offsets)}, sizes {list(c.sizes)})"
                si = metadata.storage_data.get(MetadataIndex(key, c.offsets))
                if si is None:
                    raise CheckpointCorruptError(
                        f"checkpoint {self.path}: {box} has no storage entry in {METADATA_NAME}"
                    )
                self._check_format(si)
                _safe_name(si.relative_path, self.path)
                where = os.path.join(os.fspath(self.path), si.relative_path)
                need = math.prod(c.sizes) * itemsize
                if si.length != need or si.offset < 0:
                    dtype = str(md.properties.dtype).removeprefix("torch.")
                    raise CheckpointCorruptError(
                        f"checkpoint file {where}: {box} needs {need} bytes of {dtype}, but "
                        f"{METADATA_NAME} gives it {si.length} bytes at offset {si.offset}"
                    )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for si in metadata.storage_data.values():
            _safe_name(si.relative_path, self.path)
            if si.offset < 0 or si.length < 0:
                raise CheckpointCorruptError(f"checkpoint {self.path}: negative offset/length")
        self._chunk_meta = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    self._chunk_meta[(fqn, tuple(c.offsets))] = (
                        tuple(c.sizes),
                        md.properties.dtype,
                    )

    # ------------------------------------------------------------------ reading
    def _expect(self, sinfo: _StorageInfo) -> tuple[int | None, str, Any]:
        rec = self._checksums().get((sinfo.relative_path, sinfo.offset))
        if not self.verify:
            return rec or (None, "?", None)
        if rec is None or rec[0] is None:
            where = os.path.join(str(self.path), sinfo.relative_path)
            raise CheckpointCorruptError(
                f"file {where}: chunk at byte {sinfo.offset} has no checksum in the manifest"
            )
        return rec

    def _read_verified(self, stream: Any, sinfo: _StorageInfo, buf: memoryview) -> None:
        """Read the chunk ``sinfo`` into ``buf`` (its exact size), checksumming as it arrives."""
        expected, fqn, offsets = self._expect(sinfo)
        stream.seek(sinfo.offset)
        n = sinfo.length
        pos = 0
        crc = 0
        while pos < n:
            got = stream.readinto(buf[pos : min(n, pos + _VERIFY_BLOCK)])
            if not got:
                break
            if self.verify:
                crc = crc32(buf[pos : pos + got], crc)
            pos += got
        if pos != n or (self.verify and crc != expected):
            where = os.path.join(str(self.path), sinfo.relative_path)
            what = "truncated chunk" if pos != n else "checksum mismatch"
            raise CheckpointCorruptError(
                f"{what} in file {where} for tensor {fqn!r} (chunk at offsets "
                f"{offsets}, bytes {sinfo.offset}..{sinfo.offset + sinfo.length})"
            )

    def _check_format(self, sinfo: _StorageInfo) -> None:
        if list(sinfo.transform_descriptors or ()) != [RAW_DESCRIPTOR]:
            raise CheckpointCorruptError(
                f"checkpoint {self.path}: chunk in {sinfo.relative_path} at byte {sinfo.offset} "
                f"has transforms {sinfo.transform_descriptors!r}; this reader reads "
                f"{RAW_DESCRIPTOR!r} chunks written by VescaleFileSystemWriter only"
            )

    def _open_data(self, rel: str, reqs: list) -> Any:
        if type(self.fs) is not FileSystem:  # a subclass brought its own filesystem
            return self.fs.create_stream(self.fs.concat_path(self.path, rel), "rb")
        fqns = sorted({req.storage_index.fqn for _, req in reqs})
        what = "tensor " + ", ".join(map(repr, fqns[:3])) + (" ..." if len(fqns) > 3 else "")
        return open_regular(self.path, rel, what)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every requested chunk, verifying its CRC32 on the buffer it is read into.

        A request that covers a whole saved chunk whose destination is a contiguous CPU
        tensor of the saved dtype is read straight into the destination (one copy).
        Otherwise the chunk is read once into a scratch buffer (reused by the next
        requests for the same chunk) and the requested part is copied out.
        """
        per_file: dict[str, list] = {}
        for req in plan.items:
            sinfo = self.storage_data[req.storage_index]
            self._check_format(sinfo)
            per_file.setdefault(sinfo.relative_path, []).append((sinfo.offset, req))
        for rel, reqs in per_file.items():
            reqs.sort(key=lambda x: x[0])
            with self._open_data(rel, reqs) as stream:
                scratch_at: int | None = None
                scratch: torch.Tensor | None = None
                for _off, req in reqs:
                    sinfo = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO:
                        raw = bytearray(sinfo.length)
                        self._read_verified(stream, sinfo, memoryview(raw))
                        planner.load_bytes(req, io.BytesIO(raw))
                        continue
                    idx = req.storage_index
                    sizes, dtype = self._chunk_meta[(idx.fqn, tuple(idx.offset))]
                    target = planner.resolve_tensor(req).detach()
                    check_storage(target, f"loading {idx.fqn!r}")  # never write freed memory
                    whole = all(o == 0 for o in req.storage_offsets) and tuple(
                        req.lengths
                    ) == tuple(sizes)
                    if (
                        whole
                        and scratch_at != sinfo.offset
                        and target.device.type == "cpu"
                        and target.dtype == dtype
                        and target.is_contiguous()
                        and target.numel() * target.element_size() == sinfo.length
                    ):
                        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                        self._read_verified(stream, sinfo, view)
                        self.bytes_direct += sinfo.length
                    else:
                        if scratch_at != sinfo.offset:
                            scratch = torch.empty(sinfo.length, dtype=torch.uint8)
                            self._read_verified(stream, sinfo, memoryview(scratch.numpy()))
                            scratch_at = sinfo.offset
                            self.bytes_scratch += sinfo.length
                        src = scratch.view(dtype).view(sizes)
                        for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                            if o != 0 or n != src.shape[d]:
                                src = src.narrow(d, o, n)
                        if target.shape != src.shape:
                            raise CheckpointCorruptError(
                                f"checkpoint {self.path}: chunk of {idx.fqn!r} has shape "
                                f"{tuple(src.shape)}, the destination {tuple(target.shape)}"
                            )
                        target.copy_(src)
                    planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
