"""The prepared GPU check (``benchmarks/gpu/check.py``): its dry run, and its CUDA sections.

``test_dry_run`` runs the check on CPU (tiny sizes, Triton interpreted, two ranks as
threads) so CI keeps the script working; the ``gpu`` tests run each CUDA section of
the same script (what ``benchmarks/gpu/check.sh`` reports) and skip without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "benchmarks" / "gpu" / "check.py"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def test_dry_run(tmp_path):
    """The dry run passes, and its report holds real, checked values."""
    cmd = [sys.executable, str(CHECK), "--dry-run", "--inline", "--out", str(tmp_path)]
    cmd += ["--only", "pack", "dmodule", "checkpoint", "multirank"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dry_run"] and report["ok"]
    md = (tmp_path / "report.md").read_text()
    assert "# GPU check (dry run on CPU)" in md and "| path (backend gloo) | result |" in md
    sec = report["sections"]
    ops = {r["op"] for r in sec["pack"]["rows"]}
    assert {"torch: pack fp32", "torch: unpack bf16->fp32", "device copy (copy_)"} <= ops
    if HAS_TRITON:  # interpreted Triton kernels, checked against torch.cat
        assert {"triton: pack fp32->bf16", "triton: unpack fp32"} <= ops
    assert all(r.get("correct", True) for r in sec["pack"]["rows"])
    d = sec["dmodule"]
    assert d["backend"] == "gloo"
    for key in ("fsdp_bf16_vs_plain", "tp_bf16_vs_plain"):
        assert d[key]["ok"] and d[key]["max_grad_rel_err"] < 2e-2, d[key]
    f = d["fsdp_vs_torch_fsdp2"]
    assert f["vescale FSDP"]["median_ms"] > 0 and f["torch FSDP2"]["median_ms"] > 0
    c = sec["checkpoint"]
    assert c["round_trip_equal"] == {"vescale": True, "dcp": True}
    assert {r["op"] for r in c["rows"]} >= {"vescale save", "DCP save", "vescale load", "DCP load"}
    checks = sec["multirank"]["checks"]
    for name in ("all_reduce", "reduce_scatter_tensor", "vescale FSDP step vs one device"):
        assert checks[f"gloo 2 ranks: {name}"] == "ok", checks


def test_trainer_flags_parse():
    """The trainer flags of both runs are flags the trainer knows (validated, no process)."""
    check = _load(CHECK, "_vescale_gpu_check")
    sys.path.insert(0, str(REPO / "examples" / "gpt"))
    try:
        config = _load(REPO / "examples" / "gpt" / "config.py", "_gpu_check_gpt_config")
    finally:
        sys.path.remove(str(REPO / "examples" / "gpt"))
    for dry in (True, False):
        cfg = config.parse_args(check.trainer_flags(dry, "/tmp/x"))
        assert config.validate(cfg, 1) == (1, 1)
        assert cfg.parallel.device == ("cpu" if dry else "cuda")
        assert cfg.train.steps == (2 if dry else 50)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("section", ["pack", "dmodule", "checkpoint", "multirank"])
def test_cuda_section(section, tmp_path):
    """One CUDA section of the GPU check passes (NCCL for one rank, gloo over CUDA tensors for
    several)."""
    out = tmp_path / "s.json"
    cmd = [sys.executable, str(CHECK), "--section", section, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["ok"], json.dumps(res, default=str)[:4000]
    if section == "pack" and HAS_TRITON:
        assert res["selected_kernels"] == "triton"
    if section == "dmodule":
        assert res["backend"] == "nccl"
        assert res["fsdp_vs_torch_fsdp2"]["vescale FSDP"]["peak_bytes"] > 0
