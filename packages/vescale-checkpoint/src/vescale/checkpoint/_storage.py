"""Filesystem storage on top of DCP's ``FileSystemWriter``/``FileSystemReader``.

What this adds to DCP's filesystem layer:

- chunks are written as raw row-major bytes (no pickle, no zip container): the
  writer computes a CRC32 (ISA-L's kernel when ``isal`` is installed, else zlib; the
  same values) over exactly the bytes it hands to the file (no re-read),
  the reader reads each chunk straight into the destination tensor when the chunk
  covers it (one copy, as ``readinto``) and checksums the bytes as they arrive; a
  flipped byte raises `CheckpointCorruptError` naming the file and the tensor.
  Chunks carry the transform descriptor ``vescale-raw/1`` in DCP's metadata, so
  DCP's plain ``FileSystemReader`` refuses them loudly instead of misreading them;
- DCP's pickled ``.metadata`` is checksummed too and read with an allow-list
  unpickler (only DCP's metadata classes, ``torch.Size``, dtypes, layouts): loading a
  checkpoint never runs arbitrary code;
- every file name taken from metadata must be a plain name inside the checkpoint dir,
  and only regular files are opened (a FIFO, device, directory or symlink leading
  outside the checkpoint is refused, ``.metadata`` and the manifest included);
- before DCP reads anything, every requested tensor's chunks are checked against the
  metadata: they cover the whole tensor and their byte lengths match their shapes
  (`VescaleFileSystemReader.validate`);
- atomic commit: data goes to ``<path>.tmp-<id>``; rank 0 writes the manifest and a
  ``COMPLETE`` marker there, then renames the directory to ``<path>``; a crash between
  the two renames of an overwrite is recovered by `resolve_checkpoint`;
- cleanup of stale staging directories of crashed saves of the same path;
- ``keep_last`` rotation over complete checkpoints of the same series (same parent
  directory, same name up to a trailing number).
"""

from __future__ import annotations

import dataclasses
import errno
import io
import json
import math
import os
import pickle
import re
import shutil
import stat
import time
import zlib
from collections.abc import Iterable, Sequence
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
from vescale.checkpoint._compat import StorageInfo as _StorageInfo

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

MANIFEST_NAME = "vescale_manifest.json"
COMPLETE_NAME = "COMPLETE"
METADATA_NAME = ".metadata"
FORMAT = "vescale-checkpoint"
FORMAT_VERSION = 2
#: DCP transform descriptor of a chunk stored as raw row-major bytes.
RAW_DESCRIPTOR = "vescale-raw/1"
DATA_SUFFIX = ".distcp"
_READ_BLOCK = 16 << 20
_VERIFY_BLOCK = 4 << 20


class CheckpointError(RuntimeError):
    """Base class of vescale.checkpoint errors."""


class CheckpointCorruptError(CheckpointError):
    """A checksum did not match, or the manifest/metadata is malformed or unsafe."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a complete checkpoint (no ``COMPLETE`` marker or manifest)."""


# --------------------------------------------------------------------------- checksums
def _select_crc32() -> tuple[Any, str]:
    """CRC-32 (zlib's polynomial): ISA-L's folding kernel if ``isal`` is installed, else zlib.

    Both give identical values (the format does not depend on which one ran) and both
    release the GIL. ``VESCALE_CHECKPOINT_CRC32=zlib`` forces zlib; ``=isal`` requires
    ISA-L.
    """
    want = os.environ.get("VESCALE_CHECKPOINT_CRC32", "auto").strip().lower()
    if want not in ("auto", "isal", "zlib"):
        raise ValueError(f"VESCALE_CHECKPOINT_CRC32={want!r}: expected auto, isal or zlib")
    if want != "zlib":
        try:
            from isal.isal_zlib import crc32 as isal_crc32

            if isal_crc32(b"123456789") == zlib.crc32(b"123456789"):
                return isal_crc32, "isal"
        except (ImportError, OSError):
            if want == "isal":
                raise
    return zlib.crc32, "zlib"


