"""Resharding resume across parallel configurations: save under one, resume under another.

The reference GPT trains 5 AdamW steps on one process. Each case trains the first 3
steps under a *save* configuration, saves model + optimizer with
``vescale.checkpoint.save``, then builds the model fresh under a *load* configuration
(another mesh, other placements, or one process with plain tensors), loads, and
trains steps 4 and 5. The resumed losses must equal the single-process losses of
those steps, and the loaded parameters the single-process parameters after step 3:
both depend on every parameter *and* on the AdamW moments having been resharded
correctly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vescale.dmodule import DModule
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import DTensor, init_device_mesh
from vescale.dtensor.testing import run_on_ranks

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
STEPS, SAVE_AT, GLOBAL_BATCH, LR = 5, 3, 8, 1e-2
TOL = 1e-5


def _batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(4321)
    return torch.randint(0, CFG.vocab_size, (STEPS, GLOBAL_BATCH, CFG.block_size + 1), generator=g)


def _loss(logits, y) -> torch.Tensor:
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, CFG.vocab_size), y.reshape(-1))


def _build(config: str):
    """``(model, optimizer, dp mesh dim name or None, mesh or None)`` for ``config``."""
    torch.manual_seed(0)
    model = GPT(CFG)
    mesh, dp = None, None
    if config == "single":
        pass
    elif config in ("ddp4", "fsdp4"):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        model, dp = DModule(model, mesh, data_parallel={"dp": config[:-1]}), "dp"
    elif config == "tp4":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        model = DModule(model, mesh, sequence_parallel=True)
    elif config in ("fsdp2xtp2+sp", "ddp2xtp2"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        engine = config.split("2")[0]
        sp = config.endswith("+sp")
        model = DModule(model, mesh, data_parallel={"dp": engine}, sequence_parallel=sp)
        dp = "dp"
    elif config == "hsdp2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        model = DModule(model, mesh, data_parallel={"rep": "ddp", "shard": "fsdp"})
        dp = ("rep", "shard")
    else:
        raise ValueError(config)
    return model, torch.optim.AdamW(model.parameters(), lr=LR), dp, mesh


def _train(model, opt, dp, mesh, steps: range) -> list[float]:
    if dp is None:
        n_dp, r_dp, group = 1, 0, None
    elif isinstance(dp, tuple):  # HSDP: the batch is split over both dims
        n_dp, r_dp, group = mesh.size(), dist.get_rank(), None
    else:
        n_dp, r_dp = mesh.size(mesh.mesh_dim_names.index(dp)), mesh.get_local_rank(dp)
        group = mesh.get_group(dp)
    per = GLOBAL_BATCH // n_dp
    batches = _batches()
    losses = []
    for s in steps:
        mine = batches[s][r_dp * per : (r_dp + 1) * per]
        loss = _loss(model(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if n_dp > 1:  # the global-batch loss is the mean of the data-parallel shards' losses
            dist.all_reduce(value, group=group)
            value /= n_dp
        losses.append(value.item())
    return losses


def _full_params(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _save_body(config: str, path: str) -> list[float]:
    import vescale.checkpoint as vckpt

    model, opt, dp, mesh = _build(config)
    losses = _train(model, opt, dp, mesh, range(SAVE_AT))
    vckpt.save(path, {"model": model, "optim": opt, "step": SAVE_AT})
    return losses


def _load_body(config: str, path: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    import vescale.checkpoint as vckpt

    model, opt, dp, mesh = _build(config)
    state = {"model": model, "optim": opt, "step": 0}
    vckpt.load(path, state)
    assert state["step"] == SAVE_AT
    params = _full_params(model)
    return params, _train(model, opt, dp, mesh, range(SAVE_AT, STEPS))


@pytest.fixture(scope="module")
def reference():
    model, opt, dp, mesh = _build("single")
    first = _train(model, opt, dp, mesh, range(SAVE_AT))
    at_save = _full_params(model)
    rest = _train(model, opt, dp, mesh, range(SAVE_AT, STEPS))
    return first + rest, at_save


CASES = [
    ("fsdp2xtp2+sp", "fsdp4"),
    ("fsdp2xtp2+sp", "tp4"),
    ("fsdp2xtp2+sp", "ddp2xtp2"),
    ("fsdp2xtp2+sp", "hsdp2x2"),
    ("fsdp2xtp2+sp", "single"),
    ("ddp4", "fsdp2xtp2+sp"),
    ("hsdp2x2", "single"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("saved_as", "loaded_as"), CASES)
def test_resume_under_another_configuration(saved_as, loaded_as, reference, tmp_path):
    ref_losses, ref_params = reference
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(_save_body, 4, saved_as, path, timeout=600)
    assert max(abs(a - b) for a, b in zip(saved[0], ref_losses[:SAVE_AT])) <= TOL
    if loaded_as == "single":
        results = [_load_body("single", path)]
    else:
        results = run_on_ranks(_load_body, 4, loaded_as, path, timeout=600)
    for params, losses in results:
        assert params.keys() == ref_params.keys()
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=0, atol=TOL, msg=name)
        diff = max(abs(a - b) for a, b in zip(losses, ref_losses[SAVE_AT:]))
        assert diff <= TOL, f"{saved_as} -> {loaded_as}: resumed losses differ by {diff:.3g}"
