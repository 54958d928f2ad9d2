"""HF GPT-2 and LLaMA (tiny configs, random init) under the automatic TP/SP plan.

Skipped without ``transformers`` (an optional test dependency). Models use eager
attention: torch 2.13 has no DTensor sharding rule for CPU flash attention.
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


def _build(kind):
    import transformers

    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        cfg._attn_implementation = "eager"
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg)


def run_hf(kind, sp, steps=2):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = _build(kind).eval()  # eval: no dropout; grads still flow
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, sequence_parallel=sp)
    assert isinstance(model, type(ref))
    sharded = [
        n for n, p in model.named_parameters() if any(isinstance(q, Shard) for q in p.placements)
    ]
    assert len(sharded) >= 8, sharded
    ids = torch.randint(0, 64, (2, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    params = dict(model.named_parameters())
    for _ in range(steps):
        logits = model(input_ids=ids, use_cache=False).logits
        ref_logits = ref(input_ids=ids, use_cache=False).logits
        assert isinstance(logits, DTensor)
        torch.testing.assert_close(logits.full_tensor(), ref_logits, **TOL)
        loss = F.cross_entropy(logits.to_local().flatten(0, 1), ids.flatten())
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), ids.flatten())
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        ref_loss.backward()
        for name, p in ref.named_parameters():
            if p.grad is None:
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


@distributed(2)
def test_hf_gpt2_tp():
    run_hf("gpt2", sp=False)


@distributed(2)
def test_hf_llama_tp_sp():
    run_hf("llama", sp=True)


@distributed(2)
def test_hf_llama_tp_no_sp():
    # The vocab-parallel embed_tokens output (torch's _MaskPartial, all-reduced to
    # Replicate) gets a Partial(sum) gradient from the column-parallel q/k/v and
    # gate/up projections; it must be reduced before the redistribute's backward.
    run_hf("llama", sp=False)


@distributed(2)
def test_hf_gpt2_tp_sp():
    run_hf("gpt2", sp=True)
