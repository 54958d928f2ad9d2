"""Train a tiny Hugging Face LLaMA (random init, no download) with DModule's automatic plan.

    torchrun --standalone --nproc-per-node 2 examples/hf_llama/train.py [--steps 20] [--no-sp]

The model is ``transformers.LlamaForCausalLM`` built from a config (nothing is
downloaded); ``parallelize_module(model, mesh)`` with no plan derives Megatron tensor
parallelism from the layer names (``q_proj``/``k_proj``/``v_proj``/``gate_proj``/
``up_proj`` column-parallel, ``o_proj``/``down_proj`` row-parallel, ``embed_tokens``
vocabulary-parallel, ``lm_head`` column-parallel). The data are byte-level windows of
this repository's ``examples/gpt/*.py`` sources. Needs ``transformers`` (optional).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--sp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sequence parallelism (default on)",
    )
    args = ap.parse_args()
    try:
        import transformers
    except ImportError:
        print("examples/hf_llama needs `pip install transformers`", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", "1"))
    heads, kv_heads = 4, 2
    if kv_heads % world and world % kv_heads:
        print(f"world size {world} must divide {kv_heads} kv heads", file=sys.stderr)
        return 2

    from vescale.dmodule import parallelize_module
    from vescale.dtensor import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=args.seq, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"  # torch 2.13: no DTensor rule for CPU flash attention
    model = transformers.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    parallelize_module(model, mesh, sequence_parallel=args.sp)  # no plan: automatic
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    text = b"".join(p.read_bytes() for p in sorted(Path(__file__).parents[1].glob("gpt/*.py")))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    rank = dist.get_rank()
    first = last = None
    t0 = time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)  # same batch on every tp rank
        starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
        xy = data[starts.unsqueeze(1) + torch.arange(args.seq + 1)]
        logits = model(input_ids=xy[:, :-1], use_cache=False).logits
        if isinstance(logits, DTensor):
            logits = logits.to_local()  # Replicate(): every rank holds the full logits
        loss = F.cross_entropy(logits.flatten(0, 1), xy[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step + 1:>3}/{args.steps} loss {last:.4f}", flush=True)
    if rank == 0:
        print(
            f"HF LLaMA {n_params / 1e6:.2f}M params, tp={world}{' +SP' if args.sp else ''}: "
            f"TRAINING COMPLETE: start loss {first:.4f} -> end loss {last:.4f} "
            f"({time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
