"""Equivalence with single-device PyTorch: outputs, every gradient, losses over 3 AdamW steps.

Same seed and data on every rank; the parallel model must match the single-device
model to 1e-5 (fp32) under TP=2, TP=4 and DP2xTP2 (dp: Replicate) meshes, with
hand-written and automatic plans, with and without sequence parallelism.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from vescale.dmodule import parallelize_module, vocab_parallel_cross_entropy
from vescale.dmodule.testing import GPT, MLP, GPTConfig
from vescale.dtensor import Replicate, Shard, init_device_mesh
from vescale.dtensor.testing import distributed

TOL = dict(atol=1e-5, rtol=1e-5)


def _mesh(shape):
    names = ("dp", "tp") if len(shape) == 2 else ("tp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _tp(mesh, p):
    out = [Replicate()] * mesh.ndim
    out[-1] = p
    return out


def mlp_plan(mesh):
    return {
        "parameter": {
            r"fc1\.weight": _tp(mesh, Shard(0)),
            r"fc1\.bias": _tp(mesh, Shard(0)),
            r"fc2\.weight": _tp(mesh, Shard(1)),
        },
        "forward": {"input": [_tp(mesh, Replicate())], "fc2.output": [_tp(mesh, Replicate())]},
    }


def gpt_hand_plan(mesh, sp: bool, vocab_parallel_loss: bool):
    """Megatron TP(+SP) for GPT, written by hand."""
    act = Shard(1) if sp else Replicate()
    fwd = {
        r"wte.output": [_tp(mesh, act)],
        r"blocks\.\d+\.attn\.o_proj.output": [_tp(mesh, act)],
        r"blocks\.\d+\.mlp\.fc2.output": [_tp(mesh, act)],
        r"lm_head.output": [_tp(mesh, Shard(-1) if vocab_parallel_loss else Replicate())],
    }
    if sp:
        fwd[r"blocks\.\d+\.attn.input"] = {"x": _tp(mesh, Replicate())}
        fwd[r"blocks\.\d+\.mlp.input"] = [_tp(mesh, Replicate())]
        fwd[r"lm_head.input"] = [_tp(mesh, Replicate())]
    return {
        "parameter": {
            r"wte\.weight": _tp(mesh, Shard(0)),
            r"blocks\.\d+\.attn\.[qkv]_proj\.(weight|bias)": _tp(mesh, Shard(0)),
            r"blocks\.\d+\.attn\.o_proj\.weight": _tp(mesh, Shard(1)),
            r"blocks\.\d+\.mlp\.fc1\.(weight|bias)": _tp(mesh, Shard(0)),
            r"blocks\.\d+\.mlp\.fc2\.weight": _tp(mesh, Shard(1)),
        },
        "forward": fwd,
    }


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(out, target, vocab_parallel: bool):
    if vocab_parallel:
        return vocab_parallel_cross_entropy(out, target)
    if isinstance(out, DTensor):
        assert all(p.is_replicate() for p in out.placements), out.placements
        out = out.to_local()
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def run_equivalence(kind, mesh_shape, plan_kind, sp=False, vocab_parallel_loss=False, steps=3):
    mesh = _mesh(mesh_shape)
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP(16, 32)
        x = torch.randn(4, 16)
        target = torch.randn(4, 16)
    else:
        cfg = GPTConfig()
        model = GPT(cfg)
        x = torch.randint(0, cfg.vocab_size, (2, 8))
        target = torch.randint(0, cfg.vocab_size, (2, 8))
    ref = copy.deepcopy(model)
    if plan_kind == "auto":
        plan = None
        if vocab_parallel_loss:
            plan = {"forward": {"lm_head.output": [_tp(mesh, Shard(-1))]}}
        dm = parallelize_module(model, mesh, plan, auto_plan=True, sequence_parallel=sp)
    elif kind == "mlp":
        dm = parallelize_module(model, mesh, mlp_plan(mesh))
    else:
        dm = parallelize_module(model, mesh, gpt_hand_plan(mesh, sp, vocab_parallel_loss))
    assert dm is model and isinstance(dm, type(ref))
    opt = torch.optim.AdamW(dm.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    params = dict(dm.named_parameters())
    losses = []
    for _ in range(steps):
        out, ref_out = dm(x), ref(x)
        torch.testing.assert_close(_full(out), ref_out, **TOL)
        if kind == "mlp":
            o = out.to_local() if isinstance(out, DTensor) else out
            loss, ref_loss = F.mse_loss(o, target), F.mse_loss(ref_out, target)
        else:
            loss = _loss(out, target, vocab_parallel_loss)
            ref_loss = F.cross_entropy(ref_out.flatten(0, -2), target.flatten())
        torch.testing.assert_close(loss, ref_loss, **TOL)
        losses.append(loss.item())
        loss.backward()
        ref_loss.backward()
        for name, p in ref.named_parameters():
            g = params[name].grad
            assert isinstance(g, DTensor), name
            assert not any(pl.is_partial() for pl in g.placements), (name, g.placements)
            assert g.placements == params[name].placements, (name, g.placements)
            torch.testing.assert_close(
                g.full_tensor(), p.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}"
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(
                params[name].full_tensor(),
                p.detach(),
                **TOL,
                msg=lambda m, name=name: f"{name}: {m}",
            )
    return losses


CASES_2 = [
    ("mlp", "hand", False, False),
    ("gpt", "hand", False, False),
    ("gpt", "hand", True, True),
    ("gpt", "auto", False, False),
    ("gpt", "auto", True, False),
]


@pytest.mark.parametrize("kind,plan,sp,vp", CASES_2)
@distributed(2)
def test_tp2(kind, plan, sp, vp):
    run_equivalence(kind, (2,), plan, sp, vp)


@distributed(4)
def _run4():
    run_equivalence("mlp", (4,), "hand")
    run_equivalence("gpt", (4,), "auto", sp=True, vocab_parallel_loss=True)
    run_equivalence("gpt", (2, 2), "hand", sp=True, vocab_parallel_loss=False)
    run_equivalence("gpt", (2, 2), "auto", sp=True, vocab_parallel_loss=True)


def test_tp4_and_dp2xtp2():
    _run4()


class _EmbedMLP(torch.nn.Module):
    """A vocab-parallel embedding whose replicated output feeds only column-parallel layers."""

    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.up_proj = torch.nn.Linear(dim, 2 * dim)
        self.down_proj = torch.nn.Linear(2 * dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.down_proj(self.up_proj(self.embed_tokens(ids)).relu()))


@distributed(2)
def test_vocab_parallel_embedding_partial_grad():
    # Without sequence parallelism the embedding output (_MaskPartial -> Replicate)
    # gets a Partial(sum) gradient from up_proj; the backward of the all-reduce used
    # to fail with "Redistribution from P(sum) to MaskP(...) is unsupported".
    mesh = _mesh((2,))
    torch.manual_seed(0)
    model = _EmbedMLP()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, sequence_parallel=False)
    assert model.embed_tokens.weight.placements == (Shard(0),)
    ids = torch.randint(0, 16, (2, 5))
    out, ref_out = model(ids), ref(ids)
    torch.testing.assert_close(out.full_tensor(), ref_out, **TOL)
    out.to_local().square().sum().backward()
    ref_out.square().sum().backward()
    params = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name].grad.full_tensor(), p.grad, **TOL)
