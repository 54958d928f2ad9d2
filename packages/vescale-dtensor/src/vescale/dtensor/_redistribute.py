"""Redistribution planning and execution for DTensors that carry plugin placements.

A plan turns a source placement list into a destination list as a sequence of
one-mesh-dim steps. Steps come from the ``vescale_redistribute_step`` hook (asked
once per placement pair and cached); plans are cached per (mesh, source, destination,
global shape). Executing a plan runs the cached step callables, never a hook.

Mesh dims apply left to right (the *application order*, see
``application_order``), with one exception: a ``Shard(d)`` whose tensor dim ``d``
an earlier plugin placement would cut through applies *before* that placement. So
``[RaggedShard((0,), units), Shard(0)]`` on a ``(dp, tp)`` mesh takes the tp shard
first and ragged-splits the tp-local tensor over dp (veScale's FSDP x TP layout).
The *logical tensor* of a mesh dim is the global tensor after the placements applied
before it. Changing the placement of mesh dim ``i`` is a single collective on that
mesh dim only when no mesh dim applied after it shards the tensor, so the planner
(1) reduces ``Partial`` dims that must change, (2) gathers the sharded dims applied
after the first changing one, last applied first, (3) runs the direct step of that
dim (or routes it through ``Replicate()``), and (4) re-shards in application order by
local selection, which moves no data. Source and destination are walked in one
order that is valid for both; when none exists (their common sharded dims apply in
different orders) the plan goes through the source with every sharded dim gathered.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from vescale.dtensor import _compat
from vescale.dtensor.placement_types import PluginPlacement

__all__ = [
    "StepContext",
    "RedistributeStep",
    "RedistributePlan",
    "application_order",
    "get_plan",
    "step_for",
]


@dataclass(frozen=True)
class StepContext:
    """Everything a redistribute step needs besides the local tensor.

    Attributes:
        mesh: The device mesh.
        mesh_dim: The mesh dim this step acts on.
        src: Placement on that mesh dim before the step (``Shard`` dims are
            already mapped to dims of the logical tensor).
        dst: Placement after the step (mapped likewise).
        logical_shape: Shape of the logical tensor of this mesh dim.
        num_ranks: Size of the mesh dim.
        rank: This process's coordinate on the mesh dim.
    """

    mesh: DeviceMesh
    mesh_dim: int
    src: Placement
    dst: Placement
    logical_shape: tuple[int, ...]
    num_ranks: int
    rank: int


RedistributeStep = Callable[[torch.Tensor, StepContext], torch.Tensor]
"""`step(local, ctx) -> new_local`: moves a local tensor from `ctx.src` to `ctx.dst` on one mesh dim.

