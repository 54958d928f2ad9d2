"""Checkpoints across pipeline layouts: save under pp=2 x dp=2 (FSDP per stage), resume
under pp=1 x dp=4 (FSDP, no pipeline), under pp=4 (one stage per rank) and in one
process (plain PyTorch).

Keys are the unmodified model's names (no stage prefixes), so a resumed run continues
exactly as single-device training would: parameters after loading and after one more
AdamW step (which needs the loaded optimizer state) equal the single-device run's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import vescale.checkpoint as vckpt
from vescale.dmodule import parallelize_module, pipeline_parallelize
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import DTensor, init_device_mesh
from vescale.dtensor.testing import run_on_ranks

BATCH, SEQ, LR = 8, 8, 1e-3


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=64, block_size=SEQ, n_layer=4, n_head=2, n_embd=16, tie_embeddings=False
    )
    return GPT(cfg)


def _loss(out, tgt):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (BATCH, SEQ), generator=g),
            torch.randint(0, 64, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def _reference(steps: int) -> GPT:
    ref = _model()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    for idx, tgt in _data(steps):
        opt.zero_grad()
        _loss(ref(idx), tgt).backward()
        opt.step()
    return ref


def _compare(named, ref: GPT) -> int:
    want = dict(ref.named_parameters())
    n = 0
    for name, p in named:
        p = p.detach()
        got = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(got, want[name].detach(), atol=1e-5, rtol=1e-5)
        n += 1
    return n


def _pipeline(mesh, dp: str | None, seed: int, microbatches: int = 2):
    k = BATCH // (mesh.size(mesh.mesh_dim_names.index(dp)) if dp else 1)
    fn = (lambda m, sub: parallelize_module(m, sub, {}, data_parallel={dp: "fsdp"})) if dp else None
    pp = pipeline_parallelize(
        _model(seed),
        mesh,
        example_inputs=(torch.zeros(k, SEQ, dtype=torch.long),),
        loss_fn=_loss,
        microbatches=microbatches,
        parallelize_fn=fn,
    )
    return pp, torch.optim.AdamW(pp.parameters(), lr=LR), k


def _save_pp2_dp2(path: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, opt, k = _pipeline(mesh, "dp", seed=0)
    r = mesh.get_local_rank("dp")
    for idx, tgt in _data(2):
        pp.step(idx[r * k : (r + 1) * k], target=tgt[r * k : (r + 1) * k])
        opt.step()
        opt.zero_grad()
    names = {n for n, _ in pp.named_parameters()}
    assert not any(n.startswith(("stage", "submod", "module")) for n in names), names
    vckpt.save(path, {"model": pp.module, "optimizer": opt, "step": 2})
    _compare(pp.named_parameters(), _reference(2))


def _resume_dp4_and_pp4(path: str) -> None:
    idx, tgt = _data(3)[2]
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = parallelize_module(_model(seed=5), mesh, {}, data_parallel={"dp": "fsdp"})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    state = {"model": model, "optimizer": opt, "step": 0}
    vckpt.load(path, state)
    assert state["step"] == 2
    assert _compare(model.named_parameters(), _reference(2)) == len(_model().state_dict())
    r, k = mesh.get_local_rank("dp"), BATCH // 4
    opt.zero_grad()
    _loss(model(idx[r * k : (r + 1) * k]), tgt[r * k : (r + 1) * k]).backward()
    opt.step()
    _compare(model.named_parameters(), _reference(3))
    # the same checkpoint under pp=4: each rank loads only its stage's block
    pp, opt, _ = _pipeline(
        init_device_mesh("cpu", (4,), mesh_dim_names=("pp",)), None, seed=5, microbatches=4
    )
    state = {"model": pp.module, "optimizer": opt, "step": 0}
    vckpt.load(path, state, strict=False)  # a stage holds part of the checkpoint's keys
    assert state["step"] == 2 and pp.split_points == ["blocks.1", "blocks.2", "blocks.3"]
    assert _compare(pp.named_parameters(), _reference(2)) == len(list(pp.parameters()))
    pp.step(idx, target=tgt)
    opt.step()
    _compare(pp.named_parameters(), _reference(3))


def test_checkpoint_moves_between_pipeline_layouts(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_pp2_dp2, 4, path, timeout=300)
    run_on_ranks(_resume_dp4_and_pp4, 4, path, timeout=300)
    # one process, plain PyTorch model and optimizer
    model = _model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    state = {"model": model, "optimizer": opt, "step": 0}
    vckpt.load(path, state)
    assert sorted(k for k in model.state_dict()) == sorted(_model().state_dict())
    assert _compare(model.named_parameters(), _reference(2)) == len(_model().state_dict())
    idx, tgt = _data(3)[2]
    opt.zero_grad()
    _loss(model(idx), tgt).backward()
    opt.step()
    _compare(model.named_parameters(), _reference(3))
