"""Every package builds an sdist and a wheel with the expected contents and metadata.

The wheels and sdists are built once per session by the ``dists`` fixture (conftest.py);
tests/packaging/test_standalone.py installs each wheel alone in a fresh environment.
"""

from __future__ import annotations

import re
import tarfile
import zipfile

import pytest

pytestmark = pytest.mark.slow

PACKAGES = ["dtensor", "ragged", "dmodule", "optim", "checkpoint"]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_wheel_contents(dists, package_version, pkg):
    wheel = dists[pkg]["wheel"]
    assert wheel.name.startswith(f"vescale_{pkg}-{package_version(pkg)}-")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
        entry_points = zf.read(entry_points).decode() if entry_points else ""
    assert f"vescale/{pkg}/__init__.py" in names
    assert f"vescale/{pkg}/__about__.py" in names
    # PEP 420: no package may own the shared namespace.
    assert "vescale/__init__.py" not in names
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/")]
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, flags=re.M)
    assert any(r.replace(" ", "") in ("torch<2.16,>=2.11", "torch>=2.11,<2.16") for r in requires)
    assert not any(re.match(r"vescale([<>=!~ ;]|$)", r) for r in requires), requires
    if pkg != "dtensor":
        assert "vescale-dtensor>=0.1" in [r.replace(" ", "") for r in requires]
    if pkg == "ragged":
        assert "Provides-Extra: triton" in metadata
        assert re.search(
            r"^\[vescale\]\s*\nragged\s*=\s*vescale\.ragged\._plugin\s*$", entry_points, re.M
        )
        assert "vescale/ragged/_plugin.py" in names


@pytest.mark.parametrize("pkg", PACKAGES)
def test_sdist_contents(dists, package_version, pkg):
    sdist = dists[pkg]["sdist"]
    root = f"vescale_{pkg}-{package_version(pkg)}"
    assert sdist.name == f"{root}.tar.gz"
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    for required in ("pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO"):
        assert f"{root}/{required}" in names, f"{required} missing from {sdist.name}"
    assert f"{root}/src/vescale/{pkg}/__init__.py" in names
    assert f"{root}/src/vescale/__init__.py" not in names
