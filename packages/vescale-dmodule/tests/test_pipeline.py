"""Pipeline parallelism (torch.distributed.pipelining) against single-device training.

Every case trains the same tiny GPT for a few AdamW steps on one device and split into
pipeline stages (composed with FSDP / DDP / TP / SP per stage), on real gloo ranks (the
process pool: the threaded group has no send/recv), and compares the loss of every
step and every parameter afterwards (mean over micro-batches equals the full-batch
mean). Parameter names of the stages are the unmodified model's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.dmodule import (
    PipelineParallel,
    PipelineSplitError,
    parallelize_module,
    pipeline_parallelize,
)
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import DTensor, init_device_mesh
from vescale.dtensor.random import data_parallel_rng
from vescale.dtensor.testing import distributed
from vescale.optim import DistributedOptimizer, Muon

BATCH, SEQ, STEPS, LR = 8, 8, 2, 1e-3


def _cfg(n_layer: int = 4, dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(
        vocab_size=64,
        block_size=SEQ,
        n_layer=n_layer,
        n_head=2,
        n_embd=16,
        tie_embeddings=False,
        dropout=dropout,
    )


def _model(n_layer: int = 4, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(_cfg(n_layer, dropout))


def _loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _data():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (BATCH, SEQ), generator=g),
            torch.randint(0, 64, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(
    mesh,
    *,
    schedule: str,
    microbatches: int,
    parallelize=None,
    clip: float | None = None,
    n_layer: int = 4,
    split_points=None,
    dp_dim: str | tuple[str, ...] | None = None,
    optimizer=None,
    dropout: float = 0.0,
    param_atol: float = 1e-5,
):
    """Train single-device and pipelined side by side; compare losses, norms, parameters.

    ``optimizer(module, submesh)`` builds the optimizer of both runs (the single-device
    model with ``submesh=None``; default AdamW). ``dp_dim``: the data-parallel mesh
    dim(s) splitting the batch (row-major over several). With ``dropout``, both runs
    start from one ``torch.manual_seed`` (each keeps its own generator state) and the
    pipelined masks must be the single-device run's on the whole batch. ``param_atol``:
    the parameters' absolute tolerance after the steps.
    """
    make_opt = optimizer or (lambda m, _sub: torch.optim.AdamW(m.parameters(), lr=LR))
    ref = _model(n_layer, dropout)
    ref_opt = make_opt(ref, None)
    data = _data()
    dp_dims = (dp_dim,) if isinstance(dp_dim, str) else tuple(dp_dim or ())
    dp_n, dp_r = 1, 0
    for d in dp_dims:
        dp_n, dp_r = (
            dp_n * mesh.size(mesh.mesh_dim_names.index(d)),
            dp_r * mesh.size(mesh.mesh_dim_names.index(d)) + mesh.get_local_rank(d),
        )
    k = BATCH // dp_n

    pp = pipeline_parallelize(
        _model(n_layer, dropout),
        mesh,
        example_inputs=(data[0][0][:k],),
        loss_fn=_loss,
        microbatches=microbatches,
        schedule=schedule,
        split_points=split_points,
        parallelize_fn=parallelize,
    )
    assert isinstance(pp, PipelineParallel)
    names = [n for n, _ in pp.named_parameters()]
    ref_names = dict(ref.named_parameters())
    assert names and set(names) <= set(ref_names), names  # unmodified model's names
    opt = make_opt(pp.module, pp.submesh)
    assert pp.single_device_rng == (dropout > 0)
    torch.manual_seed(1234)
    ref_rng = pp_rng = torch.get_rng_state()
    for idx, tgt in data:
        torch.set_rng_state(ref_rng)
        ref_opt.zero_grad()
        ref_loss = _loss(ref(idx), tgt)
        ref_loss.backward()
        ref_rng = torch.get_rng_state()
        torch.set_rng_state(pp_rng)
        with data_parallel_rng(mesh, dp_dims) if dp_dims else contextlib.nullcontext():
            loss = pp.step(idx[dp_r * k : (dp_r + 1) * k], target=tgt[dp_r * k : (dp_r + 1) * k])
        pp_rng = torch.get_rng_state()
        # the generator stands where one device's does, on every rank
        assert torch.equal(pp_rng, ref_rng)
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = pp.clip_grad_norm_(clip)
            torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-5)
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        if pp.has_last_stage:
            assert loss is not None
            for d in dp_dims:
                dist.all_reduce(loss, group=mesh.get_group(d))
            loss = loss / dp_n
            torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
        else:
            assert loss is None
    for name, p in pp.named_parameters():
        torch.testing.assert_close(
            _full(p.detach()), ref_names[name].detach(), atol=param_atol, rtol=1e-5
        )
    # every parameter lives on exactly one stage (per pp rank group)
    counts = torch.zeros(len(ref_names))
    index = {n: i for i, n in enumerate(ref_names)}
    for n in names:
        counts[index[n]] += 1
    dist.all_reduce(counts, group=mesh.get_group("pp"))
    assert counts.tolist() == [1.0] * len(ref_names), counts
    return pp


@distributed(4)
def test_pp4_and_pp2_schedules_match_single_device():
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    # dropout: each stage's masks are the single-device ones of the whole batch
    pp = _check(mesh, schedule="1f1b", microbatches=4, clip=0.5, dropout=0.1)
    assert pp.split_points == ["blocks.1", "blocks.2", "blocks.3"]
    assert pp.stage_indices == [dist.get_rank()]
    # pp=2 (x dp=2, plain replicas kept in sync by DDP) with GPipe and explicit split points
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp = _check(
        mesh,
        schedule="gpipe",
        microbatches=2,
        split_points=["blocks.3"],
        dp_dim="dp",
        dropout=0.1,  # inside data_parallel_rng: micro-batch of this rank's part
        parallelize=lambda m, sub: parallelize_module(m, sub, {}, data_parallel={"dp": "ddp"}),
    )
    first = {n for n, _ in pp.named_parameters()}
    if pp.has_first_stage:
        assert "wte.weight" in first and "blocks.2.mlp.fc2.weight" in first
        assert "blocks.3.ln_1.weight" not in first and "lm_head.weight" not in first
    # pp=2 x dp=2 with ZeRO: DistributedOptimizer over each stage's (dp-replicated)
    # DTensor parameters, gradients clipped by the whole model's norm first
    _check(
        mesh,
        schedule="1f1b",
        microbatches=2,
        dp_dim="dp",
        clip=0.5,
        parallelize=lambda m, sub: parallelize_module(m, sub, {}),
        optimizer=lambda m, sub: (
            torch.optim.AdamW(m.parameters(), lr=LR)
            if sub is None
            else DistributedOptimizer(m, torch.optim.AdamW, mesh=sub, dp_dim="dp", lr=LR)
        ),
    )


@distributed(4)
def test_pp_x_fsdp_and_interleaved_pp_x_tp():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    _check(
        mesh,
        schedule="1f1b",
        microbatches=2,
        dp_dim="dp",
        clip=0.5,
        parallelize=lambda m, sub: parallelize_module(
            m, sub, {}, data_parallel={"dp": "fsdp"}, activation_checkpointing=True
        ),
    )
    # interleaved 1F1B: 4 stages on 2 pp ranks, each stage tensor(+sequence)-parallel,
    # trained by Muon (its matrices orthogonalized on a root rank of the stage's mesh)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = _check(
        mesh,
        schedule="interleaved1f1b",
        microbatches=2,
        clip=0.5,
        parallelize=lambda m, sub: parallelize_module(m, sub, None, sequence_parallel=True),
        optimizer=lambda m, _sub: Muon(m, lr=LR),
        # Muon orthogonalizes in bf16 (as torch.optim.Muon): a gradient that differs from
        # one device's in the last fp32 bits (tensor-parallel sums add in another order)
        # can round to the neighbouring bf16 value, which moves that element's update by
        # one bf16 ulp: lr * sqrt(rows / cols) * 2**-8 = 7.8e-6 per step here (measured:
        # exactly 2 steps' worth, 1.56e-5, on a machine where it rounds differently)
        param_atol=STEPS * LR * 2 * 2**-7,
    )
    r = mesh.get_local_rank("pp")
    assert pp.stage_indices == [r, r + 2] and pp.num_stages == 4
    assert any(isinstance(p, DTensor) for p in pp.parameters())


@distributed(8, timeout=300)
def test_pp_x_dp_x_tp_on_8_ranks():
    # dp last: FSDP x TP on a mesh whose dp dim is not last builds a reordered mesh, a
    # collective over the world that the ranks of one stage cannot run (docs/pipeline.md)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "tp", "dp"))
    _check(
        mesh,
        schedule="1f1b",
        microbatches=2,
        dp_dim="dp",
        clip=0.5,
        parallelize=lambda m, sub: parallelize_module(
            m, sub, None, tp_dim="tp", data_parallel={"dp": "fsdp"}
        ),
        dropout=0.1,  # on DTensors (heads sharded over tp), inside data_parallel_rng
    )
    # HSDP in each stage: parameters sharded over "shard", replicated over "rep"
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "rep", "shard"))
    _check(
        mesh,
        schedule="gpipe",
        microbatches=2,
        dp_dim=("rep", "shard"),
        clip=0.5,
        parallelize=lambda m, sub: parallelize_module(
            m, sub, {}, data_parallel={"rep": "ddp", "shard": "fsdp"}
        ),
    )


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h)) * mask + h * (1 - mask)


class _TwoInputs(nn.Module):
    """Blocks that take a side tensor made before the first block (a data-dependent mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_MaskedBlock() for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = (x[..., :1] > 0).to(h.dtype)  # depends on the data: it travels with h
        for b in self.blocks:
            h = b(h, mask=mask)
        return self.head(h)


def test_split_errors_before_any_communication():
    from vescale.dmodule._pipeline_split import auto_split_points, check_split_points, trace_model

    model = _model()
    x = torch.zeros(2, SEQ, dtype=torch.long)
    trace = trace_model(model, (x,), {})
    assert auto_split_points(model, 2) == ["blocks.2"]
    assert auto_split_points(model, 4) == ["blocks.1", "blocks.2", "blocks.3"]
    with pytest.raises(PipelineSplitError, match="blockz.1"):
        check_split_points(model, ["blockz.1"], trace, 2)
    with pytest.raises(PipelineSplitError, match="3 pipeline stages need 2 split points, got 1"):
        check_split_points(model, ["blocks.1"], trace, 3)
    with pytest.raises(PipelineSplitError, match="not in the order"):
        check_split_points(model, ["blocks.3", "blocks.1"], trace, 3)
    with pytest.raises(PipelineSplitError, match="at least 8 blocks"):
        auto_split_points(model, 8)
    from vescale.dmodule._pipeline_split import stage_of_modules

    torch.manual_seed(0)
    tied = GPT(GPTConfig(vocab_size=64, block_size=SEQ, n_layer=2, n_head=2, n_embd=16))
    trace = trace_model(tied, (x,), {})
    with pytest.raises(PipelineSplitError, match="tied"):
        stage_of_modules(tied, ["blocks.1"], trace)


@distributed(2)
def test_side_tensors_travel_and_bad_options():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    ref = _TwoInputs()
    torch.manual_seed(0)
    model = _TwoInputs()
    x = torch.randn(4, 4)
    y = torch.randint(0, 2, (4,))
    pp = pipeline_parallelize(
        model, mesh, example_inputs=(x,), loss_fn=F.cross_entropy, microbatches=2
    )
    loss = pp.step(x, target=y)
    ref_loss = F.cross_entropy(ref(x), y)
    ref_loss.backward()
    if pp.has_last_stage:
        torch.testing.assert_close(loss, ref_loss.detach())
    # eval_step: the same loss, forward only (the gradients stay those of the step)
    eval_loss = pp.eval_step(x, target=y)
    if pp.has_last_stage:
        torch.testing.assert_close(eval_loss, ref_loss.detach())
    else:
        assert loss is None and eval_loss is None
    grads = dict(ref.named_parameters())
    for n, p in pp.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, atol=1e-6, rtol=1e-5)
    for bad, match in (
        ({"microbatches": 3}, "divide the batch size 4"),
        ({"microbatches": 2, "pp_dim": "pipe"}, "no dim named 'pipe'"),
        ({"microbatches": 1}, "1F1B needs at least as many micro-batches"),
        ({"microbatches": 2, "schedule": "zb"}, "unknown pipeline schedule"),
    ):
        with pytest.raises(ValueError, match=match):
            pipeline_parallelize(
                _TwoInputs(), mesh, example_inputs=(x,), loss_fn=F.cross_entropy, **bad
            )
