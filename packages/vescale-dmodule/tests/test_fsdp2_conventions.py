"""FSDP2's conventions on vescale's engines, each against torch's own FSDP2 on the same model.

Per-layer-then-root ``fully_shard``, ``MixedPrecisionPolicy`` (FSDP and DDP),
``CPUOffloadPolicy``, ``set_requires_gradient_sync``, ``unshard()``/``reshard()`` and
``reshard_after_forward`` as FSDP2 takes it. Losses of every step and the final
parameters are compared with ``torch.distributed.fsdp.fully_shard`` run on the same
ranks, seed and data.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from vescale.dmodule import (
    DModule,
    FullyShardedModule,
    MixedPrecision,
    ReplicatedModule,
    fully_shard,
    get_dp_engine,
    replicate,
)
from vescale.dtensor import DTensor
from vescale.dtensor.testing import distributed, load_helper
from vescale.ragged import RaggedShard

H = load_helper(__file__, "_dp_helpers")

# bf16 compute: both sides round the same way, but the reductions add in another order
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _per_layer_then_root(shard, model, mesh, **kw):
    for block in model.blocks:
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    return model


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: H.full(p.detach()).float() for n, p in model.named_parameters()}


def _assert_same_params(ours, theirs, **tol):
    a, b = _full_params(ours), _full_params(theirs)
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], **(tol or H.TOL), msg=n)


def _mesh():
    return H.mesh_for(4)


def _record(name, losses, ref):
    """The largest per-step loss difference vs torch; appended to the file named by
    ``VESCALE_RECORD_LOSS_DIFFS`` (rank 0) when that variable is set."""
    diff = max(abs(a - b) for a, b in zip(losses, ref))
    path = os.environ.get("VESCALE_RECORD_LOSS_DIFFS")
    if path and torch.distributed.get_rank() == 0:
        with open(path, "a") as f:
            f.write(f"{name}: max |loss - torch| = {diff:.3e}\n")
    return diff


# ----------------------------------------------------------------------------- idiom
@pytest.mark.parametrize("reshard", [True, False, None])
@distributed(4)
def test_per_layer_then_root_matches_torch_fsdp2(reshard):
    mesh, data = _mesh(), H.batches()
    ref = _per_layer_then_root(torch_fully_shard, H.make_gpt(), mesh, reshard_after_forward=reshard)
    ref_losses, _ = H.train_steps(ref, mesh, data)

    model = H.make_gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        # parameters are final after each call (an optimizer may be built now)
        assert all(isinstance(p.placements[0], RaggedShard) for p in block.parameters())
    block_params = [list(b.parameters()) for b in model.blocks]
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    assert [list(b.parameters()) for b in model.blocks] == block_params  # same objects
    engine = get_dp_engine(model)
    assert [g.name for g in engine.groups] == ["", "blocks.0", "blocks.1"]
    assert all(get_dp_engine(b) is engine for b in model.blocks)
    assert isinstance(model, FullyShardedModule) and isinstance(model, H.GPT)
    assert isinstance(model.blocks[0], FullyShardedModule)
    assert model.lm_head.weight is model.wte.weight
    losses, _ = H.train_steps(model, mesh, data)
    _record(f"per-layer-then-root reshard={reshard}", losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    _assert_same_params(model, ref)


@distributed(4)
def test_nested_calls_and_root_without_parameters():
    """fully_shard on blocks' MLPs, then the blocks, the model, and a root with no parameters."""
    mesh, data = _mesh(), H.batches()

    def build(shard):
        model = H.make_gpt()
        for block in model.blocks:
            shard(block.mlp, mesh=mesh)
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        return shard(torch.nn.Sequential(model), mesh=mesh)

    ref = build(torch_fully_shard)
    ref_losses, _ = H.train_steps(ref, mesh, data)
    model = build(fully_shard)
    engine = get_dp_engine(model)
    assert [g.name for g in engine.groups] == [
        "0",
        "0.blocks.0",
        "0.blocks.0.mlp",
        "0.blocks.1",
        "0.blocks.1.mlp",
    ]
    assert engine.root is None  # the Sequential has no parameters of its own
    losses, _ = H.train_steps(model, mesh, data)
    _record("nested fully_shard calls", losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    _assert_same_params(model, ref)
    with pytest.raises(ValueError, match="containers that do not implement forward"):
        fully_shard(H.make_gpt().blocks, mesh=mesh)


@distributed(4)
def test_per_layer_idiom_errors_before_any_collective():
    mesh = _mesh()
    model = fully_shard(H.make_gpt(), mesh, "dp")
    with pytest.raises(ValueError, match="enclosing module"):
        fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="already data-parallel"):
        fully_shard(model, mesh=mesh)
    # a weight shared between a wrapped block and the rest of the model
    model = H.make_gpt()
    model.lm_head = torch.nn.Linear(16, 16, bias=False)
    model.lm_head.weight = model.blocks[0].attn.o_proj.weight
    fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="shared with submodule 'blocks.0'"):
        fully_shard(model, mesh=mesh)
    # a DDP submodule cannot be taken over
    model = H.make_gpt()
    replicate(model.blocks[1], mesh, "dp")
    with pytest.raises(ValueError, match="fully_shard\\(\\) can only take over"):
        fully_shard(model, mesh=mesh)


