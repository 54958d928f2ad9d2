"""The one place where vescale-dtensor touches torch internals.

Every internal is probed by feature at import time; ``check_torch_internals()`` is
run by the test suite so that a torch upgrade that moves or changes one of them
fails loudly instead of silently misbehaving.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

__all__ = [
    "DTensorSpec",
    "TensorMeta",
    "make_spec",
    "new_dtensor",
    "shard_to_replicate",
    "replicate_to_shard",
    "shard_to_shard",
    "partial_to_replicate",
    "partial_to_shard",
    "shard_size_and_offset",
    "wait_tensor",
    "norm_partial",
    "is_async_tensor",
    "ORIGINAL_REDISTRIBUTE",
    "ORIGINAL_FROM_LOCAL",
    "register_foreach_type",
    "install_strided_split_rules",
    "install_cpu_attention_rules",
    "check_torch_internals",
]

AsyncCollectiveTensor = funcol.AsyncCollectiveTensor


def norm_partial(norm_type: float) -> Partial:
    """The pending-reduction placement of a p-norm computed on shards (torch private)."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    return _NormPartial(norm_type)


# Captured before vescale patches them (see _dispatch.install_patches).
ORIGINAL_REDISTRIBUTE = DTensor.redistribute
ORIGINAL_FROM_LOCAL = DTensor.from_local


def make_spec(
    mesh: DeviceMesh,
    placements: Sequence,
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> DTensorSpec:
    """Build a ``DTensorSpec`` (private torch type) for the given layout."""
    return DTensorSpec(
        mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype),
    )


def new_dtensor(
    cls: type[DTensor], local: torch.Tensor, spec: DTensorSpec, requires_grad: bool
) -> DTensor:
    """Construct a DTensor (or subclass) around ``local`` without autograd wiring."""
    return cls(local, spec, requires_grad=requires_grad)


def shard_size_and_offset(size: int, num_chunks: int, rank: int) -> tuple[int, int]:
    """Local size and offset of ``rank``'s chunk under ``torch.chunk`` semantics."""
    n, off = Shard.local_shard_size_and_offset(size, num_chunks, rank)
    return int(n), int(off)


def shard_to_replicate(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, logical_shape: Sequence[int]
) -> torch.Tensor:
    return Shard(dim)._to_replicate_tensor(local, mesh, mesh_dim, list(logical_shape))


def replicate_to_shard(
    full: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, rank: int
) -> torch.Tensor:
    return Shard(dim)._replicate_to_shard(full, mesh, mesh_dim, rank)


def shard_to_shard(
    local: torch.Tensor,
    mesh: DeviceMesh,
    mesh_dim: int,
    src_dim: int,
    dst_dim: int,
    logical_shape: Sequence[int],
) -> torch.Tensor:
    return Shard(src_dim)._to_new_shard_dim(local, mesh, mesh_dim, list(logical_shape), dst_dim)


def partial_to_replicate(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, partial: Partial
) -> torch.Tensor:
    return partial._reduce_value(local, mesh, mesh_dim)


def partial_to_shard(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, partial: Partial, dim: int
) -> torch.Tensor:
    return partial._reduce_shard_value(local, mesh, mesh_dim, Shard(dim))


def is_async_tensor(t: object) -> bool:
    return isinstance(t, AsyncCollectiveTensor)


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """Wait for a pending functional collective result and return a plain tensor."""
    if isinstance(t, AsyncCollectiveTensor):
        return t.wait()
    return t


def _foreach_type_lists() -> list[list]:
    import torch.optim.optimizer as _optim
    import torch.utils._foreach_utils as _fe

    return [_optim._foreach_supported_types, _fe._foreach_supported_types]


def register_foreach_type(cls: type) -> None:
    """Let torch's optimizers and grad clipping pick foreach/fused kernels for ``cls``.

    torch checks ``type(p) in _foreach_supported_types`` (exact type), and registers
    only ``DTensor`` itself; a DTensor subclass must be added the same way, or torch
    silently falls back to its per-tensor loops on devices with foreach kernels.
    """
    for lst in _foreach_type_lists():
        if cls not in lst:
            lst.append(cls)


