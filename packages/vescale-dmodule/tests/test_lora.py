"""LoRA fine-tuning (peft's get_peft_model on an unmodified HF LLaMA) under DDP, FSDP, TP
and FSDP x TP.

peft wraps the model first, vescale parallelizes the wrapped model; the frozen base
weights get no gradients, no gradient communication and no optimizer state, and the
losses and every parameter equal single-device peft training.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("peft")

from vescale.dmodule import dp_memory_bytes, parallelize_module  # noqa: E402
from vescale.dtensor import DTensor, init_device_mesh  # noqa: E402
from vescale.dtensor.debug import CommDebugMode  # noqa: E402
from vescale.dtensor.testing import distributed  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


def _llama(lora: bool):
    import peft
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if not lora:
        return model
    # init_lora_weights=False: B is random too, so the adapters change the output at once
    lc = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    return peft.get_peft_model(model, lc)


def _parallel(model, mode):
    if mode == "fsdp_tp":  # 2 x 2: automatic TP plan, FSDP over dp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return parallelize_module(model, mesh, None, data_parallel={"dp": "fsdp"})
    names = ("tp",) if mode == "tp" else ("dp",)
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=names)
    if mode == "tp":
        return parallelize_module(model, mesh)  # automatic TP plan
    return parallelize_module(model, mesh, {}, data_parallel={"dp": mode})


def _train(model, mode, steps=3):
    """Losses (global means) and per-step bytes sent of ``steps`` AdamW steps."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, sent = [], []
    for _ in range(steps):
        seq = torch.randint(0, 64, (8, 9), generator=g)
        x, y = seq[:, :-1], seq[:, 1:]
        if mode in ("ddp", "fsdp"):  # each data-parallel rank: its quarter of the batch
            r = dist.get_rank()
            x, y = x.chunk(4)[r], y.chunk(4)[r]
        elif mode == "fsdp_tp":  # each dp rank (rank // 2 on the 2 x 2 mesh): its half
            r = dist.get_rank() // 2
            x, y = x.chunk(2)[r], y.chunk(2)[r]
        with CommDebugMode() as comm:
            loss = model(input_ids=x, labels=y).loss
            loss.backward()
        sent.append(sum(comm.comm_bytes.values()))
        frozen_grads = [
            n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
        ]
        assert not frozen_grads, frozen_grads
        opt.step()
        opt.zero_grad()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach().clone()
        if mode in ("ddp", "fsdp", "fsdp_tp") and dist.is_initialized():
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # (tp ranks hold equal losses)
        losses.append(loss.item())
    return losses, sent, opt


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp", "fsdp_tp"])
@distributed(4)
def test_lora_matches_single_device_peft(mode):
    ref = _llama(lora=True)
    ref_losses = []
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        seq = torch.randint(0, 64, (8, 9), generator=g)
        loss = ref(input_ids=seq[:, :-1], labels=seq[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    model = _parallel(_llama(lora=True), mode)
    losses, lora_sent, lora_opt = _train(model, mode)
    torch.testing.assert_close(losses, ref_losses, **TOL)
    got = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n].detach(), p.detach(), **TOL, msg=n)

    if mode in ("ddp", "fsdp"):
        # against full fine-tuning of the same model on the same engine
        full = _parallel(_llama(lora=False), mode)
        _, full_sent, full_opt = _train(full, mode, steps=1)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in full.parameters())
        assert trainable * 20 < total
        lora_mem = dp_memory_bytes(model, lora_opt)
        full_mem = dp_memory_bytes(full, full_opt)
        # optimizer state of the trainable parameters only (FSDP: this rank's even share)
        assert lora_mem["optim"] * (10 if mode == "ddp" else 20) < full_mem["optim"], (
            lora_mem,
            full_mem,
        )
        if mode == "ddp":
            # DDP reduces gradients only: LoRA's few trainable parameters
            assert lora_sent[-1] * 10 < full_sent[-1], (lora_sent, full_sent)
        else:
            # FSDP all-gathers every weight twice (forward, backward) and reduce-scatters
            # LoRA's gradients only: about 2/3 of full fine-tuning's bytes
            assert lora_sent[-1] * 4 < full_sent[-1] * 3, (lora_sent, full_sent)
