"""Load a Hugging Face ``save_pretrained`` directory into a parallelized model.

Every rank reads, through safetensors' memory-mapped slices, only the boxes of each
tensor that its own shard holds; nothing is communicated and no rank assembles the
model.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from vescale.checkpoint._api import CheckpointMismatchError, LoadResult
from vescale.checkpoint._storage import CheckpointError
from vescale.dtensor import distribute_tensor
from vescale.dtensor.chunks import UnsupportedLayout, local_boxes

__all__ = ["load_hf"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Prefixes under which transformers nests the base model of a task model
# (``GPT2LMHeadModel.transformer``, ``LlamaForCausalLM.model``, ...).
_BASE_PREFIXES = ("transformer.", "model.", "gpt_neox.", "decoder.")


def _weight_map(path: Path) -> dict[str, Path]:
    """File key -> the safetensors file holding it."""
    index = path / _INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        out = {}
        for key, fname in wm.items():
            f = path / fname
            if not f.is_file():
                raise CheckpointError(f"{index} names {fname} for {key!r}, which is missing")
            out[key] = f
        return out
    single = path / _SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(os.fspath(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(
        f"{path}: no {_SINGLE} or {_INDEX} (expected a save_pretrained directory with "
        "safetensors weights)"
    )


def _state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every key of ``model.state_dict()`` -> the live tensor (tied weights: every alias)."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out.setdefault(prefix + n, p)
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out.setdefault(prefix + n, b)
    return out


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _lora_layers(base: nn.Module) -> dict[str, nn.Module]:
    """Name -> peft LoRA layer (a module with ``base_layer``, ``lora_A``, ``lora_B``)."""
    return {
        n: m
        for n, m in base.named_modules()
        if hasattr(m, "base_layer") and hasattr(m, "lora_A") and hasattr(m, "lora_B")
    }


def _base_view(model: nn.Module) -> list[tuple[str, torch.Tensor, str | None]]:
    """``(base-model name, live tensor, LoRA layer or None)`` in ``state_dict`` order.

    A plain model: its own ``state_dict`` names. A peft model: the names of the model
    peft wrapped (``...q_proj.base_layer.weight`` is ``...q_proj.weight``, the third
    entry naming its LoRA layer); the adapters' own tensors are left out. A module in
    peft's ``modules_to_save`` appears twice under its base name: the frozen original
    (``...lm_head.original_module.weight``) first, then the trained copy
    (``...lm_head.modules_to_save.<adapter>.weight``); `load_hf` fills both, `export`
    writes the copy (the last entry of a name).
    """
    if not _is_peft(model):
        return [(k, t, None) for k, t in _state_tensors(model).items()]
    base = model.get_base_model()
    lora = _lora_layers(base)
    out: list[tuple[str, torch.Tensor, str | None]] = []
    for key, t in _state_tensors(base).items():
        owner = next((n for n in lora if key.startswith(n + ".")), None)
        if owner is not None:
            rest = key[len(owner) + 1 :]
            if not rest.startswith("base_layer."):
                continue  # lora_A / lora_B / ... of the adapter itself
            out.append((f"{owner}.{rest[len('base_layer.') :]}", t, owner))
        elif ".original_module." in key:
            head, tail = key.split(".original_module.", 1)
            out.append((f"{head}.{tail}", t, None))
        elif ".modules_to_save." in key:
            head, tail = key.split(".modules_to_save.", 1)
            out.append((f"{head}.{tail.split('.', 1)[1]}", t, None))
        else:
            out.append((key, t, None))
    return out


def _key_mapping(model_keys: list[str], file_keys: set[str]) -> tuple[str, str]:
    """``(strip, add)``: model key ``k`` is file key ``add + k.removeprefix(strip)``.

    Picks the mapping under which most model keys are found: a task model loading a
    base model's files (``GPT2LMHeadModel`` from ``GPT2Model``) or the other way round.
    """
    candidates = [("", "")]
    candidates += [(p, "") for p in _BASE_PREFIXES] + [("", p) for p in _BASE_PREFIXES]

    def hits(c: tuple[str, str]) -> int:
        strip, add = c
        return sum(
            (add + k[len(strip) :]) in file_keys
            for k in model_keys
            if k.startswith(strip) or not strip
        )

    return max(candidates, key=hits)


def _local_pieces(t: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(global slices, destination view)`` pairs covering ``t``'s local data."""
    if not isinstance(t, DTensor):
        yield tuple(slice(0, s) for s in t.shape), t.data
        return
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return  # this rank holds nothing of it
    local = t.to_local()
    boxes, local_shape = local_boxes(t.shape, mesh.shape, coord, t.placements)
    if tuple(local.shape) != tuple(local_shape) or not local.is_contiguous():
        raise UnsupportedLayout(f"local tensor {tuple(local.shape)} vs boxes of {local_shape}")
    flat = local.data.view(-1)
    for b in boxes:
        view = flat[b.local_start : b.local_start + b.numel].view(b.sizes)
        yield tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes)), view