Answered by the `vescale_redistribute_step` hook; see [Writing plugins](../plugins.md#3-direct-steps-optional-for-speed)
for the full contract (autograd, collectives, empty pieces).
"""


def is_sharding(p: Placement) -> bool:
    """True for placements that cut the tensor (``Shard`` and plugin placements)."""
    return p.is_shard() or isinstance(p, PluginPlacement)


# ---------------------------------------------------------------------- step lookup
_lock = threading.Lock()
_step_cache: dict[tuple[Placement, Placement], RedistributeStep | None] = {}
_plan_cache: dict[tuple, RedistributePlan] = {}


def _clear_caches() -> None:
    with _lock:
        _step_cache.clear()
        _plan_cache.clear()


def step_for(src: Placement, dst: Placement) -> RedistributeStep | None:
    """The cached ``vescale_redistribute_step`` answer for one placement pair."""
    key = (src, dst)
    try:
        return _step_cache[key]
    except KeyError:
        pass
    from vescale.dtensor.plugin.manager import get_plugin_manager

    step = get_plugin_manager().hook.vescale_redistribute_step(src=src, dst=dst)
    with _lock:
        _step_cache[key] = step
    return step


# ---------------------------------------------------------------------- geometry
def _local_ndim(p: PluginPlacement, ndim: int) -> int:
    """Dims of ``p``'s local tensor, from its dim map (1 if every dim was cut)."""
    mapped = [d for d in (p.local_dim(x, ndim) for x in range(ndim)) if d is not None]
    return max(mapped) + 1 if mapped else 1


def _first_cut(
    order: list[int], placements: Sequence[Placement], dim: int, ndim: int
) -> int | None:
    """Position in ``order`` of the first plugin placement that cuts through ``dim``."""
    d: int | None = dim
    for pos, m in enumerate(order):
        q = placements[m]
        if isinstance(q, PluginPlacement):
            nd = q.local_dim(d, ndim)  # type: ignore[arg-type]
            if nd is None:
                return pos
            d, ndim = nd, _local_ndim(q, ndim)
    return None


def application_order(placements: Sequence[Placement], ndim: int) -> tuple[int, ...]:
    """The order in which the mesh dims of ``placements`` apply to a tensor of ``ndim`` dims.

    Mesh dims apply left to right, except that a ``Shard(d)`` applies right before the
    first plugin placement (earlier in the order) that would cut through tensor dim
    ``d``: ``[RaggedShard((0,), u), Shard(0)]`` applies ``Shard(0)`` first and then the
    ragged split inside the shard. Shards moved this way keep their mesh order among
    themselves. Layouts whose shards no plugin cuts through apply in mesh order.

    Args:
        placements: One placement per mesh dim.
        ndim: Number of dims of the global tensor.

    Returns:
        A permutation of ``range(len(placements))``.
    """
    order: list[int] = []
    for j, p in enumerate(placements):
        if type(p) is Shard and ndim:
            pos = _first_cut(order, placements, p.dim % ndim, ndim)
            if pos is not None:
                order.insert(pos, j)
                continue
        order.append(j)
    return tuple(order)


def localize(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int],
    coord: Sequence[int] | None = None,
    *,
    order: Sequence[int] | None = None,
) -> tuple[list[tuple[Placement, tuple[int, ...]]], tuple[int, ...]]:
    """Per mesh dim: the effective placement and the logical shape it distributes.

    Args:
        mesh: The device mesh.
        placements: One placement per mesh dim.
        global_shape: Shape of the global tensor.
        coord: Mesh coordinate to compute for (default: this rank's).
        order: Application order of the mesh dims (default:
            ``application_order``); the planner passes an order valid for both
            ends of a redistribution.

    Returns:
        ``(per_dim, local_shape)`` where ``per_dim[i] = (effective placement, logical
        shape of mesh dim i)``, indexed by mesh dim, and ``local_shape`` is this rank's
        local tensor shape.

    Raises:
        ValueError: A placement cannot distribute the shape it meets.
    """
    if coord is None:
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"this rank is not part of mesh {mesh}")
    shape = tuple(int(s) for s in global_shape)
    if order is None:
        order = application_order(placements, len(shape))
    dim_map: list[int | None] = list(range(len(shape)))
    out: list[tuple[Placement, tuple[int, ...]] | None] = [None] * len(placements)
    applied: list[int] = []
    for i in order:
        p = placements[i]
        n = mesh.size(i)
        if isinstance(p, PluginPlacement):
            p.check_shape(shape, n)
            out[i] = (p, shape)
            new_shape = tuple(int(s) for s in p.local_shape(shape, n, coord[i]))
            dim_map = [None if d is None else p.local_dim(d, len(shape)) for d in dim_map]
            shape = new_shape
        elif p.is_shard():
            if type(p) is not Shard:
                raise NotImplementedError(
                    f"{p} cannot be combined with plugin placements (only plain Shard)"
                )
            gdim = p.dim
            if not -len(dim_map) <= gdim < len(dim_map):
                raise ValueError(
                    f"{p} is out of range for a tensor of {len(global_shape)} dims "
                    f"(shape {tuple(global_shape)})"
                )
            d = dim_map[gdim]
            if d is None:
                raise ValueError(
                    f"{p} on mesh dim {i} shards a tensor dim that a plugin placement applied "
                    f"before it ({[str(placements[q]) for q in applied]}) has already cut through"
                )
            eff = Shard(d)
            out[i] = (eff, shape)
            size, _ = _compat.shard_size_and_offset(shape[d], n, coord[i])
            shape = shape[:d] + (size,) + shape[d + 1 :]
        else:
            out[i] = (p, shape)
        applied.append(i)
    return out, shape  # type: ignore[return-value]