# ------------------------------------------------------------------ fused projections
# A fused projection (QKV, gate+up) is column-parallel as ``_StridedShard(d, k)``: each
# rank holds the same slice of every one of the ``k`` fused parts. torch 2.13 propagates
# that layout through linear layers and views but gathers it for ``split``/``chunk``
# into the parts, and ``cat`` (the backward of ``split``) of ``Shard(d)`` parts gathers
# too. Two extra zero-communication strategies fix both:
#   split/chunk of ``_StridedShard(d, k)`` into ``k`` equal parts  -> each ``Shard(d)``
#   cat of ``k`` equal ``Shard(d)`` parts along ``d``              -> ``_StridedShard(d, k)``
# (rank r's local tensor is ``[part_0 slice r, ..., part_k-1 slice r]`` in both).
_STRIDED_RULES_INSTALLED = False


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def _strided_parts(spec, dim: int, k: int, part_len: int) -> int | None:
    """The one mesh dim where ``spec`` is ``_StridedShard(dim, k)`` (evenly), else None."""
    from torch.distributed.tensor.placement_types import _StridedShard

    found = None
    for i, p in enumerate(spec.placements):
        if isinstance(p, _StridedShard):
            if p.dim != dim:
                continue
            if p.split_factor != k or found is not None:
                return None
            found = i
        elif isinstance(p, Shard) and p.dim == dim:
            return None
    if found is None or part_len % spec.mesh.size(found):
        return None
    return found


def _split_sizes(size: int, arg) -> list[int]:
    if isinstance(arg, int):
        return [arg] * (size // arg) + ([size % arg] if size % arg else [])
    return [int(a) for a in arg]


def _wrap_split(orig):
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    def strategy(op_schema):
        out = orig(op_schema)
        inp = op_schema.args_schema[0]
        if not isinstance(inp, OpStrategy) or len(op_schema.args_schema) < 2:
            return out
        ndim = inp.ndim
        dim = op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else 0
        dim = dim % ndim if ndim else 0
        sizes = _split_sizes(inp.shape[dim], op_schema.args_schema[1])
        if len(sizes) < 2 or len(set(sizes)) != 1:
            return out
        extra = []
        for st in inp.strategies:
            spec = st.output_spec
            i = _strided_parts(spec, dim, len(sizes), sizes[0])
            if i is None:
                continue
            placements = list(spec.placements)
            placements[i] = Shard(dim)
            outs = tuple(DTensorSpec(spec.mesh, tuple(placements)) for _ in sizes)
            in_spec = DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta)
            extra.append(
                OpSpec(
                    output_specs=outs,
                    input_specs=(in_spec,),
                    redistribute_cost=[generate_redistribute_costs(inp, in_spec)],
                )
            )
        return OpStrategy(extra + list(out.strategies)) if extra else out

    strategy.__wrapped__ = orig  # type: ignore[attr-defined]
    return strategy


def _wrap_cat(orig):
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs
    from torch.distributed.tensor.placement_types import _StridedShard

    def legacy_empty(op_schema, children, specs):
        """``cat`` skips 1-D empty tensors (e.g. an empty KV cache being appended to):
        keep them replicated and the others as they are, instead of redistributing an
        empty tensor to a placement it has no dims for."""
        empties = {i for i, sp in enumerate(specs) if tuple(sp.shape) == (0,)}
        rest = [sp for i, sp in enumerate(specs) if i not in empties]
        ref = rest[0]
        ndim = len(ref.shape)
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dim = dim % ndim if ndim else 0
        if any(sp.placements != ref.placements for sp in rest) or any(
            isinstance(p, (Shard, _StridedShard)) and p.dim % max(ndim, 1) == dim
            for p in ref.placements
        ):
            return None
        replicate = (Replicate(),) * ref.mesh.ndim
        in_specs = tuple(
            DTensorSpec(sp.mesh, replicate if i in empties else sp.placements, sp.tensor_meta)
            for i, sp in enumerate(specs)
        )
        return OpStrategy(
            [
                OpSpec(
                    output_specs=DTensorSpec(ref.mesh, ref.placements),
                    input_specs=in_specs,
                    redistribute_cost=[
                        generate_redistribute_costs(c, sp) for c, sp in zip(children, in_specs)
                    ],
                )
            ]
        )

    def strategy(op_schema):
        tup = op_schema.args_schema[0]
        if isinstance(tup, TupleStrategy) and all(
            isinstance(c, OpStrategy) and len(c.strategies) == 1 for c in tup.children
        ):
            specs = [c.strategies[0].output_spec for c in tup.children]
            n_empty = sum(tuple(sp.shape) == (0,) for sp in specs)
            if 0 < n_empty < len(specs):
                legacy = legacy_empty(op_schema, tup.children, specs)
                if legacy is not None:
                    return legacy
        out = orig(op_schema)
        if not isinstance(tup, TupleStrategy) or len(tup.children) < 2:
            return out
        children = tup.children
        if not all(isinstance(c, OpStrategy) and len(c.strategies) == 1 for c in children):
            return out
        specs = [c.strategies[0].output_spec for c in children]
        first = specs[0]
        ndim = len(first.shape)
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dim = dim % ndim if ndim else 0
        if any(s.placements != first.placements or s.shape != first.shape for s in specs):
            return out
        shard_dims = [
            i
            for i, p in enumerate(first.placements)
            if isinstance(p, Shard) and not isinstance(p, _StridedShard) and p.dim == dim
        ]
        strided = [p for p in first.placements if isinstance(p, _StridedShard) and p.dim == dim]
        if len(shard_dims) != 1 or strided or first.shape[dim] % first.mesh.size(shard_dims[0]):
            return out
        placements = list(first.placements)
        placements[shard_dims[0]] = _StridedShard(dim, split_factor=len(specs))
        in_specs = tuple(DTensorSpec(s.mesh, s.placements, s.tensor_meta) for s in specs)
        extra = OpSpec(
            output_specs=DTensorSpec(first.mesh, tuple(placements)),
            input_specs=in_specs,
            redistribute_cost=[
                generate_redistribute_costs(c, sp) for c, sp in zip(children, in_specs)
            ],
        )
        return OpStrategy([extra, *out.strategies])

    strategy.__wrapped__ = orig  # type: ignore[attr-defined]
    return strategy


