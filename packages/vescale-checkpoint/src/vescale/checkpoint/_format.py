"""On-disk format of a vescale checkpoint: file names, format version, errors and the CRC-32."""

from __future__ import annotations

import os
import zlib
from typing import Any

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