_MAX_VALIDATED_COORDS = 4096


def validate_layout(
    mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int]
) -> None:
    """Raise ``ValueError`` if ``placements`` cannot lay out ``global_shape`` on any rank."""
    shape = tuple(mesh.shape)
    if math.prod(shape) > _MAX_VALIDATED_COORDS:
        localize(mesh, placements, global_shape)
        return
    for coord in itertools.product(*(range(n) for n in shape)):
        localize(mesh, placements, global_shape, coord)


# ---------------------------------------------------------------------- plans
@dataclass(frozen=True)
class _PlannedStep:
    fn: RedistributeStep
    ctx: StepContext


class RedistributePlan:
    """A cached sequence of one-mesh-dim steps from one layout to another."""

    __slots__ = ("steps", "src", "dst")

    def __init__(
        self, src: tuple[Placement, ...], dst: tuple[Placement, ...], steps: list[_PlannedStep]
    ):
        self.src = src
        self.dst = dst
        self.steps = steps

    def run(self, local: torch.Tensor, *, async_op: bool = False) -> torch.Tensor:
        """Execute the plan on ``local``; never calls a hook."""
        n = len(self.steps)
        for k, s in enumerate(self.steps):
            if k:
                local = _compat.wait_tensor(local)
            local = s.fn(local, s.ctx)
        if n and not async_op:
            local = _compat.wait_tensor(local)
        return local

    def describe(self) -> list[str]:
        """Human-readable steps, e.g. ``['mesh dim 1: RS(0;1,1) -> Replicate()']``."""
        return [f"mesh dim {s.ctx.mesh_dim}: {s.ctx.src} -> {s.ctx.dst}" for s in self.steps]

    def __repr__(self) -> str:
        return f"RedistributePlan({list(self.src)} -> {list(self.dst)}: {self.describe()})"


def _normalize(placements: Sequence[Placement], ndim: int) -> tuple[Placement, ...]:
    out = []
    for p in placements:
        if type(p) is Shard and p.dim < 0:
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def get_plan(
    mesh: DeviceMesh,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    global_shape: Sequence[int],
) -> RedistributePlan:
    """Return the (cached) plan that moves a tensor from ``src`` to ``dst``.

    Raises:
        ValueError: Placement lists do not match the mesh, or a shape does not fit.
        NotImplementedError: No step exists for a pair, even through ``Replicate()``.
    """
    ndim = len(global_shape)
    src_t = _normalize(src, ndim)
    dst_t = _normalize(dst, ndim)
    # Keyed by mesh identity: an equal mesh re-created later has other process groups.
    # The plan holds its mesh, so the id cannot be reused while the entry lives.
    key = (id(mesh), src_t, dst_t, tuple(global_shape))
    plan = _plan_cache.get(key)
    if plan is None:
        plan = _build_plan(mesh, src_t, dst_t, tuple(int(s) for s in global_shape))
        with _lock:
            _plan_cache[key] = plan
    return plan


def _sharding_sequence(placements: tuple[Placement, ...], order: Sequence[int]) -> list[int]:
    return [m for m in order if is_sharding(placements[m])]


def _joint_order(
    src: tuple[Placement, ...], dst: tuple[Placement, ...], ndim: int
) -> tuple[int, ...] | None:
    """One application order valid for both layouts, or ``None`` if there is none.

    Only sharding dims constrain the order (``Replicate``/``Partial`` apply anywhere):
    the sharded dims of both layouts are merged, which works iff the dims sharded in
    both apply in the same relative order. Mesh order whenever it is valid for both.
    """
    k = len(src)
    a = _sharding_sequence(src, application_order(src, ndim))
    b = _sharding_sequence(dst, application_order(dst, ndim))
    if a == sorted(a) and b == sorted(b):
        return tuple(range(k))
    a_set, b_set = set(a), set(b)
    if [m for m in a if m in b_set] != [m for m in b if m in a_set]:
        return None
    merged: list[int] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and j < len(b) and a[i] == b[j]:
            merged.append(a[i])
            i, j = i + 1, j + 1
        elif i < len(a) and a[i] not in b_set:
            merged.append(a[i])
            i += 1
        else:  # b[j] is not in a: the common dims come in the same order
            merged.append(b[j])
            j += 1
    return tuple(merged + [m for m in range(k) if m not in a_set | b_set])


