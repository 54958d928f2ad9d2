"""Each package installs and works alone, with only its declared dependencies.

For every package, a fresh virtual environment (see conftest.py: torch and pluggy are
borrowed from the running environment through symlinks, nothing named ``vescale`` is visible)
gets the package's wheel plus the wheels of the vescale siblings its metadata requires,
transitively, and nothing else. A separate interpreter in that environment then

* checks that the vescale distributions present are exactly that closure, that every direct
  requirement of each is met, that the other siblings do not import, and that the ``vescale``
  entry points are exactly those of the installed wheels;
* runs one real call of the package on a 1-rank gloo process group: a ``Shard`` ->
  ``Replicate`` redistribution (vescale-dtensor), a ``RaggedShard`` round trip
  (vescale-ragged), FSDP and tensor parallelism of a tiny model against the plain model
  (vescale-dmodule), a ``DistributedOptimizer`` step against ``torch.optim.SGD``
  (vescale-optim), a checkpoint save and load into a fresh model (vescale-checkpoint).

A missing declaration (e.g. vescale-dmodule's FSDP importing vescale-ragged without
declaring it) fails here with the ImportError a user would see.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PACKAGES = ["dtensor", "ragged", "dmodule", "optim", "checkpoint"]

PRELUDE = textwrap.dedent(
    """
    import importlib, importlib.metadata as md, json, sys, tempfile
    from packaging.requirements import Requirement

    INSTALLED, ABSENT = sys.argv[1].split(","), sys.argv[2].split(",") if sys.argv[2] else []
    report = {"prefix": sys.prefix, "unmet": [], "absent_importable": []}
    for pkg in INSTALLED:
        for raw in md.requires(f"vescale-{pkg}") or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                report["unmet"].append(f"vescale-{pkg}: {raw} (installed: {have})")
    for pkg in ABSENT:
        try:
            importlib.import_module(f"vescale.{pkg}")
        except ModuleNotFoundError:
            pass
        else:
            report["absent_importable"].append(pkg)
    report["vescale_dists"] = sorted(
        d.metadata["Name"] for d in md.distributions() if d.metadata["Name"].startswith("vescale")
    )
    report["entry_points"] = sorted(ep.value for ep in md.entry_points(group="vescale"))
    report["files"] = [importlib.import_module(f"vescale.{p}").__file__ for p in INSTALLED]

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from vescale.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    """
)

SMOKE = {
    "dtensor": """
        from vescale.dtensor import placement_registry
        from vescale.dtensor.debug import CommDebugMode

        x = torch.randn(4, 6)
        d = distribute_tensor(x, mesh, [Shard(1)])
        with CommDebugMode() as comm:
            r = d.redistribute(mesh, [Replicate()])
        assert torch.equal(r.to_local(), x)
        assert torch.equal((d * 2).full_tensor(), x * 2)
        report["placements"] = sorted(placement_registry())
        report["smoke"] = "Shard(1) -> Replicate()"
    """,
    "ragged": """
        from vescale.ragged import RaggedShard

        x = torch.randn(5, 3)
        d = distribute_tensor(x, mesh, [RaggedShard((0,), (1,))])
        assert torch.equal(d.to_local().reshape(5, 3), x), d.to_local().shape
        assert torch.equal(d.redistribute(mesh, [Shard(0)]).to_local(), x)
        assert torch.equal(d.full_tensor(), x)
        back = distribute_tensor(x, mesh, [Replicate()]).redistribute(mesh, [RaggedShard((0,), (1,))])
        assert torch.equal(back.full_tensor(), x)
        report["smoke"] = "RaggedShard round trip"
    """,
    "dmodule": """
        import copy
        from torch import nn
        from vescale.dmodule import DModule

        def model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

        x = torch.randn(3, 4)
        ref = model()
        ref(x).sum().backward()
        for kind, kwargs in {
            "fsdp": dict(data_parallel={"dp": "fsdp"}),
            "tp": dict(sharding_plan={"parameter": {"0.weight": [Shard(0)], "2.weight": [Shard(1)]}}),
        }.items():
            m = DModule(model(), mesh, **kwargs)
            out = m(x)
            out = out.full_tensor() if hasattr(out, "full_tensor") else out
            out.sum().backward()
            assert torch.allclose(out, ref(x)), kind
            for (name, p), q in zip(m.named_parameters(), ref.parameters()):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert torch.allclose(g, q.grad, atol=1e-6), (kind, name)
        report["smoke"] = "FSDP and TP of a tiny MLP"
    """,
    "optim": """
        from torch import nn
        from vescale.optim import DistributedOptimizer

        ref = nn.Linear(4, 3)
        m = nn.Linear(4, 3)
        m.load_state_dict(ref.state_dict())
        for name, p in list(m.named_parameters()):
            setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
        opt = DistributedOptimizer(m, torch.optim.SGD, mesh=mesh, dp_dim="dp", lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for p, q in zip(m.parameters(), ref.parameters()):
            g = torch.randn_like(q)
            q.grad = g
            p.grad = distribute_tensor(g, mesh, [Replicate()])
        opt.step()
        ref_opt.step()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.allclose(p.full_tensor(), q.detach()), (p, q)
        report["smoke"] = "DistributedOptimizer step"
    """,
    "checkpoint": """
        import vescale.checkpoint as vckpt
        from torch import nn

        def model():
            m = nn.Linear(4, 3)
            for name, p in list(m.named_parameters()):
                setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
            return m

        src, dst = model(), model()
        with tempfile.TemporaryDirectory() as path:
            vckpt.save(path, {"model": src, "step": 7})
            state = {"model": dst, "step": 0}
            vckpt.load(path, state)
        for p, q in zip(src.parameters(), dst.parameters()):
            assert torch.equal(p.full_tensor(), q.full_tensor())
        assert state["step"] == 7, state
        report["smoke"] = "save and load"
    """,
}


def _wheel_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
    return [
        line.split(":", 1)[1].strip()
        for line in meta.decode().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]


def _sibling_closure(dists, pkg: str) -> list[str]:
    """``pkg`` and every vescale sibling its wheel requires, transitively (wheel metadata)."""
    todo, seen = [pkg], []
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        for raw in _wheel_requires(dists[p]["wheel"]):
            if raw.startswith("vescale-"):
                todo.append(raw.split(">")[0].split("=")[0].split("<")[0].strip()[8:])
    return [p for p in PACKAGES if p in seen]


@pytest.fixture(scope="module")
def standalone_runs(dists, fresh_venv, clean_env, tmp_path_factory):
    """Install and smoke-test every package, several at a time (each is one subprocess)."""

    def run(pkg: str, cwd: Path):
        installed = _sibling_closure(dists, pkg)
        absent = [p for p in PACKAGES if p not in installed]
        python = fresh_venv(installed)
        script = PRELUDE + textwrap.dedent(SMOKE[pkg]) + "\nprint(json.dumps(report))\n"
        proc = subprocess.run(
            [str(python), "-I", "-c", script, ",".join(installed), ",".join(absent)],
            capture_output=True,
            text=True,
            env={**clean_env, "OMP_NUM_THREADS": "1"},
            cwd=cwd,
            timeout=300,
        )
        return installed, python, proc

    cwds = {pkg: tmp_path_factory.mktemp(f"smoke-{pkg}") for pkg in PACKAGES}
    pool = ThreadPoolExecutor(max_workers=max(2, min(len(PACKAGES), os.cpu_count() or 2)))
    futures = {pkg: pool.submit(run, pkg, cwds[pkg]) for pkg in PACKAGES}
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_works_alone(standalone_runs, pkg):
    installed, python, proc = standalone_runs[pkg].result()
    assert proc.returncode == 0, (
        f"vescale-{pkg} with {installed} only, in a fresh venv:\n{proc.stdout}\n{proc.stderr}"
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    prefix = Path(report["prefix"]).resolve()
    assert prefix == python.parent.parent.resolve()
    for path in report["files"]:
        assert Path(path).resolve().is_relative_to(prefix), f"{path} is outside {prefix}"
    assert report["vescale_dists"] == sorted(f"vescale-{p}" for p in installed)
    assert report["unmet"] == []
    assert report["absent_importable"] == []
    # Only the installed wheels' entry points: nothing leaks in from this environment (e.g.
    # the editable toy plugin of tests/contract).
    expected_eps = sorted(
        f"vescale.{p}._plugin" for p in installed if p in ("ragged", "dmodule", "checkpoint")
    )
    assert report["entry_points"] == expected_eps
    if pkg == "dtensor":
        assert "RaggedShard" not in " ".join(report["placements"]), report["placements"]
    assert report["smoke"]
