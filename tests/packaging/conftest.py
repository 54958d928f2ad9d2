"""Shared fixtures of the packaging tests: built distributions and fresh virtual environments.

A fresh environment must not download torch (an unpinned download can be the multi-GB CUDA
build) and must not see the editable vescale installs of the environment running the tests.
So it is created *without* system site-packages, and a ``.pth`` file puts a "shadow"
directory on its path that holds symlinks to exactly the distributions torch and pluggy need
(torch, pluggy, numpy, packaging and their requirements, found through ``importlib.metadata``),
and nothing named ``vescale``. pip installs vescale wheels into it with ``--no-index
--no-deps`` (torch's own requirements need not all be installable offline, e.g. setuptools,
which hatch's environments do not carry); the checks then verify inside the environment that
every direct requirement of the installed packages is met.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import textwrap
import venv
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["dtensor", "ragged", "dmodule", "optim", "checkpoint"]
# Requirements a fresh environment borrows from this one instead of downloading.
BORROWED_ROOTS = ["torch", "pluggy", "numpy", "packaging"]


def _package_version(pkg: str) -> str:
    about = REPO / "packages" / f"vescale-{pkg}" / "src" / "vescale" / pkg / "__about__.py"
    match = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
    assert match, f"no __version__ in {about}"
    return match.group(1)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="session")
def package_version() -> Callable[[str], str]:
    """``package_version("dtensor")``: the version in the package's ``__about__.py``."""
    return _package_version


@pytest.fixture(scope="session")
def clean_env() -> dict[str, str]:
    """This process's environment without ``PYTHON*`` variables, for fresh interpreters."""
    return _clean_env()


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """An sdist and a wheel of every package, built once with hatchling's PEP 517 backend."""
    pytest.importorskip("hatchling", reason="building needs hatchling (in the hatch test env)")
    out = tmp_path_factory.mktemp("dist")
    script = textwrap.dedent(
        f"""
        import json, os, hatchling.build as b
        out, built = {str(out)!r}, {{}}
        for pkg, path in {[(p, str(REPO / "packages" / f"vescale-{p}")) for p in PACKAGES]!r}:
            os.chdir(path)
            built[pkg] = {{"wheel": b.build_wheel(out), "sdist": b.build_sdist(out)}}
        print(json.dumps(built))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"building the packages failed:\n{proc.stdout}\n{proc.stderr}"
    names = json.loads(proc.stdout.strip().splitlines()[-1])
    return {pkg: {kind: out / name for kind, name in d.items()} for pkg, d in names.items()}


def _requirement_closure(roots: list[str]) -> list[md.Distribution]:
    """The installed distributions ``roots`` need (markers evaluated, extras ignored)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen or name.startswith("vescale"):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # optional (numpy) or not needed on this platform
        seen[name] = dist
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


@pytest.fixture(scope="session")
def shadow_site(tmp_path_factory) -> Path:
    """A directory of symlinks to the borrowed distributions' files (and nothing else)."""
    target = tmp_path_factory.mktemp("shadow")
    for dist in _requirement_closure(BORROWED_ROOTS):
        base = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or []}
        for top in sorted(tops):
            if top in ("..", "__pycache__") or top.endswith(".pth") or top.startswith("vescale"):
                continue
            src, dst = base / top, target / top
            if src.exists() and not dst.exists():
                dst.symlink_to(src, target_is_directory=src.is_dir())
    assert (target / "torch").exists(), "torch is not installed in the test environment"
    assert not (target / "vescale").exists()
    return target


@pytest.fixture(scope="session")
def fresh_venv(dists, shadow_site, tmp_path_factory) -> Callable[[Iterable[str]], Path]:
    """``fresh_venv(["dtensor", "ragged"])``: a new venv with exactly those wheels installed.

    Returns the venv's ``python``; torch and pluggy come from the shadow directory.
    """

    def make(pkgs: Iterable[str]) -> Path:
        pkgs = list(pkgs)
        env_dir = tmp_path_factory.mktemp("venv-" + "-".join(pkgs))
        venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True).create(env_dir)
        python = env_dir / "bin" / "python"
        site = subprocess.run(
            [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            env=_clean_env(),
        ).stdout.strip()
        (Path(site) / "_vescale_test_shadow.pth").write_text(f"{shadow_site}\n")
        wheels = [str(dists[p]["wheel"]) for p in pkgs]
        install = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install"]
            + ["--no-index", "--no-deps", "--no-compile", *wheels],
            capture_output=True,
            text=True,
            env=_clean_env(),
            timeout=300,
        )
        assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"
        return python

    return make
