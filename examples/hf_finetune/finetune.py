"""Fine-tune a locally saved tiny LLaMA with LoRA on 4 CPU ranks, export, reload in transformers.

    torchrun --standalone --nproc-per-node 4 examples/hf_finetune/finetune.py [--steps 20]
        [--mode fsdp|tp|fsdp_tp] [--workdir runs/hf_finetune]

1. Rank 0 saves a random tiny ``LlamaForCausalLM`` with ``save_pretrained`` (nothing is
   downloaded): this stands in for a pretrained checkpoint.
2. Every rank builds the model on the ``meta`` device, wraps it with peft's LoRA,
   parallelizes it (FSDP over 4 ranks, tensor parallelism, or FSDP x TP on 2 x 2) and
   reads its own shards of the pretrained weights with ``vescale.checkpoint.load_hf``.
3. It trains the adapters only (the base weights are frozen).
4. ``vescale.checkpoint.export`` writes the merged model (``W + B @ A * scaling``) as a
   sharded ``save_pretrained`` directory, each rank its own files, and the adapter alone
   in peft's format.
5. Rank 0 reloads both with plain transformers / peft and prints the largest logits
   difference against the vescale model.

Needs ``transformers``, ``peft`` and ``safetensors``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--mode", choices=["fsdp", "tp", "fsdp_tp"], default="fsdp")
    ap.add_argument("--workdir", default="runs/hf_finetune")
    args = ap.parse_args()
    try:
        import peft
        import transformers
    except ImportError:
        print(
            "examples/hf_finetune needs `pip install transformers peft safetensors`",
            file=sys.stderr,
        )
        return 2

    import vescale.checkpoint as vckpt
    from vescale.dmodule import parallelize_module
    from vescale.dtensor import DTensor, init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode == "fsdp_tp":  # FSDP over "dp", the automatic TP plan over "tp"
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    else:
        names = ("dp",) if args.mode == "fsdp" else ("tp",)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=names)
    rank = dist.get_rank()
    # this rank's data-parallel index and the number of data-parallel ranks
    if args.mode == "fsdp":
        dp_rank, dp_size = rank, world
    elif args.mode == "fsdp_tp":
        dp_rank, dp_size = mesh.get_local_rank("dp"), world // 2
    else:
        dp_rank, dp_size = 0, 1
    work = Path(args.workdir)
    pretrained, merged, adapter = work / "pretrained", work / "merged", work / "adapter"

    # 1. a "pretrained" model on disk
    if rank == 0:
        cfg = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(pretrained)
    dist.barrier()

    # 2. meta model -> LoRA -> parallelized -> each rank reads its own shards
    cfg = transformers.AutoConfig.from_pretrained(pretrained)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    opts = {"data_parallel": {"dp": "fsdp"}} if args.mode != "tp" else {}
    plan = {} if args.mode == "fsdp" else None  # tp, fsdp_tp: the automatic Megatron plan
    base = model.get_base_model()
    # (no torch.manual_seed: the processes' generators differ; parallelize_module
    # initialises the meta tensors from rank 0's, so replicated adapters agree)
    parallelize_module(model, mesh, plan, param_init_fn=base._init_weights, **opts)
    # LoRA starts as the identity: B = 0 (A keeps its random initialisation)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    # peft's names map to the base model's (q_proj.base_layer.weight is q_proj.weight);
    # strict: every base weight is in the files, every file key has a home
    vckpt.load_hf(model, pretrained)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if rank == 0:
        n_all = sum(p.numel() for p in model.parameters())
        n_train = sum(p.numel() for p in trainable)
        print(f"{args.mode} on {world} ranks: {n_train:,} trainable of {n_all:,} parameters")

    # 3. train the adapters on byte windows of this file
    text = Path(__file__).read_bytes()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # the same global batch on every rank
        starts = torch.randint(0, data.numel() - 33, (8,), generator=g)
        seq = data[starts.unsqueeze(1) + torch.arange(33)]
        seq = seq.chunk(dp_size)[dp_rank]  # each data-parallel rank: its share
        loss = model(input_ids=seq[:, :-1], labels=seq[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).clone()
        if dp_size > 1:  # (tensor-parallel ranks hold equal losses)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step + 1:>3}/{args.steps} loss {loss.item():.4f}", flush=True)

    # 4. export: merged base weights (sharded save_pretrained dir) and the adapter alone
    probe = torch.arange(32).reshape(2, 16)
    with torch.no_grad():
        out = model.eval()(input_ids=probe).logits
        want = out.full_tensor() if isinstance(out, DTensor) else out
    files = vckpt.export(model, merged, max_shard_size="100KB")
    vckpt.export(model, adapter, adapters="only")

    # 5. plain transformers / peft
    if rank == 0:
        with torch.no_grad():
            plain = transformers.AutoModelForCausalLM.from_pretrained(
                merged, attn_implementation="eager"
            ).eval()
            d_merged = (plain(probe).logits - want).abs().max().item()
            base_model = transformers.AutoModelForCausalLM.from_pretrained(
                pretrained, attn_implementation="eager"
            )
            with_adapter = peft.PeftModel.from_pretrained(base_model, adapter).eval()
            d_adapter = (with_adapter(input_ids=probe).logits - want).abs().max().item()
        print(f"exported {len(files)} files to {merged}")
        print(
            f"max |logits difference|: merged export {d_merged:.2e}, adapter export {d_adapter:.2e}"
        )
        ok = d_merged < 1e-4 and d_adapter < 1e-4
        print("FINETUNE COMPLETE" if ok else "LOGITS DIFFER", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
