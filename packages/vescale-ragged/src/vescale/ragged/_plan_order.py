"""Order search of the flat-buffer planner (``order="auto"``): the orders it tries.

See `vescale.ragged._planner` for the layout rules.
"""

from __future__ import annotations

import bisect
import math

from vescale.ragged._plan_pads import _is_tight


def _candidate_orders(sizes: list[int], steps: list[int], n: int) -> list[list[int]]:
    """Orders tried by ``order="auto"`` (the given one first).

    The bridged order (`_bridged_order`, a fine parameter across every cut);
    coarse units first, by unit then size (one-element-unit parameters first or last),
    and by size alone: parameters of one unit then sit on that unit's grid from the
    buffer start, so fewer of them need padding to hold a cut. Orders that give the same
    sequence of (size, unit) (so the same layout) are tried once.
    """
    idx = range(len(sizes))
    unit = [g if _is_tight(l, g) else 1 for l, g in zip(sizes, steps)]
    pairs = list(zip(sizes, steps))

    cands = [list(idx), _bridged_order(sizes, steps, n)]
    cands.append(sorted(idx, key=lambda i: (unit[i] == 1, -unit[i], -sizes[i], i)))
    cands.append(sorted(idx, key=lambda i: (-sizes[i], i)))
    cands.append(sorted(idx, key=lambda i: (unit[i] != 1, -unit[i], -sizes[i], i)))
    # the layout depends only on the sequence of (size, unit): plan each sequence once
    out, seen = [], set()
    for perm in cands:
        if perm is None:
            continue
        key = tuple(map(pairs.__getitem__, perm))
        if key not in seen:
            seen.add(key)
            out.append(perm)
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
    fine_left = sum(sizes[i] for i in fine)  # elements of the fine parameters not placed
    # negated sizes, parallel to fine / coarse (ascending): the first one that fits a gap
    # is a bisection away
    fine_neg = [-sizes[i] for i in fine]
    coarse_neg = [-sizes[i] for i in coarse]

    def take_fine(room: int) -> None:
        """Largest-first fine parameters that fit in ``room`` (in place)."""
        nonlocal pos, fine_left
        k = 0
        while room > 0:
            k = bisect.bisect_left(fine_neg, -room, k)  # the next one that fits
            if k == len(fine):
                break
            i = fine.pop(k)
            fine_neg.pop(k)
            order.append(i)
            pos += sizes[i]
            fine_left -= sizes[i]
            room -= sizes[i]

    while coarse:
        target = r * share
        if r >= n:
            order.extend(coarse)
            coarse.clear()
            break
        long = sizes[coarse[0]] > share  # long parameters go first: they hold cuts anyway
        fit = None if long else bisect.bisect_left(coarse_neg, pos - target)
        if fit is not None and fit < len(coarse):  # the largest that fits before the target
            i = coarse.pop(fit)
            coarse_neg.pop(fit)
            order.append(i)
            pos += sizes[i]
        else:
            gap = target - pos
            if not long and fine_left > gap:
                take_fine(gap)
                if pos < target and fine:  # the smallest fine one straddles the target
                    i = fine.pop()
                    fine_neg.pop()
                    order.append(i)
                    pos += sizes[i]
                    fine_left -= sizes[i]
            else:
                i = coarse.pop(0)
                coarse_neg.pop(0)
                shift = gap % steps[i]
                acc, chosen = 0, []  # fine parameters that cover the shift exactly
                for f in fine:
                    if acc + sizes[f] <= shift:
                        acc += sizes[f]
                        chosen.append(f)
                if acc == shift:
                    for f in chosen:
                        del fine_neg[fine.index(f)]
                        fine.remove(f)
                        order.append(f)
                        pos += sizes[f]
                        fine_left -= sizes[f]
                order.append(i)
                pos += sizes[i]
        while r < n and r * share <= pos:
            r += 1
    order.extend(fine)
    order.extend(zero)
    return order
