"""Filesystem storage on top of DCP's ``FileSystemWriter``/``FileSystemReader``.

What this adds to DCP's filesystem layer:

- a CRC32 per written chunk (computed from the bytes just written, recorded in a JSON
  manifest) and verified when the chunk is read: a flipped byte raises
  :class:`CheckpointCorruptError` naming the file and the tensor;
- DCP's pickled ``.metadata`` is checksummed too and read with an allow-list
  unpickler (only DCP's metadata classes, ``torch.Size``, dtypes, layouts): loading a
  checkpoint never runs arbitrary code;
- every file name taken from metadata must be a plain name inside the checkpoint dir;
- atomic commit: data goes to ``<path>.tmp-<id>``; rank 0 writes the manifest and a
  ``COMPLETE`` marker there, then renames the directory to ``<path>``;
- ``keep_last`` rotation over complete checkpoints in the same parent directory.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import shutil
import time
import zlib
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "IncompleteCheckpointError",
    "VescaleFileSystemWriter",
    "VescaleFileSystemReader",
    "MANIFEST_NAME",
    "COMPLETE_NAME",
    "read_manifest",
    "commit",
    "rotate",
    "is_complete",
]

MANIFEST_NAME = "vescale_manifest.json"
COMPLETE_NAME = "COMPLETE"
METADATA_NAME = ".metadata"
FORMAT = "vescale-checkpoint"
FORMAT_VERSION = 1
_READ_BLOCK = 16 << 20


class CheckpointError(RuntimeError):
    """Base class of vescale.checkpoint errors."""


class CheckpointCorruptError(CheckpointError):
    """A checksum did not match, or the manifest/metadata is malformed or unsafe."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a complete checkpoint (no ``COMPLETE`` marker or manifest)."""


# --------------------------------------------------------------------------- checksums
def _crc_range(path: str | os.PathLike, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            left -= len(block)
    return crc


def _crc_file(path: str | os.PathLike) -> int:
    return _crc_range(path, 0, os.path.getsize(path))


@dataclasses.dataclass
class _CheckedStorageInfo(_StorageInfo):
    """``_StorageInfo`` plus the CRC32 of the chunk's bytes (never pickled to disk)."""

    crc32: int = 0


def _safe_name(name: str, root: str | os.PathLike) -> str:
    """Return ``name`` if it is a plain file name inside ``root``; raise otherwise."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or os.path.isabs(name)
    ):
        raise CheckpointCorruptError(
            f"checkpoint {root}: file name {name!r} from metadata is not a plain name inside "
            "the checkpoint directory"
        )
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if os.path.dirname(real) != real_root:
        raise CheckpointCorruptError(
            f"checkpoint {root}: file {name!r} resolves outside the checkpoint directory"
        )
    return name


# --------------------------------------------------------------------------- writer
class VescaleFileSystemWriter(FileSystemWriter):
    """DCP's filesystem writer with a CRC32 per written chunk.

    After DCP wrote a rank's file, the rank reads back each chunk (from the page
    cache) and attaches its CRC32 to the write result. On the coordinator,
    :meth:`finish` moves the CRCs into :attr:`chunk_records` before DCP pickles plain
    metadata.

    Args:
        path: Directory to write (the staging directory during :func:`save`).
        sync_files: ``fsync`` every file (DCP's option).
        thread_count: Writer threads per rank (DCP's option).
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

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = super().write_data(plan, planner).wait()
        checked = []
        for wr in results:
            si = wr.storage_data
            crc = _crc_range(self.fs.concat_path(self.path, si.relative_path), si.offset, si.length)
            checked.append(
                dataclasses.replace(
                    wr,
                    storage_data=_CheckedStorageInfo(
                        si.relative_path, si.offset, si.length, si.transform_descriptors, crc
                    ),
                )
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(checked)
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


# --------------------------------------------------------------------------- safe metadata
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED_GLOBALS:
        return True
    if module == "torch":
        import torch

        return isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        )
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointCorruptError(
                f"checkpoint metadata refers to {module}.{name}, which is not an allowed "
                "metadata type (refusing to unpickle arbitrary objects)"
            )
        return super().find_class(module, name)


def safe_load_metadata(data: bytes) -> Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata classes and torch value types."""
    md = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"checkpoint metadata is a {type(md).__name__}, not Metadata")
    return md


# --------------------------------------------------------------------------- manifest
def is_complete(path: str | os.PathLike) -> bool:
    """True if ``path`` is a committed vescale checkpoint directory."""
    p = Path(path)
    return (p / COMPLETE_NAME).is_file() and (p / MANIFEST_NAME).is_file()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate the JSON manifest of a complete checkpoint.

    Raises:
        IncompleteCheckpointError: No checkpoint, or one that was never committed.
        CheckpointCorruptError: The manifest does not match its ``COMPLETE`` marker or is
            malformed.
    """
    p = Path(path)
    if not p.is_dir():
        raise IncompleteCheckpointError(f"no checkpoint at {p} (not a directory)")
    if not (p / COMPLETE_NAME).is_file():
        raise IncompleteCheckpointError(
            f"checkpoint {p} is incomplete: no {COMPLETE_NAME} marker (the save that wrote it "
            "did not finish, or this is a staging directory)"
        )
    try:
        marker = json.loads((p / COMPLETE_NAME).read_text())
        raw = (p / MANIFEST_NAME).read_bytes()
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"checkpoint {p}: unreadable marker or manifest: {e}") from e
    if zlib.crc32(raw) != marker.get("manifest_crc32"):
        raise CheckpointCorruptError(
            f"checkpoint {p}: {MANIFEST_NAME} does not match the checksum in {COMPLETE_NAME}"
        )
    manifest = json.loads(raw)
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"checkpoint {p}: unknown format {manifest.get('format')!r} "
            f"version {manifest.get('version')!r}"
        )
    for rec in manifest["chunks"]:
        _safe_name(rec["file"], p)
    return manifest


