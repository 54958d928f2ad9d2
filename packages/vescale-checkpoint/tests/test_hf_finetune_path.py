"""The user's LoRA fine-tuning path, end to end, on ranks whose generators differ.

examples/hf_finetune as a test: a pretrained directory; on every rank a LLaMA built on
the ``meta`` device, wrapped by peft's LoRA, parallelized (FSDP x TP on 2 x 2, TP=4 or
FSDP=4) with ``param_init_fn``, LoRA's B zeroed through the DTensors, the base weights
read by ``load_hf``; three AdamW steps, each data-parallel rank on its own samples;
``export`` merged and adapter-only. torchrun processes seed their generators at random
(the test pool seeds them all alike, so each rank reseeds differently here): the
replicated LoRA A must still be one matrix. The live logits, the merged export in plain
transformers, the adapter export in peft and single-device peft training of the same
initial values (rank 0's generator) agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("safetensors")

import vescale.checkpoint as vckpt  # noqa: E402
from vescale.dmodule import parallelize_module  # noqa: E402
from vescale.dtensor import DTensor, init_device_mesh  # noqa: E402
from vescale.dtensor.testing import run_on_ranks  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
SEED = 1000  # rank r seeds SEED + r


def _lora():
    import peft

    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


def _meta_peft_llama(src: str):
    import peft
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return peft.get_peft_model(model, _lora())


def _zero_b(model) -> None:
    with torch.no_grad():  # LoRA starts as the identity; A keeps its initialisation
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.zero_()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (8, 9), generator=g) for _ in range(3)]


def _probe():
    return torch.arange(16).reshape(2, 8) * 3 % 64


def _train(model, dp_rank: int = 0, dp: int = 1) -> list[float]:
    """Three AdamW steps on the adapters; the global batch's mean loss per step."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for seq in _batches():
        seq = seq.chunk(dp)[dp_rank]  # this data-parallel rank's samples
        loss = model(input_ids=seq[:, :-1], labels=seq[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).clone()
        if dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # (tp ranks hold equal losses)
        losses.append(loss.item())
    return losses


def _finetune(src: str, merged: str, adapter: str, mode: str) -> dict:
    import transformers

    torch.manual_seed(SEED + dist.get_rank())
    model = _meta_peft_llama(src)
    if mode == "fsdp_tp":  # FSDP over dp, the automatic TP plan over tp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan, opts = None, {"data_parallel": {"dp": "fsdp"}}
        dp_rank, dp = mesh.get_local_rank("dp"), 2
    elif mode == "tp":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        plan, opts, dp_rank, dp = None, {}, 0, 1
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        plan, opts = {}, {"data_parallel": {"dp": "fsdp"}}
        dp_rank, dp = dist.get_rank(), 4
    base = model.get_base_model()
    parallelize_module(model, mesh, plan, param_init_fn=base._init_weights, **opts)
    _zero_b(model)
    vckpt.load_hf(model, src)
    losses = _train(model, dp_rank, dp)
    with torch.no_grad():
        out = model.eval()(input_ids=_probe()).logits
        live = out.full_tensor() if isinstance(out, DTensor) else out
    vckpt.export(model, merged, max_shard_size="30KB")
    vckpt.export(model, adapter, adapters="only")
    with torch.no_grad():  # every rank: the merged export in plain transformers
        plain = transformers.AutoModelForCausalLM.from_pretrained(
            merged, attn_implementation="eager"
        ).eval()
        torch.testing.assert_close(plain(_probe()).logits, live, **TOL)
    return {"losses": losses, "live": live}


def _single_device(src: str):
    """Single-device peft from rank 0's generator: the meta model initialised module by
    module in ``named_modules()`` order (as documented), B zeroed, the pretrained weights
    copied in, trained on the whole batches."""
    import transformers

    torch.manual_seed(SEED)
    model = _meta_peft_llama(src)
    base = model.get_base_model()
    for _, mod in model.named_modules():
        own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
        if any(t.device.type == "meta" for t in own):
            mod.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                base._init_weights(mod)
    _zero_b(model)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(src).state_dict()
    own = base.state_dict()
    filled = set()
    with torch.no_grad():
        for k, v in pretrained.items():
            name = k if k in own else k.replace(".weight", ".base_layer.weight")
            own[name].copy_(v)
            filled.add(name)
    assert filled == {k for k in own if "lora_" not in k}, set(own) - filled
    return model


@pytest.mark.parametrize("mode", ["fsdp_tp", "tp", "fsdp"], ids=["fsdp2xtp2", "tp4", "fsdp4"])
def test_meta_lora_finetune_on_differently_seeded_ranks_exports_the_live_model(tmp_path, mode):
    import peft
    import transformers

    src, merged, adapter = tmp_path / "pretrained", tmp_path / "merged", tmp_path / "adapter"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            tie_word_embeddings=False,
        )  # fmt: skip
    ).save_pretrained(src)
    res = run_on_ranks(_finetune, 4, str(src), str(merged), str(adapter), mode)

    ref = _single_device(str(src))
    ref_losses = _train(ref)
    with torch.no_grad():
        want = ref.eval()(input_ids=_probe()).logits
    for r in res:  # every rank: one device's losses and logits
        torch.testing.assert_close(r["losses"], ref_losses, **TOL)
        torch.testing.assert_close(r["live"], want, **TOL)
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(
            merged, attn_implementation="eager"
        ).eval()
        torch.testing.assert_close(plain(_probe()).logits, want, **TOL)
        fresh = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
        loaded = peft.PeftModel.from_pretrained(fresh, adapter).eval()
        torch.testing.assert_close(loaded(input_ids=_probe()).logits, want, **TOL)
