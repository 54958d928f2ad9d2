"""VescaleStrategy under Lightning's own launcher, against single-device Lightning.

One launch (4 CPU processes, gloo) trains an unmodified HF LLaMA under FSDP over 4 ranks,
saves a Lightning checkpoint through vescale.checkpoint, and resumes it under FSDP x TP on
a 2 x 2 mesh (the checkpoint resharded): the losses of all four steps equal single-device Lightning
training's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent


def test_fsdp_training_and_a_resharded_fsdp_x_tp_resume_match_single_device(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        import lightning_job
    finally:
        sys.path.remove(str(HERE))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "lightning_job.py"), str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    result_file = tmp_path / "result.json"
    assert proc.returncode == 0 and result_file.is_file(), proc.stderr[-6000:]
    got = json.loads(result_file.read_text())

    ref = lightning_job.CausalLM(batch_size=8, single_device_order=True)
    lightning_job.trainer("auto", epochs=2, devices=1).fit(ref)

    assert got["world"] == 4 and got["steps"] == [2, 4]
    # phase 1: q_proj's weight is a DTensor cut into FSDP's ragged flat shards
    assert got["layout"][0] and got["layout"][1][0].startswith("RS("), got
    assert got["files"] == ["lightning.pt", "vescale"]
    torch.testing.assert_close(got["losses"], ref.losses, atol=1e-5, rtol=1e-5)
    assert abs(got["logged"] - ref.losses[-1]) < 1e-5
