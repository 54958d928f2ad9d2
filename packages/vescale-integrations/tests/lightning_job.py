"""A Lightning job on 4 CPU processes, started by Lightning's own launcher.

Phase 1 trains an unmodified HF LLaMA under FSDP over 4 ranks for one epoch and saves a
Lightning checkpoint (through vescale.checkpoint); phase 2 resumes it under FSDP x TP on a
2 x 2 mesh (another layout: the checkpoint is resharded) for a second epoch. Rank 0 writes
what it saw to
``<out>/result.json``. Run by test_lightning.py; also ``python lightning_job.py OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import transformers
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from vescale.dtensor import DTensor
from vescale.integrations.lightning import VescaleStrategy


def tiny_llama() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


class CausalLM(pl.LightningModule):
    """What a user writes: the model is unmodified, the loss is plain."""

    def __init__(self, batch_size: int, single_device_order: bool = False) -> None:
        super().__init__()
        self.model = tiny_llama()
        self.batch_size = batch_size
        self.single_device_order = single_device_order
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        loss = self.model(input_ids=seq[:, :-1], labels=seq[:, 1:]).loss
        self.log("loss", loss, sync_dist=True)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        data = torch.randint(0, 64, (16, 9), generator=torch.Generator().manual_seed(1))
        if not self.single_device_order:  # Lightning adds its distributed sampler
            return DataLoader(TensorDataset(data), batch_size=self.batch_size)
        # The reference: Lightning always shuffles the distributed sampler it adds for
        # training (seed 0, reseeded every epoch); one replica of it draws the order whose
        # global batches the data-parallel ranks share out.
        order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
        return DataLoader(TensorDataset(data), batch_size=self.batch_size, sampler=order)


def trainer(strategy, epochs: int, devices: int = 4) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=devices > 1,
    )  # fmt: skip


def main(out: Path) -> None:
    # phase 1: FSDP, each data-parallel rank gets a quarter of every global batch of 8
    first = CausalLM(batch_size=2)
    t1 = trainer(VescaleStrategy(mesh_shape=(4,), data_parallel="fsdp"), epochs=1)
    t1.fit(first)
    q = first.model.model.layers[0].self_attn.q_proj.weight
    layout = [isinstance(q, DTensor), [str(p) for p in q.placements]]
    t1.save_checkpoint(out / "ckpt")
    # phase 2: FSDP x TP (2 x 2, automatic TP plan), resumed from phase 1's checkpoint
    # (resharded); each of the 2 data-parallel ranks gets half of every global batch of 8
    second = CausalLM(batch_size=4)
    t2 = trainer(VescaleStrategy(mesh_shape=(2, 2), data_parallel={"dp": "fsdp"}), epochs=2)
    t2.fit(second, ckpt_path=out / "ckpt")
    if t2.is_global_zero:
        result = {
            "losses": first.losses + second.losses,
            "layout": layout,
            "steps": [t1.global_step, t2.global_step],
            "world": t2.world_size,
            "files": sorted(p.name for p in (out / "ckpt").iterdir()),
            "logged": float(t2.callback_metrics["loss"]),
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
