"""Tests of ``vescale.dtensor.device_mesh``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from vescale.dtensor import device_mesh as dm
from vescale.dtensor.device_mesh import (
    DeviceMesh,
    get_default_timeout,
    init_device_mesh,
    set_default_timeout,
)
from vescale.dtensor.testing import distributed, run_torchrun

SCRIPTS = Path(__file__).parent / "scripts"


# --------------------------------------------------------------------------- timeout configuration


def test_default_timeout_env_and_override(monkeypatch):
    monkeypatch.delenv(dm.TIMEOUT_ENV, raising=False)
    monkeypatch.setattr(dm, "_timeout_override", None)
    assert get_default_timeout() == 300.0
    monkeypatch.setenv(dm.TIMEOUT_ENV, "42.5")
    assert get_default_timeout() == 42.5
    set_default_timeout(7)
    assert get_default_timeout() == 7.0
    set_default_timeout(None)
    assert get_default_timeout() == 42.5
    monkeypatch.setenv(dm.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="positive number of seconds"):
        get_default_timeout()
    with pytest.raises(ValueError, match="positive number of seconds"):
        set_default_timeout(0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        set_default_timeout(float("inf"))


# --------------------------------------------------------------------------- validation (no process group needed)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_type": "tpu9", "mesh": [0]}, "unknown device type"),
        ({"device_type": "cuda:0", "mesh": [0]}, "without an index"),
        ({"device_type": "cpu", "mesh": [0, 0]}, r"unique.*\[0\]"),
        ({"device_type": "cpu", "mesh": [[0, 1], [1, 2]]}, r"duplicates \[1\]"),
        ({"device_type": "cpu", "mesh": [-1, 0]}, "non-negative"),
        ({"device_type": "cpu", "mesh": [0.0, 1.0]}, "integer ranks"),
        ({"device_type": "cpu", "mesh": []}, "at least one rank"),
        ({"device_type": "cpu", "mesh": 0}, "at least one dimension"),
        ({"device_type": "cpu", "mesh": [[0, 1], [2]]}, "list or tensor"),
        (
            {"device_type": "cpu", "mesh": [0, 1], "mesh_dim_names": ("a", "b")},
            r"2 name\(s\) but the mesh has 1",
        ),
        (
            {"device_type": "cpu", "mesh": [[0, 1]], "mesh_dim_names": ("a", "a")},
            r"unique.*\['a'\]",
        ),
        ({"device_type": "cpu", "mesh": [0], "mesh_dim_names": "a"}, "tuple of str"),
    ],
)
def test_invalid_mesh_raises_before_any_process_group(kwargs, match):
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=match):
        DeviceMesh(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("cpu", (0, 2)), {}, "positive ints"),
        (("cpu", ()), {}, "positive ints"),
        (("cpu", (2, 2)), {"mesh_dim_names": ("dp",)}, r"1 name\(s\) but the mesh has 2"),
        (("quantum", (1,)), {}, "unknown device type"),
    ],
)
def test_invalid_init_device_mesh_raises(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        init_device_mesh(*args, **kwargs)


# --------------------------------------------------------------------------- on ranks


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_init_device_mesh_1d_on_n_ranks(world_size):
    from vescale.dtensor.testing import run_on_ranks

    results = run_on_ranks(_mesh_1d_body, world_size)
    assert results == [
        (list(range(world_size)), r, float(sum(range(world_size)))) for r in range(world_size)
    ]


def _mesh_1d_body():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    assert isinstance(mesh, DeviceMesh) and isinstance(mesh, TorchDeviceMesh)
    assert mesh.mesh_dim_names == ("dp",)
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=mesh.get_group("dp"))
    return mesh.mesh.tolist(), mesh.get_coordinate()[0], t.item()


@distributed(4)
def test_two_dim_mesh_groups_reduce_over_the_right_ranks():
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    assert isinstance(mesh, TorchDeviceMesh)
    assert tuple(mesh.get_coordinate()) == (rank // 2, rank % 2)
    dp = torch.tensor([float(rank)])
    dist.all_reduce(dp, group=mesh.get_group("dp"))
    tp = torch.tensor([float(rank)])
    dist.all_reduce(tp, group=mesh.get_group("tp"))
    assert dp.item() == {0: 2.0, 1: 4.0}[rank % 2]
    assert tp.item() == {0: 1.0, 1: 5.0}[rank // 2]
    # Slicing and DTensor work with the subclass.
    assert mesh["tp"].mesh.tolist() == [2 * (rank // 2), 2 * (rank // 2) + 1]
    full = torch.arange(16.0).view(4, 4)
    dt = distribute_tensor(full, mesh, [Shard(0), Replicate()])
    assert torch.equal(dt.to_local(), full[2 * (rank // 2) : 2 * (rank // 2) + 2])
    assert torch.equal(dt.full_tensor(), full)


@distributed(4)
def test_init_device_mesh_2d_matches_explicit_mesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert isinstance(mesh, DeviceMesh)
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert mesh.size(0) == 2 and mesh.size(1) == 2


@distributed(4)
def test_submesh_of_the_world_and_out_of_range_ranks():
    rank = dist.get_rank()
    sub = DeviceMesh("cpu", torch.tensor([1, 3]))
    coord = sub.get_coordinate()
    assert (tuple(coord) if coord is not None else None) == (
        ((1, 3).index(rank),) if rank in (1, 3) else None
    )
    with pytest.raises(ValueError, match=r"range\(world_size=4\); got \[4, 7\]"):
        DeviceMesh("cpu", [[0, 4], [7, 1]])
    with pytest.raises(ValueError, match=r"\(2, 3\) has 6 rank\(s\) but the world size is 4"):
        init_device_mesh("cpu", (2, 3))


@distributed(2)
def test_mesh_groups_get_the_configured_timeout():
    set_default_timeout(33)
    try:
        mesh = DeviceMesh("cpu", [0, 1])
        group = mesh.get_group(0)
        backend = group._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 33
    finally:
        set_default_timeout(None)


@distributed(4)
def test_mesh_dim_groups_get_the_timeout_when_the_caller_made_the_default_group():
    # The pool created the default group itself and configured nothing: the groups that
    # torch creates for the mesh dims still get vescale's timeout, not torch's 30 min.
    mesh = init_device_mesh("cpu", (2, 2))
    for dim in range(2):
        backend = mesh.get_group(dim)._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == get_default_timeout()


# --------------------------------------------------------------------------- torchrun


@pytest.mark.torchrun
def test_mesh_under_torchrun_with_no_setup():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    result = run_torchrun(
        [str(SCRIPTS / "device_mesh_smoke.py")],
        nproc=4,
        timeout=180,
        env=env,
        expect_marker="DEVICE_MESH_SMOKE_OK",
    )
    assert result.stdout.count("DEVICE_MESH_SMOKE_OK") == 4


# --------------------------------------------------------------------------- agreement


@distributed(4, timeout=30)
def test_ranks_that_disagree_on_the_mesh_all_raise():
    from vescale.dtensor import MeshMismatchError

    rank = dist.get_rank()
    with pytest.raises(MeshMismatchError) as err:
        init_device_mesh("cpu", (2, 2) if rank < 2 else (4,))
    msg = str(err.value)
    assert "ranks [0, 1] built a 'cpu' mesh of shape (2, 2) with ranks [[0, 1], [2, 3]]" in msg
    assert "ranks [2, 3] built a 'cpu' mesh of shape (4,) with ranks [0, 1, 2, 3]" in msg
    assert isinstance(err.value, ValueError) and err.value.versions
    layout = [[0, 1], [2, 3]] if rank != 3 else [[0, 2], [1, 3]]
    with pytest.raises(MeshMismatchError, match=r"ranks \[3\] built .* \[\[0, 2\], \[1, 3\]\]"):
        DeviceMesh("cpu", layout)
    names = ("dp", "tp") if rank else ("tp", "dp")
    with pytest.raises(MeshMismatchError, match=r"ranks \[0\] built .*\('tp', 'dp'\)"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    mesh = init_device_mesh("cpu", (2, 2))  # agreeing ranks still build meshes afterwards
    assert mesh.shape == (2, 2)
