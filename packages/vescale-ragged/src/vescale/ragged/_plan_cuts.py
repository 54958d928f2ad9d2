"""Cut placement: the even layout planned as cuts in the unpadded data (fast planner).

See `vescale.ragged._planner` for the layout rules and `_layout_even_cuts` for the
slice-length bound.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from bisect import bisect_right


class _Grid:
    """Cut points of a buffer's data, without padding (data positions ``0..D``).

    The nonzero parameters tile ``[0, D)``. A *boundary* is a position where a cut may
    fall: a parameter's start or end, or a unit boundary inside it (a multiple of its
    step from its start). A *parameter boundary* is a start or an end.
    """

    def __init__(self, sizes: list[int], steps: list[int]) -> None:
        self.offsets: list[int] = [0, *itertools.accumulate(sizes)]
        self.total = self.offsets.pop()
        nonzero = [(a, size, g) for a, size, g in zip(self.offsets, sizes, steps) if size > 0]
        self.starts: list[int] = [a for a, _, _ in nonzero]
        self.ends: list[int] = [a + size for a, size, _ in nonzero]
        self.steps: list[int] = [g for _, _, g in nonzero]

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
    # The methods below inline `inside`, `floor` and `ceil` (one bisection each): the
    # planner calls them about ten times per rank per candidate order.
    def forward(self, a: int, s: int) -> tuple[int, int] | None:
        """Boundaries ``b`` that may end a slice starting at ``a``: ``[lo, hi]``; ``None``: none."""
        reach = a + s
        starts, total = self.starts, self.total
        lo = a
        if 0 < a < total:
            i = bisect_right(starts, a) - 1
            st = starts[i]
            if st < a:  # inside parameter i: the slice leaves it, or holds exactly s
                e = self.ends[i]
                if reach < e:
                    return None if (reach - st) % self.steps[i] else (reach, reach)
                lo = e
        if reach >= total:
            return lo, total
        if reach <= 0:
            return lo, 0
        j = bisect_right(starts, reach) - 1
        st = starts[j]
        g = self.steps[j]
        return lo, st + (reach - st) // g * g

    def backward(self, b: int, s: int) -> tuple[int, int] | None:
        """Boundaries ``a`` that may start a slice ending at ``b``: ``[lo, hi]``; ``None``: none."""
        reach = b - s
        starts, total = self.starts, self.total
        hi = b
        if 0 < b < total:
            i = bisect_right(starts, b) - 1
            st = starts[i]
            if st < b:  # inside parameter i
                if reach > st:
                    return None if (reach - st) % self.steps[i] else (reach, reach)
                hi = st
        if reach <= 0:
            return 0, hi
        if reach >= total:
            return total, hi
        j = bisect_right(starts, reach) - 1
        st = starts[j]
        g = self.steps[j]
        return min(st - (st - reach) // g * g, self.ends[j]), hi

    def nearest(self, t: int, lo: int, hi: int) -> int:
        """The boundary in ``[lo, hi]`` (both boundaries) nearest ``t``."""
        x = lo if t < lo else (hi if t > hi else t)
        total = self.total
        if x >= total:
            f = c = total
        elif x <= 0:
            f = c = 0
        else:
            i = bisect_right(self.starts, x) - 1
            st = self.starts[i]
            g = self.steps[i]
            f = st + (x - st) // g * g
            c = min(st - (st - x) // g * g, self.ends[i])
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
    # `_Grid.forward` inlined (its upper end only)
    d = grid.total
    starts, ends, steps = grid.starts, grid.ends, grid.steps
    cuts = [0]
    prev = 0
    for r in range(1, n):
        reach = prev + s
        if reach >= d:  # this cut and all the rest at the end
            prev = d
            cuts += [d] * (n - r)
            break
        if prev > 0:
            i = bisect_right(starts, prev) - 1
            st = starts[i]
            if st < prev and reach < ends[i]:  # the slice holds exactly s
                if (reach - st) % steps[i]:
                    return None, i, 0
                prev = reach
                cuts.append(prev)
                continue
        j = bisect_right(starts, reach) - 1
        st = starts[j]
        prev = st + (reach - st) // steps[j] * steps[j]
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
    # `_Grid.forward` / `backward` and `_Grid.nearest` inlined (the loop runs once per
    # rank per candidate order)
    d = grid.total
    starts, ends, steps = grid.starts, grid.ends, grid.steps
    if not reverse:
        cuts = [0]
        prev = 0
        for r in range(1, n):
            reach = prev + s
            lo = prev
            if 0 < prev < d:
                i = bisect_right(starts, prev) - 1
                st = starts[i]
                if st < prev:  # inside parameter i
                    e = ends[i]
                    if reach < e:  # the slice holds exactly s: one allowed end
                        if (reach - st) % steps[i] or bound[r] > reach:
                            return None
                        prev = reach
                        cuts.append(prev)
                        continue
                    lo = e
            if reach >= d:
                hi = d
            else:
                j = bisect_right(starts, reach) - 1
                st = starts[j]
                hi = st + (reach - st) // steps[j] * steps[j]
            if bound[r] > lo:
                lo = bound[r]
            if lo > hi:
                return None
            prev = _nearest(starts, ends, steps, d, prev + (d - prev) // (n - r + 1), lo, hi)
            cuts.append(prev)
        if d - prev > s:
            return None
        cuts.append(d)
        return cuts
    cuts = [d]
    nxt = d
    for r in range(n - 1, 0, -1):
        reach = nxt - s
        hi = nxt
        if 0 < nxt < d:
            i = bisect_right(starts, nxt) - 1
            st = starts[i]
            if st < nxt:  # inside parameter i
                if reach > st:  # the slice holds exactly s: one allowed start
                    if (reach - st) % steps[i] or reach > bound[r]:
                        return None
                    nxt = reach
                    cuts.append(nxt)
                    continue
                hi = st
        if reach <= 0:
            lo = 0
        else:
            j = bisect_right(starts, reach) - 1
            st = starts[j]
            lo = min(st - (st - reach) // steps[j] * steps[j], ends[j])
        if bound[r] < hi:
            hi = bound[r]
        if lo > hi:
            return None
        nxt = _nearest(starts, ends, steps, d, nxt - nxt // (r + 1), lo, hi)
        cuts.append(nxt)
    if nxt > s:
        return None
    cuts.append(0)
    cuts.reverse()
    return cuts


def _nearest(
    starts: list[int], ends: list[int], steps: list[int], d: int, t: int, lo: int, hi: int
) -> int:
    """`_Grid.nearest` on the grid's lists (``lo``, ``hi``: boundaries, ``lo <= hi``)."""
    if t <= lo:
        return lo
    if t >= hi:
        return hi
    i = bisect_right(starts, t) - 1
    st = starts[i]
    g = steps[i]
    f = st + (t - st) // g * g
    c = st - (st - t) // g * g
    if c > ends[i]:
        c = ends[i]
    if f < lo:
        return c
    if c > hi:
        return f
    return f if t - f <= c - t else c


