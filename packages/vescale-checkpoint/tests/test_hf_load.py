"""load_hf: a save_pretrained directory into a model parallelized on the meta device.

Tiny random GPT-2 (tied embeddings, fused c_attn) and LLaMA (GQA) configs are saved
locally; the loaded parallel model must give the logits of transformers' own
from_pretrained, while each rank reads only its own pieces.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from vescale.checkpoint import CheckpointError, CheckpointMismatchError, load_hf  # noqa: E402
from vescale.dmodule import parallelize_module  # noqa: E402
from vescale.dtensor import DTensor, init_device_mesh  # noqa: E402
from vescale.dtensor.testing import load_helper, run_on_ranks  # noqa: E402

_HF = load_helper(__file__, "_hf_helpers")
TOL = _HF.TOL
_config = _HF.config


def _save(kind, d, *, dtype=None, max_shard_size=None):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind))
    if dtype is not None:
        model = model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(d, safe_serialization=True, **kw)
    return d


def _load_parallel(d, mesh_shape, dp):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(d)
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",) if dp is None else ("dp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    opts = {"data_parallel": {"dp": dp}} if dp else {}
    plan = {} if dp and len(mesh_shape) == 1 else None  # pure DP: no TP plan
    # HF's own initializer: recomputes the non-persistent buffers (rotary inv_freq) that
    # the files do not hold; the parameters it initialises are then overwritten
    parallelize_module(model, mesh, plan, param_init_fn=model._init_weights, **opts)
    return model.eval(), load_hf(model, d)


def _logits(model, idx):
    out = model(idx).logits
    return out.full_tensor() if isinstance(out, DTensor) else out


def _compare(d, mesh_shape, dp):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    model, res = _load_parallel(d, mesh_shape, dp)
    assert not res.missing and not res.unexpected, res
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_logits(model, idx), _logits(ref, idx), **TOL)
    full = sum(p.numel() * p.element_size() for p in ref.state_dict().values())
    return res.bytes_read, full


@pytest.mark.parametrize(
    ("kind", "mesh_shape", "dp"),
    [
        ("gpt2", (4,), None),  # TP=4: fused c_attn, tied lm_head
        ("llama", (2, 2), "fsdp"),  # FSDP x TP
        ("llama", (4,), "fsdp"),  # FSDP: ragged flat shards
    ],
    ids=["gpt2-tp4", "llama-fsdp2xtp2", "llama-fsdp4"],
)
def test_loaded_parallel_model_gives_transformers_logits(tmp_path, kind, mesh_shape, dp):
    d = _save(kind, tmp_path / kind)
    per_rank = run_on_ranks(_compare, 4, str(d), mesh_shape, dp)
    full = per_rank[0][1]
    for read, _ in per_rank:
        # every rank reads its own shards, never the whole model
        assert 0 < read < full, (read, full)
    if dp == "fsdp" and len(mesh_shape) == 1:
        # FSDP on 4 ranks: together the ranks read each element once
        assert sum(r for r, _ in per_rank) == full


def _bf16_into_fp32(d) -> None:
    model, res = _load_parallel(d, (2, 2), None)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.detach(), atol=0, rtol=0, msg=n)


def test_sharded_bf16_files_load_into_fp32_parameters(tmp_path):
    d = _save("llama", tmp_path / "m", dtype=torch.bfloat16, max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    run_on_ranks(_bf16_into_fp32, 4, str(d))


def _mismatches(d: str, empty: str) -> None:
    import transformers

    cfg = _config("llama")
    cfg.intermediate_size = 48  # the MLP no longer fits the files
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointMismatchError, match=r"mlp\.gate_proj\.weight: \[64, 32\]"):
        load_hf(model, d)
    after = {n: p.full_tensor() for n, p in model.named_parameters()}
    assert all(torch.equal(before[n], after[n]) for n in before)

    # a model with an extra parameter: strict names it, strict=False reports it
    model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(3)))
    parallelize_module(model, mesh)
    with pytest.raises(CheckpointMismatchError, match="'extra'"):
        load_hf(model, d)
    res = load_hf(model, d, strict=False)
    assert res.missing == ["extra"] and not res.unexpected
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf(model, empty)


def test_mismatches_are_named_before_anything_changes(tmp_path):
    d = _save("llama", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    run_on_ranks(_mismatches, 2, str(d), str(tmp_path / "empty"))


def _load_then_save(d: str, ckpt: str) -> None:
    import vescale.checkpoint as vckpt

    model, _ = _load_parallel(d, (2, 2), "fsdp")
    vckpt.save(ckpt, {"model": model})


def test_export_of_a_loaded_model_is_the_pretrained_one(tmp_path):
    # pretrained -> sharded model -> vescale checkpoint -> safetensors -> transformers
    import shutil

    import transformers

    import vescale.checkpoint as vckpt

    d = _save("gpt2", tmp_path / "in")
    run_on_ranks(_load_then_save, 4, str(d), str(tmp_path / "ckpt"))
    out = tmp_path / "out"
    vckpt.export(tmp_path / "ckpt", out, max_shard_size="40KB")
    shutil.copy(d / "config.json", out / "config.json")
    a = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(b(idx).logits, a(idx).logits, atol=0, rtol=0)


def test_peft_modules_to_save_original_and_copy_both_load_and_the_copy_exports(tmp_path):
    # peft's modules_to_save keeps the frozen original (used with the adapter disabled)
    # and a trained copy: load_hf fills both from the base name, export writes the copy
    peft = pytest.importorskip("peft")
    import transformers

    import vescale.checkpoint as vckpt

    d = _save("llama", tmp_path / "in")
    src = transformers.AutoModelForCausalLM.from_pretrained(d)
    torch.manual_seed(1)  # other random weights than the files'
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_config(_config("llama")),
        peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    )
    res = load_hf(model, d)
    assert not res.missing and not res.unexpected, res
    head = model.get_base_model().lm_head
    want = src.lm_head.weight.detach()
    torch.testing.assert_close(head.original_module.weight.detach(), want, atol=0, rtol=0)
    torch.testing.assert_close(
        head.modules_to_save["default"].weight.detach(), want, atol=0, rtol=0
    )
    with torch.no_grad():
        head.modules_to_save["default"].weight.add_(1.0)  # "trained"
    vckpt.export(model, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(back.lm_head.weight.detach(), want + 1.0)