def load_hf(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    strict: bool = True,
) -> LoadResult:
    """Fill a (parallelized) model from a Hugging Face ``save_pretrained`` directory.

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``.
    Each rank reads only the elements its own shard of every parameter and buffer
    holds (safetensors slices of the memory-mapped files), whatever the placements:
    TP, sequence parallel, FSDP's ragged flat shards, HSDP, their combinations, or
    plain tensors. No collective runs; peak memory is the model's local shards plus
    one box being copied. Layouts that are not boxes (GPT-2's fused ``c_attn`` as
    ``_StridedShard``) read the whole tensor on each rank and cut it locally.

    Call it after ``parallelize_module`` / ``DModule``: build the model from its
    config on the ``meta`` device and pass ``param_init_fn=model._init_weights``
    (transformers' own per-module initialiser, which also recomputes non-persistent
    buffers such as rotary ``inv_freq`` that the files do not hold; a no-op
    initialiser would leave those buffers uninitialised). Names follow the
    model's ``state_dict()`` (a peft model: the names of the model it wraps, the
    adapters keeping their own initialisation); files saved from the task model load into the base
    model and the other way round (``transformer.`` / ``model.`` prefixes). Tied
    weights (``lm_head.weight`` is ``wte.weight``) are filled once, from whichever
    name the files have. Values are cast to each tensor's dtype (bf16 files into
    fp32 parameters).

    Args:
        model: The model, after parallelization (or a plain model).
        path: The directory (``config.json`` is not read).
        strict: Raise `CheckpointMismatchError` when model keys are missing from the
            files or file keys have no model tensor (like ``load_state_dict``);
            ``False`` loads what matches and reports the rest.

    Returns:
        A `LoadResult`: ``missing`` and ``unexpected`` keys (``strict=False``),
        ``loaded`` keys and the ``bytes_read`` by this rank.

    Raises:
        CheckpointError: No safetensors weights in ``path``, or an index naming a
            missing file.
        CheckpointMismatchError: A shape differs from the file's (always), or keys do
            not match (``strict=True``); raised before any tensor is changed.

    Example:
        ```python
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
        parallelize_module(model, mesh, param_init_fn=model._init_weights)
        vescale.checkpoint.load_hf(model, d)
        ```
    """
    from safetensors import safe_open

    t0 = time.perf_counter()
    root = Path(path)
    wmap = _weight_map(root)
    view = _base_view(model)
    strip, add = _key_mapping(list(dict.fromkeys(n for n, _, _ in view)), set(wmap))

    def file_key(k: str) -> str | None:
        if strip and not k.startswith(strip):
            return None
        fk = add + k[len(strip) :]
        return fk if fk in wmap else None

    # one entry per live tensor: tied aliases share it, filled from the first name found
    # (a peft modules_to_save name has two tensors, the original and the trained copy:
    # both are filled from it)
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for k, t, _ in view:
        by_id.setdefault(id(t), ([], t))[0].append(k)
    plan: list[tuple[str, str, torch.Tensor]] = []
    missing: list[str] = []
    used: set[str] = set()
    for names, t in by_id.values():
        found = [(k, fk) for k in names if (fk := file_key(k)) is not None]
        if not found:
            missing.extend(names)
            continue
        for _, fk in found:
            used.add(fk)
        plan.append((found[0][0], found[0][1], t))
    unexpected = sorted(set(wmap) - used)
    handles: dict[Path, Any] = {}
    try:
        mismatched = []
        for k, fk, t in plan:
            f = handles.get(wmap[fk])
            if f is None:
                f = handles[wmap[fk]] = safe_open(os.fspath(wmap[fk]), framework="pt")
            shape = list(f.get_slice(fk).get_shape())
            if shape != list(t.shape):
                mismatched.append((k, shape, list(t.shape)))
        if mismatched or (strict and (missing or unexpected)):
            raise CheckpointMismatchError(
                os.fspath(root),
                sorted(missing) if strict else [],
                unexpected if strict else [],
                mismatched,
            )
        read = 0
        with torch.no_grad():
            for _, fk, t in plan:
                sl = handles[wmap[fk]].get_slice(fk)
                try:
                    pieces = list(_local_pieces(t))
                except UnsupportedLayout:
                    full = sl[tuple(slice(0, s) for s in t.shape)]
                    read += full.numel() * full.element_size()
                    cut = distribute_tensor(
                        full.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None
                    )
                    t.to_local().copy_(cut.to_local())
                    continue
                for index, dst in pieces:
                    piece = sl[index] if dst.dim() else handles[wmap[fk]].get_tensor(fk)
                    read += piece.numel() * piece.element_size()
                    dst.copy_(piece.reshape(dst.shape))
    finally:
        handles.clear()
    loaded = sorted({k for names, _ in by_id.values() for k in names if k not in missing})
    return LoadResult(
        missing=sorted(missing),
        unexpected=unexpected,
        loaded=loaded,
        bytes_read=read,
        seconds=time.perf_counter() - t0,
    )
