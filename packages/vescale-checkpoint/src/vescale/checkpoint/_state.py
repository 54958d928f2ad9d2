"""Turning a user's state dict into DCP's flat ``{key: tensor}`` plus JSON values, and back.

Keys are dotted paths: ``model.fc1.weight``, ``optimizer.state.fc1.weight.exp_avg``,
``optimizer.param_groups``, ``extra.seed``. Optimizer state is keyed by parameter FQN
(``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), so it reshards
with the parameters. Non-tensor values go to the JSON manifest.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Partial, Replicate

from vescale.checkpoint import _compat
from vescale.checkpoint._chunked import ChunkedTensor, chunked_from_dtensor
from vescale.checkpoint._compat import StridedShard as _StridedShard
from vescale.checkpoint._staging import Stager
from vescale.dtensor import PluginPlacement
from vescale.dtensor.chunks import UnsupportedLayout, local_boxes

__all__ = [
    "FlatState",
    "Later",
    "flatten_state",
    "encode_value",
    "decode_value",
    "placement_record",
]

_SCALARS = (bool, int, float, str, type(None))


def encode_value(v: Any, key: str) -> Any:
    """JSON-encode a plain value (tuples are tagged so they round-trip)."""
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x, key) for x in v]}
    if isinstance(v, list):
        return [encode_value(x, key) for x in v]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"{key}: dict key {k!r} is not a str; plain values are stored as JSON"
                )
            if k == "__tuple__":
                raise TypeError(f"{key}: the dict key '__tuple__' is reserved")
            out[k] = encode_value(x, f"{key}.{k}")
        return out
    raise TypeError(
        f"{key}: cannot checkpoint a {type(v).__name__}; plain values must be int, float, str, "
        "bool, None, or lists/tuples/dicts of them"
    )


def decode_value(v: Any) -> Any:
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"__tuple__"}:
            return tuple(decode_value(x) for x in v["__tuple__"])
        return {k: decode_value(x) for k, x in v.items()}
    return v


def placement_record(p: Any) -> dict[str, Any]:
    """A placement as ``{"name": PLACEMENT_NAME, "fields": {...}}`` (JSON)."""
    import dataclasses

    name = getattr(type(p), "PLACEMENT_NAME", type(p).__name__)
    if dataclasses.is_dataclass(p):
        fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    else:
        fields = {k: getattr(p, k) for k in ("dim", "reduce_op") if hasattr(p, k)}
    return {"name": name, "fields": encode_value(fields, name)}


@dataclass
class FlatState:
    """A flattened state: DCP-ready tensors, JSON values and post-load actions."""

    tensors: dict[str, Any] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    tensor_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    value_setters: dict[str, Callable[[Any], None]] = field(default_factory=dict)
    finishers: list[Callable[[], None]] = field(default_factory=list)

    def build(self) -> None:
        """Compute the entries left as `Later` (thread-safe: touches staged buffers only)."""
        for d in (self.tensors, self.tensor_info):
            for k, v in d.items():
                if isinstance(v, Later):
                    d[k] = v.fn()

    def add_tensor(self, key: str, obj: Any, info: dict[str, Any] | Later) -> None:
        if key in self.tensors or key in self.values:
            raise ValueError(f"two state entries flatten to the same key {key!r}")
        self.tensors[key] = obj
        self.tensor_info[key] = info

    def add_value(self, key: str, value: Any, setter: Callable[[Any], None] | None) -> None:
        if key in self.tensors or key in self.values:
            raise ValueError(f"two state entries flatten to the same key {key!r}")
        self.values[key] = encode_value(value, key)
        if setter is not None:
            self.value_setters[key] = setter


def _join(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(v) for v in obj)
    return False


class Later:
    """A value computed later by `FlatState.build` (off the caller's thread)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn


def _dtensor_info(shape, dtype, mesh_shape, placements) -> dict[str, Any]:
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "mesh_shape": list(mesh_shape),
        "placements": [placement_record(p) for p in placements],
    }


#: ``local_boxes`` answers by (global shape, mesh shape, coordinate, placements): a
#: pure function of hashable arguments (placements are frozen dataclasses), asked for
#: every tensor of every async save. Boxes are immutable, so sharing them is safe.
_BOXES: dict[tuple, tuple[Any, Any]] = {}


