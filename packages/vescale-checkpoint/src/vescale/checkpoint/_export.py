"""Export a checkpoint to consolidated safetensors files, one output shard in memory at a time."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vescale.checkpoint._api import _as_checkpoint_error
from vescale.checkpoint._storage import (
    VescaleFileSystemReader,
    read_manifest,
    resolve_checkpoint,
)

__all__ = ["export", "parse_size"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(size: int | str | None) -> int | None:
    """``"5GB"``/``"500MiB"``/``1000`` -> bytes; ``None`` stays ``None``."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot parse size {size!r} (examples: 5GB, 500MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def export(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "safetensors",
    *,
    prefix: str | None = "model",
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write the tensors of a checkpoint as consolidated (unsharded) safetensors files.

    Runs in one process with no process group. Tensors are assembled from their saved
    chunks (checksums verified) one output file at a time, so peak memory is about one
    output shard, not the whole checkpoint.

    Args:
        path: A checkpoint directory written by `vescale.checkpoint.save`.
        out_dir: Output directory (created).
        format: Only ``"safetensors"``.
        prefix: Export only keys under ``prefix + "."`` with the prefix stripped
            (``"model"``: the model's ``state_dict`` names). ``None`` exports every tensor.
        max_shard_size: Split into files of at most this size (``"5GB"``), with a
            ``model.safetensors.index.json``; ``None`` writes one ``model.safetensors``.
        dtype: Cast floating-point tensors to this dtype.

    Returns:
        The written files.
    """
    if format != "safetensors":
        raise ValueError(f"unsupported export format {format!r} (only 'safetensors')")
    try:
        from safetensors.torch import save_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("export needs the safetensors package: pip install safetensors") from e
    limit = parse_size(max_shard_size)
    path = resolve_checkpoint(path)
    manifest = read_manifest(path)
    reader = VescaleFileSystemReader(path, manifest)
    md = reader.read_metadata()
    names: list[tuple[str, str, TensorStorageMetadata]] = []
    for key, tmd in md.state_dict_metadata.items():
        if not isinstance(tmd, TensorStorageMetadata):
            continue
        if prefix:
            if not key.startswith(prefix + "."):
                continue
            names.append((key[len(prefix) + 1 :], key, tmd))
        else:
            names.append((key, key, tmd))
    if not names:
        raise ValueError(f"checkpoint {path} has no tensors under prefix {prefix!r}")
    reader.validate(md, [key for _, key, _ in names])  # every element is saved somewhere

    def nbytes(tmd: TensorStorageMetadata) -> int:
        n = 1
        for s in tmd.size:
            n *= s
        dt = (
            dtype
            if dtype is not None and tmd.properties.dtype.is_floating_point
            else tmd.properties.dtype
        )
        return n * torch.empty((), dtype=dt).element_size()

    groups: list[list[tuple[str, str, TensorStorageMetadata]]] = [[]]
    size = 0
    for item in names:
        b = nbytes(item[2])
        if limit is not None and groups[-1] and size + b > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += b
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        buf = {
            key: torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype) for _, key, tmd in group
        }
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(buf, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
        except BaseException as e:  # noqa: BLE001 - re-raised with DCP's wrapper removed
            err = _as_checkpoint_error(e, f"exporting {path}")
            if err is e:
                raise
            raise err from err.__cause__
        tensors: dict[str, torch.Tensor] = {}
        for name, key, _tmd in group:
            t = buf.pop(key)
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            tensors[name] = t.contiguous()
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        meta: dict[str, Any] = {"format": "pt", "vescale_checkpoint": os.fspath(path)}
        save_file(tensors, os.fspath(out / fname), metadata={k: str(v) for k, v in meta.items()})
        files.append(out / fname)
        del tensors, buf
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        idx = out / "model.safetensors.index.json"
        idx.write_text(json.dumps(index, indent=2))
        files.append(idx)
    return files
