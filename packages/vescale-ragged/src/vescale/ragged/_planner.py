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
import itertools
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


def _is_tight(size: int, step: int) -> bool:
    """Whether a parameter constrains where a cut may fall (more than one element and a
    unit above one element); the others ("fine") may be cut anywhere."""
    return size > 1 and step > 1


def _candidate_orders(sizes: list[int], steps: list[int], n: int) -> list[list[int]]:
    """Orders tried by ``order="auto"`` (the given one first).

    The bridged order (`_bridged_order`, a fine parameter across every cut);
    coarse units first, by unit then size (one-element-unit parameters first or last),
    and by size alone: parameters of one unit then sit on that unit's grid from the
    buffer start, so fewer of them need padding to hold a cut.
    """
    idx = range(len(sizes))

    def unit(i: int) -> int:
        return steps[i] if _is_tight(sizes[i], steps[i]) else 1

    out = [list(idx)]
    bridged = _bridged_order(sizes, steps, n)
    if bridged is not None:
        out.append(bridged)
    out.append(sorted(idx, key=lambda i: (unit(i) == 1, -unit(i), -sizes[i], i)))
    out.append(sorted(idx, key=lambda i: (-sizes[i], i)))
    out.append(sorted(idx, key=lambda i: (unit(i) != 1, -unit(i), -sizes[i], i)))
    return out