def _staged_boxes(t: DTensor, key: str, stage: Stager) -> Later | None:
    """Stage ``t``'s local tensor now; build its `ChunkedTensor` later.

    Everything that reads the live DTensor (mesh coordinate, placements, box
    decomposition) runs here, on the caller's thread; the deferred part only slices the
    staged buffer. ``None`` if the local data is not a set of boxes.
    """
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shape, placements = t.shape, t.placements
    key_ = (tuple(shape), tuple(mesh.shape), tuple(coord), tuple(placements))
    try:
        hit = _BOXES.get(key_)
    except TypeError:  # an unhashable placement: no caching
        key_, hit = None, None
    if hit is None:
        try:
            hit = local_boxes(shape, mesh.shape, coord, placements)
        except UnsupportedLayout:
            hit = ((), None)
        if key_ is not None:
            if len(_BOXES) >= 4096:
                _BOXES.clear()
            _BOXES[key_] = hit
    boxes, local_shape = hit
    if local_shape is None:
        return None
    local = _compat.local_tensor(t)
    if tuple(local.shape) != tuple(local_shape):
        return None
    buf = stage.copy(key, local)
    dtype = t.dtype

    def build() -> ChunkedTensor:
        flat = buf.view(-1)
        chunks = [
            (b.offsets, flat[b.local_start : b.local_start + b.numel].view(b.sizes)) for b in boxes
        ]
        return ChunkedTensor(chunks, shape, dtype, None, buf.device)

    return Later(build)


def _tensor_entry(t: torch.Tensor, key: str, *, for_load: bool, stage, flat: FlatState):
    """The DCP object for one tensor leaf and its manifest record (either may be a `Later`)."""
    _stage = (lambda x: stage.copy(key, x)) if stage else None
    if isinstance(t, DTensor):
        placements = t.placements
        # torch's own DCP path describes a rank's data as one box: wrong for a
        # _StridedShard (k slices of a dim), which goes through the fallback like a
        # plugin placement whose data is not a set of boxes.
        plugin = any(isinstance(p, (PluginPlacement, _StridedShard)) for p in placements)
        if any(isinstance(p, Partial) for p in placements):
            if for_load:
                raise ValueError(
                    f"{key}: cannot load into a DTensor with Partial placements "
                    f"{list(placements)} (pending sums have no saved value); load into a "
                    "Replicate or Shard DTensor instead"
                )
        if stage and not for_load:
            # Record the placements as given (Partial included), resolved later.
            info = Later(
                lambda s=t.shape, d=t.dtype, m=tuple(t.device_mesh.shape), p=placements: (
                    _dtensor_info(s, d, m, p)
                )
            )
        else:
            info = _dtensor_info(t.shape, t.dtype, t.device_mesh.shape, placements)
        if any(isinstance(p, Partial) for p in placements):
            t = t.redistribute(
                placements=[Replicate() if isinstance(p, Partial) else p for p in placements]
            )
        if stage and not for_load:
            later = _staged_boxes(t, key, stage)
            if later is not None:
                return later, info
            if not plugin:
                return _staged_dtensor(t, _stage), info
        elif plugin:
            try:
                return chunked_from_dtensor(t, for_load=for_load), info
            except UnsupportedLayout:
                pass
        else:
            return t, info
        # A plugin placement whose data is not a set of boxes: go through its fallback.
        fb_placements = [
            Replicate() if isinstance(p, (PluginPlacement, _StridedShard)) else p
            for p in t.placements
        ]
        fb = t.redistribute(placements=fb_placements)
        if for_load:
            target = t

            def copy_back() -> None:
                back = fb.redistribute(placements=target.placements)
                _compat.local_tensor(target).copy_(_compat.local_tensor(back))

            flat.finishers.append(copy_back)
            return fb, info
        return (_staged_dtensor(fb, _stage) if stage else fb), info
    info = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if for_load:
        return t, info
    return (_stage(t) if stage else t.detach()), info


def _staged_dtensor(t: DTensor, stage: Callable[[torch.Tensor], torch.Tensor]) -> DTensor:
    """``t`` with its local tensor passed through ``stage`` (same layout, shape, stride)."""
    return DTensor.from_local(
        stage(_compat.local_tensor(t)),
        t.device_mesh,
        t.placements,
        run_check=False,
        shape=t.shape,
        stride=t.stride(),
    )


def _find_owner(opt: torch.optim.Optimizer, modules: list[nn.Module]) -> nn.Module | None:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for m in modules:
        if params <= {id(p) for p in m.parameters()}:
            return m
    return None


