"""Export to consolidated safetensors files (a ``save_pretrained`` directory).

Two sources, one writer: a checkpoint directory (one process, no process group) or a
live, parallelized model (a collective: each rank writes the output files assigned to
it, gathering one tensor at a time). A peft LoRA model is exported merged into its base
weights or as its adapter alone.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from vescale.checkpoint._api import _as_checkpoint_error
from vescale.checkpoint._storage import (
    VescaleFileSystemReader,
    read_manifest,
    resolve_checkpoint,
)

__all__ = ["export", "parse_size"]

_INDEX = "model.safetensors.index.json"

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
    path: str | os.PathLike | nn.Module,
    out_dir: str | os.PathLike,
    format: str = "safetensors",
    *,
    prefix: str | None = "model",
    max_shard_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    config: str | os.PathLike | bool | None = None,
    adapters: str = "merge",
) -> list[Path]:
    """Write a checkpoint or a live model as consolidated (unsharded) safetensors files.

    The output is a ``save_pretrained`` directory: ``model.safetensors``, or shards
    ``model-0000i-of-0000n.safetensors`` of at most ``max_shard_size`` plus
    ``model.safetensors.index.json``, and ``config.json`` when one is given or the model
    has one; ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` reads it.

    - **A checkpoint directory** (``path`` written by `vescale.checkpoint.save`): runs in
      one process with no process group. Tensors are assembled from their saved chunks
      (checksums verified) one output file at a time, so peak memory is about one output
      shard, not the whole checkpoint.
    - **A live model** (``path`` an ``nn.Module``, plain or parallelized): a collective,
      every rank calls it. Output file ``i`` is written by rank ``i % world_size``. The
      tensors are gathered one at a time, in file order (``full_tensor()`` of a DTensor,
      which every rank of its mesh joins); the rank that owns the file keeps it, the
      others drop it at once. So a rank holds at most one output file plus one gathered
      tensor, never the model. Tied weights are written once, under their first name
      (transformers ties them again on load). Rank 0 writes the index and the config.
    - **A peft model** (LoRA): ``adapters="merge"`` writes the base model's weights with
      each active LoRA adapter merged in (``W + B @ A * scaling``, as peft's
      ``merge_and_unload()``) under the base model's names, for plain transformers.
      ``adapters="only"`` writes peft's ``adapter_model.safetensors`` and
      ``adapter_config.json`` (peft's own ``save_pretrained``, on rank 0, from the
      gathered adapter tensors) for ``PeftModel.from_pretrained(base, out_dir)``.

    Args:
        path: A checkpoint directory, or the model to export.
        out_dir: Output directory (created; shared by every rank for a live model).
        format: Only ``"safetensors"``.
        prefix: (checkpoint only) Export only keys under ``prefix + "."`` with the prefix
            stripped (``"model"``: the model's ``state_dict`` names). ``None`` exports
            every tensor.
        max_shard_size: Split into files of at most this size (``"5GB"``), with a
            ``model.safetensors.index.json``; ``None`` writes one ``model.safetensors``.
        dtype: Cast floating-point tensors to this dtype.
        config: A directory (or ``config.json`` file) whose ``config.json`` and
            ``generation_config.json`` are copied; ``None``: the live model's own
            transformers config (``model.config``), nothing for a checkpoint; ``False``:
            no config.
        adapters: (peft models) ``"merge"`` or ``"only"``.

    Returns:
        The files of the export (every file, on every rank, for a live model).

    Raises:
        ValueError: An unknown format or ``adapters`` value, or nothing to export.
        NotImplementedError: A peft adapter that cannot be merged here (DoRA, LoRA on
            embeddings or convolutions, ``lora_bias``), naming the module.
    """
    if format != "safetensors":
        raise ValueError(f"unsupported export format {format!r} (only 'safetensors')")
    if adapters not in ("merge", "only"):
        raise ValueError(f"export(adapters={adapters!r}): expected 'merge' or 'only'")
    try:
        from safetensors.torch import save_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("export needs the safetensors package: pip install safetensors") from e
    limit = parse_size(max_shard_size)
    if isinstance(path, nn.Module):
        if adapters == "only":
            return _export_adapter(path, Path(out_dir), dtype)
        return _export_module(path, Path(out_dir), limit, dtype, config, save_file)
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

    groups = _group_by_size(names, [nbytes(tmd) for _, _, tmd in names], limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = _file_name(i, len(groups))
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
        files.append(_write_index(out, weight_map, total))
    _write_config(out, config, None)
    return files


def _group_by_size(items: list[Any], sizes: list[int], limit: int | None) -> list[list[Any]]:
    """Consecutive runs of ``items`` whose ``sizes`` add up to at most ``limit`` bytes each."""
    groups: list[list[Any]] = [[]]
    size = 0
    for item, b in zip(items, sizes):
        if limit is not None and groups[-1] and size + b > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += b
    return groups


def _file_name(i: int, n: int) -> str:
    """transformers' shard names: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``."""
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_index(out: Path, weight_map: dict[str, str], total: int) -> Path:
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    idx = out / _INDEX
    idx.write_text(json.dumps(index, indent=2))
    return idx


def _write_config(out: Path, config: Any, model: nn.Module | None) -> None:
    """``config.json`` (and ``generation_config.json``) next to the weights.

    ``config``: a directory or ``config.json`` file to copy from; ``None``: the model's
    own transformers config when it has one (nothing for a checkpoint path); ``False``:
    nothing.
    """
    if config is False:
        return
    if config is None:
        cfg = getattr(model, "config", None) if model is not None else None
        if cfg is None or not hasattr(cfg, "save_pretrained"):
            return
        cfg = copy.deepcopy(cfg)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not getattr(cfg, "architectures", None):
            cfg.architectures = [type(base).__name__]
        cfg.save_pretrained(os.fspath(out))
        return
    src = Path(config)
    files = [src / "config.json", src / "generation_config.json"] if src.is_dir() else [src]
    if not files[0].is_file():
        raise FileNotFoundError(f"export(config={os.fspath(config)!r}): no config.json there")
    for f in files:
        if f.is_file():
            shutil.copyfile(f, out / f.name)


# ---------------------------------------------------------------------------- live models


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over its mesh for a DTensor), detached, on the CPU."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def _merge_fn(name: str, layer: nn.Module, weight: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``W + sum over active adapters of B @ A * scaling`` (peft's merge), gathered."""
    merged = set(getattr(layer, "merged_adapters", ()))
    active = [a for a in layer.active_adapters if a in layer.lora_A and a not in merged]
    for a in active:
        problems = []
        if getattr(layer, "use_dora", {}).get(a, False):
            problems.append("DoRA")
        if not isinstance(layer.lora_A[a], nn.Linear) or not isinstance(layer.lora_B[a], nn.Linear):
            problems.append(f"{type(layer.lora_A[a]).__name__} adapter")
        elif layer.lora_B[a].bias is not None:
            problems.append("lora_bias")
        if problems:
            raise NotImplementedError(
                f"export: cannot merge LoRA adapter {a!r} of {name!r} ({', '.join(problems)}); "
                "export it with adapters='only'"
            )

    def fetch() -> torch.Tensor:
        w = _full(weight)
        out = w.to(torch.float32, copy=True)
        for a in active:
            delta = _full(layer.lora_B[a].weight).float() @ _full(layer.lora_A[a].weight).float()
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            out += delta * layer.scaling[a]
        return out.to(w.dtype)

    return fetch


def _module_items(model: nn.Module) -> list[tuple[str, torch.Tensor, Callable, bool]]:
    """``(output name, live tensor, fetch, collective)`` for every tensor to write.

    In ``state_dict`` order; ``collective``: ``fetch`` gathers a DTensor, so every rank
    calls it.

    For a peft model with ``adapters="merge"``: the base model's names, LoRA layers'
    base weights merged, adapter tensors left out, ``modules_to_save`` copies in place
    of their originals.
    """
    from vescale.checkpoint._hf import _base_view, _is_peft, _lora_layers

    lora = _lora_layers(model.get_base_model()) if _is_peft(model) else {}
    items: list[tuple[str, torch.Tensor, Callable, bool]] = []
    seen: set[int] = set()
    view = _base_view(model)
    last = {name: i for i, (name, _, _) in enumerate(view)}
    for i, (name, t, owner) in enumerate(view):
        if last[name] != i:
            continue  # peft's modules_to_save: the trained copy (listed last) is written
        if id(t) in seen:
            continue  # a tied alias: written once, under its first name
        seen.add(id(t))
        fetch: Callable[[], torch.Tensor] = lambda t=t: _full(t)  # noqa: E731
        collective = isinstance(t, DTensor)
        if owner is not None and name == f"{owner}.weight":
            fetch = _merge_fn(owner, lora[owner], t)
            collective = any(isinstance(p, DTensor) for p in lora[owner].parameters())
        items.append((name, t, fetch, collective))
    if not items:
        raise ValueError("export: the model has no parameters or persistent buffers")
    return items


def _export_module(
    model: nn.Module,
    out: Path,
    limit: int | None,
    dtype: torch.dtype | None,
    config: Any,
    save_file: Callable,
) -> list[Path]:
    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    items = _module_items(model)

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    sizes = [t.numel() * torch.empty((), dtype=out_dtype(t)).element_size() for _, t, _, _ in items]
    groups = _group_by_size(list(range(len(items))), sizes, limit)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    if on:
        dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    files = [out / _file_name(i, len(groups)) for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    with torch.no_grad():
        for g, group in enumerate(groups):
            mine = g % world == rank
            tensors: dict[str, torch.Tensor] = {}
            for i in group:
                name, t, fetch, collective = items[i]
                weight_map[name] = files[g].name
                if not mine and not collective:
                    continue  # plain tensors: no collective to join
                full = fetch()
                if mine:
                    tensors[name] = full.to(out_dtype(t)).contiguous()
                del full
            if mine:
                save_file(tensors, os.fspath(files[g]), metadata={"format": "pt"})
            del tensors
    if rank == 0:
        if len(groups) > 1:
            files.append(_write_index(out, weight_map, sum(sizes)))
        _write_config(out, config, model)
    elif len(groups) > 1:
        files.append(out / _INDEX)
    if on:
        dist.barrier()  # every file is on disk before anyone returns
    return files


def _export_adapter(model: nn.Module, out: Path, dtype: torch.dtype | None) -> list[Path]:
    """peft's ``save_pretrained`` on rank 0, from the gathered adapter tensors."""
    from vescale.checkpoint._hf import _is_peft, _state_tensors

    if not _is_peft(model):
        raise ValueError("export(adapters='only') needs a peft model (peft.get_peft_model)")
    from peft import get_peft_model_state_dict

    on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if on else 0
    live = _state_tensors(model)
    # which keys peft saves, decided on shapes only (meta tensors), the same on every rank
    chosen: dict[str, torch.Tensor] = {}
    for adapter in model.peft_config:
        meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in live.items()}
        picked = get_peft_model_state_dict(model, state_dict=meta, adapter_name=adapter)
        for k, t in live.items():
            if k.replace(f".{adapter}", "") in picked or k in picked:
                chosen[k] = t
    gathered: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for k, t in chosen.items():
            full = _full(t)
            if rank == 0:
                gathered[k] = (
                    full.to(dtype) if dtype is not None and full.is_floating_point() else full
                )
    if rank == 0:
        model.save_pretrained(
            os.fspath(out), state_dict=gathered, safe_serialization=True, is_main_process=True
        )
    if on:
        dist.barrier()
    return sorted(p for p in out.rglob("adapter_*") if p.is_file())
