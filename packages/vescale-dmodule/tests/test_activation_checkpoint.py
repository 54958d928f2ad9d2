"""Activation checkpointing (``activation_checkpointing=``) with no DP, TP, DDP, FSDP, FSDP x TP.

Every configuration trains 5 AdamW steps against single-device PyTorch (losses and
parameters to 1e-5). Memory: the number and bytes of tensors autograd saves in
forward, counted with ``saved_tensors_hooks``, drop by exactly the checkpointed
blocks' own saved tensors. HSDP + checkpointing is in ``test_hsdp.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vescale.dmodule import DModule, apply_activation_checkpointing, get_dp_engine
from vescale.dmodule._activation_checkpoint import is_checkpointed, resolve_checkpoint_modules
from vescale.dmodule.testing import Block
from vescale.dtensor import DTensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import distributed, load_helper


def _checkpointed(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if is_checkpointed(m)]


H = load_helper(__file__, "_dp_helpers")


def _loss(model, idx, tgt):
    out = model(idx)
    if isinstance(out, DTensor):
        out = out.to_local()  # Replicate on tp
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _saved(fn) -> tuple[int, int]:
    """(number, bytes) of tensors autograd saves for backward while ``fn()`` runs."""
    n = [0, 0]

    def pack(t):
        n[0] += 1
        n[1] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return n[0], n[1]


def _expected_saved(idx, tgt) -> tuple[int, int, int, int]:
    """Single device: saved (count, bytes) in forward + backward, without and with AC."""
    plain, ac = H.make_gpt(), H.make_gpt()
    apply_activation_checkpointing(ac)
    return (
        *_saved(lambda: _loss(plain, idx, tgt).backward()),
        *_saved(lambda: _loss(ac, idx, tgt).backward()),
    )


def _train(model, mesh, dp: str | None, *, n_dp: int):
    """5 AdamW steps of ``model`` on this rank's part of the global batch; mean losses."""
    data = H.batches()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for idx, tgt in data:
        if dp is not None:
            idx, tgt = H.local_slice(idx, mesh, dp), H.local_slice(tgt, mesh, dp)
        opt.zero_grad()
        loss = _loss(model, idx, tgt)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)  # every rank of a dp group holds the same loss
        losses.append(total.item() / dist.get_world_size())
        opt.step()
    return losses


def _reference():
    ref = H.make_gpt()
    return ref, H.train_reference(ref, H.batches())


def _check(model, losses):
    ref, ref_losses = _reference()
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    H.assert_params_close(model, ref)


# ------------------------------------------------------------------ no distribution
def test_ac_single_device_fewer_saved_tensors_same_gradients():
    idx, tgt = H.batches(1)[0]
    plain, ac = H.make_gpt(), H.make_gpt()
    names = apply_activation_checkpointing(ac)
    assert names == ["blocks.0", "blocks.1"]
    assert type(ac) is type(plain) and type(ac.blocks[0]) is Block  # classes untouched
    assert is_checkpointed(ac.blocks[0]) and not is_checkpointed(ac)
    n_plain, b_plain = _saved(lambda: H.gpt_loss(plain, idx, tgt).backward())
    n_ac, b_ac = _saved(lambda: H.gpt_loss(ac, idx, tgt).backward())
    x = torch.randn(H.GLOBAL_BATCH, H.SEQ, H.cfg().n_embd)
    n_block, b_block = _saved(lambda: plain.blocks[0](x))
    # each checkpointed block keeps only its input instead of its own saved tensors
    L = len(names)
    assert n_block > 10
    # (torch 2.11's checkpoint also keeps one small tensor per region, a few bytes)
    kept = n_ac - (n_plain - L * n_block)
    assert L <= kept <= 2 * L, (n_plain, n_ac, n_block)
    extra = b_ac - (b_plain - L * b_block + L * x.numel() * 4)
    assert 0 <= extra <= 64 * L, (b_plain, b_ac, b_block)
    for (name, p), q in zip(plain.named_parameters(), ac.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=0, rtol=0, msg=name)
    # applying again changes nothing; no_grad forwards do not checkpoint
    assert apply_activation_checkpointing(ac) == names
    with torch.no_grad():
        assert _saved(lambda: ac(idx)) == (0, 0)


