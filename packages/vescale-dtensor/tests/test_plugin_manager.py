import os

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


def test_broken_entry_points_are_reported_once_and_the_rest_keep_working(tmp_path):
    """An entry point that fails to import, and one whose hook has no spec, are skipped."""
    import subprocess
    import sys
    import textwrap

    for name, body in {
        "broken_vescale_plugin": "raise ImportError('this plugin is broken on purpose')\n",
        "typo_vescale_plugin": (
            "from vescale.dtensor import hookimpl\n\n"
            "@hookimpl\ndef vescale_register_placement():  # typo: no such hook\n    return []\n"
        ),
    }.items():
        info = tmp_path / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[vescale]\n{name[:-15]} = {name}\n")
        (tmp_path / f"{name}.py").write_text(body)
    script = textwrap.dedent(
        f"""
        import warnings
        import torch
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import vescale.checkpoint as vckpt
            from vescale.dtensor import placement_registry
            assert "RaggedShard" in placement_registry()  # an entry-point plugin
            for step in (1, 2):
                vckpt.save({str(tmp_path / "ckpt")!r}, {{"t": torch.full((3,), float(step))}})
            state = {{"t": torch.zeros(3)}}
            vckpt.load({str(tmp_path / "ckpt")!r}, state)
            assert state["t"].tolist() == [2.0] * 3
        for w in caught:
            print("WARNING:", w.message)
        print("PLUGINS_OK")
        """
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert "PLUGINS_OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    warned = [line for line in out.stdout.splitlines() if line.startswith("WARNING:")]
    broken = [w for w in warned if "'broken'" in w]
    typo = [w for w in warned if "'typo'" in w]
    assert len(broken) == 1 and "this plugin is broken on purpose" in broken[0], warned
    assert len(typo) == 1 and "vescale_register_placement" in typo[0], warned
