"""Fails loudly when torch changes an internal that vescale-dtensor relies on.

The report of ``_compat.check_torch_internals()`` on the torch under test must be the
one recorded for that release; the fallbacks it would take are tested on every torch
against the native paths, on real ranks.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale.dtensor  # noqa: F401  (installs the patches)
from vescale.dtensor import Partial, Shard, _compat, _dispatch, init_device_mesh
from vescale.dtensor.testing import distributed, expected_torch_internals

NATIVE = [
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "DTensor._local_tensor",
    "DTensor._spec",
    "torch.utils._pytree",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed._functional_collectives.AsyncCollectiveTensor",
    "torch.ops._c10d_functional",
    "torch.distributed.all_gather_single",
    "torch.distributed.reduce_scatter_single",
    "Shard._to_replicate_tensor",
    "Shard._replicate_to_shard",
    "Shard._to_new_shard_dim",
    "Shard.local_shard_size_and_offset",
    "Partial._reduce_value",
    "Partial._reduce_shard_value",
    "torch.distributed.tensor._ops._math_ops._NormPartial",
    "torch.distributed.distributed_c10d._get_default_group",
    "torch.distributed.distributed_c10d._set_pg_timeout",
    "torch.distributed.distributed_c10d._world",
    "torch.distributed.tensor.debug._clear_sharding_prop_cache",
    "torch.distributed.tensor._redistribute._gen_transform_infos",
    "torch.distributed.distributed_c10d._resolve_process_group",
    "torch.distributed.tensor.debug._comm_mode.NATIVE_TO_PY_MAPPING",
    "torch.optim.optimizer._foreach_supported_types",
    "DTensor redistribute of a _StridedShard that encodes no shard order",
    "DTensor.from_local(grad_placements=)",
    "DTensor subclass __torch_dispatch__ (plugin-placement DTensors)",
    "DTensor _unsafe_view flattening a sharded inner dim (4-D matmuls)",
    "DTensor view flattening a sharded inner dim (sequence-parallel logits)",
    "torch._dynamo DeviceMeshVariable.is_device_mesh (DeviceMesh subclasses)",
    "torch.distributed._state_dict_utils (full state dicts into plugin placements)",
    "DTensor OpDispatcher._custom_op_handlers (random ops drawn as on one device)",
    "torch.utils._python_dispatch.TorchDispatchMode",
]
FUSED = "ShardingPropagator split/cat strategies (fused projections)"
ATTENTION = "DTensor rules for aten._scaled_dot_product_flash_attention_for_cpu"
_REGISTER_SHARDING = "native: torch.distributed.tensor.experimental.register_sharding"
DYNAMO_MESH = "torch._dynamo DeviceMeshVariable.is_device_mesh (DeviceMesh subclasses)"
DYNAMO_NO_CHECK = "native: dynamo has no exact-type DeviceMesh check"
RECORDED = {
    (2, 11): {
        "torch.distributed.all_gather_single": "native: torch.distributed.all_gather_into_tensor",
        "torch.distributed.reduce_scatter_single": "native: torch.distributed.reduce_scatter_tensor",
        "DTensor redistribute of a _StridedShard that encodes no shard order": (
            "native: torch.distributed.tensor._redistribute._gen_transform_infos_non_cached wrapped"
        ),
        FUSED: "native: op_strategy_funcs + propagate_op_sharding",
        ATTENTION: _REGISTER_SHARDING,
        "DTensor.from_local(grad_placements=)": (
            "missing: has none; from_local(..., grad_placements=<not None>) raises TypeError"
        ),
        "DTensor subclass __torch_dispatch__ (plugin-placement DTensors)": (
            "native: routed from OpDispatcher._propagate_op_sharding_dispatch_slow_path"
        ),
        "DTensor _unsafe_view flattening a sharded inner dim (4-D matmuls)": (
            "fallback: torch's strict view rule refuses it (Attempted to flatten multiple "
            "dimensions, with dimension 1 being sharded.); its reshape rule (one all-gather "
            "of that dim)"
        ),
        "DTensor view flattening a sharded inner dim (sequence-parallel logits)": (
            "fallback: torch's strict view rule refuses it (Attempted to flatten multiple "
            "dimensions, with dimension 1 being sharded.); its reshape rule (one all-gather "
            "of that dim; a copy, not a view)"
        ),
        DYNAMO_MESH: "native: widened from torch's exact type to vescale's subclass",
    },
    (2, 13): {
        DYNAMO_MESH: DYNAMO_NO_CHECK,
        FUSED: "native: op_strategy_funcs + op_to_scalar_shape_adjuster",
        ATTENTION: _REGISTER_SHARDING,
    },
    (2, 15): {
        DYNAMO_MESH: DYNAMO_NO_CHECK,
        FUSED: "native: op_single_dim_strategy_funcs + op_to_scalar_shape_adjuster",
        ATTENTION: _REGISTER_SHARDING,
    },
}


def test_torch_internals_report_is_the_recorded_one():
    report = _compat.check_torch_internals()
    assert report == expected_torch_internals(report, NATIVE, RECORDED)


def test_a_fallback_warns_once_naming_the_internal():
    internals = _compat.TorchInternals("vescale-test")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not internals.probe("torch.fake._thing", lambda: "is missing", instead="a slow path")
        assert not internals.probe(
            "torch.fake._other", lambda: 1 / 0, instead="raises", required=True
        )
        internals.fallback("torch.fake._other2", "is missing", "a slow path")
        internals.fallback("torch.fake._other2", "is missing", "a slow path")  # no second warning
    msgs = [str(w.message) for w in seen if issubclass(w.category, _compat.TorchInternalsWarning)]
    assert msgs == [
        "vescale-test: torch internal torch.fake._thing: is missing; a slow path",
        "vescale-test: torch internal torch.fake._other: probe failed: "
        "ZeroDivisionError('division by zero'); raises",
        "vescale-test: torch internal torch.fake._other2: is missing; a slow path",
    ]
    report = internals.report()
    assert report["torch.fake._thing"] == "fallback: is missing; a slow path"
    assert report["torch.fake._other"].startswith("missing: probe failed: ZeroDivisionError")


def test_probe_that_passes_is_native():
    internals = _compat.TorchInternals("vescale-test")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert internals.probe("torch.fake._fine", lambda: None, instead="unused")
    assert internals.report() == {"torch.fake._fine": "native"}


def test_pick_returns_the_internal_or_its_stand_in():
    from vescale.dtensor.compat import dtensor_internals, sibling_internals

    internals = _compat.TorchInternals("vescale-test")
    public = object()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # found through an attribute chain, and through a submodule import
        assert internals.pick("torch._C._nn.flatten_dense_tensors", instead="-") is (
            torch._C._nn.flatten_dense_tensors
        )
        got = internals.pick(
            "torch.distributed.tensor.debug._comm_mode.NATIVE_TO_PY_MAPPING",
            lambda m: None if isinstance(m, dict) else "not a dict",
            instead="-",
        )
        assert isinstance(got, dict) and got
        assert internals.pick("torch.fake_mod._gone", stand_in=public, instead="slow") is public
        assert (
            internals.pick("torch.cat", lambda f: "changed", stand_in=public, instead="slow")
            is public
        )
    report = internals.report()
    assert report["torch._C._nn.flatten_dense_tensors"] == "native"
    assert report["torch.fake_mod._gone"].startswith("fallback: cannot be imported: ")
    assert report["torch.cat"] == "fallback: changed; slow"
    assert len([w for w in seen if issubclass(w.category, _compat.TorchInternalsWarning)]) == 2
    sibling = sibling_internals("vescale-test", shared=["DTensor._local_tensor"])
    assert sibling.report() == {
        "DTensor._local_tensor": dtensor_internals().report()["DTensor._local_tensor"]
    }


def test_rule_installation_degrades_instead_of_raising():
    class Bare:  # a propagator without any of the tables the rules go into
        pass

    where, adjust, problem = _compat._strided_rule_plan(Bare())
    assert (where, adjust) == (None, None) and "no split/cat strategy" in problem


@pytest.mark.parametrize("size", [0, 1, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_shard_size_fallback_matches_torch(size, n):
    for r in range(n):
        got = _compat._chunk_size_and_offset(size, n, r)
        want = Shard.local_shard_size_and_offset(size, n, r)
        assert got == tuple(int(v) for v in want)


@distributed(4)
def test_step_fallbacks_match_torch():
    """The public-collective fallback of every Shard/Partial step equals torch's own."""
    mesh = init_device_mesh("cpu", (2, 2))
    r = dist.get_rank()
    for shape in [(7, 6), (4, 4), (3, 5)]:
        full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
        for mesh_dim in (0, 1):
            n, rank = 2, mesh.get_local_rank(mesh_dim)
            for dim in (0, 1):
                size, off = _compat.shard_size_and_offset(shape[dim], n, rank)
                local = full.narrow(dim, off, size).contiguous()
                got = _compat._fallback_shard_to_replicate(local, mesh, mesh_dim, dim, shape)
                assert torch.equal(
                    got, _compat.shard_to_replicate(local, mesh, mesh_dim, dim, shape)
                )
                got = _compat._fallback_replicate_to_shard(full, mesh, mesh_dim, dim, rank)
                assert torch.equal(got, _compat.replicate_to_shard(full, mesh, mesh_dim, dim, rank))
            pending = full * (r + 1)
            for op in ("sum", "avg", "max", "min"):
                p = Partial(op)
                want = _compat.partial_to_replicate(pending, mesh, mesh_dim, p)
                saved = _compat._NATIVE_STEP["_reduce_value"]
                _compat._NATIVE_STEP["_reduce_value"] = False
                try:
                    got = _compat.partial_to_replicate(pending, mesh, mesh_dim, p)
                finally:
                    _compat._NATIVE_STEP["_reduce_value"] = saved
                torch.testing.assert_close(got, want)
            for dim in (0, 1):
                want = _compat.partial_to_shard(pending, mesh, mesh_dim, Partial("sum"), dim)
                saved = dict(_compat._NATIVE_STEP)
                _compat._NATIVE_STEP.update(dict.fromkeys(saved, False))
                try:
                    got = _compat.partial_to_shard(pending, mesh, mesh_dim, Partial("sum"), dim)
                    src = _compat.replicate_to_shard(full, mesh, mesh_dim, 0, rank)
                    moved = _compat.shard_to_shard(src, mesh, mesh_dim, 0, 1, shape)
                finally:
                    _compat._NATIVE_STEP.update(saved)
                torch.testing.assert_close(got, want)
                assert torch.equal(moved, _compat.shard_to_shard(src, mesh, mesh_dim, 0, 1, shape))
    with pytest.raises(NotImplementedError, match="no fallback reduction"):
        _compat._reduce_op(_compat.norm_partial(2.0))


