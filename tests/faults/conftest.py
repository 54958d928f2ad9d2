"""Shared helpers of the fault-injection suite: tampering with checkpoints as an attacker would.

The helpers use only the standard library and torch's pickle format, never vescale's
own readers, so a test cannot pass because the tampering and the check share a bug.
"""

from __future__ import annotations

import json
import pickle
import zlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

MANIFEST = "vescale_manifest.json"


def reseal(path: Path, manifest_bytes: bytes | None = None) -> None:
    """Recompute the checksums of ``.metadata`` and the manifest (consistent tampering)."""
    man = path / MANIFEST
    if manifest_bytes is None:
        m = json.loads(man.read_text())
        m["metadata_crc32"] = zlib.crc32((path / ".metadata").read_bytes())
        manifest_bytes = json.dumps(m, sort_keys=True).encode()
    man.write_bytes(manifest_bytes)
    marker = json.loads((path / "COMPLETE").read_text())
    marker["manifest_crc32"] = zlib.crc32(manifest_bytes)
    (path / "COMPLETE").write_text(json.dumps(marker))


def edit_metadata(path: Path, mutate: Callable[[Any], None]) -> None:
    """Unpickle DCP's ``.metadata``, let ``mutate`` change it, write it back and reseal."""
    md_path = path / ".metadata"
    md = pickle.loads(md_path.read_bytes())  # our own test file: trusted
    mutate(md)
    md_path.write_bytes(pickle.dumps(md))
    reseal(path)


@pytest.fixture
def tamper() -> SimpleNamespace:
    """``tamper.reseal(path)`` and ``tamper.edit_metadata(path, fn)``."""
    return SimpleNamespace(reseal=reseal, edit_metadata=edit_metadata)