# ----------------------------------------------------------------------------- options
@distributed(4)
def test_reshard_after_forward_int_and_none():
    mesh = _mesh()
    m = fully_shard(H.make_gpt(), mesh=mesh, reshard_after_forward=4)
    assert all(g.reshard_after_forward is True for g in get_dp_engine(m).groups)
    m = fully_shard(H.make_gpt(), mesh=mesh, reshard_after_forward=1)
    assert all(g.reshard_after_forward is False for g in get_dp_engine(m).groups)
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2"):
        fully_shard(H.make_gpt(), mesh=mesh, reshard_after_forward=2)
    with pytest.raises(ValueError, match="must divide"):
        fully_shard(H.make_gpt(), mesh=mesh, reshard_after_forward=3)
    with pytest.raises(NotImplementedError, match="shard_placement_fn"):
        fully_shard(H.make_gpt(), mesh=mesh, shard_placement_fn=lambda p: None)
    # None: FSDP2's rule, the root keeps its unsharded parameters after forward
    m = fully_shard(H.make_gpt(), mesh=mesh, reshard_after_forward=None)
    engine = get_dp_engine(m)
    idx = torch.randint(0, 64, (2, 8))
    loss = H.gpt_loss(m, idx, idx)
    assert engine.root.unsharded and not any(g.unsharded for g in engine.groups[1:])
    loss.backward()
    assert not any(g.unsharded for g in engine.groups)


@pytest.mark.parametrize("per_layer", [False, True])
@distributed(4)
def test_mp_policy_matches_torch_fsdp2(per_layer):
    mesh, data = _mesh(), H.batches()
    # output_dtype on the root only: an inner module's fp32 output would meet the
    # root's bf16 parameters (torch's FSDP2 then fails in layer_norm)
    inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    outer = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )

    def build(shard):
        model = H.make_gpt()
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=inner)
        return shard(model, mesh=mesh, mp_policy=outer)

    ref = build(torch_fully_shard)
    ref_losses, _ = H.train_steps(ref, mesh, data)
    if per_layer:
        model = build(fully_shard)
    else:  # one call: output_dtype applies where the model returns its output
        model = fully_shard(H.make_gpt(), mesh, "dp", mp_policy=outer)
    engine = get_dp_engine(model)
    mp_inner = MixedPrecision(torch.bfloat16, torch.float32)
    assert engine.root.mp == MixedPrecision(torch.bfloat16, torch.float32, torch.float32)
    assert all(g.mp == mp_inner for g in engine.groups[1:])
    with torch.no_grad():
        assert model(data[0][0][:2]).dtype == torch.float32  # output_dtype
    losses, _ = H.train_steps(model, mesh, data)
    _record(f"mp_policy bf16/fp32 per_layer={per_layer}", losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, **BF16_TOL)
    _assert_same_params(model, ref, **BF16_TOL)
    # the fp32 masters stay fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())


