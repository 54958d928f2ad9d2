"""The flat-buffer planner: lay many parameters out in one buffer per dtype.

The global (unsharded) buffer of a dtype is the concatenation of that dtype's
parameters, in the order given, each parameter's row-major storage contiguous.
The buffer is cut into ``N`` contiguous rank slices. Every cut either falls
between two parameters or inside one at a *cut point* of its granularity, so a
rank's shard of a parameter is one contiguous piece of that rank's slice, and the
parameter's placement on the mesh dim is a :class:`~vescale.ragged.RaggedShard`.

Two layouts:

* **even** (no ``weights``, or equal weights): all rank slices have the same
  length ``S`` and the buffer holds ``N * S`` elements, so the whole buffer is
  all-gathered and reduce-scattered with one even collective (gloo has no uneven
  all-gather). Padding goes only *between* parameters (never inside one), so every
  parameter stays a contiguous view of the gathered buffer. At most one gap per
  rank cut, each shorter than that parameter's cut granularity, plus fewer than
  ``N`` elements at the end.
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
    """Where one parameter lives in a :class:`FlatLayout`.

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
        """``max / min`` of :meth:`rank_bytes` (``inf`` if a rank holds nothing)."""
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
) -> dict[torch.dtype, FlatLayout]:
    """Plan one flat buffer per dtype for ``params`` sharded over ``num_ranks`` ranks.

    Args:
        params: :class:`ParamSpec` objects or ``(name, shape, dtype[, granularity])``
            tuples, in the order the buffers should hold them.
        num_ranks: Size of the mesh dim the buffers are sharded over.
        weights: Optional relative share of each rank. Equal or absent weights give
            the even (rank-padded) layout; unequal weights give an unpadded layout
            with slices proportional to the weights.

    Returns:
        A :class:`FlatLayout` per dtype, in order of first appearance.

    Raises:
        TypeError: A spec, shape, dtype or granularity has the wrong type (the
            parameter is named).
        ValueError: A duplicate name, a negative size, an invalid granularity or
            invalid ``num_ranks``/``weights``.
    """
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
    return {dtype: _plan_one(dtype, specs, num_ranks, w) for dtype, specs in groups.items()}


