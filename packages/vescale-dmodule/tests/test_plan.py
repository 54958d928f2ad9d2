"""Plan parsing, validation errors (before any communication), automatic plans, dump_plan."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from vescale.dmodule import DModule, dump_plan, is_dmodule, parallelize_module
from vescale.dmodule._plan import normalize_plan
from vescale.dmodule.testing import GPT, MLP, GPTConfig
from vescale.dtensor import DTensor, Replicate, Shard, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed


# ------------------------------------------------------------------ single process
def test_flat_dict_is_parameter_section():
    plan = normalize_plan({"fc1.weight": [Replicate()]})
    assert plan == {"parameter": {"fc1.weight": [Replicate()]}, "forward": {}}


def test_unknown_section_names_allowed_ones():
    with pytest.raises(
        ValueError, match=r"'parameters'.*did you mean 'parameter'.*\['parameter', 'forward'\]"
    ):
        normalize_plan({"parameters": {"fc1.weight": [Replicate()]}})


def test_forward_key_needs_input_or_output():
    with pytest.raises(ValueError, match="must end with '.input' or '.output'"):
        normalize_plan({"forward": {"fc1": [[Replicate()]]}})


# ------------------------------------------------------------------ two ranks
def _expect(exc, pattern, model, mesh, plan, **kw):
    with CommDebugMode() as cm, pytest.raises(exc, match=pattern):
        parallelize_module(model, mesh, plan, **kw)
    assert cm.get_total_counts() == 0, "validation must not communicate"
    assert not is_dmodule(model)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@distributed(2)
def test_bad_plans():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    m = MLP(16, 32)
    # A key that matches nothing suggests the nearest names.
    _expect(
        ValueError,
        r"'fc3\.weight' matches no name.*nearest names: \['fc2\.weight', 'fc1\.weight'",
        m,
        mesh,
        {"fc3.weight": [Shard(0)]},
    )
    _expect(
        ValueError,
        r"forward plan key.*'fcc1' matches no name.*'fc1'",
        m,
        mesh,
        {"forward": {"fcc1.output": [[Replicate()]]}},
    )
    # Placement list length != mesh ndim.
    _expect(
        ValueError,
        r"got 2 placement\(s\).*1-dim mesh \(tp=2\)",
        m,
        mesh,
        {"fc1.weight": [Shard(0), Replicate()]},
    )
    _expect(
        ValueError,
        r"fc1.output.*got 2 placement",
        m,
        mesh,
        {"forward": {"fc1.output": [[Shard(0), Replicate()]]}},
    )
    # Shard dim out of range.
    _expect(ValueError, r"S\(2\)|Shard\(dim=2\).*out of range", m, mesh, {"fc1.bias": [Shard(2)]})
    # Non-dividing shard dim.
    _expect(
        ValueError, r"does not divide dim 0.*size 3", MLP(16, 3), mesh, {"fc1.weight": [Shard(0)]}
    )
    # Unknown argument name in an input plan.
    _expect(
        ValueError,
        r"argument 'y' is not a parameter of forward\(\)",
        m,
        mesh,
        {"forward": {"fc1.input": {"y": [Replicate()]}}},
    )
    # Not a placement / unknown option.
    _expect(TypeError, r"is not a Placement", m, mesh, {"fc1.weight": ["Shard(0)"]})
    _expect(TypeError, r"unknown parallelize_module option", m, mesh, None, tensor_parallel=True)
    # Uneven is fine when asked for.
    parallelize_module(MLP(16, 3), mesh, {"fc1.weight": [Shard(0)]}, allow_uneven_shards=True)


@distributed(2)
def test_wrap_twice_warns_and_does_nothing():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    m = MLP(16, 32)
    out = DModule(m, mesh, {"fc1.weight": [Shard(0)]})
    assert out is m and isinstance(m, MLP) and isinstance(m, DModule)
    assert type(m).__name__ == "DModuleMLP" and type(m).__bases__ == (DModule, MLP)
    before = m.fc1.weight
    with pytest.warns(UserWarning, match="already parallelized"):
        again = parallelize_module(m, mesh, {"fc1.weight": [Shard(1)]})
    assert again is m and m.fc1.weight is before and m.fc1.weight.placements == (Shard(0),)
    assert not isinstance(MLP(2, 2), DModule)


@distributed(2)
def test_plugin_placement_in_plan():
    from vescale.ragged import RaggedShard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    m = MLP(16, 32)
    ref = copy.deepcopy(m)
    rs = RaggedShard((0,), (3, 1))
    parallelize_module(m, mesh, {"fc1.weight": [rs]})
    assert m.fc1.weight.placements == (rs,)
    assert m.fc1.weight.to_local().shape[0] == (24 if mesh.get_local_rank(0) == 0 else 8)
    x = torch.randn(4, 16)
    out = m(x)
    torch.testing.assert_close(out.full_tensor(), ref(x))
    out.to_local().sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(m.fc1.weight.grad.full_tensor(), ref.fc1.weight.grad)


@distributed(2)
def test_auto_plan_and_dump():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    m = GPT(GPTConfig())
    parallelize_module(m, mesh, sequence_parallel=True)
    assert m.wte.weight is m.lm_head.weight  # still tied
    assert m.wte.weight.placements == (Shard(0),)
    assert m.blocks[1].attn.q_proj.weight.placements == (Shard(0),)
    assert m.blocks[1].attn.o_proj.weight.placements == (Shard(1),)
    assert m.blocks[0].mlp.fc2.bias.placements == (Replicate(),)
    assert m.wpe.weight.placements == (Replicate(),)
    text = m.dump_plan()
    assert text == dump_plan(m)
    assert "wte.weight (= lm_head.weight): [S(0)] global (64, 32) local (32, 32)" in text
    assert "blocks.1.attn.o_proj.output: [[S(1)]]" in text
    assert "blocks.0.ln_2.output: [[R]]" in text
    # User keys override automatic ones; everything else stays automatic.
    m2 = GPT(GPTConfig())
    parallelize_module(m2, mesh, {"forward": {"lm_head.output": [[Shard(-1)]]}}, auto_plan=True)
    out = m2(torch.randint(0, 64, (2, 8)))
    assert out.placements == (Shard(2),)
    assert m2.blocks[0].mlp.fc1.weight.placements == (Shard(0),)
    # A user plan alone is not merged with the automatic one.
    m3 = GPT(GPTConfig())
    parallelize_module(m3, mesh, {r"blocks\.\d+\.mlp\.fc1\.weight": [Shard(0)]})
    assert m3.blocks[0].attn.q_proj.weight.placements == (Replicate(),)


def test_auto_plan_hook_is_overridable():
    from vescale.dmodule import _api
    from vescale.dtensor import get_plugin_manager, hookimpl, register_plugin, unregister_plugin

    class Custom:
        @hookimpl
        def vescale_sharding_plan(self, model):
            return {"parameter": {"fc1.weight": [Shard(0)]}}

    _api._ensure_plugin()
    pm = get_plugin_manager()
    assert hasattr(pm.hook, "vescale_sharding_plan")
    plugin = Custom()
    register_plugin(plugin, name="custom-plan")
    try:
        answer = pm.hook.vescale_sharding_plan(
            model=MLP(), device_mesh=None, tp_dim=0, sequence_parallel=False
        )
        assert answer == {"parameter": {"fc1.weight": [Shard(0)]}}
    finally:
        unregister_plugin(plugin)


def test_generalised_keys():
    from vescale.dmodule._auto_plan import _compress

    entries = {
        ("blocks.0.attn.q_proj", ".weight"): [Shard(0)],
        ("blocks.1.attn.q_proj", ".weight"): [Shard(0)],
        ("blocks.0.mlp.fc1", ".weight"): [Shard(0)],
        ("blocks.1.mlp.fc1", ".weight"): [Replicate()],
        ("blocks.0.attn.o_proj", ".output"): [[Replicate()]],
    }
    out = _compress(entries)
    assert out[r"blocks\.\d+\.attn\.q_proj\.weight"] == [Shard(0)]
    assert out[r"blocks\.1\.mlp\.fc1\.weight"] == [Replicate()]
    assert r"blocks\.0\.attn\.o_proj.output" in out
    for key in out:
        re.compile(key)