def _collect_modules(obj: Any, out: list[nn.Module]) -> None:
    if isinstance(obj, nn.Module):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_modules(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_modules(v, out)


def flatten_state(
    state: dict[str, Any],
    *,
    for_load: bool,
    stage: Stager | None = None,
    defer: bool = False,
    background: bool = False,
) -> FlatState:
    """Flatten ``state`` into DCP-ready tensors and JSON values.

    Args:
        state: ``{"model": module, "optimizer": opt, "step": 100, ...}``.
        for_load: Build load targets (views of the live objects) instead of save sources.
        stage: (save only) a `Stager` that copies every tensor to CPU, so the
            live objects may change while the copy is written. Every copy is complete
            when this returns.
        defer: (with ``stage``) leave the DCP objects that only depend on staged
            buffers (box views, manifest records) as `Later` entries for
            `FlatState.build`, which an async save calls on its background thread.
        background: (with ``stage``) leave the copies of dense CPU tensors to
            `Stager.complete` (background staging).

    Returns:
        The `FlatState`.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    flat = FlatState()
    modules: list[nn.Module] = []
    _collect_modules(state, modules)

    def walk(obj: Any, key: str, setter: Callable[[Any], None] | None) -> None:
        if isinstance(obj, torch.Tensor):
            entry, info = _tensor_entry(obj, key, for_load=for_load, stage=stage, flat=flat)
            flat.add_tensor(key, entry, info)
            if for_load and isinstance(entry, ChunkedTensor):
                flat.finishers.append(entry.finish_load)
            return
        if isinstance(obj, nn.Module):
            sd = obj.state_dict()
            has_values = any(not isinstance(v, torch.Tensor) for v in sd.values())
            # Buffers may be written inside ops' kernels without a version bump
            # (BatchNorm's running statistics): never stage them in the background.
            buffers = {n for n, _ in obj.named_buffers()} if stage is not None else set()
            for k in list(sd):
                if k in buffers:
                    with stage.blocking():  # type: ignore[union-attr]
                        walk(sd[k], _join(key, k), _dict_setter(sd, k))
                    continue
                walk(sd[k], _join(key, k), _dict_setter(sd, k))
            if for_load and has_values:
                flat.finishers.append(lambda m=obj, sd=sd: m.load_state_dict(sd))
            return
        # An optimizer that defines its own state_dict (vescale's DistributedOptimizer
        # keys its state by parameter name already) goes through the generic path below.
        if (
            isinstance(obj, torch.optim.Optimizer)
            and type(obj).state_dict is torch.optim.Optimizer.state_dict
        ):
            owner = _find_owner(obj, modules)
            if owner is not None:
                osd = get_optimizer_state_dict(owner, obj)
            else:
                if for_load and not obj.state:
                    raise ValueError(
                        f"{key}: cannot load optimizer state into an optimizer without state "
                        "unless its model is part of the same state dict (state is keyed by "
                        "parameter name)"
                    )
                osd = obj.state_dict()
            walk(osd["state"], _join(key, "state"), None)
            flat.add_value(
                _join(key, "param_groups"),
                osd["param_groups"],
                _dict_setter(osd, "param_groups"),
            )
            if for_load:
                if owner is not None:
                    flat.finishers.append(
                        lambda m=owner, o=obj, osd=osd: set_optimizer_state_dict(m, o, osd)
                    )
                else:
                    flat.finishers.append(lambda o=obj, osd=osd: o.load_state_dict(osd))
            return
        if (
            not isinstance(obj, (dict, list, tuple))
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            sd = obj.state_dict()
            walk(sd, key, None)
            if for_load:
                flat.finishers.append(lambda o=obj, sd=sd: o.load_state_dict(sd))
            return
        if isinstance(obj, dict):
            if not obj and key:
                flat.add_value(key, obj, setter)
                return
            for k in list(obj):
                if not isinstance(k, (str, int)):
                    raise TypeError(f"{key}: state dict key {k!r} must be a str or int")
                walk(obj[k], _join(key, k), _dict_setter(obj, k))
            return
        if isinstance(obj, (list, tuple)) and _has_tensor(obj):
            if isinstance(obj, tuple) and for_load:
                raise TypeError(f"{key}: cannot load tensors into a tuple; use a list")
            for i, v in enumerate(obj):
                walk(v, _join(key, i), _list_setter(obj, i) if isinstance(obj, list) else None)
            return
        flat.add_value(key, obj, setter)

    if stage is not None:
        stage.begin(background)
    try:
        walk(state, "", None)
    finally:
        if stage is not None:
            stage.finish()
    if not (defer and stage is not None):
        flat.build()
    return flat


def _dict_setter(d: dict, k: Any) -> Callable[[Any], None]:
    def set_(v: Any) -> None:
        d[k] = v

    return set_


def _list_setter(lst: list, i: int) -> Callable[[Any], None]:
    def set_(v: Any) -> None:
        lst[i] = v

    return set_


def numel_bytes(info: dict[str, Any]) -> int:
    return (
        math.prod(info["shape"])
        * torch.empty((), dtype=getattr(torch, info["dtype"])).element_size()
    )
