"""Pretrained loading and LoRA on 4 CPU ranks: memory while loading, bytes and state per step.

    torchrun --standalone --nproc-per-node 4 benchmarks/hf_finetune_bench.py

Needs transformers and peft (not part of `hatch run bench:run`). Prints, per rank:

* `load_hf` of a LLaMA (d=512, 4 layers, saved with save_pretrained) into an FSDP=4 model
  built on `meta`: the process's resident-set growth while loading (sampled every
  millisecond from /proc/self/statm), against the rank's shard bytes and the full model.
* One training step under TP=4 and FSDP=4, LoRA (r=8 on q_proj/v_proj) against full
  fine-tuning: bytes this rank sent (CommDebugMode) and optimizer-state bytes held locally.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import vescale.checkpoint as vckpt
from vescale.dmodule import parallelize_module
from vescale.dtensor import init_device_mesh
from vescale.dtensor.debug import CommDebugMode

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, rss())


def config(big: bool):
    import transformers

    d = 512 if big else 64
    cfg = transformers.LlamaConfig(
        vocab_size=4096 if big else 256, hidden_size=d, intermediate_size=4 * d,
        num_hidden_layers=4 if big else 2, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    return cfg


def local_bytes(tensors) -> int:
    n = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        n += t.numel() * t.element_size()
    return n


def step_cost(mode: str, lora: bool, mesh) -> tuple[int, int]:
    import peft
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config(big=False))
    if lora:
        lc = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        model = peft.get_peft_model(model, lc)
    if mode == "tp":
        parallelize_module(model, mesh)
    else:
        parallelize_module(model, mesh, {}, data_parallel={"dp": "fsdp"})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    seq = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(1))
    if mode == "fsdp":
        seq = seq.chunk(4)[dist.get_rank()]
    sent = 0
    for _ in range(2):  # the second step is measured
        with CommDebugMode() as comm:
            model(input_ids=seq[:, :-1], labels=seq[:, 1:]).loss.backward()
            opt.step()
        opt.zero_grad()
        sent = sum(comm.comm_bytes.values())
    state = local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return sent, state


def main() -> None:
    import transformers

    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    tmp = tempfile.mkdtemp() if rank == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box)
    d = box[0]
    if rank == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config(big=True)).save_pretrained(d)
    dist.barrier()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(big=True))
    full = sum(p.numel() * 4 for p in model.parameters())
    parallelize_module(
        model, dp, {}, data_parallel={"dp": "fsdp"}, param_init_fn=model._init_weights
    )
    shard = local_bytes(model.parameters())
    with PeakRSS() as mem:
        res = vckpt.load_hf(model, d)
    rows = [("load_hf", mem.peak - mem.base, shard, full, res.bytes_read)]
    gathered = [None] * 4
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        print("load_hf into FSDP=4 (LLaMA d=512, 4 layers, fp32):")
        print("rank | RSS growth while loading | shard bytes | full model bytes | bytes read")
        for r, rr in enumerate(gathered):
            _, grow, sh, fu, rd = rr[0]
            print(f"{r} | {grow:,} | {sh:,} | {fu:,} | {rd:,}")
    tp = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    out = {}
    for mode, mesh in (("tp", tp), ("fsdp", dp)):
        for lora in (True, False):
            out[(mode, lora)] = step_cost(mode, lora, mesh)
    if rank == 0:
        print("\none step, tiny LLaMA (d=64, 2 layers), rank 0: bytes sent | optimizer state bytes")
        for mode in ("tp", "fsdp"):
            (ls, lo), (fs, fo) = out[(mode, True)], out[(mode, False)]
            print(f"{mode}: LoRA {ls:,} | {lo:,}   full {fs:,} | {fo:,}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