def _verified(grid: _Grid, s: int, n: int, furthest: list[int]) -> list[int] | None:
    """Forward balanced cuts, each checked to leave a suffix that still fits.

    For when the bound-driven passes fail (a parameter holds two cuts while ``s`` is
    not a multiple of its step, so the furthest-right rule is not monotone). A known
    feasible chain ``chain[r:]`` is kept (first the furthest-right cuts); a candidate
    cut ``c`` for cut ``r`` is accepted when the furthest-right cuts from it reach the
    end, i.e. when it needs at most ``n - 1 - r`` furthest-right steps to come within
    ``s`` of the end (`_Hops`); the chain from ``r`` on is then the furthest-right cuts
    from ``c``. Candidates move from the target toward the chain's own cut, which is
    always accepted.

    Every ``chain[j]`` past the last accepted cut is the furthest-right step from
    ``chain[j - 1]``, so the chain is kept as its current cut only, and the hop counts
    are memoised per position: the work is the number of distinct positions visited,
    not ranks x candidates x ranks.
    """
    d = grid.total
    starts, ends, steps = grid.starts, grid.ends, grid.steps
    hops = _Hops(grid, s)
    known = hops.hops
    cuts = [0]
    cur = furthest[1] if n > 1 else d  # chain[r], the furthest-right step from prev
    prev = 0
    for r in range(1, n):
        # the allowed ends of the slice from prev are [lo, cur] (`_Grid.forward`)
        lo = prev
        if 0 < prev < d:
            i = bisect_right(starts, prev) - 1
            if starts[i] < prev:  # inside parameter i: the slice leaves it or ends at cur
                lo = min(ends[i], cur)
        left = n - 1 - r
        c = _nearest(starts, ends, steps, d, prev + (d - prev) // (n - r + 1), lo, cur)
        for _ in range(24):
            if c == cur:
                break
            h = known.get(c)
            if (hops.count(c) if h is None else h) <= left:
                break
            c = _nearest(starts, ends, steps, d, (c + cur + 1) // 2, min(c, cur), max(c, cur))
        else:
            c = cur
        cuts.append(c)
        prev = c
        cur = hops.step(c) if r + 1 < n else d
    cuts.append(d)
    return cuts


class _Hops:
    """Furthest-right steps from a position, memoised: ``step(x)`` is where the slice
    starting at ``x`` ends when it goes as far right as the rules allow (``None``: no
    boundary may end it), ``count(x)`` how many such steps bring ``x`` within ``s`` of
    the end (a large number when never)."""

    NEVER = 1 << 62

    def __init__(self, grid: _Grid, s: int) -> None:
        self.grid = grid
        self.s = s
        self.next: dict[int, int | None] = {}
        self.hops: dict[int, int] = {}

    def step(self, x: int) -> int | None:
        y = self.next.get(x, -1)
        if y == -1:  # `_Grid.forward`, its upper end only
            grid = self.grid
            reach = x + self.s
            if reach >= grid.total:
                y = grid.total
            else:
                starts, steps = grid.starts, grid.steps
                i = bisect_right(starts, x) - 1 if x > 0 else -1
                if i >= 0 and starts[i] < x and reach < grid.ends[i]:  # holds exactly s
                    y = None if (reach - starts[i]) % steps[i] else reach
                else:
                    j = bisect_right(starts, reach) - 1
                    y = starts[j] + (reach - starts[j]) // steps[j] * steps[j]
            self.next[x] = y
        return y

    def count(self, x: int) -> int:
        hops, d, s = self.hops, self.grid.total, self.s
        path = []
        while x not in hops:
            if d - x <= s:
                hops[x] = 0
                break
            y = self.step(x)
            if y is None or y <= x:  # a dead end, or a slice that cannot move on
                hops[x] = self.NEVER
                break
            path.append(x)
            x = y
        v = hops[x]
        for p in reversed(path):
            v = v + 1 if v < self.NEVER else v
            hops[p] = v
        return v


def _usable(grid: _Grid, cuts: list[int], s: int) -> bool:
    """Every slice ``[cuts[r], cuts[r + 1]]`` obeys the slice rules for length ``s``."""
    for a, b in itertools.pairwise(cuts):
        allowed = grid.forward(a, s)
        if allowed is None or not allowed[0] <= b <= allowed[1] or grid.floor(b) != b:
            return False
    return True


def _spread(cuts: list[int]) -> tuple[float, int]:
    """``(max / min, max - min)`` of the slice loads ``cuts[r + 1] - cuts[r]``."""
    loads = list(map(operator.sub, cuts[1:], cuts))
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
    grid, s, cuts = _even_cuts(sizes, steps, n)
    if grid.total == 0:
        return [0] * len(sizes), [(0, 0)] * n
    return _place(grid, cuts, s), [(r * s, (r + 1) * s) for r in range(n)]


def _even_cuts(sizes: list[int], steps: list[int], n: int) -> tuple[_Grid, int, list[int]]:
    """``(grid, S, cuts)`` of `_layout_even_cuts` before the padding is placed.

    Every cut comes from the allowed range of the slice before it (`_Grid.forward`,
    mirrored by `_Grid.backward`), so the three placements give usable slices by
    construction (the tests check them with `_usable`).
    """
    grid = _Grid(sizes, steps)
    d = grid.total
    if d == 0:
        return grid, 0, [0] * (n + 1)
    s, furthest = _slice_length(grid, n)
    # the backward-furthest cuts (`_Grid.backward` inlined, its lower end only); they stay
    # 0 from where they reach the start or run into a dead end
    starts, ends, steps = grid.starts, grid.ends, grid.steps
    backward = [0] * (n + 1)
    backward[n] = b = d
    for r in range(n - 1, 0, -1):
        reach = b - s
        if reach <= 0:
            break
        if b < d:
            i = bisect_right(starts, b) - 1
            st = starts[i]
            if st < b and reach > st:  # the slice holds exactly s
                if (reach - st) % steps[i]:
                    break
                backward[r] = b = reach
                continue
        j = bisect_right(starts, reach) - 1
        st = starts[j]
        backward[r] = b = min(st - (st - reach) // steps[j] * steps[j], ends[j])
    best, best_spread = furthest, _spread(furthest)
    for cand in (
        _balanced(grid, s, n, backward, reverse=False),
        _balanced(grid, s, n, furthest, reverse=True),
    ):
        if cand is not None:
            spread = _spread(cand)
            if spread < best_spread:
                best, best_spread = cand, spread
    if best is furthest:
        cand = _verified(grid, s, n, furthest)
        if cand is not None and _spread(cand) < best_spread:
            best = cand
    return grid, s, best


def _cuts_key(grid: _Grid, s: int, cuts: list[int], n: int) -> tuple[bool, float, int]:
    """`vescale.ragged._planner._even_key` of the layout the cuts give, without placing it:
    rank ``r`` holds ``cuts[r + 1] - cuts[r]`` elements."""
    if s == 0:
        return (False, 1.0, 0)
    g = max((st for st, a, b in zip(grid.steps, grid.starts, grid.ends) if b - a > 1), default=1)
    over = n * s - grid.total > (n - 1) * g
    return (over, _spread(cuts)[0], s)


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
