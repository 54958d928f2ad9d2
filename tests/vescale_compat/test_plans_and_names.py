"""veScale's plan forms, module paths, refusals and helpers, checked against single device."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vescale.dmodule.api import parallelize_module
from vescale.dtensor.device_mesh import init_device_mesh
from vescale.dtensor.placement_types import Replicate, Shard
from vescale.dtensor.testing import distributed

MODULE_PATHS = {
    "vescale.dtensor.device_mesh": ["DeviceMesh", "init_device_mesh"],
    "vescale.dtensor.placement_types": [
        "Placement",
        "Shard",
        "Replicate",
        "Partial",
        "RaggedShard",
    ],
    "vescale.dtensor.api": ["distribute_tensor", "redistribute_dtensor", "from_local", "to_local"],
    "vescale.dtensor.debug": ["CommDebugMode", "visualize_sharding"],
    "vescale.dtensor.random": ["manual_seed"],
    "vescale.dmodule.api": ["parallelize_module", "is_dmodule"],
    "vescale.ddp": ["DistributedDataParallel"],
    "vescale.ddp.distributed_data_parallel": ["DistributedDataParallel"],
    "vescale.optim.distributed_optimizer": ["DistributedOptimizer"],
    "vescale.optim.base_optimizer": [
        "BasicOptimizer",
        "BasicOptimizerHook",
        "GradOptimizerHookBase",
    ],
    "vescale.initialize": [
        "deferred_init",
        "is_deferred",
        "materialize_module",
        "materialize_dtensor",
    ],
    "vescale.dmp": ["auto_parallelize_module"],
    "vescale.devicemesh_api": ["VESCALE_DEVICE_MESH"],
}

REFUSED = {
    "vescale.dtensor.placement_types": ["InterleavedShard", "_StridedRaggedShard"],
    "vescale.dmodule.api": ["PlacementsInterface"],
    "vescale.dmp": ["set_plan_overriding_policy"],
}


def test_module_paths_and_refusals():
    from vescale.dtensor._vescale_names import UnsupportedVeScaleName
    from vescale.ragged import RaggedShard

    for path, names in MODULE_PATHS.items():
        mod = importlib.import_module(path)
        for n in names:
            assert getattr(mod, n) is not None, (path, n)
    import vescale.dtensor.placement_types as pt

    assert pt.RaggedShard is RaggedShard  # resolved by name through the registry
    for path, names in REFUSED.items():
        mod = importlib.import_module(path)
        for n in names:
            with pytest.raises(UnsupportedVeScaleName, match="not provided by vescale"):
                getattr(mod, n)
    with pytest.raises(ImportError, match="PlacementsInterface"):
        from vescale.dmodule.api import PlacementsInterface  # noqa: F401
    assert not hasattr(pt, "NoSuchPlacement")


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 4)
        self.seen: dict[str, object] = {}

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, object] = {}

    def forward(self, a, b, *rest, **kw):
        self.seen = {"a": a, "b": b, "rest": rest, "c": kw.get("c")}
        return a + b + rest[0] + rest[1] + kw["c"]


class _Factory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict[str, object] = {}

    def forward(self, x):
        z = torch.zeros(x.shape)
        r = torch.arange(4, dtype=x.dtype)
        self.seen = {"zeros": z, "arange": r}
        return self.lin(x + z) + r


def _placements(t):
    return tuple(t.placements) if hasattr(t, "placements") else None


@distributed(2, timeout=300)
def test_plan_features():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TP",))
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    # a misspelled section is a KeyError (veScale) and says what was meant
    with pytest.raises(KeyError) as e:
        parallelize_module(_Pair(), mesh, {"parameters": {"fc1.weight": [Shard(0)]}})
    assert isinstance(e.value, ValueError) and "did you mean 'parameter'" in str(e.value)

    # forward-section parameter entry: fc1.weight replicated for fc1's forward only
    torch.manual_seed(0)
    ref = _Pair()
    torch.manual_seed(0)
    m = parallelize_module(
        _Pair(),
        mesh,
        {
            "parameter": {"fc1.weight": [Shard(0)], "fc2.weight": [Shard(1)]},
            "forward": {
                "fc1.weight": [Replicate()],
                "fc1.input": [[Replicate()]],
                "fc2.output": [[Replicate()]],
            },
        },
    )
    seen = {}

    def spy(mod, args):
        seen["w"] = _placements(mod.weight)

    m.fc1.register_forward_pre_hook(spy)
    out = m(x)
    assert seen["w"] == (Replicate(),)
    assert _placements(m.fc1.weight) == (Shard(0),) and isinstance(m.fc1.weight, nn.Parameter)
    torch.testing.assert_close(out.full_tensor(), ref(x), rtol=1e-5, atol=1e-5)
    out.full_tensor().sum().backward()
    ref(x).sum().backward()
    assert _placements(m.fc1.weight.grad) == (Shard(0),)
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-5, msg=n)

    # dict input plans by argument name, *args by position, **kwargs by keyword
    mix = parallelize_module(
        _Mix(),
        mesh,
        {
            "forward": {
                "input": {
                    "a": [Shard(0)],
                    "b": [Replicate()],
                    "rest": [[Shard(0)], None],
                    "c": [Shard(0)],
                }
            }
        },
    )
    vals = [torch.randn(4, 2) for _ in range(5)]
    out = mix(vals[0], vals[1], vals[2], vals[3], c=vals[4])
    got = {k: _placements(v) for k, v in mix.seen.items() if k != "rest"}
    assert got == {"a": (Shard(0),), "b": (Replicate(),), "c": (Shard(0),)}
    assert (
        _placements(mix.seen["rest"][0]) == (Shard(0),) and _placements(mix.seen["rest"][1]) is None
    )
    torch.testing.assert_close(out.full_tensor(), sum(vals), rtol=1e-6, atol=1e-6)

    # factory=True: torch.zeros / torch.arange in forward become replicated DTensors
    torch.manual_seed(0)
    fref = _Factory()
    torch.manual_seed(0)
    fm = parallelize_module(_Factory(), mesh, None, factory=True)
    out = fm(x)
    assert _placements(fm.seen["zeros"]) == (Replicate(),) and _placements(fm.seen["arange"]) == (
        Replicate(),
    )
    torch.testing.assert_close(out.full_tensor(), fref(x), rtol=1e-6, atol=1e-6)
    # per class and per function: only torch.zeros, sharded
    fm2 = parallelize_module(_Factory(), mesh, None, factory={_Factory: {torch.zeros: [Shard(0)]}})
    fm2(torch.randn(4, 4))
    assert _placements(fm2.seen["zeros"]) == (Shard(0),) and _placements(fm2.seen["arange"]) is None
    # without factory the tensors stay plain (implicit replication still mixes them)
    fm3 = parallelize_module(_Factory(), mesh, None)
    fm3(x)
    assert _placements(fm3.seen["zeros"]) is None


@distributed(4, timeout=300)
def test_devicemesh_api_and_random_seed():
    from vescale.devicemesh_api import VESCALE_DEVICE_MESH
    from vescale.dtensor.api import distribute_tensor
    from vescale.dtensor.random import manual_seed
    from vescale.initialize import deferred_init, materialize_dtensor

    mesh = VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    rank = dist.get_rank()
    assert VESCALE_DEVICE_MESH.get() is mesh and VESCALE_DEVICE_MESH.shape == (2, 2)
    assert VESCALE_DEVICE_MESH.get_strategy_size("TP") == 2 and VESCALE_DEVICE_MESH.ndim == 2
    assert VESCALE_DEVICE_MESH.get_data_parallel_rank() == rank // 2
    assert VESCALE_DEVICE_MESH.get_tensor_parallel_rank() == rank % 2
    assert VESCALE_DEVICE_MESH.get_strategy_coordinate(3) == [1, 1]
    assert VESCALE_DEVICE_MESH.lookup_rank("DP") == rank // 2
    assert (
        VESCALE_DEVICE_MESH["TP"].mesh.tolist()
        == VESCALE_DEVICE_MESH.get_tensor_parallel_mesh().mesh.tolist()
    )
    tp_ranks = dist.get_process_group_ranks(VESCALE_DEVICE_MESH.get_tensor_parallel_dim_groups())
    dp_ranks = dist.get_process_group_ranks(VESCALE_DEVICE_MESH.get_data_parallel_dim_groups())
    assert tp_ranks == [rank // 2 * 2, rank // 2 * 2 + 1] and dp_ranks == [rank % 2, rank % 2 + 2]
    assert VESCALE_DEVICE_MESH.is_first_stage() and VESCALE_DEVICE_MESH.is_last_stage()
    with pytest.raises(ValueError, match="already initialized"):
        VESCALE_DEVICE_MESH.init_device_mesh("cpu", (4,), check_uniqueness=True)

    # the same seed everywhere: replicated random values agree across ranks
    torch.manual_seed(rank)  # deliberately different
    manual_seed(1234, mesh)
    t = torch.randn(8)
    gathered = [torch.empty(8) for _ in range(4)]
    dist.all_gather(gathered, t)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    with pytest.raises(ValueError, match="same seed"):
        manual_seed(rank, mesh)

    # deferred tensors: built for real when distributed
    fake = deferred_init(torch.randn, 4, 6)
    assert fake.device.type == "meta"
    torch.manual_seed(3)
    want = torch.randn(4, 6)
    torch.manual_seed(3)
    dt = materialize_dtensor(fake, mesh, [Shard(0), Shard(1)])
    assert torch.equal(dt.full_tensor(), want)
    assert torch.equal(
        distribute_tensor(want, mesh).full_tensor(), want
    )  # placements=None: replicated
