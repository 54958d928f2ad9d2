"""Weighted layout: unpadded rank slices proportional to per-rank weights.

See `vescale.ragged._planner`.
"""

from __future__ import annotations

import bisect


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
