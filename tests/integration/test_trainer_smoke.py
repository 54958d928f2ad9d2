"""The GPT trainer (examples/gpt/train.py) end to end, plus its config validation.

* ``test_train_2x2_then_resume_on_2_ranks``: a tiny model trains for a few steps on a
  dp=2 x tp=2 mesh (4 gloo ranks), writes metrics and checkpoints; a second launch on
  2 ranks (dp=2, tp=1) resumes from the last checkpoint (resharding it) and continues.
* The config tests check that bad values fail with a clear message before any
  process group exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vescale.dtensor.testing import run_torchrun

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "gpt" / "train.py"
MARKER = "TRAINING COMPLETE"

TINY = [
    "--model.n_layer", "1",
    "--model.n_embd", "32",
    "--model.n_head", "2",
    "--model.block_size", "32",
    "--train.batch_size", "8",
    "--train.eval_interval", "3",
    "--train.eval_batches", "1",
    "--train.sample_tokens", "16",
    "--train.log_interval", "1",
    "--optim.lr", "1e-2",
    "--optim.warmup_steps", "2",
    "--checkpoint.interval", "3",
]  # fmt: skip


def _config_module():
    spec = importlib.util.spec_from_file_location("_gpt_example_config", TRAIN.parent / "config.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _corpus(tmp_path: Path) -> Path:
    """A small, deterministic, user-supplied text corpus (exercises --data)."""
    src = Path(json.__file__).read_text() + Path(re.__file__).read_text()
    path = tmp_path / "corpus.txt"
    path.write_text(src * 2)
    return path


@pytest.mark.torchrun
@pytest.mark.slow
def test_train_2x2_then_resume_on_2_ranks(tmp_path):
    run_dir = tmp_path / "run"
    common = [*TINY, "--data", str(_corpus(tmp_path)), "--train.run_dir", str(run_dir)]

    first = run_torchrun(
        [str(TRAIN), *common, "--train.steps", "6", "--parallel.tp", "2"],
        nproc=4,
        timeout=150,
        expect_marker=MARKER,
        cwd=REPO,
    )
    assert "mesh dp=2 x tp=2" in first.stdout
    assert "data parallel: dmodule-fsdp" in first.stdout  # the default: FSDP x TP
    m = re.search(r"TRAINING COMPLETE: start loss ([\d.]+) -> end loss ([\d.]+)", first.stdout)
    assert m, first.stdout[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    losses = [r["loss"] for r in metrics["records"] if r.get("loss") is not None]
    assert len(losses) == 6
    assert losses[-1] < losses[0], losses
    assert float(m.group(2)) < float(m.group(1))
    assert any(r.get("eval_loss") is not None for r in metrics["records"])
    assert (run_dir / "metrics.csv").read_text().startswith("step,loss,eval_loss")
    ckpt = run_dir / "ckpt" / "step_000006"
    assert (ckpt / "COMPLETE").exists() or any(ckpt.iterdir())
    assert metrics["summary"]["steps"] == 6
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (run_dir / "loss.png").stat().st_size > 1000

    second = run_torchrun(
        [
            str(TRAIN),
            *common,
            "--train.steps",
            "8",
            "--parallel.dp",
            "2",
            "--parallel.tp",
            "1",
            "--resume",
        ],  # fmt: skip
        nproc=2,
        timeout=120,
        expect_marker=MARKER,
        cwd=REPO,
    )
    assert "resumed from step 6" in second.stdout, second.stdout[-3000:]
    assert "mesh dp=2 x tp=1" in second.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    steps = [r["step"] for r in metrics["records"] if r.get("loss") is not None]
    assert steps == list(range(1, 9)), steps  # history of the first run kept, then 7, 8
    assert metrics["summary"]["resumed_from_step"] == 6
    assert metrics["summary"]["steps_this_run"] == 2
    # The resumed run continues from the trained weights, not from scratch.
    resumed = [r["loss"] for r in metrics["records"] if r["step"] > 6 and r.get("loss")]
    assert max(resumed) < losses[0], (resumed, losses[0])
    assert (run_dir / "ckpt" / "step_000008").is_dir()


def test_config_bad_tp_is_a_clear_error():
    cfg_mod = _config_module()
    cfg = cfg_mod.parse_args(["--parallel.tp", "3"])
    with pytest.raises(
        cfg_mod.ConfigError, match=r"--parallel\.tp 3 does not divide --model\.n_head 4"
    ):
        cfg_mod.validate(cfg, world_size=4)


def test_config_mesh_errors():
    cfg_mod = _config_module()
    with pytest.raises(cfg_mod.ConfigError, match=r"larger than the world size 4"):
        cfg_mod.validate(cfg_mod.parse_args(["--parallel.dp", "4", "--parallel.tp", "2"]), 4)
    with pytest.raises(cfg_mod.ConfigError, match=r"must equal the world size 4"):
        cfg_mod.validate(cfg_mod.parse_args(["--parallel.dp", "1", "--parallel.tp", "2"]), 4)
    with pytest.raises(cfg_mod.ConfigError, match=r"batch_size 10 is not divisible"):
        cfg_mod.validate(cfg_mod.parse_args(["--train.batch_size", "10", "--parallel.tp", "1"]), 4)
    assert cfg_mod.validate(cfg_mod.parse_args([]), 4) == (2, 2)
    assert cfg_mod.validate(cfg_mod.parse_args(["--parallel.tp", "1"]), 2) == (2, 1)


def test_config_parser():
    cfg_mod = _config_module()
    cfg = cfg_mod.parse_args(
        ["--model.n_layer", "6", "--optim.lr=1e-3", "--resume", "--data", "x.txt",
         "--parallel.sequence_parallel", "false"]
    )  # fmt: skip
    assert cfg.model.n_layer == 6 and cfg.optim.lr == 1e-3
    assert cfg.checkpoint.resume is True and cfg.data.path == "x.txt"
    assert cfg.parallel.sequence_parallel is False
    with pytest.raises(cfg_mod.ConfigError, match=r"did you mean --model\.n_layer"):
        cfg_mod.parse_args(["--model.nlayer", "3"])
    with pytest.raises(cfg_mod.ConfigError, match=r"expected int"):
        cfg_mod.parse_args(["--model.n_layer", "six"])


def test_train_script_rejects_bad_tp_before_any_process_group():
    """Launched as rank 0 of 4 with no rendezvous address: it must fail on the config,
    not on (or waiting for) the process group."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="4", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(TRAIN), "--parallel.tp", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--parallel.tp 3 does not divide --model.n_head 4" in proc.stderr
    assert "resolved config" not in proc.stdout
