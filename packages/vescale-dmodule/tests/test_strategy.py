"""Cost model, layout search, ``DModule(strategy="auto")``, live resharding, elastic restart.

The cost model's predictions are checked against measurements in
``benchmarks/strategy_bench.py``; here: the counting (parameters, saved activations
against a real forward), the arithmetic of the estimate, the search (every
candidate, its speed at 1,024 ranks), bad input, and, on 4 and 2 gloo ranks, that
`reshard` and an elastic restart continue training exactly as a checkpoint resume
and as one device do.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vescale.checkpoint as vckpt
from vescale.dmodule import (
    DeviceSpec,
    DModule,
    Layout,
    Link,
    NoLayoutFitsError,
    ReshardError,
    apply_layout,
    dump_plan,
    estimate,
    get_strategy,
    layout_of,
    probe_device,
    profile_model,
    reshard,
    saved_activation_bytes,
    search,
)
from vescale.dmodule.testing import GPT, GPTConfig
from vescale.dtensor import DTensor
from vescale.dtensor.testing import distributed, run_on_ranks
from vescale.optim import DistributedOptimizer

SEQ = 8
BATCH = 8  # global batch
CFG = dict(vocab_size=64, block_size=SEQ, n_layer=2, n_head=2, n_embd=16)
# constants of a made-up device: fast links, slow matmuls -> data parallelism wins
DEV = DeviceSpec(
    memory=2**30,
    matmul_flops=1e9,
    copy_bandwidth=1e10,
    links=(Link(0, 1e10, 1e-6),),
    op_overhead=1e-6,
    dtensor_op_overhead=1e-3,
)


def _gpt(seed: int = 0, meta: bool = False) -> GPT:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return GPT(GPTConfig(**CFG))
    return GPT(GPTConfig(**CFG))


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, 64, (BATCH, SEQ), generator=g),
            torch.randint(0, 64, (BATCH, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


def _loss(model, idx, tgt):
    out = model(idx)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))


def _train(model, opt, data, layout: Layout | None) -> list[float]:
    """Steps on this rank's part of each global batch; the global mean loss per step."""
    losses = []
    for idx, tgt in data:
        if layout is not None and layout.dp_degree > 1:
            k = BATCH // layout.dp_degree
            r = dist.get_rank() // layout.tp  # tp innermost: data-parallel index
            idx, tgt = idx[r * k : (r + 1) * k], tgt[r * k : (r + 1) * k]
        loss = _loss(model, idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        val = loss.detach().clone()
        if layout is not None and dist.is_initialized():
            dist.all_reduce(val, op=dist.ReduceOp.AVG)
        losses.append(float(val))
    return losses


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _zero(model):
    mesh = next(p.device_mesh for p in model.parameters())
    return DistributedOptimizer(
        model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=1e-2, weight_decay=0.1
    )


def _reference(steps: int) -> list[float]:
    model = _gpt()
    return _train(model, _opt(model), _data(steps), None)


# ---------------------------------------------------------------- single process


def test_profile_counts_and_estimate_arithmetic():
    model = _gpt()
    prof = profile_model(model, SEQ)
    assert prof.num_params == sum(p.numel() for p in model.parameters())  # tied once
    assert prof.n_blocks == 2 and prof.hidden == 16 and prof.vocab == 64
    assert prof.fwd_flops > 0 and prof.bwd_flops == pytest.approx(2 * prof.fwd_flops, rel=0.1)
    # predicted saved activations against a real forward (batch 3)
    with saved_activation_bytes() as real:
        _loss(model, torch.zeros(3, SEQ, dtype=torch.long), torch.zeros(3, SEQ, dtype=torch.long))
    predicted = estimate(prof, Layout(micro_batch=3), DEV, 3).memory
    assert real.bytes > 0
    assert predicted["activations"] == pytest.approx(real.bytes, rel=0.1)
    p = prof.num_params * 4
    one = estimate(prof, Layout(micro_batch=8), DEV, BATCH)
    assert one.memory["params"] == p and one.memory["optimizer"] == 2 * p
    fsdp = estimate(prof, Layout(fsdp=4, micro_batch=2), DEV, BATCH)
    assert fsdp.memory["params"] == pytest.approx(p / 4) and fsdp.accumulation == 1
    ddp = estimate(prof, Layout(dp=4, micro_batch=1), DEV, BATCH)
    assert ddp.memory["params"] == p and ddp.accumulation == 2
    assert ddp.time["dp_comm"] > 0 and one.time["dp_comm"] == 0
    tp = estimate(prof, Layout(tp=2, micro_batch=8), DEV, BATCH)
    assert p / 2 < tp.memory["params"] < p and tp.time["tp_comm"] > 0
    sp = estimate(prof, Layout(tp=2, sequence_parallel=True, micro_batch=8), DEV, BATCH)
    assert sp.memory["activations"] < tp.memory["activations"]
    ac = estimate(prof, Layout(activation_checkpointing=True, micro_batch=8), DEV, BATCH)
    assert ac.memory["activations"] < one.memory["activations"]
    assert ac.time["compute"] > one.time["compute"]
    # bad input, before anything runs
    with pytest.raises(ValueError, match="sequence_parallel needs tp"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValueError, match="does not divide"):
        estimate(prof, Layout(dp=3), DEV, BATCH)
    with pytest.raises(ValueError, match="overlap"):
        DeviceSpec(1, 1, 1, (Link(0, 1, 0),), overlap=2)


def test_pipeline_layout_and_oversubscription_arithmetic():
    prof = profile_model(_gpt(), SEQ)  # 2 blocks
    lay = Layout(pp=2, micro_batch=2)
    assert lay.world == 2 and lay.mesh_dims == (("pp", 2),) and lay.describe() == "pp2 mb2"
    est = estimate(prof, lay, DEV, BATCH)
    m, p = BATCH // 2, 2  # 4 micro-batches through 2 stages
    t = est.time
    busy = t["compute"] + t["memory_bound"] + t["overhead"] + t["tp_comm"] + t["pp_comm"]
    assert t["pp_bubble"] / (busy + t["pp_bubble"]) == pytest.approx((p - 1) / (m + p - 1))
    # boundary activations forward and their gradients backward, per micro-batch
    assert est.traffic["pp"] == 2 * m * 2 * SEQ * 16 * 4
    assert t["pp_comm"] == pytest.approx(m * 2 * (2 * SEQ * 16 * 4 / 1e10 + 1e-6))
    # the busiest stage: half the blocks and everything outside them
    inside = sum(n * e for name, n, e, _ in prof.params if name.startswith("blocks."))
    outside = prof.num_params * 4 - inside
    assert est.memory["params"] == pytest.approx(inside / p + outside)
    assert est.memory["optimizer"] == pytest.approx(2 * (inside / p + outside))
    # 1F1B: the first stage keeps min(m, p) micro-batches of its blocks
    kept, whole = sum(prof.block_act.values()), sum(prof.act.values())
    assert est.memory["activations"] == pytest.approx(
        max(min(m, p) * kept / p, kept / p + whole - kept) * 2
    )
    one = estimate(prof, Layout(micro_batch=2), DEV, BATCH)
    assert est.time["compute"] < one.time["compute"] and one.time["pp_bubble"] == 0
    # pipeline layouts: searched on request, predicted only
    ranked, _ = search(prof, 4, DEV, BATCH, allow={"pp": [1, 2, 4]})
    pps = {e.layout.pp for e in ranked}
    assert pps == {1, 2}  # pp 4 > 2 blocks
    assert {e.layout.pp for e in search(prof, 4, DEV, BATCH)[0]} == {1}
    with pytest.raises(ValueError, match="2 transformer block"):
        estimate(prof, Layout(pp=4, micro_batch=2), DEV, BATCH)
    with pytest.raises(NotImplementedError, match="pipeline_parallelize"):
        apply_layout(_gpt(), lay)
    with pytest.raises(ValueError, match="predicted by search"):
        DModule(_gpt(), strategy="auto", device=DEV, global_batch=BATCH, allow={"pp": [2]})
    # CPU ranks sharing cores: host time stretches by ranks / cores; a GPU per rank: not
    shared = dataclasses.replace(DEV, cores=2, ranks_per_node=4)
    assert shared.host_share(4) == 2 and shared.host_share(1) == 1 and DEV.host_share(4) == 1
    d4 = Layout(dp=4, micro_batch=2)
    alone, crowded = estimate(prof, d4, DEV, BATCH), estimate(prof, d4, shared, BATCH)
    for k in ("compute", "memory_bound", "overhead", "optimizer"):
        assert crowded.time[k] == pytest.approx(2 * alone.time[k])
    assert crowded.time["dp_comm"] == alone.time["dp_comm"]


def test_search_ranks_every_candidate_and_is_fast_at_1024_ranks():
    prof = profile_model(_gpt(), SEQ)
    ranked, rejected = search(prof, 4, DEV, BATCH)
    labels = {e.layout.describe() for e in ranked}
    # every factorization of 4 the heads allow (tp <= 2: two heads)
    assert {
        "ddp4 mb1",
        "fsdp4 mb2",
        "hsdp2x2 mb1",
        "ddp2 x tp2 mb4",
        "fsdp2 x tp2 +sp +ac mb1",
    } <= labels
    assert not any("tp4" in x for x in labels) and rejected == 0
    times = [e.time["total"] for e in ranked]
    assert times == sorted(times)
    tight = min(e.memory["total"] for e in ranked) * 1.01
    small, rej = search(prof, 4, DeviceSpec(tight, 1e9, 1e10, DEV.links), BATCH)
    assert rej > 0 and all(e.memory["total"] <= tight for e in small)
    with pytest.raises(NoLayoutFitsError, match="smallest is"):
        search(prof, 4, DeviceSpec(1e3, 1e9, 1e10, DEV.links), BATCH)
    # 1,024 ranks, an 8-layer model: every factorization x sp x ac x micro-batch
    with torch.device("meta"):
        big = GPT(GPTConfig(vocab_size=32000, block_size=1024, n_layer=8, n_head=32, n_embd=2048))
    prof = profile_model(big, 1024)
    gpu = DeviceSpec(
        80e9, 4e14, 2e12, (Link(8, 2e11, 5e-6), Link(0, 2.5e10, 2e-5)), 5e-6, 5e-5, 0.8, "cuda"
    )
    t0 = time.perf_counter()
    ranked, rejected = search(prof, 1024, gpu, 2048)
    took = time.perf_counter() - t0
    assert took < 5.0, f"search over 1,024 ranks took {took:.2f} s"
    assert len(ranked) + rejected > 500 and ranked[0].fits


def test_profile_hf_models():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=16)
    )
    prof = profile_model(gpt2, 16)
    assert prof.num_params == sum(p.numel() for p in gpt2.parameters())
    assert prof.n_blocks == 2 and prof.valid_tp(2) and prof.valid_tp(4)
    # c_attn's _StridedShard is replicated under FSDP: fewer sharded parameters
    assert sum(prof.tp_sharded(2, True).values()) < sum(prof.tp_sharded(2, False).values())
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=16,
        )
    )
    prof = profile_model(llama, 16)
    assert prof.num_params == sum(p.numel() for p in llama.parameters())
    assert prof.valid_tp(2) and not prof.valid_tp(4)  # two key/value heads
    ranked, _ = search(prof, 4, DEV, 8)
    assert all(e.layout.tp <= 2 for e in ranked)


