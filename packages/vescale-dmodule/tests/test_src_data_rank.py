"""``src_data_rank`` under every data-parallel mode, with differently seeded ranks.

torch seeds every process at random and torchrun does not seed, so an eagerly built
model differs from rank to rank unless the program seeds. ``parallelize_module``
promises the parameters of the ``src_data_rank`` rank (default 0). Each mode here
builds the model eagerly after ``torch.manual_seed(100 + rank)``, parallelizes, and
checks every parameter's full value against the source rank's model (broadcast for the
comparison), then one SGD step against single-device training of that model. With
``src_data_rank=None`` each rank keeps its own values and nothing is sent.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from vescale.dmodule import DModule, parallelize_module, pipeline_parallelize
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import DTensor, init_device_mesh
from vescale.dtensor.debug import CommDebugMode
from vescale.dtensor.testing import run_on_ranks

TOL = dict(atol=1e-5, rtol=1e-5)

# mode -> (mesh shape, mesh dim names, plan (None: automatic TP plan), data_parallel)
MODES = {
    "fsdp": ((4,), ("dp",), {}, {"dp": "fsdp"}),
    "ddp": ((4,), ("dp",), {}, {"dp": "ddp"}),
    "hsdp": ((2, 2), ("rep", "shard"), {}, {"rep": "ddp", "shard": "fsdp"}),
    "fsdp_tp": ((2, 2), ("dp", "tp"), None, {"dp": "fsdp"}),
    "ddp_tp": ((2, 2), ("dp", "tp"), None, {"dp": "ddp"}),
    "tp": ((4,), ("tp",), None, None),
    "tp_replica": ((2, 2), ("dp", "tp"), None, None),  # dp only replicated by the plan
}


def _cfg(tie: bool = True) -> GPTConfig:
    return GPTConfig(
        vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=16, tie_embeddings=tie
    )


def _source_model(model: torch.nn.Module, src: int) -> torch.nn.Module:
    """A copy of ``model`` holding global rank ``src``'s values (on every rank)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for t in ref.state_dict().values():
            dist.broadcast(t, src=src)
    return ref


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dp_coord(mesh, data_parallel) -> tuple[int, int]:
    """(index, count) of this rank's part of the global batch."""
    names = mesh.mesh_dim_names
    dims = [names.index(k) for k in (data_parallel or {})]
    if not dims and "dp" in names and "tp" in names:  # tp_replica: each dp rank its samples
        dims = [names.index("dp")]
    idx, count = 0, 1
    for d in sorted(dims):
        idx = idx * mesh.size(d) + mesh.get_local_rank(d)
        count *= mesh.size(d)
    return idx, count


