"""Random ops on distributed tensors that draw exactly what one device would draw.

A random op (dropout, ``rand_like``, ``uniform_``, ``bernoulli``, ...) on a DTensor
runs on every rank as it would on one device holding the whole tensor: the op is
called once on a full-size tensor (the DTensor's global shape and stride, on the local
device, with the caller's generator), and each rank keeps the boxes of the result that
its placements give it (`vescale.dtensor.chunks.local_boxes`). So

* every rank holds exactly its slice of the single-device values, on any device and
  for any kernel (no assumption about how a kernel maps elements to random numbers);
* the generator advances exactly as on one device, so later random ops match too;
* the cost is one full-size draw (and a full-size temporary) per op on every rank:
  the price of equality. torch's CUDA tracker draws only the local shard at a Philox
  offset, which is cheaper but cannot equal one device: a CUDA kernel's element-to-
  counter mapping depends on its launch grid, hence on the tensor's size.

Tensor arguments whose values the op reads (the input of ``native_dropout``, the
probabilities of ``bernoulli``) are written into the full-size tensor at this rank's
boxes; elsewhere they are zero. These ops draw the same random numbers whatever the
values are, so the boxes come out right.

Data parallelism: activations are plain tensors (or DTensors replicated over the data
dims) that hold a rank's part of the batch. Inside `data_parallel_rng` a dispatch mode
widens every random op's tensor to the global batch (``block``: rank ``r`` holds rows
``[r*b, (r+1)*b)``; ``interleaved``: row ``j`` is global row ``j*n + r``) before the
boxes are taken.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from vescale.dtensor import _compat
from vescale.dtensor._compat import OpOverload, dtensor_spec, local_tensor

__all__ = [
    "RANDOM_OPS",
    "draw",
    "enable",
    "is_enabled",
    "data_parallel_region",
    "RegionStats",
]

aten = torch.ops.aten


def _overloads(*names: str) -> set[OpOverload]:
    out = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            out.add(op)
    return out


# ``self`` is overwritten (its values are not read).
_FILL = _overloads(
    "uniform_",
    "normal_",
    "bernoulli_.float",
    "bernoulli_.Tensor",
    "exponential_",
    "cauchy_",
    "log_normal_",
    "geometric_",
    "random_",
    "random_.from",
    "random_.to",
)
# Only ``self``'s shape, dtype and layout matter.
_LIKE = _overloads(
    "rand_like",
    "randn_like",
    "randint_like",
    "randint_like.low_dtype",
    "randint_like.Tensor",
    "bernoulli.p",
)
# Every tensor argument's values are read (elementwise).
_READ = _overloads(
    "native_dropout",
    "bernoulli",
    "normal.Tensor_float",
    "normal.float_Tensor",
    "normal.Tensor_Tensor",
)
#: The random ops drawn as on one device.
RANDOM_OPS: frozenset[OpOverload] = frozenset(_FILL | _LIKE | _READ)


# ------------------------------------------------------------------ geometry
def _dense_strides(shape: Sequence[int], like: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` in the memory order of strides ``like`` (``empty_like``'s)."""
    order = sorted(range(len(shape)), key=lambda d: (-like[d], d))
    stride = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(int(shape[d]), 1)
    return tuple(stride)