def _plan_one(
    dtype: torch.dtype, specs: list[ParamSpec], n: int, weights: list[float] | None
) -> FlatLayout:
    sizes = [math.prod(s.shape) for s in specs]
    rules = [_cut_rule(s.shape, s.granularity) for s in specs]
    steps = [max(step, 1) for _, step in rules]
    if weights is None:
        offsets, ranges = _layout_even(sizes, steps, n)
    else:
        offsets, ranges = _layout_weighted(sizes, steps, n, weights)
    starts = [a for a, _ in ranges]
    slots = []
    for spec, size, off, (k, _) in zip(specs, sizes, offsets, rules):
        slots.append(_make_slot(spec, size, off, k, ranges, starts, n))
    numel = ranges[-1][1]
    even = all(b - a == ranges[0][1] - ranges[0][0] for a, b in ranges)
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
) -> ParamSlot:
    stop = off + size
    if size == 0:
        r = _rank_of(off, starts, ranges)
        units = [0] * n
        units[r] = 1
        return ParamSlot(
            spec.name, spec.shape, off, 0, RaggedShard(tuple(range(k)), tuple(units)), r, r
        )
    r0 = _rank_of(off, starts, ranges)
    r1 = _rank_of(stop - 1, starts, ranges)
    slice_numel = math.prod(spec.shape[k:])
    counts = []
    for r in range(r0, r1 + 1):
        a, b = ranges[r]
        counts.append((min(stop, b) - max(off, a)) // slice_numel)
    g = 0
    for c in counts:
        g = math.gcd(g, c)
    units = (0,) * r0 + tuple(c // g for c in counts) + (0,) * (n - r1 - 1)
    placement = RaggedShard(tuple(range(k)), units)
    return ParamSlot(spec.name, spec.shape, off, size, placement, r0, r1)


def _layout_even(
    sizes: list[int], steps: list[int], n: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets and rank ranges of the rank-padded layout (all slices of length ``S``).

    Rank cuts sit at ``r * S``. A parameter that straddles a cut off its grid is moved
    forward (a gap between parameters, before it, shorter than its step). A parameter
    that holds several cuts has them all on its grid only if ``S`` is a multiple of
    its step. The smallest ``S`` whose layout fits in ``N * S`` is searched for:

    1. ``S* = ceil((D + (N - 1) * (G - 1)) / N)`` (``D`` data, ``G`` the largest step)
       always fits unless a parameter holds two cuts off its grid: at most ``N - 1``
       gaps, each ``< G``. So the padding is at most ``(N - 1) * G``.
    2. From ``ceil(D / N)`` up: any ``S`` (layouts that would cut a parameter off its
       grid are rejected), then, if that fails quickly, ``S`` rounded up to the lcm of
       the steps of the parameters longer than ``S`` (always valid; this is the only
       case where the padding can exceed ``(N - 1) * G``, by less than ``N * lcm``).
    3. Bisection down to the smallest feasible ``S`` found.
    """
    data = sum(sizes)
    if data == 0:
        return [0] * len(sizes), [(0, 0)] * n
    s_min = -(-data // n)

    def lcm_norm(v: int) -> int:
        big = {st for sz, st in zip(sizes, steps) if sz > v and st > 1}
        lcm = math.lcm(*big) if big else 1
        return -(-v // lcm) * lcm

    def attempt(v: int) -> list[int] | None:
        for spread in (True, False):
            offsets, end = _greedy(sizes, steps, v, n, data, spread)
            if 0 <= end <= n * v:
                return offsets
        return None

    best: tuple[int, list[int]] | None = None
    s_star = -(-(data + (n - 1) * (max(steps) - 1)) // n)
    found = attempt(s_star)
    if found is not None:
        best = (s_star, found)
    for norm in (lambda v: v, lcm_norm):
        s = norm(s_min)
        for _ in range(24):
            if best is not None and s >= best[0]:
                break
            offsets, end = _greedy(sizes, steps, s, n, data, True)
            if 0 <= end <= n * s:
                best = (s, offsets)
                break
            s = norm(max(s + 1, -(-end // n)) if end >= 0 else s + 1)
    if best is None:  # pragma: no cover - the lcm search always converges
        raise RuntimeError("flat-buffer planner did not converge")
    lo, (hi, offsets) = s_min - 1, best
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cand = attempt(mid)
        if cand is not None:
            hi, offsets = mid, cand
        else:
            lo = mid
    return offsets, [(r * hi, (r + 1) * hi) for r in range(n)]


def _greedy(
    sizes: list[int], steps: list[int], s: int, n: int, data: int, spread: bool = True
) -> tuple[list[int], int]:
    """Place parameters in order with slices of ``s``; return offsets and the end.

    The end is ``-1`` when a parameter would hold two cuts not both on its grid.
    The padding still to place (``n * s - data`` in all) is spread evenly over the
    rank slices still to fill, so that every slice holds about ``data / n`` elements:
    before a parameter that straddles the next cut, a gap is inserted that puts the
    cut on the parameter's grid (``gap = (cut - pos) mod step``) and, in steps of the
    grid, comes as near that slice's share as it can without passing it or the cut.
    Slices inside one parameter take no padding; the last slice takes what is left.
    With ``spread=False`` only the gaps the grid requires are inserted.
    """
    slack = n * s - data
    offsets = []
    pos = 0
    pad = 0
    for size, step in zip(sizes, steps):
        if size > 0:
            r = pos // s
            cut = (r + 1) * s  # first rank cut after pos
            if cut < pos + size:
                room = cut - pos
                gap = room % step
                if spread and r < n - 1:
                    want = (slack - pad) // (n - r)
                    if want > gap:
                        gap += min(want - gap, room - gap) // step * step
                pos += gap
                pad += gap
                if step > 1 and s % step and cut + s < pos + size:
                    return offsets, -1
        offsets.append(pos)
        pos += size
    return offsets, pos


def _layout_weighted(
    sizes: list[int], steps: list[int], n: int, weights: list[float]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Unpadded layout whose cuts are the grid points nearest the weighted targets."""
    offsets = []
    pos = 0
    for size in sizes:
        offsets.append(pos)
        pos += size
    total = pos
    wsum = sum(weights)
    cuts = [0]
    acc = 0.0
    for r in range(n - 1):
        acc += weights[r]
        target = round(total * acc / wsum)
        i = bisect.bisect_right(offsets, target) - 1
        if i < 0 or target >= total:
            cut = min(target, total)
        else:
            off, size, step = offsets[i], sizes[i], steps[i]
            if target >= off + size:  # at the end of the last parameter
                cut = target
            else:
                lo = off + (target - off) // step * step
                hi = min(lo + step, off + size)
                cut = lo if target - lo <= hi - target else hi
        cuts.append(max(cut, cuts[-1]))
    cuts.append(total)
    return offsets, [(cuts[r], cuts[r + 1]) for r in range(n)]


def layouts_from_tensors(
    named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    num_ranks: int,
    *,
    granularity: Granularity | Mapping[str, Granularity] = "element",
    weights: Sequence[float] | None = None,
) -> dict[torch.dtype, FlatLayout]:
    """:func:`plan_flat_buffers` for named tensors (e.g. ``model.named_parameters()``).

    Args:
        named: ``name -> tensor`` pairs.
        num_ranks: Size of the sharded mesh dim.
        granularity: One granularity for all, or a ``name -> granularity`` mapping
            (missing names get ``"element"``).
        weights: Optional per-rank weights.
    """
    items = named.items() if isinstance(named, Mapping) else named
    specs = []
    for name, t in items:
        g = granularity.get(name, "element") if isinstance(granularity, Mapping) else granularity
        specs.append(ParamSpec.from_tensor(name, t, g))
    return plan_flat_buffers(specs, num_ranks, weights=weights)


__all__ += ["layouts_from_tensors"]
