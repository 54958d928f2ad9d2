"""export(model, dir): a parallelized model back to a sharded save_pretrained directory.

Every rank writes the output files assigned to it (one gathered tensor at a time);
transformers' from_pretrained of the result gives the trained vescale model's logits. A
peft LoRA model exports merged (plain transformers, against single-device peft's
merge_and_unload) or as its adapter alone (PeftModel.from_pretrained).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import vescale.checkpoint as vckpt  # noqa: E402
from vescale.dmodule import parallelize_module  # noqa: E402
from vescale.dtensor import DTensor, init_device_mesh  # noqa: E402
from vescale.dtensor.testing import load_helper, run_on_ranks  # noqa: E402

_HF = load_helper(__file__, "_hf_helpers")
TOL = _HF.TOL
_config = _HF.config


def _batches(n, rows=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (rows, 9), generator=g) for _ in range(n)]


def _logits(model, idx):
    out = model(input_ids=idx).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _train(model, batches, dp_rank=None, dp=1):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for seq in batches:
        if dp_rank is not None:  # a data-parallel rank: its share of the batch
            seq = seq.chunk(dp)[dp_rank]
        model(input_ids=seq[:, :-1], labels=seq[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()


def _export_trained(src: str, out: str, kind: str, mesh_shape, names) -> dict:
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    plan = {} if "tp" not in names else None
    parallelize_module(
        model, mesh, plan, data_parallel={"dp": "fsdp"}, param_init_fn=model._init_weights
    )
    vckpt.load_hf(model, src)
    dp_rank = mesh.get_local_rank("dp")
    _train(model, _batches(2), dp_rank, mesh["dp"].size())
    idx = _batches(1, rows=2)[0][:, :8]
    with torch.no_grad():
        want = _logits(model.eval(), idx)
    files = vckpt.export(model, out, max_shard_size="20KB")
    # every rank sees the whole export; the files of the export were written by several ranks
    assert all(f.is_file() for f in files), files
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        torch.testing.assert_close(ref.eval()(idx).logits, want, **TOL)
    return {"files": [f.name for f in files], "rank": dist.get_rank()}


@pytest.mark.parametrize(
    ("kind", "mesh_shape", "names"),
    [("llama", (2, 2), ("dp", "tp")), ("gpt2", (4,), ("dp",))],
    ids=["llama-fsdp2xtp2", "gpt2-fsdp4"],
)
def test_trained_parallel_model_exports_a_sharded_save_pretrained_dir(
    tmp_path, kind, mesh_shape, names
):
    import transformers

    src, out = tmp_path / "in", tmp_path / "out"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(kind)).save_pretrained(src)
    res = run_on_ranks(_export_trained, 4, str(src), str(out), kind, mesh_shape, names)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 4 and shards == sorted(f for f in res[0]["files"] if "-of-" in f)
    assert (out / "config.json").is_file()
    from safetensors import safe_open

    size = 0
    for f in shards:
        with safe_open(os.fspath(out / f), framework="pt") as h:
            size += sum(h.get_slice(k).get_shape().__len__() >= 0 for k in h.keys())
    assert size == len(index["weight_map"])  # each tensor in exactly the file the index names
    if kind == "gpt2":
        assert "lm_head.weight" not in index["weight_map"]  # tied: written once


def _peft_llama():
    import peft
    import transformers

    cfg = _config("llama")
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    lc = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
        init_lora_weights=False,
    )  # fmt: skip
    return peft.get_peft_model(model, lc)


def _lora_export(merged: str, adapter: str, mode: str) -> None:
    model = _peft_llama()
    if mode == "tp":  # automatic TP plan; every rank sees the whole batch
        parallelize_module(model, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))
        _train(model, _batches(2))
    elif mode == "fsdp_tp":  # 2 x 2: automatic TP plan, FSDP over dp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh, None, data_parallel={"dp": "fsdp"})
        _train(model, _batches(2), mesh.get_local_rank("dp"), 2)
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        parallelize_module(model, mesh, {}, data_parallel={"dp": "fsdp"})
        _train(model, _batches(2), dist.get_rank(), 4)
    vckpt.export(model, merged, max_shard_size="30KB")
    vckpt.export(model, adapter, adapters="only")


@pytest.mark.parametrize("mode", ["tp", "dp", "fsdp_tp"], ids=["tp4", "fsdp4", "fsdp2xtp2"])
def test_lora_exports_merged_and_as_adapter_like_single_device_peft(tmp_path, mode):
    pytest.importorskip("peft")
    import peft
    import transformers

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    run_on_ranks(_lora_export, 4, str(merged), str(adapter), mode)

    ref = _peft_llama()
    _train(ref, _batches(2))
    idx = _batches(1, rows=2)[0][:, :8]
    with torch.no_grad():
        want = ref.eval()(input_ids=idx).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(
            merged, attn_implementation="eager"
        ).eval()
        assert not any("lora" in n for n, _ in base.named_parameters())
        torch.testing.assert_close(base(idx).logits, want, **TOL)
        # the same as peft's own merge of the single-device model
        torch.testing.assert_close(ref.merge_and_unload()(idx).logits, want, **TOL)

        assert (adapter / "adapter_model.safetensors").is_file()
        assert (adapter / "adapter_config.json").is_file()
        torch.manual_seed(0)
        cfg = _config("llama")
        cfg._attn_implementation = "eager"
        fresh = transformers.LlamaForCausalLM(cfg)  # the untouched base weights (same seed)
        loaded = peft.PeftModel.from_pretrained(fresh, adapter).eval()
        torch.testing.assert_close(loaded(input_ids=idx).logits, want, **TOL)
