"""torch.distributed.checkpoint and torch's state-dict API on every vescale engine.

``dcp.save`` / ``dcp.load`` / ``dcp.async_save`` and
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` (full and
sharded) on DDP (``replicate``), FSDP (``fully_shard``), HSDP, TP (``parallelize_module``)
and FSDP x TP, each against the single-device model: saved by one engine, loaded into
every other and into a plain single-device model, values exactly equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from vescale.dmodule import DModule, fully_shard, parallelize_module, replicate
from vescale.dtensor import DTensor, init_device_mesh
from vescale.dtensor.testing import distributed, load_helper
from vescale.ragged import RaggedShard

H = load_helper(__file__, "_dp_helpers")

ENGINES = ["ddp", "fsdp", "hsdp", "tp", "fsdp_tp"]
FULL = StateDictOptions(full_state_dict=True)
TIMEOUT = 300.0


def _build(kind: str, seed: int = 0):
    """The test GPT (``seed``) under one engine on the 4-rank pool."""
    H.fresh_caches()
    model = H.make_gpt(seed)
    if kind == "ddp":
        return replicate(model, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), "dp")
    if kind == "fsdp":
        return fully_shard(model, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)), "dp")
    if kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
        return DModule(model, mesh, data_parallel={"rep": "ddp", "dp": "fsdp"})
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(model, mesh, None, tp_dim="tp")
    if kind == "tp":
        return model
    assert kind == "fsdp_tp", kind
    return fully_shard(model, mesh, "dp")


def _step(model) -> torch.optim.Optimizer:
    """One AdamW step on the same full batch on every rank (the optimizer gets state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    idx, tgt = H.batches(1)[0]
    out = model(idx)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1)).backward()
    opt.step()
    opt.zero_grad()
    return opt


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_equal(got, want, where: str = "state dict") -> None:
    """Nested state dicts equal exactly: same keys, tensors (gathered) bit-equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (
            f"{where}: keys differ: {sorted(set(got) ^ set(want))}"
        )
        for k in want:
            _assert_equal(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        g, w = _full(got), _full(want)
        assert isinstance(g, torch.Tensor) and not isinstance(g, DTensor), where
        assert g.shape == w.shape and g.dtype == w.dtype, f"{where}: {g.shape} vs {w.shape}"
        assert torch.equal(g, w), f"{where}: values differ"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _fresh_full(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=FULL)


@pytest.mark.parametrize("kind", ENGINES)
@distributed(4, timeout=TIMEOUT)
def test_get_state_dict_equals_single_device(kind):
    ref = H.make_gpt().state_dict()
    model = _build(kind)
    full = _fresh_full(model)
    _assert_equal(full, ref, f"{kind} full")
    assert not any(isinstance(v, DTensor) for v in full.values())
    sharded = get_model_state_dict(model)
    _assert_equal(sharded, ref, f"{kind} sharded")
    dts = [v for v in sharded.values() if isinstance(v, DTensor)]
    if kind in ("fsdp", "hsdp", "fsdp_tp"):
        assert len(dts) == len(ref)
        assert all(isinstance(v.placements[-1], RaggedShard) for v in dts)
    if kind == "tp":
        assert dts and any(not p.is_replicate() for v in dts for p in v.placements)


@pytest.mark.parametrize("src", ENGINES)
@distributed(4, timeout=TIMEOUT)
def test_save_with_one_engine_load_into_every_other(src, tmp_path):
    ref = H.make_gpt().state_dict()
    path = str(tmp_path / src)
    dcp.save(get_model_state_dict(_build(src)), checkpoint_id=path)
    for dst in ENGINES:
        model = _build(dst, seed=3)  # other values: the load must overwrite all of them
        sd = get_model_state_dict(model)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model, sd)
        _assert_equal(_fresh_full(model), ref, f"{src} -> {dst}")
    if dist.get_rank() == 0:  # a plain single-device model, no process group involved
        plain = H.make_gpt(5)
        sd = plain.state_dict()
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        plain.load_state_dict(sd)
        _assert_equal(plain.state_dict(), ref, f"{src} -> single device")
    dist.barrier()


@pytest.mark.parametrize("kind", ENGINES)
@distributed(4, timeout=TIMEOUT)
def test_async_save_then_load(kind, tmp_path):
    model = _build(kind)
    opt = _step(model)
    want_model, want_optim = get_state_dict(model, opt, options=FULL)
    m_sd, o_sd = get_state_dict(model, opt)
    path = str(tmp_path / kind)
    dcp.async_save({"model": m_sd, "optim": o_sd}, checkpoint_id=path).result()
    for dst in sorted({kind, "fsdp"}):
        model2 = _build(dst, seed=3)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
        m2, o2 = get_state_dict(model2, opt2)
        state = {"model": m2, "optim": o2}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        got_model, got_optim = get_state_dict(model2, opt2, options=FULL)
        _assert_equal(got_model, want_model, f"{kind} -> {dst} model")
        _assert_equal(got_optim, want_optim, f"{kind} -> {dst} optimizer")


@pytest.mark.parametrize("broadcast", [False, True])
@pytest.mark.parametrize("kind", ENGINES)
@distributed(4, timeout=TIMEOUT)
def test_set_state_dict_full_round_trip(kind, broadcast):
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    give = not broadcast or dist.get_rank() == 0  # broadcast_from_rank0: only rank 0 has it
    # a single-device model's state dict into the engine
    ref = H.make_gpt().state_dict()
    model = _build(kind, seed=3)
    set_model_state_dict(
        model, {k: v.clone() for k, v in ref.items()} if give else {}, options=opts
    )
    _assert_equal(_fresh_full(model), ref, f"{kind} from single device")
    # model and optimizer state: get full, set into a fresh engine, get again
    opt = _step(model)
    want_model, want_optim = get_state_dict(model, opt, options=FULL)
    model2 = _build(kind, seed=4)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    if broadcast:
        # Two calls: torch's combined set_state_dict decides per rank whether the model is
        # loaded from `not model_state_dict`, so ranks given {} skip it (docs/data_parallel.md).
        # torch also rewrites rank 0's dicts in place: hand it copies.
        set_model_state_dict(model2, copy.deepcopy(want_model) if give else {}, options=opts)
        set_optimizer_state_dict(
            model2, opt2, copy.deepcopy(want_optim) if give else {}, options=opts
        )
    else:
        set_state_dict(
            model2, opt2, model_state_dict=want_model, optim_state_dict=want_optim, options=FULL
        )
    got_model, got_optim = get_state_dict(model2, opt2, options=FULL)
    _assert_equal(got_model, want_model, f"{kind} model")
    _assert_equal(got_optim, want_optim, f"{kind} optimizer")


@distributed(4, timeout=TIMEOUT)
def test_full_state_dict_of_the_wrong_shape_names_the_key():
    model = _build("fsdp")
    bad = {k: v.clone() for k, v in H.make_gpt().state_dict().items()}
    bad["ln_f.weight"] = torch.zeros(3, 5)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    with pytest.raises(ValueError, match=r"'ln_f\.weight' has shape \(3, 5\)"):
        set_model_state_dict(model, bad if dist.get_rank() == 0 else {}, options=opts)