def test_patches_wrap_torch_originals():
    assert DTensor.redistribute is _dispatch._patched_redistribute
    assert DTensor.from_local is _dispatch._patched_from_local
    assert _compat.ORIGINAL_REDISTRIBUTE.__module__ == "torch.distributed.tensor._api"
    assert _compat.ORIGINAL_FROM_LOCAL.__module__ == "torch.distributed.tensor._api"


def test_plugin_dtensor_is_a_dtensor_subclass():
    assert issubclass(_dispatch.PluginDTensor, DTensor)
    # base DTensor keeps torch's own dispatch (no Python override installed by vescale)
    assert DTensor.__torch_dispatch__.__func__.__module__ == "torch.distributed.tensor._api"


def _plans_of_two_meshes() -> bool:
    import torch.distributed.tensor._redistribute as tr
    from torch.distributed.tensor import Replicate

    from vescale.dtensor import distribute_tensor

    assert _compat.keep_redistribution_plans_across_meshes()  # the pool installed it
    found = []
    for _ in range(2):
        mesh = init_device_mesh("cpu", (2, 2))
        t = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0), Shard(1)])
        dst = t.redistribute(mesh, [Replicate(), Shard(0)])
        found.append(tr._gen_transform_infos(t._spec, dst._spec))
        assert found[-1] == tr._gen_transform_infos_non_cached(t._spec, dst._spec)
        assert torch.equal(dst.full_tensor(), torch.arange(16.0).reshape(4, 4))
        _compat.destroy_subgroups()
        _compat.clear_dtensor_caches()
    return found[0] is found[1]


@distributed(4)
def test_redistribution_plans_are_kept_by_mesh_layout():
    # a second mesh of the same layout reuses the plan searched for the first
    assert _plans_of_two_meshes()
