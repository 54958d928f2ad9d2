"""HF GPT-2 and LLaMA (tiny configs, random init) under the automatic TP/SP plan.

Skipped without ``transformers`` (an optional test dependency). Models use eager
attention, and HF's default SDPA attention (``F.scaled_dot_product_attention``, whose CPU
flash kernel gets its DTensor rule from vescale-dtensor) in the ``sdpa`` tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from vescale.dmodule import parallelize_module  # noqa: E402
from vescale.dtensor import DTensor, Shard, init_device_mesh  # noqa: E402
from vescale.dtensor.testing import distributed  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def _torch_211_attention_gap() -> bool:
    """torch 2.11's strict view rule (vescale-dtensor's compat report: "fallback").

    On that torch, tensor parallelism of GPT-2 is a known gap (docs/torch_versions.md):
    its fused ``c_attn`` fails in backward with a shape error. The tests are strict
    expected failures there, so a fix shows up as XPASS. (LLaMA works there: its
    attention ``view`` of head-sharded tensors takes the reshape rule.)
    """
    from vescale.dtensor import _compat

    status = _compat.check_torch_internals()[
        "DTensor _unsafe_view flattening a sharded inner dim (4-D matmuls)"
    ]
    return status.startswith("fallback")


GAP_211 = pytest.mark.xfail(
    _torch_211_attention_gap(),
    reason="known gap on torch 2.11: GPT-2 under TP (docs/torch_versions.md)",
    strict=True,
)


def _build(kind, attn="eager"):
    import transformers

    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        cfg._attn_implementation = attn
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(cfg)


def run_hf(kind, sp, steps=3, attn="eager", mesh_shape=(2,), plan=None, dp=None):
    """``dp``: ``"ddp"``/``"fsdp"`` on the mesh's "dp" dim, or ``"optimizer"``: no
    ``data_parallel=``, `vescale.optim.DistributedOptimizer` averages the gradients over
    "dp"; each dp rank trains on its own half of the batch (the reference: the whole
    batch on one device)."""
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = _build(kind, attn).eval()  # eval: no dropout; grads still flow
    ref = copy.deepcopy(model)
    extra = {"data_parallel": {"dp": dp}} if dp in ("ddp", "fsdp") else {}
    parallelize_module(
        model, mesh, plan(mesh.ndim) if plan else None, sequence_parallel=sp, **extra
    )
    assert isinstance(model, type(ref))
    sharded = [
        n for n, p in model.named_parameters() if any(isinstance(q, Shard) for q in p.placements)
    ]
    assert len(sharded) >= 8, sharded
    if kind == "gpt2":
        from torch.distributed.tensor.placement_types import _StridedShard

        # the fused QKV projection is column-parallel over its three parts
        for name, p in model.named_parameters():
            if "c_attn" in name:
                assert p.placements[-1] == _StridedShard(p.ndim - 1, split_factor=3), name
    ids = torch.randint(0, 64, (2, 8))
    mine = ids  # this rank's samples
    if dp:
        mine = ids.chunk(mesh.size(0))[mesh.get_local_rank("dp")]
    # data parallel: the mean of per-rank means rounds differently from one mean, and
    # AdamW's first step (g / sqrt(g^2)) turns that into a full lr-sized difference on a
    # ~1e-9 gradient element unless eps is above such elements
    eps = 1e-6 if dp else 1e-8
    if dp == "optimizer":
        from vescale.optim import DistributedOptimizer

        # the parameters stay on the whole mesh, Replicate() on "dp"
        assert all(p.device_mesh == mesh and p.placements[0].is_replicate()
                   for p in model.parameters())  # fmt: skip
        opt = DistributedOptimizer(
            model, torch.optim.AdamW, mesh=mesh, dp_dim="dp", lr=1e-2, eps=eps
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=eps)
    params = dict(model.named_parameters())
    for step in range(steps):
        if step == 0 and kind == "gpt2" and not sp:
            _check_gpt2_forward_comm(model, ids)
        logits = model(input_ids=mine, use_cache=False).logits
        ref_logits = ref(input_ids=ids, use_cache=False).logits
        assert isinstance(logits, DTensor)
        want = ref_logits
        if dp:
            want = ref_logits.chunk(mesh.size(0))[mesh.get_local_rank("dp")]
        torch.testing.assert_close(logits.full_tensor(), want, **TOL)
        # data parallel: the mean of the dp ranks' local means is the whole batch's mean
        loss = F.cross_entropy(logits.to_local().flatten(0, 1), mine.flatten())
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), ids.flatten())
        if not dp:
            torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
        for name, p in ref.named_parameters():
            if p.grad is None or dp == "optimizer":  # each rank's own, reduced in step()
                continue
            torch.testing.assert_close(
                params[name].grad.full_tensor(),
                p.grad,
                **TOL,
                msg=lambda m, name=name: f"{name}: {m}",
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if dp:
            for name, p in ref.named_parameters():
                torch.testing.assert_close(
                    params[name].detach().full_tensor(),
                    p.detach(),
                    **TOL,
                    msg=lambda m, name=name, step=step: f"after step {step}, {name}: {m}",
                )


def _check_gpt2_forward_comm(model, ids):
    """One all-reduce per row-parallel layer (2 per block) and the embedding's, one
    all-gather of the logits: q/k/v come out of the fused projection already sharded."""
    from vescale.dtensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        model(input_ids=ids, use_cache=False)
    counts = {str(k).rsplit(".", 1)[-1]: v for k, v in comm.get_comm_counts().items()}
    n_layer = model.config.n_layer
    assert counts == {"all_reduce": 2 * n_layer + 1, "all_gather_into_tensor": 1}, counts


@GAP_211
@distributed(2)
def test_hf_gpt2_tp():
    run_hf("gpt2", sp=False)


@pytest.mark.parametrize("kind", [pytest.param("gpt2", marks=GAP_211), "llama"])
@distributed(2)
def test_hf_sdpa_attention_tp(kind):
    run_hf(kind, sp=False, attn="sdpa")


@pytest.mark.parametrize("kind", [pytest.param("gpt2", marks=GAP_211), "llama"])
@distributed(4)
def test_hf_tp4(kind):
    run_hf(kind, sp=False, mesh_shape=(4,))


@pytest.mark.parametrize(
    "kind,sp,dp",
    [
        pytest.param("gpt2", True, None, marks=GAP_211),
        ("llama", False, "fsdp"),
        ("llama", True, "ddp"),
        ("llama", False, "optimizer"),
        ("llama", True, "optimizer"),
    ],
)
@distributed(4)
def test_hf_dp2_x_tp2(kind, sp, dp):
    # With data parallelism each dp rank holds other samples: tensor parallelism then
    # computes on the tp sub-mesh (LLaMA's gradients used to mix the dp ranks' samples).
    # "optimizer": the documented DistributedOptimizer x TP program (no data_parallel=):
    # "dp" is a replica dim of the plan, so TP computes on the tp sub-mesh too.
    run_hf(kind, sp=sp, mesh_shape=(2, 2), dp=dp)


def _megatron_plan(ndim, params, replicated_outputs):
    """A hand-written plan: ``params`` (key -> placement on tp, the last mesh dim) and
    the module outputs all-reduced / gathered to ``Replicate()``."""
    from vescale.dtensor import Replicate

    def tp(p):
        return [Replicate()] * (ndim - 1) + [p]

    return {
        "parameter": {k: tp(p) for k, p in params.items()},
        "forward": {k: [tp(Replicate())] for k in replicated_outputs},
    }


def _gpt2_hand_plan(ndim):
    from torch.distributed.tensor.placement_types import _StridedShard

    blk = r"transformer\.h\.\d+"
    params = {
        r"transformer\.wte.weight": Shard(0),
        rf"{blk}\.attn\.c_attn.weight": _StridedShard(1, split_factor=3),
        rf"{blk}\.attn\.c_attn.bias": _StridedShard(0, split_factor=3),
        rf"{blk}\.(attn|mlp)\.c_proj.weight": Shard(0),
        rf"{blk}\.mlp\.c_fc.weight": Shard(1),
        rf"{blk}\.mlp\.c_fc.bias": Shard(0),
    }
    outs = [r"transformer\.wte.output", rf"{blk}\.(attn|mlp)\.c_proj.output", "lm_head.output"]
    return _megatron_plan(ndim, params, outs)


def _llama_hand_plan(ndim):
    layer = r"model\.layers\.\d+"
    params = {
        r"model\.embed_tokens.weight": Shard(0),
        rf"{layer}\.self_attn\.(q|k|v)_proj.weight": Shard(0),
        rf"{layer}\.self_attn\.o_proj.weight": Shard(1),
        rf"{layer}\.mlp\.(gate|up)_proj.weight": Shard(0),
        rf"{layer}\.mlp\.down_proj.weight": Shard(1),
        "lm_head.weight": Shard(0),
    }
    outs = [
        r"model\.embed_tokens.output",
        rf"{layer}\.(self_attn\.o_proj|mlp\.down_proj).output",
        "lm_head.output",
    ]
    return _megatron_plan(ndim, params, outs)


@pytest.mark.parametrize(
    "kind,mesh_shape", [pytest.param("gpt2", (4,), marks=GAP_211), ("llama", (2, 2))]
)
@distributed(4)
def test_hf_hand_written_plans(kind, mesh_shape):
    plan = _gpt2_hand_plan if kind == "gpt2" else _llama_hand_plan
    run_hf(kind, sp=False, mesh_shape=mesh_shape, plan=plan)


@distributed(2)
def test_hf_llama_tp_sp():
    run_hf("llama", sp=True)


@distributed(2)
def test_hf_llama_tp_no_sp():
    # The vocab-parallel embed_tokens output (torch's _MaskPartial, all-reduced to
    # Replicate) gets a Partial(sum) gradient from the column-parallel q/k/v and
    # gate/up projections; it must be reduced before the redistribute's backward.
    run_hf("llama", sp=False)


@GAP_211
@distributed(2)
def test_hf_gpt2_tp_sp():
    run_hf("gpt2", sp=True)


@distributed(4)
def test_hf_gpt2_fsdp_x_tp_keeps_fused_qkv_replicated_over_tp():
    # FSDP's RaggedShard composes with plain Shard only: the automatic plan then
    # leaves the fused c_attn replicated over tp (and FSDP shards it over dp).
    from vescale.dmodule import DModule
    from vescale.dtensor import Replicate

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _build("gpt2").eval()
    ref = copy.deepcopy(model)
    model = DModule(model, mesh, data_parallel={"dp": "fsdp"})
    for name, p in model.named_parameters():
        if "c_attn" in name:  # (sharded parameters live on the mesh with dp last)
            tp = p.device_mesh.mesh_dim_names.index("tp")
            assert p.placements[tp] == Replicate(), (name, p.placements)
    ids = torch.randint(0, 64, (2, 8))
    logits = model(input_ids=ids, use_cache=False).logits
    ref_logits = ref(input_ids=ids, use_cache=False).logits
    got = logits.full_tensor() if isinstance(logits, DTensor) else logits
    torch.testing.assert_close(got, ref_logits, **TOL)
    # a hand-written plan with a fused projection and FSDP: a clear error up front
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = {
        r"transformer\.h\.\d+\.attn\.c_attn.weight": [Replicate(), _StridedShard(1, split_factor=3)]
    }
    with pytest.raises(ValueError, match="FSDP composes with plain Shard only"):
        DModule(_build("gpt2"), mesh, strided, data_parallel={"dp": "fsdp"})


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@distributed(2)
def test_hf_generate_with_kv_cache_tp(kind):
    # HF's KV cache starts as an empty 1-D tensor that torch.cat skips; generate()
    # mixes the DTensor logits with plain input ids (hence implicit_replication).
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = _build(kind, "sdpa").eval()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad(), implicit_replication():
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    want = ref.generate(ids, max_new_tokens=4, do_sample=False, use_cache=True)
    got = got.full_tensor() if isinstance(got, DTensor) else got
    assert torch.equal(got, want), (got, want)