def _adjust_split_sizes(input_specs, schema):
    """Local split sizes for a split of ``_StridedShard(dim, k)`` into ``k`` parts."""
    from torch.distributed.tensor._op_schema import OpSchema

    spec = input_specs[0]
    args = list(schema.args_schema)
    if len(args) < 2 or spec.tensor_meta is None:
        return schema
    ndim = len(spec.shape)
    dim = (args[2] if len(args) > 2 else 0) % ndim if ndim else 0
    sizes = _split_sizes(spec.shape[dim], args[1])
    if len(sizes) < 2 or len(set(sizes)) != 1:
        return schema
    i = _strided_parts(spec, dim, len(sizes), sizes[0])
    if i is None:
        return schema
    m = spec.mesh.size(i)
    args[1] = args[1] // m if isinstance(args[1], int) else [int(a) // m for a in args[1]]
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def install_strided_split_rules() -> None:
    """Add the two fused-projection strategies to torch's DTensor propagator (once)."""
    global _STRIDED_RULES_INSTALLED
    if _STRIDED_RULES_INSTALLED:
        return
    aten = torch.ops.aten
    funcs = _propagator().op_strategy_funcs
    adjusters = _propagator().op_to_scalar_shape_adjuster
    for op in (aten.split.Tensor, aten.split_with_sizes.default):
        funcs[op] = _wrap_split(funcs[op])
        if op in adjusters:  # pragma: no cover - only if torch adds its own
            raise RuntimeError(f"torch now adjusts {op}'s arguments itself; revisit vescale")
        adjusters[op] = _adjust_split_sizes
    funcs[aten.cat.default] = _wrap_cat(funcs[aten.cat.default])
    _propagator().propagate_op_sharding.cache.cache_clear()
    _STRIDED_RULES_INSTALLED = True


# ------------------------------------------------------------------ CPU attention
# torch 2.13 has DTensor strategies for the CUDA flash/efficient/cuDNN attention ops
# but none for the CPU flash kernel that ``F.scaled_dot_product_attention`` picks on
# CPU. The same rules as torch's CUDA flash op: all replicated, heads sharded (dim 1,
# tensor parallelism) or batch sharded (dim 0), for query/key/value, the output and
# the logsumexp alike; forward and backward. Masks are not covered (no rule then).
_CPU_ATTENTION_INSTALLED = False


def _cpu_attention_strategy(n_out: int, n_in: int, input_index: int):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    singles = [[Replicate()] * (n_out + n_in), [Shard(1)] * (n_out + n_in)]
    singles.append([Shard(0)] * (n_out + n_in))

    def strategy(op_schema):
        if op_schema.kwargs_schema.get("attn_mask") is not None:
            raise NotImplementedError(
                "vescale: no DTensor rule for CPU flash attention with an attn_mask; pass "
                "is_causal=True instead of a causal mask, or use eager attention"
            )
        mesh = op_schema.get_mesh_from_args(validate=False)
        return expand_to_full_mesh_op_strategy(
            mesh, op_schema, [list(s) for s in singles], input_index=input_index
        )

    return strategy


def install_cpu_attention_rules() -> None:
    """Register DTensor strategies for ``_scaled_dot_product_flash_attention_for_cpu``."""
    global _CPU_ATTENTION_INSTALLED
    if _CPU_ATTENTION_INSTALLED:
        return
    aten = torch.ops.aten
    prop = _propagator()
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if fwd not in prop.op_strategy_funcs:  # torch may ship its own some day
        prop.register_op_strategy(fwd, _cpu_attention_strategy(2, 3, 2))
        prop.register_op_strategy(bwd, _cpu_attention_strategy(3, 6, 3))
        prop.propagate_op_sharding.cache.cache_clear()
    _CPU_ATTENTION_INSTALLED = True


