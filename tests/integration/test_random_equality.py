"""Dropout under TP, SP, FSDP and FSDP x TP (and on RaggedShard) draws the one-device masks.

One 4-rank body trains the small GPT with ``dropout=0.1`` for 2 steps in each layout,
after the same ``torch.manual_seed`` as the single-device run, and checks every
dropout mask of the first step exactly (gathered to the global tensor) and the
losses of every step to 1e-5 (the tensor-parallel sums round differently). With
vescale's one-device drawing turned off the losses differ by far more, so the check
can fail.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vescale.dmodule import DModule
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import DTensor, distribute_tensor, init_device_mesh
from vescale.dtensor import random as vrandom
from vescale.dtensor.testing import run_on_ranks
from vescale.ragged import RaggedShard

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.1)
STEPS, BATCH, LR, TOL = 2, 4, 1e-2, 1e-5


def _batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, CFG.vocab_size, (STEPS, BATCH, CFG.block_size + 1), generator=g)


def _record_masks(model: nn.Module, masks: list) -> list:
    def hook(mod, args, out):
        if mod.training:
            masks.append(out)

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Dropout)]


def _train(model: nn.Module, step_ctx, local_batch, gather) -> tuple[list[float], list]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    masks: list = []
    handles = _record_masks(model, masks)
    losses = []
    torch.manual_seed(1234)  # the one seed of the run (after model creation)
    for step, batch in enumerate(_batches()):
        mine = local_batch(batch)
        with step_ctx():
            logits = model(mine[:, :-1])
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.reshape(-1, CFG.vocab_size), mine[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(gather(loss.detach().reshape(1)).mean().item())
        if step == 0:
            for h in handles:
                h.remove()
            masks = [gather(m.full_tensor() if isinstance(m, DTensor) else m) == 0 for m in masks]
    return losses, masks


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def reference() -> tuple[list[float], list]:
    return _train(_model(), contextlib.nullcontext, lambda b: b, lambda t: t)


def _check_plugin_placements(world: int) -> None:
    """RaggedShard (a plugin placement): its flat ranges of the one-device mask."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(0))
    for pl in ([RaggedShard((0, 1, 2), (1, 2, 0, 1))], [RaggedShard((0,), (3, 0, 1, 2))]):
        x = distribute_tensor(full, mesh, pl, src_data_rank=None)
        torch.manual_seed(3)
        got, got_next = F.dropout(x, 0.5), torch.rand(2)
        torch.manual_seed(3)
        want, want_next = F.dropout(full, 0.5), torch.rand(2)
        assert torch.equal(got.full_tensor(), want), pl
        assert torch.equal(got_next, want_next), pl


def _layouts() -> dict:
    """Every layout on this rank: ``(losses, masks)`` gathered to global tensors."""
    world = dist.get_world_size()
    _check_plugin_placements(world)
    out = {}
    for name in ("tp4", "tp4+sp", "fsdp4", "fsdp2xtp2+sp", "fsdp4 (rng off)"):
        if name.startswith("tp4"):
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            model, dp = DModule(_model(), mesh, sequence_parallel=name.endswith("sp")), None
        elif name.startswith("fsdp4"):
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            model, dp = DModule(_model(), mesh, data_parallel={"dp": "fsdp"}), "dp"
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            sp = name.endswith("+sp")
            model = DModule(_model(), mesh, data_parallel={"dp": "fsdp"}, sequence_parallel=sp)
            dp = "dp"
        n = mesh.size(mesh.mesh_dim_names.index(dp)) if dp else 1
        r = mesh.get_local_rank(dp) if dp else 0
        group = mesh.get_group(dp) if dp else None

        def gather(t, n=n, group=group):
            if n == 1:
                return t
            parts = [torch.empty_like(t) for _ in range(n)]
            dist.all_gather(parts, t.contiguous(), group=group)
            return torch.cat(parts)

        off = name.endswith("(rng off)")

        def ctx(mesh=mesh, dp=dp, off=off):
            if dp and not off:
                return vrandom.data_parallel_rng(mesh, dp)
            return contextlib.nullcontext()

        before = vrandom.set_single_device_rng(not off)
        try:
            out[name] = _train(model, ctx, lambda b, n=n, r=r: b.chunk(n)[r], gather)
        finally:
            vrandom.set_single_device_rng(before)
    return out


def test_dropout_equals_single_device_under_tp_sp_fsdp():
    ref_losses, ref_masks = reference()
    got = run_on_ranks(_layouts, 4, timeout=600)
    for name, (losses, masks) in got[0].items():
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
        if name.endswith("(rng off)"):
            assert diff > 100 * TOL, f"{name}: losses match without one-device drawing ({diff})"
            continue
        assert diff <= TOL, f"{name}: max |loss - single-device loss| = {diff:.3g}"
        assert len(masks) == len(ref_masks) == 2 * CFG.n_layer + 1, name
        for i, (m, want) in enumerate(zip(masks, ref_masks)):
            assert m.shape == want.shape and torch.equal(m, want), f"{name}: mask {i} differs"
        for rank in got[1:]:
            assert rank[name][0] == losses, f"{name}: ranks disagree on the loss"
