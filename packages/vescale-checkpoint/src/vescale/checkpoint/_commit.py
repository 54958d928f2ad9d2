"""Atomic commit of a saved checkpoint: the manifest, the ``COMPLETE`` marker, the directory
renames (and recovery from a crash between them), ``keep_last`` rotation, the save lock and
cleanup of stale staging directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from vescale.checkpoint._format import (
    COMPLETE_NAME,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    METADATA_NAME,
    CheckpointCorruptError,
    IncompleteCheckpointError,
    _crc_file,
    crc32,
)
from vescale.checkpoint._safe_io import _read_regular, _safe_name


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
    for kind, _, d in _staging_dirs(p):
        if kind != "old" or not _is_complete_dir(d):
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


def _staging_dirs(final: Path) -> list[tuple[str, str, Path]]:
    """``(kind, save id, directory)`` of each ``<final>.tmp-<id>`` / ``<final>.old-<id>``
    directory beside ``final`` (``kind`` is ``"tmp"`` or ``"old"``; none if the parent
    cannot be listed)."""
    try:
        entries = list(final.parent.iterdir())
    except OSError:
        return []
    out = []
    for d in entries:
        if not d.name.startswith(final.name + "."):
            continue
        m = _TMP_RE.fullmatch(d.name[len(final.name) :])
        if m is not None and d.is_dir():
            out.append((m.group(1), m.group(2), d))
    return out


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
    deleted = []
    for kind, save_id, d in _staging_dirs(Path(final)):
        if save_id == keep_id or (kind == "tmp" and not _is_stale(d)):
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