class _Layout:
    """Where this rank's data of one tensor lies in the single-device tensor."""

    def __init__(self, ref: torch.Tensor, batch: tuple[int, int, int, str] | None) -> None:
        self.is_dtensor = isinstance(ref, DTensor)
        self.shape = tuple(int(s) for s in ref.shape)  # DTensor: global (per its mesh)
        self.stride = tuple(int(s) for s in ref.stride())
        self.device = (local_tensor(ref) if self.is_dtensor else ref).device
        self.placements: tuple[Placement, ...] = ()
        self.boxes = None
        if self.is_dtensor:
            from vescale.dtensor.chunks import UnsupportedLayout, local_boxes

            spec = dtensor_spec(ref)
            self.mesh: DeviceMesh = spec.mesh
            self.placements = tuple(spec.placements)
            coord = self.mesh.get_coordinate()
            geometry = [Replicate() if isinstance(p, Partial) else p for p in self.placements]
            if coord is not None and any(not isinstance(p, Replicate) for p in geometry):
                try:
                    self.boxes, _ = local_boxes(self.shape, self.mesh.shape, coord, geometry)
                except UnsupportedLayout as exc:
                    raise NotImplementedError(
                        f"vescale cannot draw random values for a DTensor with placements "
                        f"{list(self.placements)} as one device would: {exc}. Redistribute it "
                        "(e.g. to Replicate) before the random op"
                    ) from None
        self.batch = batch
        self.full_shape = self.shape
        self.full_stride = self.stride
        if batch is not None:
            n, _r, dim, _layout = batch
            if not self.shape:
                raise ValueError(
                    "data_parallel_rng: a random op on a 0-dim tensor has no batch dim"
                )
            d = dim % len(self.shape)
            self.full_shape = self.shape[:d] + (self.shape[d] * n,) + self.shape[d + 1 :]
            self.full_stride = _dense_strides(self.full_shape, self.stride)

    def matches(self, t: torch.Tensor) -> bool:
        return tuple(t.shape) == self.shape

    def view(self, full: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` that ``self.shape`` (the DTensor's or plain tensor's frame) covers."""
        if self.batch is None:
            return full
        n, r, dim, layout = self.batch
        d = dim % full.dim()
        b = self.shape[d]
        if layout == "block":
            return full.narrow(d, r * b, b)
        return full.unflatten(d, (b, n)).select(d + 1, r)

    def full_like(self, local: torch.Tensor, dtype: torch.dtype, *, read: bool) -> torch.Tensor:
        full = torch.empty_strided(
            self.full_shape, self.full_stride, dtype=dtype, device=self.device
        )
        if not read:
            return full
        full.zero_()
        region = self.view(full)
        if self.boxes is None:
            region.copy_(local)
            return full
        flat = local.reshape(-1)
        for box in self.boxes:
            region[_slices(box)].copy_(
                flat[box.local_start : box.local_start + box.numel].view(box.sizes)
            )
        return full

    def extract(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor of ``full``, laid out like ``like`` (the local input)."""
        region = self.view(full)
        if self.boxes is None:
            return torch.empty_like(like, dtype=full.dtype).copy_(region)
        out = region.new_empty(like.shape)
        flat = out.view(-1)
        for box in self.boxes:
            flat[box.local_start : box.local_start + box.numel].view(box.sizes).copy_(
                region[_slices(box)]
            )
        if out.stride() != like.stride():
            out = torch.empty_like(like, dtype=out.dtype).copy_(out)
        return out


def _slices(box: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


# ------------------------------------------------------------------ drawing
def _tensor_positions(args: Sequence[Any], kwargs: dict) -> list[tuple[Any, Any]]:
    pos = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    pos += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return pos


def _local(t: Any) -> Any:
    return local_tensor(t) if isinstance(t, DTensor) else t


def draw(func: OpOverload, args: tuple, kwargs: dict, batch=None) -> Any:
    """Run random op ``func`` as one device would, keeping this rank's part.

    Args:
        func: One of `RANDOM_OPS`.
        args: Its positional arguments (DTensors and/or plain tensors).
        kwargs: Its keyword arguments (a ``generator`` is used as given).
        batch: ``(n, r, batch_dim, layout)`` when the tensors are rank ``r``'s part of a
            batch split ``n`` ways (inside `data_parallel_rng`), else ``None``.

    Returns:
        What ``func`` returns: DTensors for DTensor inputs, ``args[0]`` for in-place ops.
    """
    kwargs = dict(kwargs or {})
    tensors = _tensor_positions(args, kwargs)
    if not tensors:
        return func(*args, **kwargs)
    ref = tensors[0][1]
    layout = _Layout(ref, batch)
    inplace = func._schema.name.endswith("_")
    read_all = func in _READ
    mesh = layout.mesh if layout.is_dtensor else None

    for key, t in tensors:
        if isinstance(t, DTensor):
            spec = dtensor_spec(t)
            if mesh is not None and spec.mesh != mesh:
                raise ValueError(
                    f"{func}: its DTensor arguments live on different meshes ({mesh} and {spec.mesh})"
                )
            reads = read_all or key != 0
            if (
                reads
                and func is not aten.native_dropout.default
                and any(isinstance(p, Partial) for p in spec.placements)
            ):
                raise ValueError(
                    f"{func}: argument {key!r} has Partial placements {list(spec.placements)}; "
                    "its values are pending a reduction, so redistribute it (to Replicate) first"
                )
    if inplace and layout.is_dtensor and any(isinstance(p, Partial) for p in layout.placements):
        # The random values V become the pending reduction's result: with "sum" one rank
        # of each Partial group holds V and the others zero; "avg"/"max"/"min" hold V.
        keep = _partial_keeps_value(func, layout)
        return _fill_partial(func, args, kwargs, batch, layout, keep)

    # Every rank holds the whole tensor: the op on the local tensors is the one-device op.
    if layout.boxes is None and batch is None:
        local_args = [_local(a) for a in args]
        local_kwargs = {k: _local(v) for k, v in kwargs.items()}
        out = func(*local_args, **local_kwargs)
        if inplace:
            return args[0]
        return _wrap(func, out, layout, ref)

    full_args = list(args)
    full_kwargs = dict(kwargs)
    for key, t in tensors:
        if not layout.matches(t):
            if isinstance(t, DTensor) and any(not p.is_replicate() for p in t.placements):
                raise NotImplementedError(
                    f"{func}: argument {key!r} of shape {tuple(t.shape)} is sharded "
                    f"({list(t.placements)}) but the tensor drawn for has shape {layout.shape}"
                )
            value = _local(t)
        else:
            reads = read_all or key != 0
            value = layout.full_like(_local(t), t.dtype, read=reads)
        if isinstance(key, int):
            full_args[key] = value
        else:
            full_kwargs[key] = value
    out = func(*full_args, **full_kwargs)
    if inplace:
        _local(ref).copy_(layout.extract(full_args[0], _local(ref)))
        return ref
    outs = out if isinstance(out, tuple) else (out,)
    like = _local(ref)
    locals_ = tuple(
        layout.extract(o, like)
        if isinstance(o, torch.Tensor) and tuple(o.shape) == layout.full_shape
        else o
        for o in outs
    )
    return _wrap(func, locals_ if isinstance(out, tuple) else locals_[0], layout, ref)


def _partial_keeps_value(func: OpOverload, layout: _Layout) -> bool:
    coord = layout.mesh.get_coordinate() or ()
    keep = True
    for i, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            op = getattr(p, "reduce_op", "sum")
            if op == "sum":
                keep = keep and coord[i] == 0
            elif op not in ("avg", "max", "min"):
                raise ValueError(
                    f"{func}: cannot fill a DTensor with placement {p} in place with random "
                    "values; redistribute it (to Replicate) first"
                )
    return keep


def _fill_partial(func, args, kwargs, batch, layout: _Layout, keep: bool) -> Any:
    """In-place fill of a Partial DTensor: draw as if replicated, then keep or zero."""
    ref = args[0]
    spec = dtensor_spec(ref)
    rep = tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements)
    from vescale.dtensor._dispatch import make_dtensor

    local = local_tensor(ref)
    stand_in = make_dtensor(local, spec.mesh, rep, ref.shape, ref.stride())
    draw(func, (stand_in, *args[1:]), kwargs, batch)  # fills ``local`` in place
    if not keep:
        local.zero_()
    return ref


def _wrap(func: OpOverload, out: Any, layout: _Layout, ref: torch.Tensor) -> Any:
    if not layout.is_dtensor:
        return out
    from vescale.dtensor._dispatch import make_dtensor

    outs = out if isinstance(out, tuple) else (out,)
    wrapped = []
    for i, o in enumerate(outs):
        if not isinstance(o, torch.Tensor):
            wrapped.append(o)
            continue
        placements = layout.placements
        keeps_partial = func is aten.native_dropout.default and i == 0
        if not keeps_partial:
            placements = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
        stride = _dense_strides(layout.shape, o.stride()) if o.dim() else ()
        wrapped.append(make_dtensor(o, layout.mesh, placements, layout.shape, stride))
    return tuple(wrapped) if isinstance(out, tuple) else wrapped[0]


# ------------------------------------------------------------------ switches
_ENABLED = False


def _dtensor_handler(func: OpOverload, args: tuple, kwargs: dict) -> Any:
    return draw(func, args, kwargs)


_dtensor_handler._vescale_rng = True  # type: ignore[attr-defined]


def enable(on: bool = True) -> bool:
    """Draw random ops on DTensors as one device would (``on``) or as torch does.

    Returns:
        The previous setting.
    """
    global _ENABLED
    before = _ENABLED
    if _compat.set_random_op_handler(sorted(RANDOM_OPS, key=str), _dtensor_handler if on else None):
        _ENABLED = on
    return before


def is_enabled() -> bool:
    """Whether random ops on torch's DTensors are drawn as one device would."""
    return _ENABLED


def _mode_class() -> type:
    cls = getattr(_mode_class, "cls", None)
    if cls is not None:
        return cls
    if not _compat.DISPATCH_MODE_OK:
        raise NotImplementedError(
            f"data_parallel_rng needs torch.utils._python_dispatch.TorchDispatchMode, which "
            f"torch {torch.__version__} does not offer; see "
            "vescale.dtensor._compat.check_torch_internals()"
        )

    class _BatchRandomMode(_compat.TorchDispatchMode):
        def __init__(self, batch: tuple[int, int, int, str], dims: frozenset) -> None:
            super().__init__()
            self.batch = batch
            self.dims = dims  # the data-parallel mesh dims' names
            self.stats = RegionStats()

        def _batch_for(self, args: tuple, kwargs: dict) -> Any:
            if self.batch[0] == 1:
                return None  # the whole batch: nothing to widen
            tensors = _tensor_positions(args, kwargs)
            ref = tensors[0][1] if tensors else None
            if isinstance(ref, DTensor):
                spec = dtensor_spec(ref)
                names = spec.mesh.mesh_dim_names or ()
                for name, p in zip(names, spec.placements):
                    if name in self.dims and not p.is_replicate():
                        return None  # already sharded over the data dims: its shape is global
            return self.batch

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in RANDOM_OPS:
                self.stats.random_ops += 1
                return draw(func, args, kwargs, self._batch_for(args, kwargs))
            return func(*args, **kwargs)

    _mode_class.cls = _BatchRandomMode  # type: ignore[attr-defined]
    return _BatchRandomMode


class RegionStats:
    """What a `data_parallel_region` saw: ``random_ops``, the random ops run inside."""

    def __init__(self) -> None:
        self.random_ops = 0


@contextlib.contextmanager
def data_parallel_region(
    n: int, r: int, batch_dim: int, layout: str, dim_names: Sequence[str] = ()
) -> Iterator[RegionStats]:
    """Treat every random op's tensor as rank ``r``'s part of a batch split ``n`` ways.

    ``dim_names``: the data-parallel mesh dims; a DTensor already sharded over one of
    them has the global batch in its shape and is not widened. Regions nest: an outer
    region widens what an inner one draws (micro-batch -> rank's batch -> global batch).
    """
    mode = _mode_class()((n, r, batch_dim, layout), frozenset(dim_names))
    with mode:
        yield mode.stats


def rank_in_dims(mesh: DeviceMesh, dims: Sequence[int]) -> tuple[int, int]:
    """``(size, index)`` of this rank in the sub-mesh spanned by mesh dims ``dims``."""
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"data_parallel_rng: this rank is not part of {mesh}")
    n, r = 1, 0
    for d in dims:
        size = mesh.size(d)
        r = r * size + coord[d]
        n *= size
    return n, r