def test_ac_selection_spellings():
    m = H.make_gpt()
    assert resolve_checkpoint_modules(m, True) == ["blocks.0", "blocks.1"]
    assert resolve_checkpoint_modules(m, r"blocks\.\d+\.mlp") == ["blocks.0.mlp", "blocks.1.mlp"]
    assert resolve_checkpoint_modules(m, [r"blocks\.0", r"blocks\.0\.attn", "ln_f"]) == [
        "blocks.0",  # blocks.0.attn is inside blocks.0: only the outermost
        "ln_f",
    ]
    assert resolve_checkpoint_modules(m, lambda n, mod: isinstance(mod, Block)) == [
        "blocks.0",
        "blocks.1",
    ]
    assert resolve_checkpoint_modules(m, [m.blocks[1]]) == ["blocks.1"]
    assert resolve_checkpoint_modules(m, None) == [] == resolve_checkpoint_modules(m, False)
    with pytest.raises(ValueError, match="'block' matches no submodule name; did you mean"):
        resolve_checkpoint_modules(m, ["block"])
    with pytest.raises(ValueError, match="not a submodule"):
        resolve_checkpoint_modules(m, [torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        resolve_checkpoint_modules(torch.nn.Linear(2, 2), True)
    with pytest.raises(TypeError, match="activation_checkpointing must be"):
        resolve_checkpoint_modules(m, 3)


# ------------------------------------------------------------------ tensor parallel only
@pytest.mark.parametrize("sp", [False, True])
@distributed(4)
def test_ac_tensor_parallel_matches_single_device(sp):
    H.fresh_caches()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # no data parallelism: every rank trains on the whole batch
    model = DModule(
        H.make_gpt(), mesh, None, tp_dim="tp", sequence_parallel=sp, activation_checkpointing=True
    )
    _check(model, _train(model, mesh, None, n_dp=1))


# ------------------------------------------------------------------ DDP
@distributed(4)
def test_ac_ddp_matches_single_device():
    mesh = H.mesh_for(4)
    model = DModule(
        H.make_gpt(),
        mesh,
        data_parallel={"dp": {"mode": "ddp", "bucket_cap_mb": 0.004}},
        activation_checkpointing=True,
    )
    _check(model, _train(model, mesh, "dp", n_dp=4))


# ------------------------------------------------------------------ FSDP
@pytest.mark.parametrize(
    "reshard,prefetch", [(True, True), (False, True), (True, False), (False, False)]
)
@distributed(4)
def test_ac_fsdp_matches_single_device(reshard, prefetch):
    n = 4
    mesh = H.mesh_for(n)
    fsdp = {"mode": "fsdp", "reshard_after_forward": reshard, "prefetch": prefetch}
    model = DModule(H.make_gpt(), mesh, data_parallel={"dp": fsdp}, activation_checkpointing=True)
    engine = get_dp_engine(model)
    assert _checkpointed(model) == [g.name for g in engine.groups[1:]]
    idx, tgt = H.batches(1)[0]
    idx, tgt = H.local_slice(idx, mesh), H.local_slice(tgt, mesh)
    # memory: the same saved tensors as the checkpointed single-device model
    n_plain, b_plain, n_ac, b_ac = _expected_saved(idx, tgt)
    assert n_ac < n_plain // 2 and b_ac < b_plain // 2
    with CommDebugMode() as comm:
        saved = _saved(lambda: _loss(model, idx, tgt).backward())
    assert saved == (n_ac, b_ac), (saved, n_ac, b_ac, n_plain, b_plain)
    # recomputation neither gathers again nor reduces twice: FSDP's own bytes
    nparams = sum(p.numel() for p in model.parameters())
    bound = (3 if reshard else 2) * (n - 1) / n * nparams * 4
    assert bound <= comm.get_total_bytes() <= 1.02 * bound, (comm.get_total_bytes(), bound)
    assert engine._fwd_order == engine.groups  # no order recorded during recomputation
    assert not any(g.unsharded or g.swapped_in or g.grads_live for g in engine.groups)
    sharded = {id(s) for g in engine.groups for bb in g.bufs for s in bb.sharded.values()}
    assert all(id(p) in sharded for p in model.parameters())  # sharded parameters back
    # equivalence: a fresh model, 5 steps
    model = DModule(H.make_gpt(), mesh, data_parallel={"dp": fsdp}, activation_checkpointing=True)
    _check(model, _train(model, mesh, "dp", n_dp=n))


@pytest.mark.parametrize("where", ["around_groups", "inside_groups"])
@distributed(4)
def test_ac_fsdp_regions_vs_groups(where):
    mesh = H.mesh_for(4)
    if where == "around_groups":
        # FSDP groups are each block's attn and mlp; the checkpointed region is the
        # whole block: its layer norms belong to the enclosing root group
        fsdp = {"mode": "fsdp", "groups": [r"blocks\.\d+\.attn", r"blocks\.\d+\.mlp"]}
        ac = [r"blocks\.\d+"]
    else:
        # FSDP groups are the blocks; only each block's MLP is checkpointed
        fsdp = {"mode": "fsdp"}
        ac = [r"blocks\.\d+\.mlp"]
    model = DModule(H.make_gpt(), mesh, data_parallel={"dp": fsdp}, activation_checkpointing=ac)
    _check(model, _train(model, mesh, "dp", n_dp=4))
    engine = get_dp_engine(model)
    assert not any(g.unsharded or g.swapped_in for g in engine.groups)


# ------------------------------------------------------------------ FSDP x TP
@pytest.mark.parametrize("sp", [False, True])
@distributed(4)
def test_ac_fsdp_tp_matches_single_device(sp):
    H.fresh_caches()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = DModule(
        H.make_gpt(),
        mesh,
        None,
        tp_dim="tp",
        sequence_parallel=sp,
        data_parallel={"dp": "fsdp"},
        activation_checkpointing=True,
    )
    assert _checkpointed(model) == ["blocks.0", "blocks.1"]
    _check(model, _train(model, mesh, "dp", n_dp=2))


@distributed(4)
def test_ac_bad_input_before_communication():
    mesh = H.mesh_for(4)
    m = H.make_gpt()
    with pytest.raises(ValueError, match="matches no submodule"):
        DModule(m, mesh, data_parallel={"dp": "fsdp"}, activation_checkpointing=["nope"])
    # nothing happened to the model
    assert get_dp_engine(m) is None and not is_checkpointed(m.blocks[0])
    with pytest.raises(TypeError, match="activation_checkpointing must be"):
        DModule(H.make_gpt(), mesh, data_parallel={"dp": "ddp"}, activation_checkpointing=1.5)