def _loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _body(mode: str, src: int | None, entry: str, src_global: int = 0) -> tuple[int, int]:
    """``src``: the option's value (a coordinate on every mesh dim); ``src_global``: its rank."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # as torchrun: every rank its own initialisation
    model = GPT(_cfg())
    if MODES[mode][2] == {}:  # pure data parallelism: a buffer each rank draws its own
        model.register_buffer("noise", torch.randn(5))
    own = copy.deepcopy(model)
    ref = _source_model(model, src_global)
    shape, names, plan, dp = MODES[mode]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    opts = {} if dp is None else {"data_parallel": dp}
    if src != 0:
        opts["src_data_rank"] = src
    with CommDebugMode() as comm:
        if entry == "DModule":
            model = DModule(model, mesh, plan, **opts)
        else:
            model = parallelize_module(model, mesh, plan, **opts)
    sent = sum(comm.get_comm_bytes().values())
    counts = {str(k): v for k, v in comm.get_comm_counts().items() if v}

    if src is None:
        # each rank's own values, nothing sent: a local tensor is cut from this rank's model
        assert sent == 0, comm.get_comm_counts()
        mine = dict(own.named_parameters())
        for n, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            flat = mine[n].detach().reshape(-1)
            assert any(
                torch.equal(local.detach().reshape(-1), flat[a : a + local.numel()])
                for a in range(0, flat.numel() - local.numel() + 1)
            ), (mode, n)
        return sent, counts
    want = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(_full(p.detach()), want[n]), (mode, n)
    for n, b in model.named_buffers():
        assert torch.equal(_full(b), dict(ref.named_buffers())[n]), (mode, n)

    # one SGD step equals single-device training of the source rank's model
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 64, (8, 8), generator=g)
    tgt = torch.randint(0, 64, (8, 8), generator=g)
    i, k = _dp_coord(mesh, dp)
    n = idx.shape[0] // k
    if mode == "tp_replica":  # data parallelism over the replica dim by the optimizer
        from vescale.optim import DistributedOptimizer

        opt = DistributedOptimizer(model, torch.optim.SGD, mesh=mesh, dp_dim="dp", lr=0.5)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _loss(model(idx[i * n : (i + 1) * n]), tgt[i * n : (i + 1) * n]).backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _loss(ref(idx), tgt).backward()
    ref_opt.step()
    want = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(_full(p.detach()), want[n].detach(), **TOL, msg=f"{mode} {n}")
    return sent, counts


@pytest.mark.parametrize("mode", list(MODES))
def test_differently_seeded_ranks_get_rank_0s_parameters(mode):
    out = run_on_ranks(_body, 4, mode, 0, "parallelize_module")
    if mode == "fsdp":
        # one scatter per flat buffer: rank 0 sends the other ranks their slices (3/4 of
        # the model's bytes and a little padding), nobody else sends; a broadcast of the
        # model (DDP) would send the model's bytes from every rank
        model_bytes = sum(p.numel() * p.element_size() for p in GPT(_cfg()).parameters())
        # (and one broadcast of the 20-byte buffer, counted on every rank)
        assert out[0][1] == {"c10d.scatter_": 3, "c10d.broadcast_": 1}, out[0][1]
        assert [s for s, _ in out[1:]] == [20, 20, 20]
        assert out[0][0] - 20 <= 3 * model_bytes // 4 + 3 * 4 * 4, (out[0][0], model_bytes)


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "ddp_tp"])
def test_src_data_rank_picks_the_source(mode):
    """Not always rank 0: the rank at coordinate 1 of every mesh dim (global 1 or 3)."""
    src_global = 3 if len(MODES[mode][0]) == 2 else 1
    run_on_ranks(_body, 4, mode, 1, "DModule", src_global)


@pytest.mark.parametrize("mode", ["fsdp", "hsdp", "ddp"])
def test_src_data_rank_none_keeps_each_ranks_values(mode):
    run_on_ranks(_body, 4, mode, None, "parallelize_module")


def _pipeline_body(src: int | None) -> None:
    """pp=2 x dp=2 (FSDP per stage): every stage holds the source rank's values."""
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    model = GPT(_cfg(tie=False))  # a tied pair cannot span two stages
    own = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _source_model(model, 0)  # (pp=0, dp=0): global rank 0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, 64, (8, 8), generator=g)
    tgt = torch.randint(0, 64, (8, 8), generator=g)
    dp = mesh.get_local_rank("dp")
    with CommDebugMode() as comm:
        pp = pipeline_parallelize(
            model,
            mesh,
            example_inputs=(idx[:4],),
            loss_fn=_loss,
            microbatches=2,
            src_data_rank=src,
            parallelize_fn=lambda m, sub: DModule(
                m, sub, {}, data_parallel={"dp": "fsdp"}, src_data_rank=src
            ),
        )
    names = [n for n, _ in pp.named_parameters()]
    assert names
    if src is None:
        # each rank its own values (its dp slice of them), nothing sent
        assert sum(comm.get_comm_bytes().values()) == 0, comm.get_comm_counts()
        for n, p in pp.named_parameters():
            local = p.to_local().detach().reshape(-1)
            flat = own[n].reshape(-1)
            assert any(
                torch.equal(local, flat[a : a + local.numel()])
                for a in range(flat.numel() - local.numel() + 1)
            ), n
        return
    want = dict(ref.named_parameters())
    for n, p in pp.named_parameters():
        assert torch.equal(_full(p.detach()), want[n]), n
    opt = torch.optim.SGD(pp.module.parameters(), lr=0.5)
    pp.step(idx[dp * 4 : (dp + 1) * 4], target=tgt[dp * 4 : (dp + 1) * 4])
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _loss(ref(idx), tgt).backward()
    ref_opt.step()
    for n, p in pp.named_parameters():
        torch.testing.assert_close(_full(p.detach()), want[n].detach(), **TOL, msg=n)


@pytest.mark.parametrize("src", [0, None])
def test_pipeline_stages_take_the_source_ranks_values(src):
    run_on_ranks(_pipeline_body, 4, src)


def _bad_source() -> None:
    from vescale.dmodule import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    with CommDebugMode() as comm:
        for bad in (2, -1, True):
            with pytest.raises(ValueError, match=rf"src_data_rank={bad!r} is not a rank"):
                parallelize_module(
                    GPT(_cfg()),
                    mesh,
                    {},
                    data_parallel={"rep": "ddp", "shard": "fsdp"},
                    src_data_rank=bad,
                )
            with pytest.raises(ValueError, match=r"'shard'.*sizes \[2\]"):
                fully_shard(GPT(_cfg()), mesh, "shard", src_data_rank=bad)
    assert not comm.get_comm_counts() or not any(comm.get_comm_counts().values())


def test_bad_src_data_rank_fails_before_any_collective():
    run_on_ranks(_bad_source, 4)