def _build_plan(
    mesh: DeviceMesh,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    global_shape: tuple[int, ...],
) -> RedistributePlan:
    k = mesh.ndim
    for name, pl in (("source", src), ("destination", dst)):
        if len(pl) != k:
            raise ValueError(
                f"{name} placements {[str(p) for p in pl]} have {len(pl)} entries; "
                f"the mesh has {k} dims (one placement per mesh dim expected)"
            )
    # Validate both layouts up front, for every coordinate of the mesh, so that a
    # layout that does not fit raises the same error on every rank before any
    # communication (an error on some ranks only would leave the others hanging).
    validate_layout(mesh, src, global_shape)
    validate_layout(mesh, dst, global_shape)
    ndim = len(global_shape)
    order = _joint_order(src, dst, ndim)
    if order is not None:
        steps = _plan_steps(mesh, src, dst, global_shape, order)
    else:
        # No common order: gather every sharded dim of the source, then re-shard.
        mid = tuple(Replicate() if is_sharding(p) else p for p in src)
        steps = _plan_steps(
            mesh, src, mid, global_shape, application_order(src, ndim)
        ) + _plan_steps(mesh, mid, dst, global_shape, application_order(dst, ndim))
    return RedistributePlan(src, dst, steps)


def _plan_steps(
    mesh: DeviceMesh,
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    global_shape: tuple[int, ...],
    order: tuple[int, ...],
) -> list[_PlannedStep]:
    """The steps from ``src`` to ``dst``, walking the mesh dims in ``order``."""
    k = mesh.ndim
    coord = mesh.get_coordinate()
    pos = {m: q for q, m in enumerate(order)}
    cur = list(src)
    steps: list[_PlannedStep] = []

    def add(i: int, a: Placement, b: Placement) -> None:
        per_dim, _ = localize(mesh, cur, global_shape, order=order)
        a_eff, logical = per_dim[i]
        b_eff = _effective(b, cur, i, per_dim, order)
        fn = step_for(a_eff, b_eff)
        if fn is None:
            raise NotImplementedError(
                f"no redistribute step from {a} to {b} on mesh dim {i} (also not through "
                "Replicate()); a plugin must answer vescale_redistribute_step for this pair"
            )
        ctx = StepContext(mesh, i, a_eff, b_eff, logical, mesh.size(i), coord[i])
        steps.append(_PlannedStep(fn, ctx))
        cur[i] = b

    def add_routed(i: int, a: Placement, b: Placement) -> None:
        per_dim, _ = localize(mesh, cur, global_shape, order=order)
        a_eff = per_dim[i][0]
        b_eff = _effective(b, cur, i, per_dim, order)
        if step_for(a_eff, b_eff) is not None:
            add(i, a, b)
            return
        missing = [
            f"{x} -> {y}"
            for x, y, xe, ye in (
                (a, Replicate(), a_eff, Replicate()),
                (Replicate(), b, Replicate(), b_eff),
            )
            if xe != ye and step_for(xe, ye) is None
        ]
        if missing:
            raise NotImplementedError(
                f"cannot redistribute mesh dim {i} from {a} to {b}: no direct step, and no "
                f"route through Replicate() ({', '.join(missing)} missing); a plugin must "
                "answer vescale_redistribute_step for this pair"
            )
        add(i, a, Replicate())  # the Replicate() -> b step follows in phase B

    shape_changing = [
        i for i in range(k) if cur[i] != dst[i] and (is_sharding(cur[i]) or is_sharding(dst[i]))
    ]
    f = min(shape_changing, key=pos.__getitem__) if shape_changing else None
    # (1) value-only reductions that must happen anyway (commute with any sharding).
    for i in order:
        if i != f and cur[i].is_partial() and cur[i] != dst[i]:
            add(i, cur[i], Replicate())
    if f is not None:
        # (2) unshard the dims applied after f, last applied first, so each gather is a
        # single collective.
        for i in reversed(order[pos[f] + 1 :]):
            if is_sharding(cur[i]):
                add(i, cur[i], Replicate())
        # (3) the first changing dim: direct step or through Replicate().
        add_routed(f, cur[f], dst[f])
    # (4) re-shard / partition in application order from Replicate(): local, no
    # communication.
    for i in order:
        if cur[i] != dst[i]:
            if not isinstance(cur[i], Replicate):
                add(i, cur[i], Replicate())
            add(i, cur[i], dst[i])
    return steps


