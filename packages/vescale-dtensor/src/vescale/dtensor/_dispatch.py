"""DTensors that carry plugin placements.

Only a DTensor with at least one `PluginPlacement` is a ``PluginDTensor``;
built-in-only DTensors stay torch's own objects on torch's own (C++) dispatch path.
A ``PluginDTensor`` runs the op families its placements declare locally, and for
every other op converts its plugin-placed operands to the placements' declared
fallbacks and defers to torch's DTensor dispatch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from vescale.dtensor import _compat, _rng
from vescale.dtensor._compat import (
    OpOverload,
    dtensor_spec,
    local_tensor,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from vescale.dtensor._redistribute import get_plan, is_sharding, localize, validate_layout
from vescale.dtensor.placement_types import PluginPlacement

__all__ = ["PluginDTensor", "has_plugin_placement", "make_dtensor"]

aten = torch.ops.aten


def has_plugin_placement(placements: Sequence[Placement]) -> bool:
    for p in placements:
        if isinstance(p, PluginPlacement):
            return True
    return False


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int] | None = None,
    *,
    requires_grad: bool = False,
) -> DTensor:
    """Wrap ``local`` as a DTensor (no autograd): ``PluginDTensor`` iff a plugin placement is present."""
    if stride is None:
        stride = _contiguous_stride(shape)
    spec = _compat.make_spec(mesh, placements, shape, stride, local.dtype)
    cls = PluginDTensor if has_plugin_placement(placements) else DTensor
    return _compat.new_dtensor(cls, local, spec, requires_grad)


# Specs are immutable, so results of the same layout and dtype share one spec object
# (keyed by the source spec's identity; the source spec is kept alive as the value).
_SPEC_CACHE: dict[tuple[int, torch.dtype], tuple[Any, Any]] = {}
_SPEC_CACHE_MAX = 4096


def _spec_for_dtype(spec: Any, dtype: torch.dtype) -> Any:
    if spec.tensor_meta.dtype == dtype:
        return spec
    key = (id(spec), dtype)
    hit = _SPEC_CACHE.get(key)
    if hit is not None and hit[0] is spec:
        return hit[1]
    new_spec = _compat.make_spec(
        spec.mesh, spec.placements, spec.shape, spec.tensor_meta.stride, dtype
    )
    if len(_SPEC_CACHE) >= _SPEC_CACHE_MAX:
        _SPEC_CACHE.clear()
    _SPEC_CACHE[key] = (spec, new_spec)
    return new_spec


def _wrap_like(local: torch.Tensor, spec: Any, shape: Sequence[int] | None = None) -> DTensor:
    if shape is None or tuple(shape) == tuple(spec.shape):
        return _compat.new_dtensor(PluginDTensor, local, _spec_for_dtype(spec, local.dtype), False)
    new_spec = _compat.make_spec(
        spec.mesh, spec.placements, shape, spec.tensor_meta.stride, local.dtype
    )
    return _compat.new_dtensor(PluginDTensor, local, new_spec, False)


# ------------------------------------------------------------------ op families
_LOCAL_SAME_SPEC = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.copy_.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten._to_copy.default,
}
# Per-tensor element-wise ops over lists of tensors (optimizer kernels included).
_FOREACH_PREFIXES = (
    "aten::_foreach_",
    "aten::_fused_adam",
    "aten::_fused_sgd",
    "aten::_fused_adagrad",
)
_FOREACH_REDUCTIONS = {"aten::_foreach_max"}
# ``x.new_empty(x.shape, ...)`` and friends: a tensor of the same global shape, so of the
# same layout (torch.distributed.checkpoint's staging builds its CPU copies with them)
_NEW_LIKE = {
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}
_FULL_REDUCTIONS = {aten.sum.default, aten.mean.default, aten.linalg_vector_norm.default}


@functools.cache
def _family(func: OpOverload) -> str | None:
    name = func._schema.name
    if name.startswith(_FOREACH_PREFIXES):
        return "foreach"
    if func in _FULL_REDUCTIONS:
        return "full_reduction"
    if func in _LOCAL_SAME_SPEC or torch.Tag.pointwise in func.tags:
        return "pointwise"
    return None


@functools.cache
def _mutated_args(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of every argument the op writes to (``self_``, ``out=``...)."""
    return tuple(
        (i, a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _same_layout(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return a.mesh == b.mesh and a.placements == b.placements and a.shape == b.shape


@functools.lru_cache(maxsize=1024)
def _allows_placements(placements: tuple, family: str) -> bool:
    for p in placements:
        if isinstance(p, PluginPlacement) and family not in p.LOCAL_OP_FAMILIES:
            return False
    return True


def _allows(spec: Any, family: str) -> bool:
    return _allows_placements(spec.placements, family)


_MISS = object()


# ------------------------------------------------------------------ pending reductions
# On a DTensor with a ``Partial`` placement each rank holds one term of a pending
# reduction, so only ops that commute with that reduction may run on the local terms;
# every other op takes the fallback path, where torch reduces first.
_PARTIAL_STRUCTURAL = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten.copy_.default,
    aten.zero_.default,
    aten.zeros_like.default,
    aten.empty_like.default,
    aten._to_copy.default,
    aten.neg.default,
    aten.neg_.default,
}
_PARTIAL_SCALE = {  # linear in the DTensor operand when every other operand is a scalar
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.div_.Tensor,
    aten.div_.Scalar,
}
_PARTIAL_SUM = {  # sums of terms of the same pending sum/average
    aten.add.Tensor,
    aten.add_.Tensor,
    aten.sub.Tensor,
    aten.sub_.Tensor,
}
_PARTIAL_FOREACH = {
    "aten::_foreach_mul",
    "aten::_foreach_mul_",
    "aten::_foreach_div",
    "aten::_foreach_div_",
    "aten::_foreach_zero_",
    "aten::_foreach_neg",
    "aten::_foreach_neg_",
}


@functools.lru_cache(maxsize=1024)
def _has_partial(placements: tuple) -> bool:
    return any(p.is_partial() for p in placements)


def _partial_linear(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` commutes with the pending reductions of its DTensor operands."""
    if func in _PARTIAL_STRUCTURAL:
        return True
    dts = [a for a in args if isinstance(a, DTensor)]
    if func in _PARTIAL_SCALE:
        # the scale must not be a DTensor, and for div the DTensor is the numerator
        return len(dts) == 1 and isinstance(args[0], DTensor)
    if func in _PARTIAL_SUM:
        if len(dts) != len([a for a in args if isinstance(a, torch.Tensor)]) or len(dts) < 2:
            return False
        return all(
            not p.is_partial() or getattr(p, "reduce_op", None) in ("sum", "avg")
            for p in dtensor_spec(dts[0]).placements
        )
    return False


def _fast_pointwise(func, args: tuple, kwargs: dict) -> Any:
    """``_try_local`` for the common case: flat arguments (no lists or dicts).

    Element-wise ops on operands of one layout (the optimizer's per-parameter ops)
    run here without pytree traversal; anything else returns ``_MISS``.
    """
    spec = None
    for a in args:
        if isinstance(a, DTensor):
            s = dtensor_spec(a)
            if spec is None:
                spec = s
            elif s is not spec and not _same_layout(spec, s):
                return _MISS
        elif isinstance(a, torch.Tensor):
            if a.dim() != 0:
                return _MISS
        elif isinstance(a, (list, tuple, dict)):
            return _MISS
    for a in kwargs.values():
        if isinstance(a, (torch.Tensor, list, tuple, dict)):
            return _MISS
    if spec is None or not _allows_placements(spec.placements, "pointwise"):
        return _MISS
    if _has_partial(spec.placements) and not _partial_linear(func, args, kwargs):
        return _MISS
    out = func(*[local_tensor(a) if isinstance(a, DTensor) else a for a in args], **kwargs)
    if not isinstance(out, torch.Tensor):  # e.g. a tuple of results
        return tree_map(lambda t: _wrap_like(t, spec) if isinstance(t, torch.Tensor) else t, out)
    mutated = _mutated_args(func)
    if mutated:  # in-place or out=: return the written arg
        i, name = mutated[0]
        return args[i] if i < len(args) else kwargs[name]
    return _compat.new_dtensor(PluginDTensor, out, _spec_for_dtype(spec, out.dtype), False)


def _new_like(func, args: tuple, kwargs: dict) -> Any:
    """``new_empty``/``new_zeros``/``new_ones``/``new_full`` of the DTensor's own global shape."""
    x, size = args[0], args[1]
    if not isinstance(x, DTensor) or tuple(size) != tuple(dtensor_spec(x).shape):
        return _MISS
    local = func(local_tensor(x), tuple(local_tensor(x).shape), *args[2:], **kwargs)
    return _wrap_like(local, dtensor_spec(x))


# ------------------------------------------------------------------ local execution
def _try_local(func, family: str, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    flat, treedef = tree_flatten((args, kwargs))
    if family == "foreach":
        return _try_local_foreach(func, args, kwargs)
    spec = None
    for a in flat:
        if isinstance(a, DTensor):
            if spec is None:
                spec = dtensor_spec(a)
            elif not _same_layout(spec, dtensor_spec(a)):
                return False, None
        elif isinstance(a, torch.Tensor) and a.dim() != 0:
            return False, None
    if spec is None or not _allows(spec, family):
        return False, None
    if family == "pointwise" and _has_partial(spec.placements):
        if not _partial_linear(func, args, kwargs):
            return False, None
    if family == "full_reduction":
        return _full_reduction(func, spec, flat, treedef)
    local_flat = [local_tensor(a) if isinstance(a, DTensor) else a for a in flat]
    largs, lkwargs = tree_unflatten(local_flat, treedef)
    out = func(*largs, **lkwargs)
    mutated = _mutated_args(func)
    if mutated and isinstance(out, torch.Tensor):  # in-place or out=: return the written arg
        i, name = mutated[0]
        return True, args[i] if i < len(args) else kwargs[name]
    return True, tree_map(lambda t: _wrap_like(t, spec) if isinstance(t, torch.Tensor) else t, out)


def _try_local_foreach(func, args: tuple, kwargs: dict) -> tuple[bool, Any]:
    # empty lists (e.g. max_exp_avg_sqs without amsgrad) take no part
    lists = [a for a in args if isinstance(a, (list, tuple)) and len(a)]
    if not lists:
        return False, None
    n = len(lists[0])
    specs: list[Any] = [None] * n
    ref_shapes: list[tuple[int, ...]] = [()] * n
    for lst in lists:
        if len(lst) != n:
            return False, None
        for i, t in enumerate(lst):
            if isinstance(t, DTensor):
                if specs[i] is None:
                    specs[i] = dtensor_spec(t)
                    ref_shapes[i] = tuple(local_tensor(t).shape)
                elif not _same_layout(specs[i], dtensor_spec(t)):
                    return False, None
            elif isinstance(t, torch.Tensor) and t.dim() != 0:
                return False, None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, DTensor) or (isinstance(a, torch.Tensor) and a.dim() != 0):
            return False, None  # a lone tensor operand broadcast over the list
    if any(s is None for s in specs):
        return False, None
    for s in specs:
        if has_plugin_placement(s.placements) and not _allows(s, "foreach"):
            return False, None
        if _has_partial(s.placements) and func._schema.name not in _PARTIAL_FOREACH:
            return False, None

    def unwrap(a):
        if isinstance(a, (list, tuple)):
            return [local_tensor(t) if isinstance(t, DTensor) else t for t in a]
        return a

    if func._schema.name == "aten::_foreach_norm":
        return _foreach_norm(lists[0], specs, *args[1:], **kwargs)  # type: ignore[arg-type]
    if func._schema.name in _FOREACH_REDUCTIONS:
        return False, None
    out = func(*[unwrap(a) for a in args], **kwargs)
    if out is None:
        return True, None
    wrapped = []
    for i, t in enumerate(out):
        s = specs[i]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(
            local_tensor(lists[0][i]).shape
        ):
            raise RuntimeError(f"{func} is not shape-preserving; it cannot run on local shards")
        if has_plugin_placement(s.placements):
            wrapped.append(_wrap_like(t, s))
        else:
            new_spec = _compat.make_spec(
                s.mesh, s.placements, s.shape, s.tensor_meta.stride, t.dtype
            )
            wrapped.append(_compat.new_dtensor(DTensor, t, new_spec, False))
    return True, wrapped


def _full_reduction(func, spec: Any, flat: list, treedef) -> tuple[bool, Any]:
    args, kwargs = tree_unflatten(flat, treedef)
    x = args[0]
    local = local_tensor(x)
    if func is aten.linalg_vector_norm.default:
        return _full_norm(spec, local, *args[1:], **kwargs)
    if any(v is not None for k, v in kwargs.items() if k != "dtype"):
        return False, None
    out_placements: list[Placement] = []
    for p in spec.placements:
        if is_sharding(p):
            out_placements.append(Partial("sum"))
        elif isinstance(p, Partial) and p.reduce_op != "sum":
            return False, None
        else:
            out_placements.append(p)
    dtype = kwargs.get("dtype")
    if func is aten.mean.default:
        kind = dtype or local.dtype
        if not (kind.is_floating_point or kind.is_complex):
            return False, None
        numel = 1
        for s in spec.shape:
            numel *= int(s)
        res = aten.sum.default(local, dtype=dtype) / numel
    else:
        res = func(local, dtype=dtype) if dtype is not None else func(local)
    return True, make_dtensor(res, spec.mesh, out_placements, ())


def _full_norm(spec, local, ord=2, dim=None, keepdim=False, *, dtype=None) -> tuple[bool, Any]:
    ndim = len(spec.shape)
    if keepdim or (dim is not None and sorted(d % ndim for d in dim) != list(range(ndim))):
        return False, None
    ord = float(ord)
    if ord == float("inf"):
        pending: Placement = Partial("max")
    elif ord == float("-inf"):
        pending = Partial("min")
    elif ord == 0.0:
        pending = Partial("sum")
    else:
        pending = _compat.norm_partial(ord)
        if pending is None:  # torch has no pending-norm placement: the general path
            return False, None
    out_placements: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, Partial):
            return False, None  # the norm of a pending sum is not a pending norm
        out_placements.append(pending if is_sharding(p) else p)
    if local.numel() == 0:  # identity of the pending reduction (norms are >= 0)
        fill = float("inf") if ord == float("-inf") else 0.0
        res = torch.full((), fill, dtype=dtype or local.dtype, device=local.device)
    else:
        res = torch.linalg.vector_norm(local, ord, dtype=dtype)
    return True, make_dtensor(res, spec.mesh, out_placements, ())


def _foreach_norm(tensors, specs, ord=2, dtype=None) -> tuple[bool, Any]:
    outs = []
    for t, s in zip(tensors, specs):
        if not isinstance(t, DTensor) or not _allows(s, "full_reduction"):
            return False, None
        ok, res = _full_norm(s, local_tensor(t), ord, dtype=dtype)
        if not ok:
            return False, None
        outs.append(res)
    return True, outs


# ------------------------------------------------------------------ fallback
def _to_fallback(t: DTensor) -> DTensor:
    spec = dtensor_spec(t)
    per_dim, _ = localize(spec.mesh, spec.placements, spec.shape)
    target = [
        p.fallback_placement(per_dim[i][1]) if isinstance(p, PluginPlacement) else p
        for i, p in enumerate(spec.placements)
    ]
    if has_plugin_placement(target):
        raise TypeError(f"fallback placements must be built-in placements, got {target}")
    plan = get_plan(spec.mesh, spec.placements, target, spec.shape)
    local = plan.run(local_tensor(t))
    return make_dtensor(local, spec.mesh, target, spec.shape, spec.tensor_meta.stride)


def _from_fallback_into(orig: PluginDTensor, fb: DTensor) -> None:
    spec = dtensor_spec(orig)
    plan = get_plan(spec.mesh, dtensor_spec(fb).placements, spec.placements, spec.shape)
    local_tensor(orig).copy_(plan.run(local_tensor(fb)))


def _fallback(func, args: tuple, kwargs: dict) -> Any:
    converted: dict[int, DTensor] = {}

    def conv(a):
        if isinstance(a, PluginDTensor):
            fb = converted.get(id(a))
            if fb is None:
                fb = _to_fallback(a)
                converted[id(a)] = fb
            return fb
        return a

    new_args = tree_map(conv, args)
    new_kwargs = tree_map(conv, kwargs)
    out = func(*new_args, **new_kwargs)
    mutated = _mutated_args(func)
    if not mutated:
        return out
    result = out
    for i, name in mutated:
        if i < len(args):
            orig, fb = args[i], new_args[i]
        elif name in kwargs:
            orig, fb = kwargs[name], new_kwargs[name]
        else:
            continue
        if isinstance(orig, PluginDTensor):
            _from_fallback_into(orig, fb)
            if isinstance(out, torch.Tensor) and out is fb:
                result = orig
        elif isinstance(orig, (list, tuple)):  # foreach in-place ops mutate lists
            for o, f in zip(orig, fb):
                if isinstance(o, PluginDTensor):
                    _from_fallback_into(o, f)
    return result


# ------------------------------------------------------------------ the subclass
class PluginDTensor(DTensor):
    """A DTensor with at least one plugin placement (private; users see a ``DTensor``)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _rng.RANDOM_OPS:
            return _rng.draw(func, args, kwargs)
        if func in _NEW_LIKE:
            out = _new_like(func, args, kwargs)
            if out is not _MISS:
                return out
        family = _family(func)
        if family == "pointwise":
            out = _fast_pointwise(func, args, kwargs)
            if out is not _MISS:
                return out
        if family is not None:
            done, out = _try_local(func, family, args, kwargs)
            if done:
                return out
        return _fallback(func, args, kwargs)

    def data_ptr(self) -> int:  # type: ignore[override]
        """0, as for torch's DTensors: the wrapper has no storage (its data is the local tensor's).

        The wrapper is built with the local tensor's storage offset, so for a shard that
        is a view into a flat buffer the inherited ``data_ptr()`` is ``offset * itemsize``
        of no storage; torch.distributed.checkpoint's staging (``async_save``) reads a
        non-zero value as "has a storage" and fails on the wrapper's invalid one.
        """
        return 0

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"DTensor(local_tensor={local_tensor(self)}, device_mesh={dtensor_spec(self).mesh}, "
            f"placements={dtensor_spec(self).placements})"
        )

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return local_tensor(self)
        return _ToLocal.apply(self)

    def redistribute(  # type: ignore[override]
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> DTensor:
        return redistribute_dtensor(self, device_mesh, placements, async_op=async_op)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        return self.redistribute(placements=[Replicate()] * dtensor_spec(self).mesh.ndim).to_local()

    # torch.distributed.checkpoint protocol: a rank's data as boxes of the global tensor
    # (no communication); loading writes into views of the local tensor.
    def __create_write_items__(self, fqn: str, object: Any):
        from vescale.dtensor.chunks import dcp_write_items

        return dcp_write_items(self, fqn)

    def __create_chunk_list__(self):
        from vescale.dtensor.chunks import dcp_chunk_list

        return dcp_chunk_list(self)

    def __get_tensor_shard__(self, index):
        from vescale.dtensor.chunks import dcp_tensor_shard

        return dcp_tensor_shard(self, index)


# ------------------------------------------------------------------ autograd functions
class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: PluginDTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = dtensor_spec(dt)
        return local_tensor(dt).view_as(local_tensor(dt))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        spec = ctx.spec
        return _wrap_like(grad.contiguous(), spec)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: Any) -> DTensor:  # type: ignore[override]
        ctx.spec = spec
        return _compat.new_dtensor(PluginDTensor, local.detach(), spec, False)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        spec = ctx.spec
        if isinstance(grad, DTensor):
            # A partial input's gradient is the output's gradient itself on every rank
            # (d(sum of contributions) / d(one contribution) = 1): Replicate, as in torch.
            target = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
            if dtensor_spec(grad).placements != target:
                plan = get_plan(spec.mesh, dtensor_spec(grad).placements, target, spec.shape)
                return plan.run(local_tensor(grad)), None
            return local_tensor(grad), None
        return grad, None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, dt: DTensor, mesh: DeviceMesh, placements: tuple, async_op: bool
    ) -> DTensor:
        spec = dtensor_spec(dt)
        ctx.src_spec = spec
        plan = get_plan(mesh, spec.placements, placements, spec.shape)
        local = plan.run(local_tensor(dt), async_op=async_op)
        if not plan.steps:
            local = local.view_as(local)
        return make_dtensor(local, mesh, placements, spec.shape, spec.tensor_meta.stride)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        src = ctx.src_spec
        target = tuple(Replicate() if p.is_partial() else p for p in src.placements)
        gspec = dtensor_spec(grad)
        plan = get_plan(src.mesh, gspec.placements, target, src.shape)
        local = plan.run(local_tensor(grad))
        return (
            make_dtensor(local, src.mesh, target, src.shape, src.tensor_meta.stride),
            None,
            None,
            None,
        )


def redistribute_dtensor(
    dt: DTensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    *,
    async_op: bool = False,
) -> DTensor:
    """Redistribute a DTensor when either side carries a plugin placement."""
    mesh = device_mesh or dt.device_mesh
    if mesh != dt.device_mesh:
        raise ValueError(
            f"redistribute keeps the mesh: the DTensor lives on {dt.device_mesh}, got {mesh}"
        )
    if placements is None:
        raise ValueError("redistribute needs placements (one per mesh dim)")
    placements = tuple(placements)
    for i, p in enumerate(placements):
        if p.is_partial() and (i >= len(dt.placements) or dt.placements[i] != p):
            raise ValueError(
                f"cannot redistribute mesh dim {i} from {dt.placements[i] if i < len(dt.placements) else '?'} "
                f"to {p}: Partial placements are produced by ops, not requested"
            )
    return _Redistribute.apply(dt, mesh, placements, async_op)


def from_local_plugin(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
    stride: Sequence[int] | None,
) -> DTensor:
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{len(placements)} placements {[str(p) for p in placements]} for a {mesh.ndim}-dim mesh"
        )
    validate_layout(mesh, placements, shape)
    _, expected = localize(mesh, placements, shape)
    if tuple(local.shape) != tuple(expected):
        raise ValueError(
            f"local tensor of shape {tuple(local.shape)} does not match placements "
            f"{[str(p) for p in placements]} of global shape {tuple(shape)} on this rank "
            f"(expected local shape {tuple(expected)})"
        )
    stride = _contiguous_stride(shape) if stride is None else tuple(stride)
    spec = _compat.make_spec(mesh, placements, shape, stride, local.dtype)
    return _FromLocal.apply(local, spec)


# ------------------------------------------------------------------ torch patches
def _patched_redistribute(self, device_mesh=None, placements=None, *, async_op=False, **kw):
    if placements is not None and has_plugin_placement(placements):
        return redistribute_dtensor(self, device_mesh, placements, async_op=async_op)
    return _compat.ORIGINAL_REDISTRIBUTE(self, device_mesh, placements, async_op=async_op, **kw)


def _patched_from_local(
    local_tensor,
    device_mesh=None,
    placements=None,
    *,
    run_check=False,
    shape=None,
    stride=None,
    grad_placements=None,
):
    if placements is not None and has_plugin_placement(placements):
        from vescale.dtensor.api import from_local

        return from_local(
            local_tensor, device_mesh, placements, run_check=run_check, shape=shape, stride=stride
        )
    return _compat.ORIGINAL_FROM_LOCAL(
        local_tensor,
        device_mesh,
        placements,
        run_check=run_check,
        shape=shape,
        stride=stride,
        grad_placements=grad_placements,
    )


_patched_redistribute.__doc__ = _compat.ORIGINAL_REDISTRIBUTE.__doc__
_patched_from_local.__doc__ = _compat.ORIGINAL_FROM_LOCAL.__doc__


def _distribute_full(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], **kwargs: Any
) -> DTensor:
    """torch's full-state-dict loading when every rank holds ``tensor`` (its ``src_data_rank``)."""
    from vescale.dtensor.api import distribute_tensor

    return distribute_tensor(tensor, mesh, placements, src_data_rank=kwargs.get("src_data_rank", 0))


def _fill_local(key: str, local: DTensor, full: torch.Tensor) -> DTensor:
    """Write this rank's piece of ``full`` (on every rank) into ``local`` (a new DTensor if meta)."""
    from vescale.dtensor.api import distribute_tensor

    if tuple(full.shape) != tuple(local.shape):
        raise ValueError(
            f"full state dict entry {key!r} has shape {tuple(full.shape)}, but the "
            f"DTensor it loads into has global shape {tuple(local.shape)}"
        )

    piece = distribute_tensor(
        full.detach().to(local_tensor(local).device, local.dtype),
        local.device_mesh,
        local.placements,
        src_data_rank=None,
    )
    if local.is_meta:
        return piece
    with torch.no_grad():
        local_tensor(local).copy_(local_tensor(piece))
    return local


def install_patches() -> None:
    """Route torch's ``DTensor.redistribute``/``from_local`` to vescale for plugin placements.

    Built-in-only calls go straight to torch's original implementation.
    """
    _compat.register_foreach_type(PluginDTensor)
    _compat.route_subclass_dispatch(PluginDTensor)
    _compat.install_strided_split_rules()
    _compat.install_cpu_attention_rules()
    _compat.install_unsafe_view_rule()
    _compat.install_state_dict_rules(has_plugin_placement, _distribute_full, _fill_local)
    _rng.enable(True)
    DTensor.redistribute = _patched_redistribute  # type: ignore[method-assign]
    DTensor.from_local = staticmethod(_patched_from_local)  # type: ignore[method-assign]
