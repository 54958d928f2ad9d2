"""Padding placement: the even layout planned as the padding in front of each parameter.

Finds the least slice length any even layout of the parameters in their order has,
then spreads the padding over the rank slices. See `vescale.ragged._planner`.
"""

from __future__ import annotations

import bisect
import math


def _is_tight(size: int, step: int) -> bool:
    """Whether a parameter constrains where a cut may fall (more than one element and a
    unit above one element); the others ("fine") may be cut anywhere."""
    return size > 1 and step > 1


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


def _fit_threshold(l: int, g: int) -> int:
    """From which slice length on a parameter of ``l`` elements and unit ``g`` always fits.

    Below it, `_never_fits` is true exactly for the lengths that are not multiples of
    ``g``. At ``s >= l`` it holds no cut; at ``l / 2 <= s < l`` one cut, at an offset
    in ``[l - s, s]`` that must be a multiple ``k * g`` (``k >= 1``), which first exists
    at ``s = max(k * g, l - k * g)``, least near ``k = l / (2 * g)``, and then for every
    larger ``s`` (the interval only grows).
    """
    k = max(1, l // (2 * g))
    return min(l, max(k * g, l - k * g), max((k + 1) * g, l - (k + 1) * g))


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
        # a long parameter takes every s from its threshold on, below it only multiples
        # of its unit: the lengths it can never take are skipped (`_never_fits`)
        th = sorted((_fit_threshold(self.sizes[i], self.steps[i]), self.steps[i]) for i in long)
        ts = [t for t, _ in th]
        lcms = [forced] * (len(th) + 1)  # lcms[k]: forced and the units of th[k:]
        for k in range(len(th) - 1, -1, -1):
            lcms[k] = math.lcm(lcms[k + 1], th[k][1])
        while s < s1:
            k = bisect.bisect_right(ts, s)
            c = -(-s // lcms[k]) * lcms[k]
            if k < len(ts) and c >= ts[k]:
                s = max(s, -(-ts[k] // forced) * forced)
                continue
            if c > s:
                s = c
                continue
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
        n_tight = len(tight)
        xs, sizes, steps = self.x, self.sizes, self.steps
        for i in range(len(sizes)):
            t = target(i)
            if k < n_tight and tight[k] == i:
                x = xs[i]
                hi = latest[k]
                lo = max(pi, least[k])
                a = _next_start(x + max(t, lo), sizes[i], steps[i], s, x + hi)
                b = _prev_start(x + min(max(t, lo), hi), sizes[i], steps[i], s, x + lo)
                # the one nearer t (the later start on a tie)
                if b is None or (a is not None and abs(a - x - t) <= abs(b - x - t)):
                    pi = a - x  # type: ignore[operator]
                else:
                    pi = b - x
                k += 1
            else:
                cap = latest[k] if k < n_tight else p
                pi = min(max(t, pi), cap)
            out[i] = pi
        return out

    def spread(self, s: int, latest: list[int], q: int) -> list[int] | None:
        """Pads with at most ``q`` padding elements in any rank slice, or ``None``.

        Greedy: in front of each parameter as much padding as its slice's budget (and
        ``latest``, so the rest still fits) allows, so the slices fill in order.
        """
        p = self.n * s - self.d
        steps, sizes, tight = self.steps, self.sizes, self.tight
        n_tight = len(tight)
        cr = cp = 0  # the slice padding was last added to, and its padding so far
        out = [0] * len(sizes)
        pi = k = 0
        for i, x in enumerate(self.x):
            # room: padding that may go in front of this parameter
            y = x + pi
            r = y // s
            rem = q - (cp if r == cr else 0)
            to_end = (r + 1) * s - y
            room = rem if to_end > rem else (p if q >= s else to_end + q)
            if k < n_tight:
                if tight[k] != i:
                    # leave the next tight parameter room to align
                    hi = min(latest[k], pi + max(0, room - steps[tight[k]] + 1))
                else:
                    hi = min(latest[k], pi + room)
                    u = _prev_start(x + hi, sizes[i], steps[i], s, x + pi)
                    if u is None:
                        return None
                    hi = u - x
                    k += 1
            else:
                hi = min(p, pi + room)
            add = hi - pi
            if add > 0:  # the padding fills slice r, then the slices after it
                if add <= to_end:
                    cp = (cp if r == cr else 0) + add
                    cr = r
                else:
                    cr = (y + add - 1) // s
                    cp = y + add - cr * s
            out[i] = pi = hi
        y = self.d + pi
        r = y // s
        rem = q - (cp if r == cr else 0)
        to_end = (r + 1) * s - y
        room = rem if to_end > rem else (p if q >= s else to_end + q)
        if p - pi > room:
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
        r = a // s
        if b <= (r + 1) * s:  # within one slice (most parameters)
            if size:
                pads[r] -= size
            continue
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
