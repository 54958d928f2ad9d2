"""Each package declares exactly what its source imports, so the package graph cannot lie.

Parses every ``.py`` file under ``packages/<pkg>/src`` (all imports, including the ones inside
functions and ``try`` blocks) and compares them with ``packages/<pkg>/pyproject.toml``:

* vescale siblings: the set of sibling distributions imported equals the set of sibling
  distributions in ``[project] dependencies`` (a sibling used only behind an extra would have
  to be declared in that extra; none is today). Every sibling requirement is a floor
  (``>=``), never a pin.
* third-party: every non-standard-library import is a declared dependency or belongs to an
  extra (``safetensors``, ``triton``, ...); every declared runtime dependency is imported.
* the graph is acyclic and vescale-dtensor imports no sibling (it finds plugins through the
  ``vescale`` entry point).

The graph this test enforces is drawn in docs/architecture.md.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

REPO = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.name for p in (REPO / "packages").iterdir() if (p / "pyproject.toml").exists())

# Import name -> distribution name, where they differ.
IMPORT_TO_DIST = {"_pytest": "pytest", "yaml": "pyyaml"}


def _dist_of_vescale_module() -> dict[str, str]:
    """``vescale.<top>`` -> the distribution under packages/ that ships it."""
    owner: dict[str, str] = {}
    for pkg in PACKAGES:
        for top in (REPO / "packages" / pkg / "src" / "vescale").iterdir():
            if top.is_dir() and not top.name.startswith(("_", ".")):
                assert top.name not in owner, f"vescale.{top.name} shipped twice"
                owner[top.name] = pkg
    return owner


def _imports(pkg: str) -> set[str]:
    """Dotted names of every absolute import in a package's source."""
    found: set[str] = set()
    for path in sorted((REPO / "packages" / pkg / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                if node.module == "vescale":  # `from vescale import ragged`
                    found.update(f"vescale.{alias.name}" for alias in node.names)
    return found


def _requirement_name(raw: str) -> str:
    return re.split(r"[<>=!~;\[ ]", raw, maxsplit=1)[0].strip().lower().replace("_", "-")


def _project(pkg: str) -> dict:
    return tomllib.loads((REPO / "packages" / pkg / "pyproject.toml").read_text())["project"]


def graph() -> dict[str, set[str]]:
    """Distribution -> the sibling distributions its source imports."""
    owner = _dist_of_vescale_module()
    edges: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        used = set()
        for name in _imports(pkg):
            parts = name.split(".")
            if parts[0] == "vescale" and len(parts) > 1:
                assert parts[1] in owner, f"{pkg} imports {name}, which no package ships"
                used.add(owner[parts[1]])
        used.discard(pkg)
        edges[pkg] = used
    return edges


def test_sibling_dependencies_are_exactly_the_imported_ones():
    edges = graph()
    problems = []
    for pkg in PACKAGES:
        deps = _project(pkg).get("dependencies", [])
        declared = {_requirement_name(r) for r in deps if r.startswith("vescale")}
        for raw in deps:
            if raw.startswith("vescale"):
                spec = raw[len(_requirement_name(raw)) :].replace(" ", "")
                if not re.fullmatch(r">=[0-9.]+", spec):
                    problems.append(f"{pkg}: {raw!r} must be a floor (>=), never a pin")
        if edges[pkg] - declared:
            problems.append(f"{pkg} imports but does not declare {sorted(edges[pkg] - declared)}")
        if declared - edges[pkg]:
            problems.append(f"{pkg} declares but never imports {sorted(declared - edges[pkg])}")
    assert not problems, "\n".join(problems)


def test_third_party_imports_are_declared_and_declared_ones_used():
    problems = []
    stdlib = set(sys.stdlib_module_names)
    for pkg in PACKAGES:
        project = _project(pkg)
        runtime = {
            _requirement_name(r)
            for r in project.get("dependencies", [])
            if not r.startswith("vescale")
        }
        extras = {
            _requirement_name(r)
            for reqs in project.get("optional-dependencies", {}).values()
            for r in reqs
        }
        roots = {name.split(".")[0] for name in _imports(pkg)} - stdlib - {"vescale", "__future__"}
        used = {IMPORT_TO_DIST.get(r, r).lower().replace("_", "-") for r in roots}
        if used - runtime - extras:
            problems.append(f"{pkg} imports undeclared {sorted(used - runtime - extras)}")
        if runtime - used:
            problems.append(f"{pkg} declares but never imports {sorted(runtime - used)}")
    assert not problems, "\n".join(problems)


def test_graph_is_acyclic_and_dtensor_is_the_root():
    edges = graph()
    assert edges["vescale-dtensor"] == set(), "vescale-dtensor must not import a sibling"
    for pkg in PACKAGES:
        if pkg != "vescale-dtensor":
            assert "vescale-dtensor" in edges[pkg], f"{pkg} is expected to build on vescale-dtensor"
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*path, node]))
        if state.get(node) == 2:
            return
        state[node] = 1
        for nxt in sorted(edges[node]):
            visit(nxt, [*path, node])
        state[node] = 2

    for pkg in PACKAGES:
        visit(pkg, [])


def test_architecture_page_draws_the_real_graph():
    """docs/architecture.md's mermaid graph (``dmodule --> ragged`` lines) has exactly the import edges."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no mermaid package graph"
    drawn = {
        (f"vescale-{a}", f"vescale-{b}")
        for a, b in re.findall(r"^\s*([a-z]+)\s*-->\s*([a-z]+)\s*$", block.group(1), re.M)
        if f"vescale-{a}" in PACKAGES and f"vescale-{b}" in PACKAGES
    }
    real = {(pkg, dep) for pkg, deps in graph().items() for dep in deps}
    assert drawn == real, (
        f"drawn but not imported: {sorted(drawn - real)}; imported but not drawn: {sorted(real - drawn)}"
    )


def _sibling_private_imports(pkg: str, owner: dict[str, str]) -> list[str]:
    """``file:line name`` for each import of another distribution's private name."""
    bad: list[str] = []
    for path in sorted((REPO / "packages" / pkg / "src").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if len(parts) < 3 or parts[0] != "vescale" or owner.get(parts[1]) in (None, pkg):
                    continue
                if any(p.startswith("_") and not p.startswith("__") for p in parts[2:]):
                    rel = path.relative_to(REPO)
                    bad.append(f"{rel}:{node.lineno} {name}")
    return bad


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_package_imports_a_siblings_private_module(pkg):
    # Siblings meet through public names only (vescale.dtensor.compat for the probed torch
    # internals), so a sibling may rename its private modules without breaking another.
    bad = _sibling_private_imports(pkg, _dist_of_vescale_module())
    assert not bad, f"{pkg} imports private names of another distribution:\n" + "\n".join(bad)
