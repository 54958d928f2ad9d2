"""Tensor parallelism on a mesh with a replica dim, each rank of it holding other samples.

``parallelize_module(model, mesh)`` on a ("dp", "tp") mesh without ``data_parallel=``:
the plan places only ``Replicate()`` on "dp", so the model computes on the "tp"
sub-mesh while its parameters stay DTensors on the whole mesh (``Replicate()`` on
"dp"), and each rank's gradients are those of its own samples. The model is plain
PyTorch with LLaMA's shape of backward: a SwiGLU MLP and a hand-written RMSNorm pass
the column-parallel ``lm_head``'s ``Partial`` input gradient on, and the ``mul`` of the
MLP then cut it over "dp" when the activations claimed ``Replicate()`` there (the
dp ranks' samples were mixed: parameters 4e-2 off single-device training).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vescale.dmodule import parallelize_module
from vescale.dtensor import DTensor, Replicate, Shard, init_device_mesh
from vescale.dtensor.testing import distributed

TOL = dict(atol=1e-5, rtol=1e-5)
VOCAB, DIM, SEQ = 32, 16, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class SwiGLU(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([SwiGLU(DIM), SwiGLU(DIM)])
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.lm_head(self.norm(x))


def _setup(**options):
    from vescale.dtensor import _compat

    _compat.clear_dtensor_caches()  # meshes of earlier test bodies
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, options.pop("plan", None), **options)
    ids = torch.randint(0, VOCAB, (4, SEQ))
    mine = ids.chunk(2)[mesh.get_local_rank("dp")]  # this dp rank's samples
    return mesh, model, ref, ids, mine


def _loss(out, ids):
    out = out.to_local() if isinstance(out, DTensor) else out
    return F.cross_entropy(out.flatten(0, 1), ids.flatten())


@distributed(4)
def test_distributed_optimizer_per_rank_data_matches_single_device():
    from vescale.optim import DistributedOptimizer

    mesh, model, ref, ids, mine = _setup()
    for p in model.parameters():  # what the optimizer and checkpoints see is unchanged
        assert p.device_mesh == mesh and p.placements[0] == Replicate(), p.placements
    assert model.layers[0].up_proj.weight.placements == (Replicate(), Shard(0))
    eps = 1e-6  # see test_hf.run_hf: the data-parallel mean rounds differently
    opt = DistributedOptimizer(model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=1e-2, eps=eps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=eps)
    params = dict(model.named_parameters())
    for step in range(3):
        out = model(mine)
        _loss(out, mine).backward()
        opt.step()
        opt.zero_grad()
        _loss(ref(ids), ids).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                params[name].detach().full_tensor(),
                p.detach(),
                **TOL,
                msg=lambda m, name=name, step=step: f"after step {step}, {name}: {m}",
            )
    # activations and outputs live on the tp sub-mesh: nothing claims Replicate() on dp
    assert out.device_mesh == mesh["tp"], out.device_mesh


@distributed(4)
def test_user_loop_idioms_match_single_device():
    """The loop as users write it: ``zero_grad()`` between forward and backward, the input
    as a keyword argument, a frozen parameter, two accumulated micro-batches per step."""
    from vescale.optim import DistributedOptimizer

    mesh, model, ref, ids, mine = _setup()
    for m in (model, ref):
        m.embed_tokens.weight.requires_grad_(False)
    eps = 1e-6
    opt = DistributedOptimizer(model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=1e-2, eps=eps)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, eps=eps)
    params = dict(model.named_parameters())
    for _step in range(2):
        for k, half in enumerate(mine.chunk(2)):  # accumulate two micro-batches
            out = model(ids=half)
            if k == 0:
                opt.zero_grad()  # after the forward, before the backward
            (_loss(out, half) / 2).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref(ids), ids).backward()
        ref_opt.step()
    for name, p in ref.named_parameters():
        assert params[name].requires_grad == p.requires_grad, name
        torch.testing.assert_close(params[name].detach().full_tensor(), p.detach(), **TOL)
    assert params["embed_tokens.weight"].grad is None


@pytest.mark.parametrize("sp", [False, True])
@distributed(4)
def test_gradients_are_each_ranks_own(sp):
    # The gradients (whole-mesh DTensors with the parameters' placements) are those of
    # this rank's samples alone: single-device backward on ``mine``.
    mesh, model, ref, _, mine = _setup(sequence_parallel=sp)
    _loss(model(mine), mine).backward()
    _loss(ref(mine), mine).backward()
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        g = params[name].grad
        assert isinstance(g, DTensor) and g.device_mesh == mesh, name
        assert g.placements == params[name].placements, (name, g.placements)
        # full_tensor gathers over tp only: Replicate() on dp moves nothing
        torch.testing.assert_close(
            g.full_tensor(), p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


@distributed(4)
def test_activation_checkpointing_of_a_module_with_own_parameters():
    # A checkpointed module's own hooks sit outside the checkpointed region: the
    # recomputation must see its parameters on the compute mesh too.
    mesh, model, ref, _, mine = _setup(activation_checkpointing=[r"layers\.\d+\.up_proj", "norm"])
    _loss(model(mine), mine).backward()
    _loss(ref(mine), mine).backward()
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad.full_tensor(), p.grad, **TOL)


@distributed(4)
def test_dump_plan_names_the_compute_mesh():
    _, model, *_ = _setup()
    text = model.dump_plan()
    assert "compute mesh:" in text and "replica dims 'dp'" in text, text


@distributed(4)
def test_a_plan_that_shards_on_dp_keeps_the_dim():
    # The input placed Shard(0) on dp: that dim carries data the plan knows of, so the
    # model computes on the whole mesh (as before) and the output lives there.
    plan = {"forward": {"input": [[Shard(0), Replicate()]]}}
    mesh, model, ref, ids, _ = _setup(plan=plan, auto_plan=True)
    out = model(ids)  # the whole batch on every rank, cut over dp by the plan
    # the automatic plan's lm_head output Replicate() gathers the batch over dp again
    assert out.device_mesh == mesh and out.placements == (Replicate(), Replicate())
    assert "compute mesh:" not in model.dump_plan()
    torch.testing.assert_close(out.full_tensor(), ref(ids), **TOL)


@distributed(4)
def test_gradient_sync_debug_sees_the_per_rank_gradients():
    # Without an optimizer that averages them, per-rank gradients of a parameter that is
    # Replicate() on dp diverge: the debug check names them. With the same data it stays
    # quiet.
    from vescale.debug import GradientSyncError, enable_gradient_sync_debug

    mesh, model, _, ids, mine = _setup()
    with enable_gradient_sync_debug(model):
        _loss(model(ids), ids).backward()  # same batch everywhere: replicas agree
        model.zero_grad()
        with pytest.raises(GradientSyncError, match="lm_head.weight"):
            _loss(model(mine), mine).backward()