def _fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit(staging: str | os.PathLike, final: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Write manifest + ``COMPLETE`` into ``staging`` and atomically rename it to ``final``.

    Called on one rank after every rank finished writing. An existing ``final`` is
    moved aside first and deleted only after the new checkpoint is in place.
    """
    staging, final = Path(staging), Path(final)
    manifest = dict(manifest)
    manifest["metadata_crc32"] = _crc_file(staging / METADATA_NAME)
    raw = json.dumps(manifest, sort_keys=True).encode()
    _write_synced(staging / MANIFEST_NAME, raw)
    marker = {"created_ns": manifest["created_ns"], "manifest_crc32": zlib.crc32(raw)}
    _write_synced(staging / COMPLETE_NAME, json.dumps(marker).encode())
    _fsync_dir(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{manifest['save_id']}")
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def rotate(final: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete the oldest complete checkpoints next to ``final`` beyond ``keep_last``.

    ``final`` (the newest) is never deleted. Returns the deleted paths.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    final = Path(final)
    found = []
    for d in final.parent.iterdir():
        if d.is_dir() and is_complete(d):
            try:
                created = json.loads((d / COMPLETE_NAME).read_text())["created_ns"]
            except (OSError, ValueError, KeyError):
                continue
            found.append((created, d))
    found.sort()
    older = [d for _, d in found if d.resolve() != final.resolve()]
    deleted = []
    excess = len(older) + 1 - keep_last
    for d in older[: max(excess, 0)]:
        shutil.rmtree(d, ignore_errors=True)
        deleted.append(d)
    return deleted


def new_manifest(save_id: str, world_size: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "save_id": save_id,
        "world_size": world_size,
        "created_ns": time.time_ns(),
        "chunks": [],
        "values": {},
        "tensors": {},
    }


# --------------------------------------------------------------------------- reader
class VescaleFileSystemReader(FileSystemReader):
    """DCP's filesystem reader with checksum verification and safe metadata loading.

    Args:
        path: A complete checkpoint directory.
        manifest: Its manifest (read with :func:`read_manifest` if omitted).
        verify: Check every chunk's CRC32 as it is read.
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
        data = path.read_bytes()
        if zlib.crc32(data) != self.manifest.get("metadata_crc32"):
            raise CheckpointCorruptError(
                f"checksum mismatch in file {path} (DCP metadata of the checkpoint)"
            )
        return safe_load_metadata(data)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        for si in metadata.storage_data.values():
            _safe_name(si.relative_path, self.path)
            if si.offset < 0 or si.length < 0:
                raise CheckpointCorruptError(f"checkpoint {self.path}: negative offset/length")

    def _slice_file(self, file: IO[bytes], sinfo: _StorageInfo) -> IO[bytes]:
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if self.verify:
            expected, fqn, offsets = self._checksums().get(
                (sinfo.relative_path, sinfo.offset), (None, "?", None)
            )
            where = os.path.join(str(self.path), sinfo.relative_path)
            if expected is None:
                raise CheckpointCorruptError(
                    f"file {where}: chunk at byte {sinfo.offset} has no checksum in the manifest"
                )
            if len(data) != sinfo.length or zlib.crc32(data) != expected:
                raise CheckpointCorruptError(
                    f"checksum mismatch in file {where} for tensor {fqn!r} (chunk at offsets "
                    f"{offsets}, bytes {sinfo.offset}..{sinfo.offset + sinfo.length})"
                )
        return io.BytesIO(data)