# ---------------------------------------------------------------- 4 ranks


@distributed(4, timeout=300)
def test_auto_reshard_and_checkpoint_resume(tmp_path):
    ref = _reference(6)
    data = _data(6)
    # the probe: real figures, the same on every rank (the slowest rank's)
    probed = probe_device(
        memory=2**30,
        matmul_sizes=(64, 128),
        copy_sizes=(),
        copy_mb=1.0,
        collective_mb=1.0,
        repeats=2,
    )
    got = [None] * 4
    dist.all_gather_object(got, probed)
    assert all(g == probed for g in got)
    assert probed.matmul_flops > 0 and probed.links[0].bandwidth > 0 and probed.op_overhead > 0
    assert probed.optimizer_dtensor_param_overhead > 0 and probed.links[0].call_latency >= 0
    assert probed.ranks_per_node == 4 and probed.cores >= 1  # CPU ranks: cores counted
    # DModule(model, strategy="auto"): the search picks; dump_plan says why
    model = DModule(_gpt(), strategy="auto", device=DEV, global_batch=BATCH)
    choice = get_strategy(model)
    assert choice is not None and layout_of(model) == choice.layout
    assert choice.layout.world == 4 and choice.ranked[0].layout == choice.layout
    assert "strategy: auto" in dump_plan(model) and choice.layout.describe() in dump_plan(model)
    with pytest.raises(ValueError, match="global_batch"):
        DModule(_gpt(), strategy="auto", device=DEV)
    with pytest.raises(ValueError, match="mesh=None"):
        DModule(_gpt(), mesh=object(), strategy="auto", device=DEV, global_batch=BATCH)

    a = Layout(fsdp=4, micro_batch=2)
    model = apply_layout(_gpt(), a)
    opt = _opt(model)
    losses = _train(model, opt, data[:2], a)
    path = str(tmp_path / "a")
    vckpt.save(path, {"model": model, "optimizer": opt})
    rng0 = [torch.get_rng_state()]
    dist.broadcast_object_list(rng0, src=0)

    b = Layout(fsdp=2, tp=2, micro_batch=4)
    model, opt = reshard(model, opt, b)
    assert layout_of(model) == b and torch.equal(torch.get_rng_state(), rng0[0])
    after = _train(model, opt, data[2:4], b)
    # reference: a checkpoint saved under A, loaded under B
    fresh = apply_layout(_gpt(seed=7), b)
    fresh_opt = _opt(fresh)
    _train(fresh, fresh_opt, data[:1], b)  # creates optimizer state to load into
    vckpt.load(path, {"model": fresh, "optimizer": fresh_opt})
    resumed = _train(fresh, fresh_opt, data[2:4], b)
    assert after == pytest.approx(resumed, abs=1e-6), (after, resumed)

    c = Layout(dp=4, micro_batch=2)  # to DDP
    model, opt = reshard(model, opt, c)
    losses += after + _train(model, opt, data[4:], c)
    assert losses == pytest.approx(ref, abs=1e-5), (losses, ref)
    with pytest.raises(ReshardError, match="model_fn"):
        reshard(GPT(GPTConfig(**CFG)), None, c)

    # ZeRO (DistributedOptimizer): its sharded state moves too, dp 4 -> dp 2 x tp 2
    z = Layout(dp=4, micro_batch=2)
    model = apply_layout(_gpt(), z, data_parallel=None)  # ZeRO reduces the gradients
    opt = _zero(model)
    zero_losses = _train(model, opt, data[:2], z)
    path = str(tmp_path / "z")
    vckpt.save(path, {"model": model, "optimizer": opt})
    # refused before any collective: only rank 0 calls (a collective would hang)
    if dist.get_rank() == 0:
        with pytest.raises(ReshardError, match="shards parameters over 'fsdp'"):
            reshard(model, opt, Layout(fsdp=4, micro_batch=2))
        with pytest.raises(ReshardError, match="no 'dp' dim"):
            reshard(model, opt, Layout(tp=4, micro_batch=8))
    zt = Layout(dp=2, tp=2, micro_batch=4)
    model, opt = reshard(model, opt, zt)
    assert isinstance(opt, DistributedOptimizer) and opt.dp_size == 2
    after = _train(model, opt, data[2:4], zt)
    fresh = apply_layout(_gpt(seed=7), zt, data_parallel=None)
    fresh_opt = _zero(fresh)
    _train(fresh, fresh_opt, data[:1], zt)
    vckpt.load(path, {"model": fresh, "optimizer": fresh_opt})
    resumed = _train(fresh, fresh_opt, data[2:4], zt)
    assert after == pytest.approx(resumed, abs=1e-6), (after, resumed)
    assert zero_losses + after == pytest.approx(ref[:4], abs=1e-5), (zero_losses + after, ref)