#: ``crc32(data, value=0) -> int``: the CRC-32 used for chunks, metadata and manifest.
crc32, CRC32_IMPL = _select_crc32()


def _crc_range(path: str | os.PathLike, offset: int, length: int) -> int:
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                break
            crc = crc32(block, crc)
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


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")


def open_regular(root: str | os.PathLike, name: str, what: str = "") -> io.BufferedReader:
    """Open ``root/name`` for reading if it is a regular file inside ``root``.

    Symlinks are followed only while they stay inside ``root`` (the directory itself
    may be a symlink). A FIFO, device, socket or directory is refused before it is
    opened, and again on the opened descriptor (``O_NONBLOCK``, so opening a FIFO that
    replaced the file in between cannot block).

    Args:
        root: The checkpoint directory.
        name: A plain file name inside it.
        what: What the file holds, for the error message (e.g. ``"tensor 'w'"``).

    Raises:
        CheckpointCorruptError: Missing, unreadable, not a regular file, or outside ``root``.
    """
    _safe_name(name, root)
    where = os.path.join(os.fspath(root), name)
    about = f" ({what})" if what else ""
    real = os.path.realpath(where)
    try:
        mode = os.stat(real).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointCorruptError(
                f"checkpoint file {where}{about} is not a regular file: it is {_kind(mode)}"
            )
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(real, flags | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {where}{about} is missing") from None
    except OSError as e:
        raise CheckpointCorruptError(
            f"cannot open checkpoint file {where}{about}: {e.strerror or e}"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointCorruptError(
                f"checkpoint file {where}{about} is not a regular file: it is {_kind(mode)}"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_regular(root: str | os.PathLike, name: str, what: str = "") -> bytes:
    with open_regular(root, name, what) as f:
        try:
            return f.read()
        except OSError as e:
            where = os.path.join(os.fspath(root), name)
            raise CheckpointCorruptError(f"cannot read checkpoint file {where}: {e}") from None


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


def safe_load_metadata(data: bytes, where: str | os.PathLike = "") -> Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata classes and torch value types.

    Args:
        data: The pickled ``Metadata``.
        where: The file it came from (for error messages).

    Raises:
        CheckpointCorruptError: Not a pickled ``Metadata`` or refers to another type.
    """
    name = f" in {os.fspath(where)}" if where else ""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{e}{name}") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointCorruptError(
            f"checkpoint metadata{name} cannot be unpickled: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(
            f"checkpoint metadata{name} is a {type(md).__name__}, not Metadata"
        )
    return md


# --------------------------------------------------------------------------- manifest
def _is_complete_dir(p: Path) -> bool:
    return (p / COMPLETE_NAME).is_file() and (p / MANIFEST_NAME).is_file()


def _created_ns(p: Path) -> int:
    try:
        created = json.loads((p / COMPLETE_NAME).read_text())["created_ns"]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return created if isinstance(created, int) else -1


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The directory that holds the committed checkpoint ``path``.

    That is ``path`` itself, except after a crash inside the commit of a save that
    overwrote ``path``: the previous checkpoint was moved to ``<path>.old-<id>`` and the
    crash came before the new one was renamed to ``path``. The previous checkpoint is
    then still the committed one (the new one never reached ``path``), so its directory
    is returned; the next successful save of ``path`` removes it.

    Returns:
        ``path``, or the ``<path>.old-<id>`` directory holding its committed checkpoint.
    """
    p = Path(path)
    if p.exists():
        return p
    best: tuple[int, Path] | None = None
    try:
        entries = list(p.parent.iterdir())
    except OSError:
        return p
    for d in entries:
        if not d.name.startswith(p.name + "."):
            continue
        m = _TMP_RE.fullmatch(d.name[len(p.name) :])
        if m is None or m.group(1) != "old" or not d.is_dir() or not _is_complete_dir(d):
            continue
        created = _created_ns(d)
        if best is None or created > best[0]:
            best = (created, d)
    return p if best is None else best[1]


def is_complete(path: str | os.PathLike) -> bool:
    """True if ``path`` is a committed vescale checkpoint (see `resolve_checkpoint`)."""
    return _is_complete_dir(resolve_checkpoint(path))


def _parse_json(p: Path, name: str, raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint file {p / name} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointCorruptError(
            f"checkpoint file {p / name} is not a JSON object (it holds a {type(obj).__name__})"
        )
    return obj


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(p: Path, manifest: dict[str, Any]) -> None:
    where = p / MANIFEST_NAME

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"checkpoint file {where}: {what}")

    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise bad(
            f"unknown format {manifest.get('format')!r} version {manifest.get('version')!r} "
            f"(expected {FORMAT!r} version {FORMAT_VERSION})"
        )
    for key, typ in (("chunks", list), ("values", dict), ("tensors", dict)):
        if not isinstance(manifest.get(key), typ):
            raise bad(f"{key!r} is missing or not a JSON {'array' if typ is list else 'object'}")
    if not _is_int(manifest.get("metadata_crc32")):
        raise bad("'metadata_crc32' is missing or not an integer")
    for i, rec in enumerate(manifest["chunks"]):
        if not isinstance(rec, dict):
            raise bad(f"chunks[{i}] is not a JSON object")
        ok = (
            isinstance(rec.get("fqn"), str)
            and isinstance(rec.get("file"), str)
            and all(_is_int(rec.get(k)) and rec[k] >= 0 for k in ("offset", "length"))
            and (rec.get("crc32") is None or _is_int(rec["crc32"]))
            and (
                rec.get("offsets") is None
                or (isinstance(rec["offsets"], list) and all(map(_is_int, rec["offsets"])))
            )
        )
        if not ok:
            raise bad(
                f"chunks[{i}] is malformed (expected fqn, file, offset, length, crc32, "
                f"offsets), got {rec!r}"
            )
        _safe_name(rec["file"], p)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate the JSON manifest of the complete checkpoint in directory ``path``.

    Raises:
        IncompleteCheckpointError: No checkpoint, or one that was never committed.
        CheckpointCorruptError: The manifest does not match its ``COMPLETE`` marker, or
            the marker or manifest is not a regular file, not JSON or malformed (the
            message names the file).
    """
    p = Path(path)
    if not p.is_dir():
        raise IncompleteCheckpointError(f"no checkpoint at {p} (not a directory)")
    if not os.path.lexists(p / COMPLETE_NAME):
        raise IncompleteCheckpointError(
            f"checkpoint {p} is incomplete: no {COMPLETE_NAME} marker (the save that wrote it "
            "did not finish, or this is a staging directory)"
        )
    marker = _parse_json(p, COMPLETE_NAME, _read_regular(p, COMPLETE_NAME, "commit marker"))
    raw = _read_regular(p, MANIFEST_NAME, "manifest")
    if not _is_int(marker.get("manifest_crc32")):
        raise CheckpointCorruptError(
            f"checkpoint file {p / COMPLETE_NAME}: 'manifest_crc32' is missing or not an integer"
        )
    if crc32(raw) != marker["manifest_crc32"]:
        raise CheckpointCorruptError(
            f"checkpoint {p}: {MANIFEST_NAME} does not match the checksum in {COMPLETE_NAME}"
        )
    manifest = _parse_json(p, MANIFEST_NAME, raw)
    _check_manifest(p, manifest)
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
    moved aside to ``<final>.old-<id>`` first and deleted only after the new checkpoint
    is in place; a crash between the two renames is recovered by
    `resolve_checkpoint`, which then returns the previous checkpoint.
    """
    staging, final = Path(staging), Path(final)
    manifest = dict(manifest)
    manifest["metadata_crc32"] = _crc_file(staging / METADATA_NAME)
    raw = json.dumps(manifest, sort_keys=True).encode()
    _write_synced(staging / MANIFEST_NAME, raw)
    marker = {"created_ns": manifest["created_ns"], "manifest_crc32": crc32(raw)}
    _write_synced(staging / COMPLETE_NAME, json.dumps(marker).encode())
    _fsync_dir(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}.old-{manifest['save_id']}")
        os.rename(final, old)
    # A crash here leaves no `final`: resolve_checkpoint() finds the previous one at `old`.
    os.rename(staging, final)
    _fsync_dir(final.parent)
    try:
        # Removed only now: a crash before the rename leaves a staging directory whose
        # lock no live process holds, which the next save of `final` deletes.
        os.unlink(final / LOCK_NAME)  # the saver still holds its fd until it returns
    except FileNotFoundError:
        pass
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


_TMP_RE = re.compile(r"\.(tmp|old)-([0-9a-f]{12})$")
LOCK_NAME = ".vescale-save.lock"


def series_pattern(name: str) -> re.Pattern[str] | None:
    """The names in the same rotation series as ``name``: same text, another trailing number.

    ``step_000100`` -> ``step_\\d+``; ``ckpt-7`` -> ``ckpt-\\d+``; a name without a
    trailing number (``latest``) has no series (``None``).
    """
    m = re.fullmatch(r"(.*?)(\d+)", name)
    if m is None:
        return None
    return re.compile(re.escape(m.group(1)) + r"\d+")


def rotate(final: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete the oldest complete checkpoints of ``final``'s series beyond ``keep_last``.

    The series of ``final`` is every complete checkpoint in the same parent directory
    whose name is ``final``'s name with its trailing number replaced by another number
    (``step_100`` rotates ``step_90``, ``step_80``..., never ``best_3`` or ``latest``).
    A name without a trailing number rotates nothing. Age is the commit time recorded
    in ``COMPLETE``. ``final`` (the newest) is never deleted. Returns the deleted paths.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    final = Path(final)
    pattern = series_pattern(final.name)
    if pattern is None:
        return []
    found = []
    for d in final.parent.iterdir():
        if pattern.fullmatch(d.name) and d.is_dir() and is_complete(d):
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


class SaveLock:
    """An exclusive ``flock`` on a file inside a staging directory, held while the save runs.

    The kernel drops it when the saving process exits, however it dies, so a staging
    directory whose lock can be taken belongs to no live save.
    """

    def __init__(self, staging: str | os.PathLike, save_id: str) -> None:
        self.fd: int | None = None
        os.makedirs(staging, exist_ok=True)
        path = os.path.join(staging, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (ImportError, OSError):
            pass  # no flock here: stale directories are then never cleaned up
        os.write(fd, json.dumps({"save_id": save_id, "pid": os.getpid()}).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _is_stale(d: Path) -> bool:
    """True if no live process holds the save lock of staging directory ``d``."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        fd = os.open(d / LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        # A staging dir without a lock file: rank 0 died before creating it, or
        # another rank created the dir first and rank 0 has not yet. Only trust age.
        try:
            return time.time() - d.stat().st_mtime > 3600
        except OSError:
            return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live save holds it (or flock is unsupported: keep it)
    finally:
        os.close(fd)
    return True


def clean_stale(final: str | os.PathLike, keep_id: str) -> list[Path]:
    """Delete ``<final>.tmp-<id>`` / ``<final>.old-<id>`` left by crashed saves of ``final``.

    Called after a successful commit of ``final``. A staging directory whose save lock
    is held by a live process (another save of the same path in progress) is kept, as
    is anything belonging to ``keep_id``. Returns the deleted paths.
    """
    final = Path(final)
    deleted = []
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return deleted
    for d in entries:
        if not d.name.startswith(final.name + "."):
            continue
        m = _TMP_RE.fullmatch(d.name[len(final.name) :])
        if m is None or m.group(2) == keep_id or not d.is_dir():
            continue
        if m.group(1) == "tmp" and not _is_stale(d):
            continue
        shutil.rmtree(d, ignore_errors=True)
        deleted.append(d)
    return deleted


def new_manifest(save_id: str, world_size: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "checksum": "crc32",
        "save_id": save_id,
        "world_size": world_size,
        "created_ns": time.time_ns(),
        "chunks": [],
        "values": {},
        "tensors": {},
    }


# --------------------------------------------------------------------------- coverage
Box = tuple[list[int], list[int]]


def _gap(lo: list[int], hi: list[int], boxes: list[Box], d: int) -> Box | None:
    """A box inside ``[lo, hi)`` that none of ``boxes`` (all inside it) covers, or ``None``.

    Sweeps dim ``d``: between consecutive box boundaries the set of boxes crossing the
    slab is constant, and the slab is covered iff that set covers it in dims ``d+1..``.
    """
    if not boxes:
        return list(lo), [h - a for a, h in zip(lo, hi)]
    if d == len(lo):
        return None
    cuts = {lo[d], hi[d]}
    for b_lo, b_hi in boxes:
        cuts.add(b_lo[d])
        cuts.add(b_hi[d])
    order = sorted(boxes, key=lambda b: b[0][d])
    active: list[Box] = []
    seen: set[tuple[int, ...]] = set()
    nxt = 0
    edges = sorted(cuts)
    for a, b in zip(edges, edges[1:]):
        while nxt < len(order) and order[nxt][0][d] <= a:
            active.append(order[nxt])
            nxt += 1
        active = [x for x in active if x[1][d] > a]
        ids = tuple(sorted(map(id, active)))
        if ids in seen:  # the same boxes cross an earlier slab, which they covered
            continue
        seen.add(ids)
        sub_lo, sub_hi = list(lo), list(hi)
        sub_lo[d], sub_hi[d] = a, b
        gap = _gap(sub_lo, sub_hi, active, d + 1)
        if gap is not None:
            return gap
    return None


def uncovered_box(shape: Sequence[int], chunks: Iterable[Box]) -> Box | None:
    """``(offsets, sizes)`` of a box of a ``shape`` tensor that no chunk covers, or ``None``.

    Args:
        shape: The tensor's shape.
        chunks: ``(offsets, sizes)`` of the saved chunks (they may overlap).
    """
    shape = [int(s) for s in shape]
    if any(s == 0 for s in shape):
        return None
    boxes: list[Box] = []
    for off, size in chunks:
        b_lo = [max(0, int(o)) for o in off]
        b_hi = [min(h, int(o) + int(s)) for o, s, h in zip(off, size, shape)]
        if all(a < b for a, b in zip(b_lo, b_hi)):
            boxes.append((b_lo, b_hi))
    return _gap([0] * len(shape), shape, boxes, 0)


def check_chunks(key: str, md: TensorStorageMetadata, where: str | os.PathLike) -> None:
    """Raise unless the saved chunks of tensor ``key`` lie inside it and cover every element.

    Raises:
        CheckpointCorruptError: Naming the tensor and a chunk outside it, or a box that
            no chunk covers (a load would leave those elements unchanged).
    """
    shape = list(md.size)
    for c in md.chunks:
        off, size = list(c.offsets), list(c.sizes)
        if (
            len(off) != len(shape)
            or len(size) != len(shape)
            or any(o < 0 or s < 0 or o + s > h for o, s, h in zip(off, size, shape))
        ):
            raise CheckpointCorruptError(
                f"checkpoint {where}: tensor {key!r} of shape {shape} has a chunk at offsets "
                f"{off} with sizes {size} that does not lie inside it"
            )
    gap = uncovered_box(shape, ((c.offsets, c.sizes) for c in md.chunks))
    if gap is not None:
        raise CheckpointCorruptError(
            f"checkpoint {where}: tensor {key!r} of shape {shape} is not covered by its saved "
            f"chunks: no chunk holds the box at offsets {gap[0]} with sizes {gap[1]} "
            f"(the metadata lost a chunk)"
        )


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