def _bridged_order(sizes: list[int], steps: list[int], n: int) -> list[int] | None:
    """An order that puts a one-element-unit parameter across every even-share cut.

    Walks the targets ``r * S`` (``S``: ``ceil(D / N)`` rounded up to the unit of every
    parameter longer than two slices): places the parameters longer than a slice first,
    then fills each stretch with the largest coarse parameters that fit, then with fine
    (one-element-unit) ones, and lets a fine one straddle the target, so the cut can fall
    exactly there. A coarse parameter that has to straddle a target gets fine ones in
    front of it (when they sum exactly to the shift needed) so that the target falls on
    one of its unit boundaries. ``None`` when there are no fine or no coarse parameters.
    """
    tight = [_is_tight(l, g) for l, g in zip(sizes, steps)]
    fine = sorted((i for i, l in enumerate(sizes) if l and not tight[i]), key=lambda i: -sizes[i])
    coarse = sorted((i for i in range(len(sizes)) if tight[i]), key=lambda i: -sizes[i])
    if not fine or not coarse or n < 2:
        return None
    zero = [i for i, l in enumerate(sizes) if l == 0]
    share = -(-sum(sizes) // n)
    # parameters longer than two slices hold two cuts anywhere: S is a multiple of their unit
    forced = math.lcm(1, *(steps[i] for i in coarse if sizes[i] > 2 * share))
    share = -(-share // forced) * forced
    order: list[int] = []
    pos = 0
    r = 1

    def take_fine(room: int) -> None:
        """Largest-first fine parameters that fit in ``room`` (in place)."""
        nonlocal pos
        k = 0
        while k < len(fine) and room > 0:
            if sizes[fine[k]] <= room:
                i = fine.pop(k)
                order.append(i)
                pos += sizes[i]
                room -= sizes[i]
            else:
                k += 1

    while coarse:
        target = r * share
        if r >= n:
            order.extend(coarse)
            coarse.clear()
            break
        long = sizes[coarse[0]] > share  # long parameters go first: they hold cuts anyway
        fit = (
            None
            if long
            else next((k for k, i in enumerate(coarse) if pos + sizes[i] <= target), None)
        )
        if fit is not None:
            i = coarse.pop(fit)
            order.append(i)
            pos += sizes[i]
        else:
            gap = target - pos
            if not long and sum(sizes[i] for i in fine) > gap:
                take_fine(gap)
                if pos < target and fine:  # the smallest fine one straddles the target
                    i = fine.pop()
                    order.append(i)
                    pos += sizes[i]
            else:
                i = coarse.pop(0)
                shift = gap % steps[i]
                acc, chosen = 0, []  # fine parameters that cover the shift exactly
                for f in fine:
                    if acc + sizes[f] <= shift:
                        acc += sizes[f]
                        chosen.append(f)
                if acc == shift:
                    for f in chosen:
                        fine.remove(f)
                        order.append(f)
                        pos += sizes[f]
                order.append(i)
                pos += sizes[i]
        while r < n and r * share <= pos:
            r += 1
    order.extend(fine)
    order.extend(zero)
    return order


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
            layout = _layout_even(p_sizes, p_steps, n) if k == 0 else None
            if layout is None:
                layout = _layout_even_cuts(p_sizes, p_steps, n)
            key = _even_key(*layout, p_sizes, p_steps, n)
            if best is None or key < best[0]:
                best = (key, perm, *layout)
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
                best = (key, perm, *layout)
        _, perm, p_offsets, ranges = best
        # slots in buffer order: the chosen order (empty parameters keep their place)
        specs = [specs[i] for i in perm]
        sizes = [sizes[i] for i in perm]
        rules = [rules[i] for i in perm]
        offsets = p_offsets
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


# ---------------------------------------------------------------------- even layout
class _Grid:
    """Cut points of a buffer's data, without padding (data positions ``0..D``).

    The nonzero parameters tile ``[0, D)``. A *boundary* is a position where a cut may
    fall: a parameter's start or end, or a unit boundary inside it (a multiple of its
    step from its start). A *parameter boundary* is a start or an end.
    """

    def __init__(self, sizes: list[int], steps: list[int]) -> None:
        self.offsets: list[int] = []
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.steps: list[int] = []
        pos = 0
        for size, step in zip(sizes, steps):
            self.offsets.append(pos)
            if size > 0:
                self.starts.append(pos)
                self.ends.append(pos + size)
                self.steps.append(step)
            pos += size
        self.total = pos

    def _find(self, x: int) -> int:
        """Index of the nonzero parameter holding data position ``0 <= x < D``."""
        return bisect.bisect_right(self.starts, x) - 1

    def inside(self, x: int) -> int:
        """The parameter with ``start < x < end``, or ``-1``."""
        if x <= 0 or x >= self.total:
            return -1
        i = self._find(x)
        return i if self.starts[i] < x else -1

    def floor(self, x: int) -> int:
        """The largest boundary ``<= x``."""
        if x >= self.total:
            return self.total
        if x <= 0:
            return 0
        i = self._find(x)
        s, g = self.starts[i], self.steps[i]
        return s + (x - s) // g * g

    def ceil(self, x: int) -> int:
        """The smallest boundary ``>= x``."""
        if x <= 0:
            return 0
        if x >= self.total:
            return self.total
        i = self._find(x)
        s, g = self.starts[i], self.steps[i]
        return min(s - (s - x) // g * g, self.ends[i])

    def param_floor(self, x: int) -> int:
        """The largest parameter boundary ``<= x``."""
        return self.total if x >= self.total else self.starts[self._find(x)]

    # A slice ``[a, b]`` of the data is usable in a slice of length ``S`` iff ``a`` and
    # ``b`` are boundaries, ``b - a <= S`` and, when ``b - a < S``, a parameter boundary
    # lies in ``[a, b]`` (the slice's padding goes there; never inside a parameter).
    # So a slice that starts and ends strictly inside one parameter holds exactly ``S``.
    def forward(self, a: int, s: int) -> tuple[int, int] | None:
        """Boundaries ``b`` that may end a slice starting at ``a``: ``[lo, hi]``; ``None``: none."""
        reach = a + s
        i = self.inside(a)
        if i >= 0 and reach < self.ends[i]:
            if (reach - self.starts[i]) % self.steps[i]:
                return None
            return reach, reach
        return (self.ends[i] if i >= 0 else a), self.floor(reach)

    def backward(self, b: int, s: int) -> tuple[int, int] | None:
        """Boundaries ``a`` that may start a slice ending at ``b``: ``[lo, hi]``; ``None``: none."""
        reach = b - s
        i = self.inside(b)
        if i >= 0 and reach > self.starts[i]:
            if (reach - self.starts[i]) % self.steps[i]:
                return None
            return reach, reach
        return self.ceil(reach), (self.starts[i] if i >= 0 else b)

    def nearest(self, t: int, lo: int, hi: int) -> int:
        """The boundary in ``[lo, hi]`` (both boundaries) nearest ``t``."""
        x = min(max(t, lo), hi)
        f, c = self.floor(x), self.ceil(x)
        if f < lo:
            return c
        if c > hi:
            return f
        return f if x - f <= c - x else c


def _furthest(grid: _Grid, s: int, n: int) -> tuple[list[int] | None, int, int]:
    """Cuts placed as far right as the rules allow, with slices of ``s``.

    Returns ``(cuts, -1, 0)`` on success (``cuts[0] = 0``, ``cuts[n] = D``), else
    ``(None, i, 0)`` when the cuts ran into parameter ``i`` off its grid (it holds two
    cuts and ``s`` is not a multiple of its step), or ``(None, -1, short)`` when the
    last slice is ``short`` elements too long.
    """
    cuts = [0]
    prev = 0
    for _ in range(n - 1):
        allowed = grid.forward(prev, s)
        if allowed is None:
            return None, grid.inside(prev), 0
        prev = allowed[1]
        cuts.append(prev)
    if grid.total - prev > s:
        return None, -1, grid.total - prev - s
    cuts.append(grid.total)
    return cuts, -1, 0


def _balanced(grid: _Grid, s: int, n: int, bound: list[int], reverse: bool) -> list[int] | None:
    """Cuts nearest the even share of what is left, kept feasible by ``bound``.

    Forward (``reverse=False``): cut ``r`` is the allowed boundary nearest
    ``prev + (D - prev) / (n - r + 1)`` and at least ``bound[r]`` (the backward-furthest
    cut, from which the rest still fits). ``reverse=True`` mirrors it from the end (then
    ``bound`` holds the forward-furthest cuts, an upper bound).
    """
    d = grid.total
    if not reverse:
        cuts = [0]
        prev = 0
        for r in range(1, n):
            allowed = grid.forward(prev, s)
            if allowed is None:
                return None
            lo, hi = max(allowed[0], bound[r]), allowed[1]
            if lo > hi:
                return None
            prev = grid.nearest(prev + (d - prev) // (n - r + 1), lo, hi)
            cuts.append(prev)
        if d - prev > s:
            return None
        cuts.append(d)
        return cuts
    cuts = [d]
    nxt = d
    for r in range(n - 1, 0, -1):
        allowed = grid.backward(nxt, s)
        if allowed is None:
            return None
        lo, hi = allowed[0], min(allowed[1], bound[r])
        if lo > hi:
            return None
        nxt = grid.nearest(nxt - nxt // (r + 1), lo, hi)
        cuts.append(nxt)
    if nxt > s:
        return None
    cuts.append(0)
    cuts.reverse()
    return cuts


def _verified(grid: _Grid, s: int, n: int, furthest: list[int]) -> list[int] | None:
    """Forward balanced cuts, each checked to leave a suffix that still fits.

    For when the bound-driven passes fail (a parameter holds two cuts while ``s`` is
    not a multiple of its step, so the furthest-right rule is not monotone). A known
    feasible chain ``chain[r:]`` is kept (first the furthest-right cuts); a candidate
    cut is accepted when the furthest-right cuts from it rejoin that chain or reach
    the end. Candidates move from the target toward the chain's own cut, which is
    always accepted.
    """
    d = grid.total
    chain = list(furthest)

    def follow(r: int, c: int) -> list[int] | None:
        path = [c]
        for j in range(r + 1, n):
            if path[-1] == chain[j - 1] and j - 1 > r:
                return path[:-1] + chain[j - 1 :]
            allowed = grid.forward(path[-1], s)
            if allowed is None:
                return None
            path.append(allowed[1])
        if d - path[-1] > s:
            return None
        return path + [d]

    prev = 0
    for r in range(1, n):
        allowed = grid.forward(prev, s)
        if allowed is None:  # pragma: no cover - the chain's cut is always allowed
            return None
        lo, hi = allowed[0], min(allowed[1], chain[r]) if chain[r] >= allowed[0] else allowed[1]
        target = prev + (d - prev) // (n - r + 1)
        c = grid.nearest(target, lo, hi)
        for _ in range(24):
            if c == chain[r]:
                break
            path = follow(r, c)
            if path is not None:
                chain[r:] = path
                break
            c = grid.nearest((c + chain[r] + 1) // 2, min(c, chain[r]), max(c, chain[r]))
        else:
            c = chain[r]
        prev = c
    return chain


def _usable(grid: _Grid, cuts: list[int], s: int) -> bool:
    """Every slice ``[cuts[r], cuts[r + 1]]`` obeys the slice rules for length ``s``."""
    for a, b in itertools.pairwise(cuts):
        allowed = grid.forward(a, s)
        if allowed is None or not allowed[0] <= b <= allowed[1] or grid.floor(b) != b:
            return False
    return True


def _spread(cuts: list[int]) -> tuple[float, int]:
    loads = [b - a for a, b in itertools.pairwise(cuts)]
    lo, hi = min(loads), max(loads)
    return (math.inf if lo == 0 else hi / lo), hi - lo


def _slice_length(grid: _Grid, n: int) -> tuple[int, list[int]]:
    """The slice length ``S`` and the furthest-right cuts that fit it.

    ``S`` is searched upward from ``ceil(D / N)``; each failure of the furthest-right
    placement says how far to move: by the shortfall over ``N`` when the last slice is
    too long, to the next multiple of a parameter's step when that parameter must hold
    two cuts. The search stops at ``S1``, which always fits (see `_layout_even_cuts`).
    """
    d = grid.total
    g = max(grid.steps)
    s0 = -(-(d + (n - 1) * (g - 1)) // n)
    lcm = math.lcm(1, *(st for a, b, st in zip(grid.starts, grid.ends, grid.steps) if b - a > s0))
    s1 = -(-s0 // lcm) * lcm
    s = -(-d // n)
    for _ in range(512):
        if s >= s1:
            break
        cuts, i, short = _furthest(grid, s, n)
        if cuts is not None:
            return s, cuts
        if i >= 0:
            step = grid.steps[i]
            if grid.ends[i] - grid.starts[i] > 2 * (s + step):
                s = (s // step + 1) * step  # it holds two cuts at any offset
            else:
                s += max(1, step // n)
        else:
            s += max(1, short // n)
    cuts, _, _ = _furthest(grid, s1, n)
    if cuts is None:  # pragma: no cover - S1 always fits
        raise RuntimeError("flat-buffer planner: the guaranteed slice length did not fit")
    return s1, cuts


def _layout_even_cuts(
    sizes: list[int], steps: list[int], n: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets and rank ranges of the rank-padded layout (all slices of length ``S``).

    The plan is made on the data alone (positions ``0..D``, no padding): choose ``S``
    and cuts ``0 = c0 <= c1 <= ... <= cN = D`` at boundaries (see `_Grid`) with
    every slice ``[c_r, c_r+1]`` holding ``d_r <= S`` elements and, when ``d_r < S``, a
    parameter boundary where its ``S - d_r`` padding elements go. The buffer is then the
    data with that padding inserted: rank ``r``'s slice is ``[r * S, (r + 1) * S)`` and
    the padding is ``N * S - D``, set by ``S`` alone.

    ``S`` (`_slice_length`): let ``G`` be the largest step of the buffer,
    ``S0 = ceil((D + (N - 1) * (G - 1)) / N)``, ``L`` the lcm of the steps of the
    parameters longer than ``S0`` (1 if none) and ``S1`` the first multiple of ``L``
    ``>= S0``. With ``S1`` the furthest-right cuts always fit: every parameter that can
    hold two cuts has a step dividing ``S1`` (no dead end) and each cut loses less than
    ``G`` against ``r * S1``. So the padding is at most ``(N - 1) * G + N * (L - 1)``,
    i.e. ``(N - 1) * G`` when ``L = 1``; the search usually finds a smaller ``S``.

    Cuts for that ``S``: the forward and backward balanced placements
    (`_balanced`), the one with the better ``max / min`` load, else the
    furthest-right cuts.
    """
    grid = _Grid(sizes, steps)
    d = grid.total
    if d == 0:
        return [0] * len(sizes), [(0, 0)] * n
    s, furthest = _slice_length(grid, n)
    backward = [0] * (n + 1)
    backward[n] = d
    for r in range(n - 1, 0, -1):
        allowed = grid.backward(backward[r + 1], s)
        if allowed is None:
            break
        backward[r] = allowed[0]
    best = furthest
    for cand in (
        _balanced(grid, s, n, backward, reverse=False),
        _balanced(grid, s, n, furthest, reverse=True),
    ):
        if cand is not None and _usable(grid, cand, s) and _spread(cand) < _spread(best):
            best = cand
    if best is furthest:
        cand = _verified(grid, s, n, furthest)
        if cand is not None and _usable(grid, cand, s) and _spread(cand) < _spread(best):
            best = cand
    return _place(grid, best, s), [(r * s, (r + 1) * s) for r in range(n)]


def _place(grid: _Grid, cuts: list[int], s: int) -> list[int]:
    """Buffer offsets: slice ``r``'s padding goes at the last parameter boundary of it."""
    pads = []  # (data position, elements), in order
    for a, b in itertools.pairwise(cuts):
        if b - a < s:
            at = grid.param_floor(b)
            assert a <= at, "slice padding has no parameter boundary"
            pads.append((at, s - (b - a)))
    offsets = []
    k = 0
    shift = 0
    for off in grid.offsets:
        while k < len(pads) and pads[k][0] <= off:
            shift += pads[k][1]
            k += 1
        offsets.append(off + shift)
    return offsets


# The even layout is planned in terms of the *padding in front of* each parameter.
# Parameter ``i`` holds ``[x_i, x_i + l_i)`` of the unpadded data (``0..D``). With
# ``pi_i`` padding elements in front of it (non-decreasing in ``i``, at most
# ``P = N * S - D``) it starts at ``u_i = x_i + pi_i`` in the buffer, whose rank slices
# are ``[r * S, (r + 1) * S)``. The only constraint is local: every slice boundary
# strictly inside parameter ``i`` must fall on one of its unit boundaries,
# ``(k * S - u_i) % g_i == 0``. Whether a start is allowed depends on that start alone,
# so taking the least allowed padding in front of each parameter, in order, gives the
# least padding possible, and ``S`` fits iff that greedy ends with ``pi <= P``.


def _never_fits(l: int, g: int, s: int) -> bool:
    """True when no start works: every start puts two cuts in it, or one off its grid."""
    if s % g == 0 or l <= s:
        return False
    if l > 2 * s:
        return True
    # exactly one cut, at offset t from the start: t in [l - s, min(s, l - 1)], t % g == 0
    return min(s, l - 1) // g * g < l - s


def _next_start(u: int, l: int, g: int, s: int, limit: int) -> int | None:
    """The smallest allowed start ``>= u``; ``None`` if it is above ``limit``."""
    while u <= limit:
        c = (u // s + 1) * s  # first slice boundary after u
        if c >= u + l:
            return u
        r = (c - u) % g
        if r:
            u += r  # put the first cut on the grid (u stays <= c)
        elif c + s < u + l and s % g:
            u = c  # the second cut would be off the grid: start at the first one
        else:
            return u
    return None


def _prev_start(u: int, l: int, g: int, s: int, floor: int) -> int | None:
    """The largest allowed start ``<= u``; ``None`` if it is below ``floor``."""
    while u >= floor:
        c = (u // s + 1) * s
        if c >= u + l:
            return u
        r = (c - u) % g
        if r:
            # align the first cut, or let it leave through the end, whichever is nearer
            u = max(u - (g - r), c - l)
        elif c + s < u + l and s % g:
            u = c + s - l  # let the second cut leave through the end
        else:
            return u
    return None


class _Even:
    """Planner state of one buffer's even layout.

    *Tight* parameters (more than one element, a unit above one element) constrain
    their start; the others may start anywhere.
    """

    #: ``least_pads`` steps the exhaustive search for ``S`` may spend (~50 ms).
    SEARCH_BUDGET = 15_000

    def __init__(self, sizes: list[int], steps: list[int], n: int) -> None:
        self.n = n
        self.sizes = sizes
        self.steps = steps
        self.x: list[int] = []
        pos = 0
        for size in sizes:
            self.x.append(pos)
            pos += size
        self.d = pos
        self.tight = [i for i, (l, g) in enumerate(zip(sizes, steps)) if _is_tight(l, g)]
        self.tight_xlg = [(self.x[i], sizes[i], steps[i]) for i in self.tight]
        self.work = 0

    # ------------------------------------------------------------ slice length
    def least_pads(self, s: int) -> tuple[list[int] | None, int]:
        """Least padding in front of every tight parameter for slice length ``s``.

        Returns ``(pads, 0)``, or ``(None, excess)`` when ``s`` does not fit: ``excess``
        estimates the padding missing (used only to skip ahead once the exhaustive
        search is over budget).
        """
        p = self.n * s - self.d
        pi = 0
        out = []
        for x, l, g in self.tight_xlg:
            u = x + pi
            if (u // s + 1) * s < u + l:  # a cut falls inside: check it
                u = _next_start(u, l, g, s, x + p)
                if u is None:
                    self.work += len(out) + 1
                    return None, max(1, pi + g - p)
                pi = u - x
            out.append(pi)
        self.work += len(out)
        return out, 0

    def slice_length(self) -> tuple[int, list[int], bool]:
        """``(S, least pads, exact)``: the least ``S`` that fits, when ``exact``.

        ``S`` runs upward from ``ceil(D / N)`` over the multiples of ``F``, the lcm of
        the units of the parameters longer than ``2 * S1`` (they hold two cuts at any
        start, so ``S`` must be a multiple of their unit). ``S1`` (see
        `_layout_even_pads`) always fits, so the search ends there. Past
        `SEARCH_BUDGET` it skips ahead by the missing padding over ``N`` (then
        the ``S`` found may not be the least; ``exact`` is False).
        """
        n, d = self.n, self.d
        g = max([self.steps[i] for i in self.tight], default=1)
        s0 = -(-(d + (n - 1) * (g - 1)) // n)
        lcm = math.lcm(1, *(self.steps[i] for i in self.tight if self.sizes[i] > s0))
        s1 = -(-s0 // lcm) * lcm
        forced = math.lcm(1, *(self.steps[i] for i in self.tight if self.sizes[i] > 2 * s1))
        share = -(-d // n)
        s = -(-share // forced) * forced
        long = [i for i in self.tight if self.sizes[i] > s]
        exact = True
        while s < s1:
            if not any(_never_fits(self.sizes[i], self.steps[i], s) for i in long):
                pads, excess = self.least_pads(s)
                if pads is not None:
                    return s, pads, exact
                if self.work > self.SEARCH_BUDGET:
                    # skip ahead: at least the missing padding over N, at most ~32 more tries
                    exact = False
                    jump = max(-(-excess // n), (s1 - s) // 32)
                    s += max(1, -(-jump // forced)) * forced
                    continue
            s += forced
        pads, _ = self.least_pads(s1)
        if pads is None:  # pragma: no cover - S1 always fits
            raise RuntimeError("flat-buffer planner: the guaranteed slice length did not fit")
        return s1, pads, exact

    # ------------------------------------------------------------ spreading the padding
    def latest_pads(self, s: int, least: list[int]) -> list[int]:
        """The most padding in front of every tight parameter that lets the rest fit."""
        p = self.n * s - self.d
        out = [0] * len(self.tight)
        cap = p
        for j in range(len(self.tight) - 1, -1, -1):
            i = self.tight[j]
            x = self.x[i]
            u = _prev_start(x + cap, self.sizes[i], self.steps[i], s, x + least[j])
            assert u is not None, "the least pads are a feasible chain"
            cap = out[j] = u - x
        return out

    def follow(self, s: int, least: list[int], latest: list[int], target) -> list[int]:
        """Pads of every parameter, each as near ``target(i)`` as the constraints allow."""
        p = self.n * s - self.d
        out = [0] * len(self.sizes)
        pi = 0
        k = 0
        tight = self.tight
        for i in range(len(self.sizes)):
            t = target(i)
            if k < len(tight) and tight[k] == i:
                x, l, g = self.x[i], self.sizes[i], self.steps[i]
                hi = latest[k]
                lo = max(pi, least[k])
                a = _next_start(x + max(t, lo), l, g, s, x + hi)
                b = _prev_start(x + min(max(t, lo), hi), l, g, s, x + lo)
                cands = [v - x for v in (a, b) if v is not None]
                pi = min(cands, key=lambda v: abs(v - t))
                k += 1
            else:
                cap = latest[k] if k < len(tight) else p
                pi = min(max(t, pi), cap)
            out[i] = pi
        return out

    def spread(self, s: int, latest: list[int], q: int) -> list[int] | None:
        """Pads with at most ``q`` padding elements in any rank slice, or ``None``.

        Greedy: in front of each parameter as much padding as its slice's budget (and
        ``latest``, so the rest still fits) allows, so the slices fill in order.
        """
        p = self.n * s - self.d
        cur = [0, 0]  # [slice, padding in it]

        def room(y: int) -> int:
            r = y // s
            rem = q - (cur[1] if r == cur[0] else 0)
            to_end = (r + 1) * s - y
            if to_end > rem:
                return rem
            return p if q >= s else to_end + q

        def add(y: int, k: int) -> None:
            while k > 0:
                r = y // s
                take = min(k, (r + 1) * s - y)
                cur[1] = (cur[1] if r == cur[0] else 0) + take
                cur[0] = r
                y += take
                k -= take

        out = [0] * len(self.sizes)
        tight = self.tight
        pi = k = 0
        for i, x in enumerate(self.x):
            cap = latest[k] if k < len(tight) else p
            if k < len(tight) and tight[k] != i:
                # leave the next tight parameter room to align
                hi = min(cap, pi + max(0, room(x + pi) - self.steps[tight[k]] + 1))
            else:
                hi = min(cap, pi + room(x + pi))
            if k < len(tight) and tight[k] == i:
                u = _prev_start(x + hi, self.sizes[i], self.steps[i], s, x + pi)
                if u is None:
                    return None
                hi = u - x
                k += 1
            add(x + pi, hi - pi)
            out[i] = pi = hi
        if p - pi > room(self.d + pi):
            return None
        return out

    def offsets(self, pads: list[int]) -> list[int]:
        return [x + pi for x, pi in zip(self.x, pads)]

    def slice_padding(self, s: int, pads: list[int]) -> list[int]:
        """Padding elements in every rank slice."""
        return _slice_pads(self.offsets(pads), self.sizes, s, self.n)


def _layout_even_pads(
    sizes: list[int], steps: list[int], n: int
) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets and rank ranges of the rank-padded layout (all slices of length ``S``).

    ``S`` (`_Even.slice_length`) is the least slice length any even layout of
    these parameters, in this order, can have, so the padding ``N * S - D`` is the least
    possible (for very large buffers the exhaustive search may end early; then ``S``
    still satisfies the bound below). ``S <= S1``: with ``G`` the largest unit,
    ``S0 = ceil((D + (N - 1) * (G - 1)) / N)``, ``L`` the lcm of the units of the
    parameters longer than ``S0`` (1 if none), ``S1`` is the first multiple of ``L``
    ``>= S0``; at ``S1`` every parameter that can hold two cuts has a unit dividing
    ``S1`` and each needs less than ``G`` padding in front, so the padding is at most
    ``(N - 1) * G + N * (L - 1)``, i.e. ``(N - 1) * G`` when ``L = 1``.

    The padding is then spread over the slices (rank loads are ``S`` minus the slice's
    padding): the cumulative padding follows a straight line over the buffer (slices
    inside a parameter longer than ``S`` take none, so one line skips them), and when
    that leaves a slice well above its share, a greedy fill is bisected on the largest
    slice padding; the layout with the least largest slice padding wins.
    """
    plan = _Even(sizes, steps, n)
    d = plan.d
    if d == 0:
        return [0] * len(sizes), [(0, 0)] * n
    s, least, _ = plan.slice_length()
    latest = plan.latest_pads(s, least)
    p = n * s - d
    # measure of the data that can take padding: the inside of long tight parameters
    # (slices there hold exactly S) is skipped
    skip = []
    for i in plan.tight:
        if sizes[i] > s:
            skip.append((plan.x[i] + s // 2, plan.x[i] + sizes[i] - s // 2))
    cum = [0]
    for a, b in skip:
        cum.append(cum[-1] + b - a)
    measure = d - cum[-1]

    def absorb(x: int) -> int:
        j = bisect.bisect_right(skip, (x, math.inf))
        return x - (cum[j - 1] + min(x, skip[j - 1][1]) - skip[j - 1][0] if j else 0)

    def line(i: int) -> int:
        return p * absorb(plan.x[i]) // max(measure, 1)

    def uniform(i: int) -> int:
        return p * plan.x[i] // d

    best, worst = None, math.inf
    for target in (line, uniform):
        pads = plan.follow(s, least, latest, target)
        cand = max(plan.slice_padding(s, pads))
        if cand < worst:
            best, worst = pads, cand
    # when the line leaves a slice well above its share, bisect the largest slice
    # padding the greedy fill reaches (~log2(S) passes)
    lo = -(-p // n)
    if worst > lo and (worst >= s or (s - lo) / (s - worst) > 1.0001):
        hi = worst - 1
        while lo <= hi:
            q = (lo + hi) // 2
            pads = plan.spread(s, latest, q)
            if pads is None:
                lo = q + 1
                continue
            cand = max(plan.slice_padding(s, pads))
            if cand < worst:
                best, worst = pads, cand
            hi = min(q, cand) - 1
    return plan.offsets(best), [(r * s, (r + 1) * s) for r in range(n)]


def _slice_pads(offsets: list[int], sizes: list[int], s: int, n: int) -> list[int]:
    """Padding elements in every rank slice of an even layout with slices of ``s``."""
    pads = [s] * n
    for off, size in zip(offsets, sizes):
        a, b = off, off + size
        while a < b:
            r = a // s
            e = min(b, (r + 1) * s)
            pads[r] -= e - a
            a = e
    return pads


def _slice_spread(offsets: list[int], sizes: list[int], s: int, n: int) -> float:
    """``max / min`` of the rank loads of an even layout (``inf`` if a rank holds nothing)."""
    pads = _slice_pads(offsets, sizes, s, n)
    lo = s - max(pads)
    return math.inf if lo == 0 else (s - min(pads)) / lo


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
    cuts = _layout_even_cuts(sizes, steps, n)
    key = _even_key(*cuts, sizes, steps, n)
    if not key[0] and key[1] <= 1.001:
        return cuts
    pads = _layout_even_pads(sizes, steps, n)
    return pads if _even_key(*pads, sizes, steps, n) < key else cuts


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
