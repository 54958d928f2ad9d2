"""The conformance matrix (see ``_matrix.py``): engines x idioms vs single-device PyTorch.

Each engine's cells run in one call on the 4-rank pool (one mesh per engine, every
idiom in turn, each cell's failure recorded with its traceback); each cell is its own
test. ``VESCALE_CONFORMANCE_CELLWISE=1`` runs every cell in a call of its own instead
(slower; a cell that hangs then cannot take its engine's other cells with it).

``python tests/conformance/test_conformance.py`` prints the matrix as the Markdown
table in docs/conformance.md.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import time
import traceback

import pytest

from vescale.dtensor.testing import run_on_ranks

_spec = importlib.util.spec_from_file_location(
    "_conformance_matrix", pathlib.Path(__file__).with_name("_matrix.py")
)
M = sys.modules.setdefault("_conformance_matrix", importlib.util.module_from_spec(_spec))
if not hasattr(M, "ENGINES"):
    _spec.loader.exec_module(M)

CELLWISE = os.environ.get("VESCALE_CONFORMANCE_CELLWISE") == "1"


def cells_of(engine: str) -> list[str]:
    return [i for i in M.IDIOMS if M.not_applicable(M.ENGINES[engine], M.IDIOMS[i]) is None]


CELLS = [pytest.param(e, i, id=f"{e}-{i}") for e in M.ENGINES for i in cells_of(e)]


def _engine_cells(engine: str, idioms: list[str]) -> dict[str, tuple[str | None, float]]:
    """Runs on every rank: each idiom's outcome (``None`` or a traceback) and seconds."""
    M.MESHES.clear()
    out = {}
    for name in idioms:
        t0 = time.perf_counter()
        try:
            M.cell(engine, name)
            err = None
        except Exception:  # noqa: BLE001 (recorded, reported by the cell's test)
            err = traceback.format_exc()
        out[name] = (err, time.perf_counter() - t0)
    return out


_RESULTS: dict[str, list[dict]] = {}


def engine_results(engine: str) -> list[dict]:
    if engine not in _RESULTS:
        idioms = cells_of(engine)
        _RESULTS[engine] = run_on_ranks(
            _engine_cells, M.WORLD, engine, idioms, timeout=60 + 30 * len(idioms)
        )
    return _RESULTS[engine]


@pytest.mark.parametrize("engine,idiom", CELLS)
def test_cell(engine, idiom):
    if CELLWISE:
        run_on_ranks(_engine_cells_strict, M.WORLD, engine, idiom, timeout=120)
        return
    per_rank = engine_results(engine)
    failed = {r: res[idiom][0] for r, res in enumerate(per_rank) if res[idiom][0] is not None}
    if failed:
        r, tb = next(iter(failed.items()))
        pytest.fail(f"{engine} x {idiom} failed on ranks {sorted(failed)}; rank {r}:\n{tb}")


def _engine_cells_strict(engine: str, idiom: str) -> None:
    M.MESHES.clear()
    M.cell(engine, idiom)


def table(run: bool = True) -> str:
    """The Markdown table of docs/conformance.md.

    Args:
        run: Run every cell and mark failures; ``False`` prints the layout the test
            suite enforces (every runnable cell passes or raises its expected error).
    """
    engines = list(M.ENGINES)
    lines = [
        "| idiom | " + " | ".join(f"`{e}`" for e in engines) + " |",
        "| --- |" + " --- |" * len(engines),
    ]
    results = {e: engine_results(e) if run else None for e in engines}
    seconds = 0.0
    for name, idi in M.IDIOMS.items():
        row = []
        for e in engines:
            why = M.not_applicable(M.ENGINES[e], idi)
            if why is not None:
                row.append("n/a")
                continue
            res = [r[name] for r in results[e]] if run else [(None, 0.0)]
            seconds += max(t for _, t in res)
            if not all(err is None for err, _ in res):
                row.append("**FAILS**")
            elif (e, name) in M.EXPECTED_ERRORS:
                row.append(f"error: `{M.EXPECTED_ERRORS[(e, name)][0]}`")
            else:
                row.append("yes")
        lines.append(f"| {idi.doc} | " + " | ".join(row) + " |")
    lines.append("")
    timing = f"; compute time {seconds:.0f} s (slowest rank per cell)" if run else ""
    lines.append(f"Cells: {len(CELLS)}{timing}.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run="--no-run" not in sys.argv))
