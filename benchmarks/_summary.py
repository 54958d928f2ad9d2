"""One machine-readable summary row per comparison, gathered by ``run_all.py``.

Every benchmark prints its own table for people, and for each comparison it makes
also one ``SUMMARY {json}`` line through :func:`emit`. ``run_all.py`` collects those
lines from all benchmarks into the one table at the top of ``docs/benchmarks.md``
(and strips them from the per-benchmark sections).
"""

from __future__ import annotations

import json
import math
from typing import Any

PREFIX = "SUMMARY "

#: Columns of the summary table: key -> header.
COLUMNS = {
    "bench": "benchmark",
    "case": "case",
    "metric": "measured",
    "vescale": "vescale",
    "baseline": "PyTorch baseline",
    "ratio": "ratio",
    "comm": "bytes sent / lower bound",
    "copied": "bytes copied",
    "memory": "memory / rank",
    "target": "target",
}


def emit(
    bench: str,
    case: str,
    metric: str,
    vescale: float | str,
    baseline: float | str | None = None,
    *,
    ratio: float | None = None,
    unit: str = "",
    comm: str = "",
    copied: str = "",
    memory: str = "",
    target: str = "",
) -> None:
    """Print one summary row (``ratio`` defaults to ``vescale / baseline``)."""
    if ratio is None and isinstance(vescale, (int, float)) and isinstance(baseline, (int, float)):
        ratio = vescale / baseline if baseline else math.nan
    row: dict[str, Any] = {
        "bench": bench,
        "case": case,
        "metric": metric,
        "vescale": _fmt(vescale, unit),
        "baseline": "—" if baseline is None else _fmt(baseline, unit),
        "ratio": "—" if ratio is None else f"{ratio:.2f}",
        "comm": comm or "—",
        "copied": copied or "—",
        "memory": memory or "—",
        "target": target or "—",
    }
    print(PREFIX + json.dumps(row), flush=True)


def _fmt(v: float | str, unit: str) -> str:
    if isinstance(v, str):
        return v
    if abs(v) >= 100:
        s = f"{v:,.0f}"
    elif abs(v) >= 1:
        s = f"{v:.2f}"
    else:
        s = f"{v:.3g}"
    return f"{s} {unit}".strip()


def human_bytes(n: float) -> str:
    """``12.3 MB`` style (decimal units, as disks and links are quoted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def parse(text: str) -> tuple[list[dict[str, str]], str]:
    """``(summary rows, text without the summary lines)`` of a benchmark's stdout."""
    rows, rest = [], []
    for line in text.splitlines():
        if line.startswith(PREFIX):
            try:
                rows.append(json.loads(line[len(PREFIX) :]))
                continue
            except json.JSONDecodeError:
                pass
        rest.append(line)
    return rows, "\n".join(rest)


def markdown_table(rows: list[dict[str, str]]) -> str:
    """The summary rows as one markdown table (cells' ``|`` escaped)."""
    keys = list(COLUMNS)
    out = [
        "| " + " | ".join(COLUMNS[k] for k in keys) + " |",
        "|" + "|".join("---" for _ in keys) + "|",
    ]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(k, "—")).replace("|", "\\|") for k in keys) + " |")
    return "\n".join(out)