def check_torch_internals() -> list[str]:
    """Probe every torch internal vescale-dtensor relies on.

    Returns:
        A list of problems; empty when torch still looks as expected.
    """
    problems: list[str] = []

    def need(obj: object, name: str, params: Sequence[str] = ()) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            problems.append(f"{getattr(obj, '__name__', obj)}.{name} is missing")
            return
        if params:
            got = list(inspect.signature(fn).parameters)
            missing = [p for p in params if p not in got]
            if missing:
                problems.append(f"{name}: parameters {missing} missing (has {got})")

    need(
        Shard, "_to_replicate_tensor", ["local_tensor", "mesh", "mesh_dim", "current_logical_shape"]
    )
    need(Shard, "_replicate_to_shard", ["local_tensor", "mesh", "mesh_dim", "shard_index"])
    need(
        Shard,
        "_to_new_shard_dim",
        ["local_tensor", "mesh", "mesh_dim", "current_logical_shape", "new_shard_dim"],
    )
    need(Shard, "local_shard_size_and_offset", ["curr_local_size", "num_chunks", "rank"])
    need(Partial, "_reduce_value", ["tensor", "mesh", "mesh_dim"])
    need(Partial, "_reduce_shard_value", ["tensor", "mesh", "mesh_dim", "shard_spec"])
    need(DTensor, "from_local", ["local_tensor", "device_mesh", "placements", "shape", "stride"])
    need(DTensor, "redistribute", ["device_mesh", "placements", "async_op"])
    if "placements" not in getattr(DTensorSpec, "__dataclass_fields__", {}):
        problems.append("DTensorSpec has no dataclass field 'placements'")
    if TensorMeta._fields[:3] != ("shape", "stride", "dtype"):
        problems.append(f"TensorMeta fields changed: {TensorMeta._fields}")
    if not hasattr(torch.Tensor, "_dtensor__new__"):
        problems.append("torch.Tensor._dtensor__new__ missing (DTensor construction changed)")
    if "__torch_dispatch__" not in DTensor.__dict__:
        problems.append("DTensor.__torch_dispatch__ for subclasses is missing")
    try:
        p = norm_partial(3.0)
        if not (p.is_partial() and p.norm_type == 3.0):
            problems.append("_NormPartial changed (is_partial/norm_type)")
    except Exception as exc:  # pragma: no cover - only on a torch change
        problems.append(f"_NormPartial unavailable: {exc!r}")
    try:
        lists = _foreach_type_lists()
        if not all(isinstance(lst, list) and DTensor in lst for lst in lists):
            problems.append("_foreach_supported_types no longer lists DTensor")
    except (ImportError, AttributeError) as exc:  # pragma: no cover - only on a torch change
        problems.append(f"_foreach_supported_types unavailable: {exc!r}")
    try:
        funcs = _propagator().op_strategy_funcs
        for op in (
            torch.ops.aten.split.Tensor,
            torch.ops.aten.split_with_sizes.default,
            torch.ops.aten.cat.default,
        ):
            if op not in funcs:
                problems.append(f"no DTensor strategy function registered for {op}")
        from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

        if "input_index" not in inspect.signature(expand_to_full_mesh_op_strategy).parameters:
            problems.append("expand_to_full_mesh_op_strategy lost its input_index argument")
        if not callable(getattr(_propagator(), "register_op_strategy", None)):
            problems.append("ShardingPropagator.register_op_strategy is missing")
        if not isinstance(_propagator().op_to_scalar_shape_adjuster, dict):
            problems.append("ShardingPropagator.op_to_scalar_shape_adjuster changed")
        from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, TupleStrategy
        from torch.distributed.tensor._ops.utils import generate_redistribute_costs
        from torch.distributed.tensor.placement_types import _StridedShard

        if "split_factor" not in inspect.signature(_StridedShard).parameters:
            problems.append("_StridedShard(dim, split_factor=...) changed")
        del OpSpec, OpStrategy, TupleStrategy, generate_redistribute_costs
    except (AttributeError, ImportError, TypeError, ValueError) as exc:  # pragma: no cover
        problems.append(f"DTensor sharding propagator internals changed: {exc!r}")
    if not isinstance(Replicate(), torch._C._distributed.Placement):
        problems.append("placements are no longer torch._C._distributed.Placement")
    return problems
