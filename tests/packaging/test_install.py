"""Every package builds an sdist and a wheel, and installed wheels expose only themselves.

The install check builds the wheels of vescale-dtensor and vescale-ragged, installs just
those two into a fresh virtual environment and checks, in a separate interpreter, that
``vescale.dtensor`` and ``vescale.ragged`` import from that environment (through the PEP 420
``vescale`` namespace) while ``vescale.dmodule`` does not exist there.

The fresh environment must not download torch (an unpinned download can be the multi-GB
CUDA build) and must not see the editable vescale installs of the environment running the
tests. So it is created *without* system site-packages, and a ``.pth`` file puts a "shadow"
directory on its path that holds symlinks to exactly the distributions torch and
vescale-dtensor need (torch, pluggy and their requirements, found through
``importlib.metadata``), and nothing named ``vescale``. pip installs the two wheels with
``--no-index --no-deps`` (torch's own requirements need not all be installable offline, e.g.
setuptools, which hatch's environments do not carry), and the check then verifies that every
direct requirement of the two installed packages is met inside the fresh environment.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ["dtensor", "ragged", "dmodule", "optim", "checkpoint"]
# Requirements the fresh environment borrows from this one instead of downloading.
BORROWED_ROOTS = ["torch", "pluggy", "numpy", "packaging"]


def _version(pkg: str) -> str:
    about = REPO / "packages" / f"vescale-{pkg}" / "src" / "vescale" / pkg / "__about__.py"
    match = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
    assert match, f"no __version__ in {about}"
    return match.group(1)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Build an sdist and a wheel of every package with hatchling's PEP 517 backend."""
    pytest.importorskip("hatchling", reason="building needs hatchling (in the hatch test env)")
    out = tmp_path_factory.mktemp("dist")
    built: dict[str, dict[str, Path]] = {}
    for pkg in PACKAGES:
        script = textwrap.dedent(
            f"""
            import json, hatchling.build as b
            out = {str(out)!r}
            print(json.dumps({{"wheel": b.build_wheel(out), "sdist": b.build_sdist(out)}}))
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO / "packages" / f"vescale-{pkg}",
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"building vescale-{pkg} failed:\n{proc.stdout}\n{proc.stderr}"
        names = json.loads(proc.stdout.strip().splitlines()[-1])
        built[pkg] = {kind: out / name for kind, name in names.items()}
    return built


@pytest.mark.parametrize("pkg", PACKAGES)
def test_wheel_contents(dists, pkg):
    wheel = dists[pkg]["wheel"]
    assert wheel.name.startswith(f"vescale_{pkg}-{_version(pkg)}-")
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
def test_sdist_contents(dists, pkg):
    sdist = dists[pkg]["sdist"]
    root = f"vescale_{pkg}-{_version(pkg)}"
    assert sdist.name == f"{root}.tar.gz"
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    for required in ("pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO"):
        assert f"{root}/{required}" in names, f"{required} missing from {sdist.name}"
    assert f"{root}/src/vescale/{pkg}/__init__.py" in names
    assert f"{root}/src/vescale/__init__.py" not in names


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


def _shadow_site(target: Path) -> Path:
    """A directory of symlinks to the borrowed distributions' files (and nothing else)."""
    target.mkdir()
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


CHECK = textwrap.dedent(
    """
    import importlib.metadata as md, json, sys
    import vescale.dtensor, vescale.ragged
    import vescale
    try:
        import vescale.dmodule
    except ModuleNotFoundError as e:
        dmodule = f"ModuleNotFoundError: {e.name}"
    else:
        dmodule = "imported from " + vescale.dmodule.__file__
    eps = [(ep.name, ep.value) for ep in md.entry_points(group="vescale")]
    for ep in md.entry_points(group="vescale"):
        ep.load()
    from packaging.requirements import Requirement
    unmet = []
    for dist in ("vescale-dtensor", "vescale-ragged"):
        for raw in md.requires(dist) or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist}: {raw} (installed: {have})")
    import pluggy
    pm = pluggy.PluginManager("vescale")
    pm.load_setuptools_entrypoints("vescale")
    print(json.dumps({
        "prefix": sys.prefix,
        "namespace": list(vescale.__path__),
        "namespace_file": getattr(vescale, "__file__", None),
        "files": [vescale.dtensor.__file__, vescale.ragged.__file__],
        "versions": [vescale.dtensor.__version__, vescale.ragged.__version__],
        "dmodule": dmodule,
        "unmet": unmet,
        "entry_points": eps,
        "pluggy_plugins": sorted(n for n, _ in pm.list_name_plugin()),
        "vescale_dists": sorted(
            d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("vescale")
        ),
    }))
    """
)


def test_fresh_venv_installs_only_named_packages(dists, tmp_path):
    shadow = _shadow_site(tmp_path / "shadow")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=_clean_env(),
    ).stdout.strip()
    (Path(site) / "_vescale_test_shadow.pth").write_text(f"{shadow}\n")

    wheels = [str(dists["dtensor"]["wheel"]), str(dists["ragged"]["wheel"])]
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-index",
            "--no-deps",
            *wheels,
        ],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"

    proc = subprocess.run(
        [str(python), "-I", "-c", CHECK],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, f"check failed in the fresh venv:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    prefix = Path(report["prefix"]).resolve()
    assert prefix == env_dir.resolve()
    # Everything vescale comes from the fresh environment, never from the source tree or
    # from the editable installs of the environment running this test.
    assert report["namespace_file"] is None
    assert report["namespace"], report
    for path in [*report["namespace"], *report["files"]]:
        assert Path(path).resolve().is_relative_to(prefix), f"{path} is outside {prefix}"
    assert report["versions"] == [_version("dtensor"), _version("ragged")]
    assert report["vescale_dists"] == ["vescale-dtensor", "vescale-ragged"]
    assert report["dmodule"] == "ModuleNotFoundError: vescale.dmodule"
    assert report["unmet"] == []
    # Only the installed wheel's entry point: nothing leaks in from this environment
    # (e.g. the editable toy plugin of tests/contract).
    assert report["entry_points"] == [["ragged", "vescale.ragged._plugin"]]
    assert "ragged" in report["pluggy_plugins"]