# ---------------------------------------------------------------- elastic: 4 -> 2 ranks


def _save_on_four(path: str) -> list[float]:
    a = Layout(fsdp=4, micro_batch=2)
    model = apply_layout(_gpt(), a)
    opt = _opt(model)
    losses = _train(model, opt, _data(2), a)
    vckpt.save(path, {"model": model, "optimizer": opt, "step": 2})
    return losses


def _resume_on_two(path: str) -> tuple[list[float], str]:
    model = DModule(_gpt(seed=9, meta=True), strategy="auto", device=DEV, global_batch=BATCH)
    lay = layout_of(model)
    opt = _opt(model)
    state = {"model": model, "optimizer": opt, "step": 0}
    _train(model, opt, _data(1), lay)  # optimizer state to load into
    vckpt.load(path, state)
    assert state["step"] == 2
    return _train(model, opt, _data(4)[2:], lay), lay.describe()


def test_elastic_restart_on_fewer_ranks_continues(tmp_path):
    path = str(tmp_path / "elastic")
    first = run_on_ranks(_save_on_four, 4, path, timeout=300)[0]
    second, label = run_on_ranks(_resume_on_two, 2, path, timeout=300)[0]
    ref = _reference(4)
    assert first + second == pytest.approx(ref, abs=1e-5), (label, first + second, ref)
