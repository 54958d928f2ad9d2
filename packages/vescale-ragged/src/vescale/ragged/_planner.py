"""The flat-buffer planner: lay many parameters out in one buffer per dtype.

The global (unsharded) buffer of a dtype is the concatenation of that dtype's
parameters, in the order given, each parameter's row-major storage contiguous.
The buffer is cut into ``N`` contiguous rank slices. Every cut either falls
between two parameters or inside one at a *cut point* of its granularity, so a
rank's shard of a parameter is one contiguous piece of that rank's slice, and the
parameter's placement on the mesh dim is a `RaggedShard`.

Two layouts:

* **even** (no ``weights``, or equal weights): all rank slices have the same
  length ``S`` and the buffer holds ``N * S`` elements, so the whole buffer is
  all-gathered and reduce-scattered with one even collective (gloo has no uneven
  all-gather). Padding goes only *between* parameters (never inside one), so every
  parameter stays a contiguous view of the gathered buffer. With ``G`` the buffer's
  granularity (its largest unit, in elements) the padding is at most
  ``(N - 1) * G + N * (L - 1)``, ``L`` the lcm of the units of the parameters that can
  hold two cuts (1 if none; see `_layout_even_cuts`), so ``(N - 1) * G`` when
  ``L = 1``. Two planners (`_layout_even`): *cut placement* puts the cuts at the
  unit boundaries nearest an even split (fast; balanced while slices hold many units);
  when it ends above ``1 + 1/1000`` ``max / min`` or above ``(N - 1) * G`` padding,
  *padding placement* also runs: it finds the least ``S`` any even layout of the
  parameters in this order has (an exact greedy on the padding in front of each
  parameter) and spreads the padding over the slices. The layout within
  ``(N - 1) * G`` padding wins, then the better ``max / min``, then the shorter slices.
  With ``order="auto"`` the planner also tries other orders of each buffer's
  parameters (`_candidate_orders`).
* **weighted** (``weights`` not all equal): rank ``r`` holds about
  ``weights[r] / sum(weights)`` of the data; no padding at all. Slices have
  different lengths, so gathering them takes one broadcast per rank.

Granularity (where a parameter may be cut) and the ``RaggedShard`` dims chosen:

========================  ==============================================  ==========================
granularity               cut points (from the parameter's start)          ``RaggedShard.dims``
========================  ==============================================  ==========================
``"element"`` (default)   every element                                     all dims ``(0..ndim-1)``
``"row"``                 every row (dims ``>= 1`` never split)            ``(0,)``
block ``(b0, ..., bm-1)`` every ``b0`` slices of dim ``L = ndim - m``        ``(0..L)``
========================  ==============================================  ==========================

Blocks tile the *trailing* ``m`` dims. A ``(32, 32)`` block on an ``(R, C)``
matrix is cut only between 32-row strips (a partial last strip, when
``R % 32 != 0``, is kept whole). On a higher-rank tensor, e.g. ``(E, R, C)``
experts with ``(32, 32)`` blocks, the flattened ``E * R`` rows are cut every
32 rows when ``R % 32 == 0``; otherwise only between whole ``(R, C)`` matrices.
A 0-d parameter is one element, owned by one rank (``dims=()``, one-hot units).

Every ``RaggedShard`` is expressed in the coarsest units that describe it: the
per-rank slice counts divided by their gcd (an even split of 768 rows on 4 ranks
is ``RaggedShard((0,), (1, 1, 1, 1))``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vescale.ragged._placement import RaggedShard
from vescale.ragged._plan_cuts import (  # noqa: F401
    _cuts_key,
    _even_cuts,
    _Grid,
    _layout_even_cuts,
    _place,
)
from vescale.ragged._plan_order import _bridged_order, _candidate_orders  # noqa: F401
from vescale.ragged._plan_pads import _Even, _layout_even_pads, _slice_spread  # noqa: F401
from vescale.ragged._plan_weighted import _layout_weighted

__all__ = [
    "Granularity",
    "ParamSpec",
    "ParamSlot",
    "FlatLayout",
    "plan_flat_buffers",
]

#: ``"element"``, ``"row"`` or a block shape (tuple of positive ints).
Granularity = str | tuple[int, ...]

_GRANULARITY_NAMES = ("element", "row")


@dataclass(frozen=True)
class ParamSpec:
    """What the planner needs to know about one parameter.

    Args:
        name: Unique name (e.g. the ``named_parameters()`` key).
        shape: Global (unsharded) shape.
        dtype: Element type; parameters of one dtype share one buffer.
        granularity: ``"element"``, ``"row"`` or a block shape; see the module docs.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: Granularity = "element"

    @classmethod
    def from_tensor(
        cls, name: str, tensor: torch.Tensor, granularity: Granularity = "element"
    ) -> ParamSpec:
        """Spec of an existing tensor (its shape and dtype)."""
        return cls(name, tuple(tensor.shape), tensor.dtype, granularity)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in a `FlatLayout`.

    Attributes:
        name: Parameter name.
        shape: Global shape.
        offset: First element in the global buffer.
        numel: Number of elements.
        placement: The parameter's ``RaggedShard`` on the sharded mesh dim.
        first_rank: First rank whose slice holds part of the parameter.
        last_rank: Last such rank (``first_rank`` for a parameter on one rank).
    """

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    placement: RaggedShard
    first_rank: int
    last_rank: int

    @property
    def stop(self) -> int:
        """One past the last element in the global buffer."""
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatLayout:
    """The plan of one dtype's flat buffer over one mesh dim of ``num_ranks`` ranks.

    Attributes:
        dtype: Element type of the buffer.
        num_ranks: Ranks on the sharded mesh dim.
        numel: Elements of the global (unsharded) buffer, padding included.
        rank_ranges: Every rank's ``[start, stop)`` in the global buffer; they tile
            ``[0, numel)`` in rank order.
        params: Parameter slots, in buffer order.
        even: True when all rank slices have the same length (one even collective).
    """

    dtype: torch.dtype
    num_ranks: int
    numel: int
    rank_ranges: tuple[tuple[int, int], ...]
    params: tuple[ParamSlot, ...]
    even: bool
    _index: dict[str, ParamSlot] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._index.update((p.name, p) for p in self.params)

    # ------------------------------------------------------------------ lookup
    def __getitem__(self, name: str) -> ParamSlot:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"no parameter {name!r} in the {self.dtype} flat layout") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @property
    def names(self) -> list[str]:
        """Parameter names in buffer order."""
        return [p.name for p in self.params]

    # ------------------------------------------------------------------ sizes
    @property
    def data_numel(self) -> int:
        """Elements that belong to parameters."""
        return sum(p.numel for p in self.params)

    @property
    def padding(self) -> int:
        """Padding elements in the global buffer."""
        return self.numel - self.data_numel

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.dtype).element_size()

    def slice_numel(self, rank: int) -> int:
        """Length of ``rank``'s slice (padding included)."""
        a, b = self.rank_ranges[rank]
        return b - a

    def rank_data_numel(self) -> list[int]:
        """Parameter elements in each rank's slice (padding excluded)."""
        loads = [0] * self.num_ranks
        for p in self.params:
            for r in range(p.first_rank, p.last_rank + 1):
                a, b = self.piece(p.name, r)
                loads[r] += b - a
        return loads

    def rank_bytes(self) -> list[int]:
        """Parameter bytes in each rank's slice (padding excluded)."""
        return [n * self.itemsize for n in self.rank_data_numel()]

    def imbalance(self) -> float:
        """``max / min`` of `rank_bytes` (``inf`` if a rank holds nothing)."""
        loads = self.rank_data_numel()
        lo = min(loads)
        return math.inf if lo == 0 else max(loads) / lo

    # ------------------------------------------------------------------ geometry
    def piece(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of ``rank``'s piece of ``name`` in the global buffer (may be empty)."""
        p = self[name]
        a, b = self.rank_ranges[rank]
        start = min(max(p.offset, a), b)
        stop = max(min(p.stop, b), start)
        return start, stop

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of ``rank``'s piece of ``name`` inside ``rank``'s slice."""
        start, stop = self.piece(name, rank)
        base = self.rank_ranges[rank][0]
        return start - base, stop - base

    def local_shape(self, name: str, rank: int) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor of ``name`` (its ``RaggedShard`` local shape)."""
        p = self[name]
        return tuple(p.placement.local_shape(p.shape, self.num_ranks, rank))

    def shard_of(self, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s piece of the dense parameter ``full`` (a view, shaped like the local tensor)."""
        p = self[name]
        if tuple(full.shape) != p.shape:
            raise ValueError(f"{name}: expected shape {p.shape}, got {tuple(full.shape)}")
        start, stop = self.piece(name, rank)
        flat = full.reshape(-1)[start - p.offset : stop - p.offset]
        return flat.view(self.local_shape(name, rank))


# ---------------------------------------------------------------------- validation
def _as_spec(item: object, i: int) -> ParamSpec:
    if isinstance(item, ParamSpec):
        spec = item
    elif isinstance(item, (tuple, list)) and len(item) in (3, 4):
        spec = ParamSpec(*item)  # type: ignore[arg-type]
    else:
        raise TypeError(
            f"parameter #{i}: expected a ParamSpec or a (name, shape, dtype[, granularity]) "
            f"tuple, got {item!r}"
        )
    name = spec.name
    if not isinstance(name, str) or not name:
        raise TypeError(f"parameter #{i}: name must be a non-empty str, got {name!r}")
    shape = spec.shape
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in shape
    ):
        raise TypeError(f"parameter {name!r}: shape must be a tuple of ints, got {shape!r}")
    if any(s < 0 for s in shape):
        raise ValueError(f"parameter {name!r}: negative size in shape {tuple(shape)}")
    if not isinstance(spec.dtype, torch.dtype):
        raise TypeError(f"parameter {name!r}: dtype must be a torch.dtype, got {spec.dtype!r}")
    gran = spec.granularity
    if isinstance(gran, str):
        if gran not in _GRANULARITY_NAMES:
            raise ValueError(
                f"parameter {name!r}: unknown granularity {gran!r}; expected 'element', 'row' "
                "or a block shape tuple"
            )
    elif isinstance(gran, (tuple, list)):
        if not gran or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in gran
        ):
            raise ValueError(
                f"parameter {name!r}: a block granularity must be a non-empty tuple of "
                f"positive ints, got {tuple(gran)!r}"
            )
        if len(gran) > len(shape):
            raise ValueError(
                f"parameter {name!r}: block {tuple(gran)} has more dims than its shape "
                f"{tuple(shape)}"
            )
        gran = tuple(gran)
    else:
        raise TypeError(
            f"parameter {name!r}: granularity must be 'element', 'row' or a block shape "
            f"tuple, got {gran!r}"
        )
    return ParamSpec(name, tuple(shape), spec.dtype, gran)


def _cut_rule(shape: tuple[int, ...], gran: Granularity) -> tuple[int, int]:
    """``(k, step)``: ``RaggedShard`` dims ``(0..k-1)`` and the cut step in elements.

    Cuts are allowed at multiples of ``step`` from the parameter's start, and at its end.
    """
    ndim = len(shape)
    if gran == "element":
        return ndim, 1
    if gran == "row":
        k = min(ndim, 1)
        return k, math.prod(shape[k:])
    lead = ndim - len(gran)  # type: ignore[arg-type]
    b0 = gran[0]  # type: ignore[index]
    if lead == 0 or shape[lead] % b0 == 0:
        return lead + 1, b0 * math.prod(shape[lead + 1 :])
    return lead, math.prod(shape[lead:])


# ---------------------------------------------------------------------- planning
def plan_flat_buffers(
    params: Iterable[ParamSpec | tuple],
    num_ranks: int,
    *,
    weights: Sequence[float] | None = None,
    order: str = "given",
) -> dict[torch.dtype, FlatLayout]:
    """Plan one flat buffer per dtype for ``params`` sharded over ``num_ranks`` ranks.

    Args:
        params: `ParamSpec` objects or ``(name, shape, dtype[, granularity])``
            tuples, in the order the buffers should hold them.
        num_ranks: Size of the mesh dim the buffers are sharded over.
        weights: Optional relative share of each rank. Equal or absent weights give
            the even (rank-padded) layout; unequal weights give an unpadded layout
            with slices proportional to the weights.
        order: ``"given"`` keeps every buffer in the order of ``params``; ``"auto"``
            lets the planner reorder each even buffer's parameters (it tries the given
            order, a bridged order and three sorted ones, and keeps the layout within
            ``(N - 1) * G`` padding, then the best ``max / min`` rank load, then the
            shortest slices). `FlatLayout.params` is in buffer order.

    Returns:
        A `FlatLayout` per dtype, in order of first appearance.

    Raises:
        TypeError: A spec, shape, dtype or granularity has the wrong type (the
            parameter is named).
        ValueError: A duplicate name, a negative size, an invalid granularity or
            invalid ``num_ranks``/``weights``/``order``.
    """
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    w: list[float] | None = None
    if weights is not None:
        w = [float(x) for x in weights]
        if len(w) != num_ranks:
            raise ValueError(f"weights has {len(w)} entries for {num_ranks} ranks")
        if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"weights must be finite, >= 0 and not all zero, got {tuple(w)}")
        if all(x == w[0] for x in w):
            w = None
    groups: dict[torch.dtype, list[ParamSpec]] = {}
    seen: set[str] = set()
    for i, item in enumerate(params):
        spec = _as_spec(item, i)
        if spec.name in seen:
            raise ValueError(f"parameter {spec.name!r} appears twice")
        seen.add(spec.name)
        groups.setdefault(spec.dtype, []).append(spec)
    return {
        dtype: _plan_one(dtype, specs, num_ranks, w, order == "auto")
        for dtype, specs in groups.items()
    }


_ORDERS = ("given", "auto")


def _plan_one(
    dtype: torch.dtype,
    specs: list[ParamSpec],
    n: int,
    weights: list[float] | None,
    reorder: bool = False,
) -> FlatLayout:
    sizes = [math.prod(s.shape) for s in specs]
    rules = [_cut_rule(s.shape, s.granularity) for s in specs]
    steps = [max(step, 1) for _, step in rules]
    if weights is not None:
        offsets, ranges = _layout_weighted(sizes, steps, n, weights)
    elif not reorder:
        offsets, ranges = _layout_even(sizes, steps, n)
    else:
        best = None
        cuts_best = None
        perfect = False
        # cut placement for every candidate order; padding placement (slower) only for
        # the given order and the best of the others
        for k, perm in enumerate(_candidate_orders(sizes, steps, n)):
            p_sizes = [sizes[i] for i in perm]
            p_steps = [steps[i] for i in perm]
            if k == 0:
                layout = _layout_even(p_sizes, p_steps, n)
                key = _even_key(*layout, p_sizes, p_steps, n)
            else:  # the padding is placed only for the layout that wins
                layout = _even_cuts(p_sizes, p_steps, n)
                key = _cuts_key(*layout, n)
            if best is None or key < best[0]:
                best = (key, perm, layout)
            if k and (cuts_best is None or key < cuts_best[0]):
                cuts_best = (key, perm)
            if key[1] <= 1.0001 and n * key[2] - sum(sizes) < n:
                perfect = True
                break  # as good as an even layout gets
        if not perfect and cuts_best is not None:
            perm = cuts_best[1]
            p_sizes = [sizes[i] for i in perm]
            p_steps = [steps[i] for i in perm]
            layout = _layout_even(p_sizes, p_steps, n)
            key = _even_key(*layout, p_sizes, p_steps, n)
            if key < best[0]:
                best = (key, perm, layout)
        _, perm, layout = best
        if isinstance(layout[0], _Grid):
            layout = _placed(*layout, len(perm), n)
        p_offsets, ranges = layout
        # slots in buffer order: the chosen order (empty parameters keep their place)
        specs = [specs[i] for i in perm]
        sizes = [sizes[i] for i in perm]
        rules = [rules[i] for i in perm]
        offsets = p_offsets
    starts = [a for a, _ in ranges]
    numel = ranges[-1][1]
    even = all(b - a == ranges[0][1] - ranges[0][0] for a, b in ranges)
    cache: dict = {}
    s = ranges[0][1] if even else 0  # slices [r * s, (r + 1) * s): the rank is pos // s
    slots = [
        _make_slot(spec, size, off, k, ranges, starts, n, cache, s)
        for spec, size, off, (k, _) in zip(specs, sizes, offsets, rules)
    ]
    return FlatLayout(dtype, n, numel, tuple(ranges), tuple(slots), even)


def _rank_of(pos: int, starts: list[int], ranges: list[tuple[int, int]]) -> int:
    """The rank whose slice holds element ``pos`` (the last one for a slice end)."""
    r = bisect.bisect_right(starts, pos) - 1
    # skip empty slices that start at pos
    while r > 0 and ranges[r][0] == ranges[r][1] and ranges[r][0] == pos:
        r -= 1
    return max(r, 0)


def _make_slot(
    spec: ParamSpec,
    size: int,
    off: int,
    k: int,
    ranges: list[tuple[int, int]],
    starts: list[int],
    n: int,
    cache: dict | None = None,
    even_s: int = 0,
) -> ParamSlot:
    """The slot of one parameter; ``cache`` shares equal placements between parameters
    (placements are immutable values; at 1,024 ranks building each one's units is most
    of the cost). ``even_s``: the slice length when all slices have it (``> 0``)."""
    stop = off + size
    if size == 0:
        r0 = r1 = min(off // even_s, n - 1) if even_s else _rank_of(off, starts, ranges)
        counts: tuple[int, ...] = (1,)
    else:
        if even_s:
            r0, r1 = off // even_s, (stop - 1) // even_s
        else:
            r0 = _rank_of(off, starts, ranges)
            r1 = _rank_of(stop - 1, starts, ranges)
        if r0 == r1:
            counts = (1,)
        else:
            slice_numel = math.prod(spec.shape[k:])
            raw = [
                (min(stop, ranges[r][1]) - max(off, ranges[r][0])) // slice_numel
                for r in range(r0, r1 + 1)
            ]
            g = math.gcd(*raw)
            counts = tuple(c // g for c in raw)
    key = (k, r0, counts)
    placement = None if cache is None else cache.get(key)
    if placement is None:
        units = (0,) * r0 + counts + (0,) * (n - r0 - len(counts))
        # the units are ints >= 0 with a positive gcd: valid by construction
        placement = RaggedShard._checked_by_caller(tuple(range(k)), units)
        if cache is not None:
            cache[key] = placement
    return ParamSlot(spec.name, spec.shape, off, size, placement, r0, r1)


# ---------------------------------------------------------------------- even layout
def even_slice_lower_bound(sizes: Sequence[int], steps: Sequence[int], n: int) -> int:
    """A proven lower bound on the slice length ``S`` of any even layout, in any order.

    ``S`` is what an even layout costs: every rank holds ``S`` elements and every
    all-gather / reduce-scatter moves ``N * S``; the largest rank load is at most ``S``.
    Whatever the order and the padding, ``S`` is at least

    * ``ceil(D / N)``: the ``N`` slices hold all ``D`` data elements;
    * the largest *unit* ``max_i min(l_i, g_i)`` (``l_i`` elements, cut step ``g_i``):
      no cut falls inside a unit, so one slice holds it whole;
    * and ``S`` is a multiple of ``g_i`` for every parameter with ``l_i > 2 * S``: such a
      parameter strictly contains two consecutive slice boundaries ``r * S`` and
      ``(r + 1) * S``, and both must be on its grid.

    The bound is the least ``S`` satisfying all three: from the first two, ``S`` moves
    up to the next multiple of the long parameters' units, or to where the shortest of
    them stops being longer than ``2 * S`` (the set shrinks there), whichever is first.
    The benchmark (``benchmarks/ragged_bench.py``) reports every layout's ``S`` against
    it.
    """
    d = sum(sizes)
    if d == 0:
        return 0
    s = max(-(-d // n), max(min(l, g) for l, g in zip(sizes, steps) if l))
    while True:
        long = [(l, g) for l, g in zip(sizes, steps) if l > 2 * s]
        lcm = math.lcm(1, *(g for _, g in long))
        if s % lcm == 0:
            return s
        shortest = min(l for l, _ in long)
        s = min(-(-s // lcm) * lcm, -(-shortest // 2))


def _even_key(
    offsets: list[int], ranges: list[tuple[int, int]], sizes: list[int], steps: list[int], n: int
) -> tuple[bool, float, int]:
    """Rank of an even layout: within ``(N - 1) * G`` padding first, then ``max / min``, then ``S``."""
    s = ranges[0][1] - ranges[0][0]
    if s == 0:
        return (False, 1.0, 0)
    g = max((st for st, size in zip(steps, sizes) if size > 1), default=1)
    over = n * s - sum(sizes) > (n - 1) * g
    return (over, _slice_spread(offsets, sizes, s, n), s)


def _layout_even(
    sizes: list[int], steps: list[int], n: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets and rank ranges of the rank-padded layout (all slices of length ``S``).

    Two planners (see the module notes): cut placement (`_layout_even_cuts`,
    fast, balances well while slices hold many units) and padding placement
    (`_layout_even_pads`: the least ``S``, and every rank loaded when coarse
    units make cut placement give up). The second runs only when the first ends above
    ``1 + 1/1000`` ``max / min`` or above ``(N - 1) * G`` padding; then the layout
    within that padding wins, then the better ``max / min``, then the shorter slices.
    """
    plan = _even_cuts(sizes, steps, n)
    key = _cuts_key(*plan, n)
    if not key[0] and key[1] <= 1.001:
        return _placed(*plan, len(sizes), n)
    pads = _layout_even_pads(sizes, steps, n)
    return pads if _even_key(*pads, sizes, steps, n) < key else _placed(*plan, len(sizes), n)


def _placed(
    grid: _Grid, s: int, cuts: list[int], count: int, n: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets and rank ranges of the cut placement ``(grid, s, cuts)`` (`_even_cuts`)."""
    if grid.total == 0:
        return [0] * count, [(0, 0)] * n
    return _place(grid, cuts, s), [(r * s, (r + 1) * s) for r in range(n)]


def layouts_from_tensors(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    num_ranks: int,
    *,
    granularity: Granularity | Mapping[str, Granularity] = "element",
    weights: Sequence[float] | None = None,
    order: str = "given",
) -> dict[torch.dtype, FlatLayout]:
    """`plan_flat_buffers` for named tensors (e.g. ``model.named_parameters()``).

    Args:
        named: ``name -> tensor`` pairs.
        num_ranks: Size of the sharded mesh dim.
        granularity: One granularity for all, or a ``name -> granularity`` mapping
            (missing names get ``"element"``).
        weights: Optional per-rank weights.
        order: ``"given"`` or ``"auto"`` (see `plan_flat_buffers`).
    """
    items = named.items() if isinstance(named, Mapping) else named
    specs = []
    for name, t in items:
        g = granularity.get(name, "element") if isinstance(granularity, Mapping) else granularity
        specs.append(ParamSpec.from_tensor(name, t, g))
    return plan_flat_buffers(specs, num_ranks, weights=weights, order=order)


__all__ += ["layouts_from_tensors"]