def _effective(
    b: Placement,
    cur: list[Placement],
    i: int,
    per_dim: list[tuple[Placement, tuple[int, ...]]],
    order: Sequence[int],
) -> Placement:
    """Map a destination ``Shard(d)`` on mesh dim ``i`` into the logical tensor's dims."""
    if type(b) is not Shard:
        return b
    # The dims applied before i are unchanged by the step, so their dim mapping applies.
    before = list(order[: list(order).index(i)])
    ndim = len(per_dim[order[0]][1]) if per_dim else 0
    dim_map: list[int | None] = list(range(ndim))
    for j in before:
        p = cur[j]
        if isinstance(p, PluginPlacement):
            logical = per_dim[j][1]
            dim_map = [None if d is None else p.local_dim(d, len(logical)) for d in dim_map]
    d = dim_map[b.dim]
    if d is None:
        raise ValueError(
            f"{b} on mesh dim {i} shards a tensor dim that a plugin placement applied before "
            "it cut through"
        )
    return Shard(d)


# ---------------------------------------------------------------------- built-in steps
def replicate_to_partial(local: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """``Replicate() -> Partial(op)``: an exact partition of the replicated value."""
    op = ctx.dst.reduce_op  # type: ignore[attr-defined]
    if op == "sum":
        return local.clone() if ctx.rank == 0 else torch.zeros_like(local)
    if op in ("avg", "max", "min"):
        return local.clone()
    raise ValueError(f"Replicate() -> {ctx.dst} is not supported")


def _overrides(p: PluginPlacement, method: str) -> bool:
    return getattr(type(p), method) is not getattr(PluginPlacement, method)


def builtin_step(src: Placement, dst: Placement) -> RedistributeStep | None:
    """Steps between torch's placements and between a plugin placement and ``Replicate()``."""
    if isinstance(src, PluginPlacement):
        if isinstance(dst, Replicate) and _overrides(src, "unshard"):
            return lambda t, c: c.src.unshard(t, c.mesh, c.mesh_dim, c.logical_shape)
        return None
    if isinstance(dst, PluginPlacement):
        if isinstance(src, Replicate) and _overrides(dst, "shard"):
            return lambda t, c: c.dst.shard(t, c.num_ranks, c.rank)
        return None
    if type(src) is Shard:
        if isinstance(dst, Replicate):
            return lambda t, c: _compat.shard_to_replicate(
                t, c.mesh, c.mesh_dim, c.src.dim, c.logical_shape
            )
        if type(dst) is Shard:
            return lambda t, c: _compat.shard_to_shard(
                t, c.mesh, c.mesh_dim, c.src.dim, c.dst.dim, c.logical_shape
            )
        return None
    if isinstance(src, Replicate):
        if type(dst) is Shard:
            return lambda t, c: _compat.replicate_to_shard(t, c.mesh, c.mesh_dim, c.dst.dim, c.rank)
        if isinstance(dst, Partial):
            return replicate_to_partial
        return None
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return lambda t, c: _compat.partial_to_replicate(t, c.mesh, c.mesh_dim, c.src)
        if type(dst) is Shard:
            return lambda t, c: _compat.partial_to_shard(t, c.mesh, c.mesh_dim, c.src, c.dst.dim)
        return None
    return None


def _register_invalidation() -> None:
    from vescale.dtensor.plugin.manager import add_cache_invalidation_callback

    add_cache_invalidation_callback(_clear_caches)


_register_invalidation()
