"""Outcome records for one multi-rank run and the failure message built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RankOutcome", "failure_message"]

_MAX_OUTPUT_CHARS = 6000


@dataclass
class RankOutcome:
    """What one rank reported for one run.

    Attributes:
        rank: Global rank.
        ok: ``True`` when the body returned and the closing barrier passed.
        value: The body's return value (only when ``ok``).
        error: Formatted traceback or a reason (hang, dead process) when not ``ok``.
        finished: ``False`` when the rank did not report before the deadline.
        output: Output the rank wrote while running (attached to failures only).
    """

    rank: int
    ok: bool = False
    value: Any = None
    error: str = ""
    finished: bool = True
    output: str = field(default="", repr=False)


def failure_message(name: str, world_size: int, timeout: float, outcomes: list[RankOutcome]) -> str:
    """Build the assertion message for a failed run.

    Args:
        name: Function name shown in the header.
        world_size: Number of ranks.
        timeout: Timeout of the run in seconds.
        outcomes: One outcome per rank.

    Returns:
        A message naming every failing or unfinished rank with its traceback.
    """
    failed = [o for o in outcomes if o.finished and not o.ok]
    hung = [o for o in outcomes if not o.finished]
    parts = [f"{name} failed on {world_size} rank(s)"]
    if failed:
        parts[0] += f"; raised on rank(s) {[o.rank for o in failed]}"
    if hung:
        parts[0] += (
            f"; did not finish within the timeout ({timeout:g} s or shortly after another rank failed): rank(s) {[o.rank for o in hung]}"
        )
    for o in sorted(failed + hung, key=lambda o: o.rank):
        header = f"----- rank {o.rank} " + ("raised" if o.finished else "did not finish") + " -----"
        parts.append(header)
        parts.append(o.error.rstrip() or "(no traceback)")
        if o.output.strip():
            text = o.output
            if len(text) > _MAX_OUTPUT_CHARS:
                text = "...\n" + text[-_MAX_OUTPUT_CHARS:]
            parts.append(f"----- rank {o.rank} output -----")
            parts.append(text.rstrip())
    return "\n".join(parts)