@distributed(4)
def test_mp_policy_output_dtype_and_errors():
    mesh = _mesh()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float16)
    m = fully_shard(H.make_gpt(), mesh=mesh, mp_policy=policy)
    with torch.no_grad():
        assert m(torch.randint(0, 64, (2, 8))).dtype == torch.float16
    with pytest.raises(TypeError, match="not both"):
        fully_shard(H.make_gpt(), mesh=mesh, mp_policy=policy, mixed_precision=MixedPrecision())
    with pytest.raises(TypeError, match="mp_policy must be"):
        fully_shard(H.make_gpt(), mesh=mesh, mp_policy="bf16")
    with pytest.raises(TypeError, match="offload_policy must be"):
        fully_shard(H.make_gpt(), mesh=mesh, offload_policy=True)


@pytest.mark.parametrize("reshard", [True, False])
@distributed(4)
def test_cpu_offload_matches_torch_fsdp2(reshard):
    mesh, data = _mesh(), H.batches()
    ref = _per_layer_then_root(
        torch_fully_shard,
        H.make_gpt(),
        mesh,
        offload_policy=CPUOffloadPolicy(pin_memory=False),
        reshard_after_forward=reshard,
    )
    ref_losses, _ = H.train_steps(ref, mesh, data)
    model = _per_layer_then_root(
        fully_shard,
        H.make_gpt(),
        mesh,
        offload_policy=CPUOffloadPolicy(),
        reshard_after_forward=reshard,
    )
    engine = get_dp_engine(model)
    assert engine.offload_device == torch.device("cpu")
    assert all(b.offloaded and b.dshard is not None for g in engine.groups for b in g.bufs)
    shard_bytes = sum(b.fb.local.numel() * 4 for g in engine.groups for b in g.bufs)
    engine.offload_copy_bytes = 0
    losses, opt = H.train_steps(model, mesh, data)
    # per step: every shard copied to the compute device for each all-gather (forward,
    # and backward again when resharded) and every gradient shard copied back
    gathers = 2 if reshard else 1
    assert engine.offload_copy_bytes == len(data) * (gathers + 1) * shard_bytes
    _record(f"cpu offload reshard={reshard}", losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    _assert_same_params(model, ref)
    # parameters, gradients and optimizer state: on the offload device
    for p in model.parameters():
        assert p.to_local().device.type == "cpu" and p.grad.to_local().device.type == "cpu"
        for v in opt.state[p].values():
            assert H.full(v).device.type == "cpu"


@distributed(4)
def test_set_requires_gradient_sync_matches_torch_fsdp2():
    mesh, data = _mesh(), H.batches()

    def accumulate(model, last):
        model.set_requires_gradient_sync(last)

    ref = _per_layer_then_root(torch_fully_shard, H.make_gpt(), mesh)
    ref_losses, _ = H.train_steps(ref, mesh, data, micro=2, accumulate=accumulate)
    model = _per_layer_then_root(fully_shard, H.make_gpt(), mesh)
    engine = get_dp_engine(model)
    seen = []

    def accumulate_and_check(model, last):
        accumulate(model, last)
        seen.append(all(g.sync is last for g in engine.groups))

    losses, _ = H.train_steps(model, mesh, data, micro=2, accumulate=accumulate_and_check)
    assert all(seen)
    _record("set_requires_gradient_sync accumulation", losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    _assert_same_params(model, ref)
    # recurse=False: only the module's own group
    model.set_requires_gradient_sync(False, recurse=False)
    assert [g.sync for g in engine.groups] == [False, True, True]
    model.blocks[1].set_requires_gradient_sync(False)
    assert [g.sync for g in engine.groups] == [False, True, False]


@distributed(4)
def test_unshard_reshard_match_torch_fsdp2():
    mesh = _mesh()
    ref = _per_layer_then_root(torch_fully_shard, H.make_gpt(), mesh)
    model = _per_layer_then_root(fully_shard, H.make_gpt(), mesh)
    ref.blocks[0].unshard()
    handle = model.blocks[0].unshard(async_op=True)
    handle.wait()
    theirs = dict(ref.blocks[0].named_parameters())
    ours = dict(model.blocks[0].named_parameters())
    assert ours.keys() == theirs.keys()
    for n, p in ours.items():
        assert not isinstance(p, DTensor) and p.shape == theirs[n].shape
        torch.testing.assert_close(p.detach(), theirs[n].detach(), **H.TOL)
    # not recursive: the root and the other block stay sharded
    assert isinstance(model.wte.weight, DTensor) and isinstance(
        model.blocks[1].ln_1.weight, DTensor
    )
    ref.blocks[0].reshard()
    model.blocks[0].reshard()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    engine = get_dp_engine(model)
    assert not any(g.unsharded for g in engine.groups)
    # a forward right after unshard() uses the gathered parameters
    model.unshard()
    data = H.batches(1)
    idx, tgt = H.local_slice(data[0][0], mesh), H.local_slice(data[0][1], mesh)
    ref.unshard()
    with torch.no_grad():
        ours, theirs = H.gpt_loss(model, idx, tgt).item(), H.gpt_loss(ref, idx, tgt).item()
    torch.testing.assert_close(ours, theirs, **H.TOL)
    assert all(isinstance(p, DTensor) for p in model.parameters())


# ----------------------------------------------------------------------------- DDP
@distributed(4)
def test_ddp_mp_policy_matches_torch_fsdp2():
    """DDP with FSDP2's MixedPrecisionPolicy (torch has no public DDP that takes one; the
    reference is torch's FSDP2 with the same policy: the same bf16 compute and fp32
    average of the gradients, only reduce-scattered instead of all-reduced)."""
    mesh, data = _mesh(), H.batches()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ref = torch_fully_shard(H.make_gpt(), mesh=mesh, mp_policy=policy)
    ref_losses, _ = H.train_steps(ref, mesh, data)
    model = replicate(H.make_gpt(), mesh, "dp", mp_policy=policy)
    assert isinstance(model, ReplicatedModule)
    losses, _ = H.train_steps(model, mesh, data)
    _record("DDP mp_policy bf16/fp32", losses, ref_losses)
    torch.testing.assert_close(losses, ref_losses, **BF16_TOL)
    _assert_same_params(model, ref, **BF16_TOL)
    # fp32 masters are the module's parameters outside forward
    assert all(p.dtype == torch.float32 for p in model.parameters())


@distributed(4)
def test_ddp_set_requires_gradient_sync_and_dmodule_mixins():
    mesh, data = _mesh(), H.batches()
    ref_losses = H.train_reference(H.make_gpt(), data, micro=2)
    model = DModule(H.make_gpt(), mesh, data_parallel={"dp": "ddp"})
    assert isinstance(model, DModule) and isinstance(model, ReplicatedModule)
    losses, _ = H.train_steps(
        model, mesh, data, micro=2, accumulate=lambda m, last: m.set_requires_gradient_sync(last)
    )
    torch.testing.assert_close(losses, ref_losses, **H.TOL)
    model = DModule(H.make_gpt(), mesh, data_parallel={"dp": "fsdp"})
    assert isinstance(model, DModule) and isinstance(model, FullyShardedModule)
    assert type(model).__name__ == "FSDPDModuleGPT"
