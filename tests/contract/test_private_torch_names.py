"""torch internals are touched only in each package's ``_compat.py``.

Every private torch name a package relies on is probed there by feature, reported by its
``check_torch_internals()`` and given a fallback; this scans the code (not comments or
docstrings) of every package for private torch names used anywhere else.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for p in (ROOT / "packages").glob("*/src/**/*.py") if p.name != "_compat.py")
# DTensor's private attributes, torch's private modules and functions
PRIVATE = re.compile(
    r"\._local_tensor\b|\._spec\b|\._make_wrapper_subclass\b"
    r"|\b(?:torch|dist)(?:\.[A-Za-z]\w*)*\._(?!_)\w+"
    r"|^\s*from\s+torch\S*\s+import\s+(?:\(?\s*)(?:\w+(?:\s+as\s+\w+)?\s*,\s*)*_(?!_)\w+"
    r"|^\s*from\s+torch(?:\.\w+)*\._(?!_)\w+"
)


def _code_lines(path: Path) -> dict[int, str]:
    """Line number -> the line with its comments and string literals blanked."""
    src = path.read_text()
    lines = src.splitlines()
    blank: dict[int, list[tuple[int, int]]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                a = c0 if r == r0 else 0
                b = c1 if r == r1 else len(lines[r - 1])
                blank.setdefault(r, []).append((a, b))
    out = {}
    for i, line in enumerate(lines, 1):
        chars = list(line)
        for a, b in blank.get(i, []):
            chars[a:b] = " " * (b - a)
        out[i] = "".join(chars)
    return out


def test_the_scan_sees_every_package():
    assert {p.parts[len(ROOT.parts) + 1] for p in SOURCES} >= {
        "vescale-dtensor", "vescale-ragged", "vescale-dmodule", "vescale-optim",
        "vescale-checkpoint",
    }  # fmt: skip


def test_the_pattern_catches_private_names():
    for bad in (
        "x = t._local_tensor",
        "s = dt._spec.placements",
        "from torch.utils._pytree import tree_map",
        "from torch.distributed.tensor.placement_types import _StridedShard",
        "torch.distributed.distributed_c10d._get_default_group()",
        "r = torch.Tensor._make_wrapper_subclass(cls, size)",
        "w = dist.distributed_c10d._world",
        "    from torch.distributed.tensor import Shard, _StridedShard",
    ):
        assert PRIVATE.search(bad), bad
    for fine in (
        "from torch.distributed.tensor import DTensor",
        "from torch.distributed.tensor import distribute_tensor as _torch_distribute",
        "t.to_local()",
        "torch.__version__",
        "x.spec_",
    ):
        assert not PRIVATE.search(fine), fine


def test_no_private_torch_name_outside_compat_modules():
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in SOURCES
        for i, line in _code_lines(p).items()
        if PRIVATE.search(line)
    ]
    assert not found, "private torch names outside _compat.py:\n" + "\n".join(found)


# the packages built on vescale-dtensor, each with its own _compat.py
SIBLINGS = {
    "vescale-ragged": "vescale.ragged",
    "vescale-dmodule": "vescale.dmodule",
    "vescale-optim": "vescale.optim",
    "vescale-checkpoint": "vescale.checkpoint",
}


def test_every_compat_module_is_a_sibling_record():
    """One form for every package's _compat.py: its probes live in a record from
    ``vescale.dtensor.compat.sibling_internals`` (no second ``TorchInternals`` of its
    own), its public ``check_torch_internals()`` reports that record, and an internal it
    shares with vescale-dtensor carries vescale-dtensor's status."""
    import importlib

    from vescale.dtensor import check_torch_internals as dtensor_report

    compat_files = {p.parts[len(ROOT.parts) + 1] for p in ROOT.glob("packages/*/src/**/_compat.py")}
    assert compat_files == {"vescale-dtensor", *SIBLINGS}
    base = dtensor_report()
    for dist_name, module in SIBLINGS.items():
        compat = importlib.import_module(f"{module}._compat")
        code = "\n".join(_code_lines(Path(compat.__file__)).values())
        assert "sibling_internals(" in code, (
            f"{dist_name}: _compat.py does not use sibling_internals"
        )
        assert "TorchInternals(" not in code, (
            f"{dist_name}: _compat.py builds its own TorchInternals"
        )
        report = importlib.import_module(module).check_torch_internals()
        assert report == compat._INTERNALS.report(), dist_name
        shared = set(report) & set(base)
        assert {n: report[n] for n in shared} == {n: base[n] for n in shared}, dist_name
