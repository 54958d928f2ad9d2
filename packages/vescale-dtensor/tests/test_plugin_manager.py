import pytest
import torch

import vescale.dtensor as vd
from vescale.dtensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    get_plugin_manager,
    init_device_mesh,
    placement_registry,
    register_plugin,
    unregister_plugin,
)
from vescale.dtensor.testing import distributed
from vescale.dtensor.testing.placements import Impostor, NoGeometry, OwnerOnly, OwnerPlugin, StepSpy


def test_builtins_register_through_the_same_hook():
    pm = get_plugin_manager()
    builtin = pm.get_plugin("vescale.dtensor.builtin")
    assert builtin is not None
    impls = {i.plugin_name: i for i in pm.hook.vescale_register_placements.get_hookimpls()}
    assert impls["vescale.dtensor.builtin"].trylast
    steps = {i.plugin_name: i for i in pm.hook.vescale_redistribute_step.get_hookimpls()}
    assert steps["vescale.dtensor.builtin"].trylast
    reg = placement_registry()
    assert reg["Shard"] is Shard and reg["Replicate"] is Replicate and reg["Partial"] is Partial


def test_register_and_duplicate_names():
    name = register_plugin(OwnerPlugin(), name="test-owner")
    try:
        assert placement_registry()["test.OwnerOnly"] is OwnerOnly
        register_plugin(Impostor(), name="test-impostor")
        try:
            with pytest.raises(ValueError) as err:
                placement_registry()
            msg = str(err.value)
            assert "test.OwnerOnly" in msg and "OwnerOnly" in msg and "OtherOwner" in msg
        finally:
            unregister_plugin(name="test-impostor")
        assert placement_registry()["test.OwnerOnly"] is OwnerOnly
    finally:
        unregister_plugin(name=name)
    assert "test.OwnerOnly" not in placement_registry()


def test_non_placement_is_a_type_error():
    class Bad:
        @vd.hookimpl
        def vescale_register_placements(self):
            return int

    register_plugin(Bad(), name="test-bad")
    try:
        with pytest.raises(TypeError, match="Placement subclass"):
            placement_registry()
    finally:
        unregister_plugin(name="test-bad")


def test_unknown_op_family_rejected():
    from dataclasses import dataclass
    from typing import ClassVar

    with pytest.raises(TypeError, match="unknown families"):

        @dataclass(frozen=True)
        class Weird(vd.PluginPlacement):
            PLACEMENT_NAME: ClassVar[str] = "weird"
            LOCAL_OP_FAMILIES: ClassVar[frozenset[str]] = frozenset({"matmul"})


@distributed(2)
def test_step_hook_is_asked_once_per_pair_and_never_per_op():
    mesh = init_device_mesh("cpu", (2,))
    register_plugin(OwnerPlugin(), name="test-owner")
    spy = StepSpy()
    register_plugin(spy, name="test-spy")
    try:
        x = torch.arange(12.0).reshape(4, 3)
        for _ in range(5):
            d = distribute_tensor(x, mesh, [OwnerOnly(1)])
            r = d.redistribute(mesh, [Replicate()])
            assert torch.equal(r.to_local(), x)
        pairs = [(s, t) for s, t in spy.calls]
        assert len(pairs) == len(set(pairs)), "a pair was asked twice"
        asked = len(spy.calls)
        for _ in range(20):  # ops and repeated redistributions ask no hook
            d = d * 2 + 1
            d.redistribute(mesh, [Replicate()])
            d.sum()
        assert len(spy.calls) == asked
    finally:
        unregister_plugin(name="test-spy")
        unregister_plugin(name="test-owner")


@distributed(2)
def test_no_step_is_a_clear_error_naming_both_placements():
    mesh = init_device_mesh("cpu", (2,))
    x = torch.ones(4, 2)
    with pytest.raises(NotImplementedError) as err:
        distribute_tensor(x, mesh, [NoGeometry()])
    assert "NoGeometry" in str(err.value) and "Replicate" in str(err.value)
    d = distribute_tensor(x, mesh, [OwnerOnly(0)])
    with pytest.raises(NotImplementedError) as err:
        d.redistribute(mesh, [NoGeometry()])
    assert "OwnerOnly" in str(err.value) and "NoGeometry" in str(err.value)
