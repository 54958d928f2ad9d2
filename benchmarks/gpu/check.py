"""The prepared GPU check: every CUDA path of vescale in one run, one report.

Run on a machine with one GPU (torch with CUDA, Triton, no network needed)::

    bash benchmarks/gpu/check.sh                 # writes gpu-report/report.{md,json}
    python benchmarks/gpu/check.py --out DIR     # the same, without the wrapper

and anywhere as a dry run (CPU, tiny sizes, Triton under ``TRITON_INTERPRET=1``; what
needs CUDA is skipped and said so)::

    python benchmarks/gpu/check.py --dry-run --out /tmp/gpu-dry

Every section runs in its own subprocess with its own time limit (the sum stays under
8 minutes), so a hang or a crash costs one section, not the report. Sections:

* ``pytest``: ``pytest -m gpu`` over the suite (dry run: the ``gpu`` tests of
  ``tests/gpu``, which skip without CUDA).
* ``pack``: vescale's pack kernels (Triton on CUDA) and torch's kernels against one
  ``torch.cat`` and the measured device-to-device copy bandwidth, many small and few
  large tensors, fp32 and fp32<->bf16 casts; results checked against ``torch.cat``.
* ``dmodule``: one rank (world size 1; NCCL on CUDA, gloo on CPU): FSDP with bf16
  ``MixedPrecision`` and tensor parallelism under bf16 autocast, each against the same
  model without vescale (losses and gradients within bf16 tolerance); vescale FSDP vs
  torch FSDP2 (``fully_shard``) step time and peak memory.
* ``trainer``: ``examples/gpt/train.py`` for 50 steps on one GPU (tokens/s, peak memory).
* ``checkpoint``: ``vescale.checkpoint`` save (synchronous, and asynchronous with pinned
  staging: blocking time) and load GB/s against DCP's ``save``/``load``.
* ``multirank``: 2 and 4 ranks on the one device. NCCL refuses two ranks on one GPU
  (the report records what it said); the collectives, async work on side CUDA streams,
  pinned copies, a vescale FSDP step and an async checkpoint then run on gloo over CUDA
  tensors, each recorded as passed or refused with gloo's message.

The report (``report.md`` and ``report.json``) says for every path whether it ran on
NCCL or gloo, and on CUDA or CPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

#: section -> (time limit in seconds on a GPU, in a dry run). Sum of the GPU limits: 460 s.
SECTIONS = {
    "pytest": (130, 60),
    "pack": (40, 60),
    "dmodule": (70, 60),
    "trainer": (90, 90),
    "checkpoint": (40, 60),
    "multirank": (90, 90),
}


# --------------------------------------------------------------------------- helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(dry: bool):
    import torch

    if not dry and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available (run with --dry-run on a machine without a GPU)")
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device, repeat: int) -> float:
    """Best wall time of ``fn`` over ``repeat`` runs (after one warm-up), synchronized."""
    fn()
    _sync(device)
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _peak(device) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _init_single(device) -> str:
    """World-size-1 default process group: NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1"
    )
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(backend, rank=0, world_size=1)
    return backend


def _rel_err(a, b) -> float:
    """``|a - b| / |b|`` (Frobenius), in float64."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- pytest
def section_pytest(dry: bool) -> dict:
    if dry:
        paths = [str(REPO / "tests" / "gpu")]
    else:
        # tests/gpu runs these very sections: the script runs them itself
        paths = [
            str(REPO / "packages"),
            str(REPO / "tests"),
            "--ignore",
            str(REPO / "tests" / "gpu"),
        ]
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:randomly"]
    cmd += ["--continue-on-collection-errors", *paths]
    limit = SECTIONS["pytest"][1 if dry else 0] - 10
    t0 = time.perf_counter()
    res = subprocess.run(
        cmd, capture_output=True, text=True, cwd=REPO, timeout=limit, env=dict(os.environ)
    )
    tail = res.stdout.strip().splitlines()[-1:] if res.stdout.strip() else []
    return {
        "command": " ".join(cmd[1:]).replace(str(REPO) + "/", ""),
        "returncode": res.returncode,
        "summary": tail[0] if tail else res.stderr.strip()[-500:],
        "seconds": round(time.perf_counter() - t0, 1),
        "output_tail": (res.stdout + res.stderr)[-3000:],
        "ok": res.returncode in (0, 5),  # 5: nothing collected
    }


# --------------------------------------------------------------------------- pack
def _pack_case(kernels, label, count, size, device, repeat, rows, errors) -> None:
    """One pack case: every kernel's pack/unpack against ``torch.cat`` and a device copy."""
    import torch

    ts = [torch.randn(size, device=device) for _ in range(count)]
    total = count * size
    gb = total * 4 / 1e9
    out = torch.empty(total, device=device)
    src = torch.randn(total, device=device)
    out_bf16 = torch.empty(total, dtype=torch.bfloat16, device=device)
    ref = torch.cat(ts)
    ref_bf16 = ref.to(torch.bfloat16)
    ref_round = ref_bf16.float()  # what an unpack of the bf16 buffer gives

    def restore(ts=ts, ref=ref):
        torch.split_with_sizes_copy(ref, [t.numel() for t in ts], out=ts)
        return True

    copy_s = _best(lambda: out.copy_(src), device, repeat)
    cat_s = _best(lambda: torch.cat(ts, out=out), device, repeat)
    base = {"case": label, "tensors": count, "elements": size, "MB": round(gb * 1e3, 1)}
    rows.append({**base, "op": "device copy (copy_)", "ms": copy_s * 1e3})
    rows.append({**base, "op": "torch.cat(out=)", "ms": cat_s * 1e3})
    for name, k in kernels.items():
        for op, fn, check in (
            ("pack fp32", lambda k=k: k.pack(ts, out), lambda: out.equal(ref)),
            (
                "pack fp32->bf16",
                lambda k=k: k.pack(ts, out_bf16),
                lambda: out_bf16.equal(ref_bf16),
            ),
            ("unpack fp32", lambda k=k: k.unpack(ref, ts), lambda: torch.cat(ts).equal(ref)),
            (
                "unpack bf16->fp32",
                lambda k=k: k.unpack(ref_bf16, ts),
                lambda: torch.cat(ts).equal(ref_round) and restore(),
            ),
        ):
            try:
                sec = _best(fn, device, repeat)
                ok = bool(check())
            except Exception as e:  # noqa: BLE001 - recorded in the report
                errors.append(f"{name} {op} ({label}): {type(e).__name__}: {e}")
                continue
            if not ok:
                errors.append(f"{name} {op} ({label}): result differs from torch")
            rows.append({**base, "op": f"{name}: {op}", "ms": sec * 1e3, "correct": ok})
    for r in rows:
        if r["case"] == label:
            r["GB/s"] = gb / (r["ms"] / 1e3)
            r["vs cat"] = r["ms"] / (cat_s * 1e3)
            r["vs copy"] = r["ms"] / (copy_s * 1e3)


def section_pack(dry: bool) -> dict:
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    from vescale.ragged._pack import TorchPackKernels, get_pack_kernels

    device = _device(dry)
    kernels = {"torch": TorchPackKernels()}
    selected = get_pack_kernels(device.type)
    triton_note = None
    try:
        from vescale.ragged._triton_pack import TritonPackKernels

        kernels["triton"] = TritonPackKernels()
    except Exception as e:  # noqa: BLE001 - Triton is optional: say why it is absent
        triton_note = f"Triton kernels unavailable: {type(e).__name__}: {e}"
    if dry:
        cases = [("many small", 16, 64), ("few large", 2, 512)]
        repeat = 1
    else:
        cases = [("many small", 4000, 4096), ("tiny", 2000, 100), ("few large", 8, 1 << 24)]
        repeat = 10
    rows, errors = [], []
    torch.manual_seed(0)
    for label, count, size in cases:
        _pack_case(kernels, label, count, size, device, repeat, rows, errors)
    return {
        "device": str(device),
        "selected_kernels": selected.name,
        "triton": triton_note or ("interpreted (TRITON_INTERPRET=1)" if dry else "compiled"),
        "rows": rows,
        "errors": errors,
        "ok": not errors,
    }


# --------------------------------------------------------------------------- dmodule
def _gpt_cfg(dry: bool, big: bool = False):
    from vescale.dmodule.testing import GPTConfig

    if dry:
        return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    if big:
        return GPTConfig(vocab_size=8192, block_size=512, n_layer=8, n_head=16, n_embd=1024)
    return GPTConfig(vocab_size=4096, block_size=256, n_layer=4, n_head=8, n_embd=512)


def _batch(cfg, batch: int, device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return x.to(device), y.to(device)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fsdp_bf16_vs_plain(device, dry: bool) -> dict:
    """vescale FSDP with bf16 MixedPrecision vs the same math without vescale."""
    import copy

    import torch
    import torch.nn.functional as F

    from vescale.dmodule import MixedPrecision, fully_shard
    from vescale.dmodule.testing import GPT
    from vescale.dtensor import init_device_mesh

    cfg = _gpt_cfg(dry)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    model = fully_shard(
        copy.deepcopy(base),
        mesh,
        "dp",
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # reference: fp32 masters, a bf16 copy for forward/backward, fp32 grads into AdamW
    master = base
    ref_opt = torch.optim.AdamW(master.parameters(), lr=1e-3)
    losses, ref_losses, grad_err = [], [], {}
    for step in range(3):
        x, y = _batch(cfg, 4, device, step)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        compute = copy.deepcopy(master).to(torch.bfloat16)
        ref = F.cross_entropy(compute(x).float().flatten(0, 1), y.flatten())
        ref.backward()
        for p, c in zip(master.parameters(), compute.parameters()):
            p.grad = None if c.grad is None else c.grad.float()
        if step == 0:
            named = dict(master.named_parameters())
            for name, p in model.named_parameters():
                if p.grad is not None:
                    grad_err[name] = _rel_err(_full(p.grad), named[name].grad)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref.item())
    worst = max(grad_err.values())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return {
        "losses": losses,
        "reference_losses": ref_losses,
        "max_loss_rel_err": loss_err,
        "max_grad_rel_err": worst,
        "worst_grad": max(grad_err, key=grad_err.get),
        "tolerance": "2e-2 relative (bf16)",
        "ok": loss_err < 2e-2 and worst < 2e-2,
    }


def _tp_bf16_vs_plain(device, dry: bool) -> dict:
    """Tensor parallelism (automatic Megatron plan, world size 1) under bf16 autocast."""
    import copy

    import torch
    import torch.nn.functional as F

    from vescale.dmodule import parallelize_module
    from vescale.dmodule.testing import GPT
    from vescale.dtensor import init_device_mesh

    cfg = _gpt_cfg(dry)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    model = parallelize_module(copy.deepcopy(base), mesh)
    x, y = _batch(cfg, 4, device, 7)
    out = {}
    for name, m in (("vescale", model), ("plain", base)):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = m(x)
        logits = _full(logits).float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        out[name] = (loss.item(), {k: _full(p.grad) for k, p in m.named_parameters()})
    loss_err = abs(out["vescale"][0] - out["plain"][0]) / abs(out["plain"][0])
    errs = {k: _rel_err(g, out["plain"][1][k]) for k, g in out["vescale"][1].items()}
    worst = max(errs.values())
    return {
        "loss": out["vescale"][0],
        "reference_loss": out["plain"][0],
        "loss_rel_err": loss_err,
        "max_grad_rel_err": worst,
        "worst_grad": max(errs, key=errs.get),
        "tolerance": "2e-2 relative (bf16)",
        "ok": loss_err < 2e-2 and worst < 2e-2,
    }


def _fsdp_vs_fsdp2(device, dry: bool) -> dict:
    """Step time and peak memory: vescale FSDP vs torch FSDP2 on one rank."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale.dmodule import MixedPrecision, fully_shard
    from vescale.dmodule.testing import GPT
    from vescale.dtensor import init_device_mesh

    cfg = _gpt_cfg(dry, big=True)
    steps = 2 if dry else 8
    batch = 2 if dry else 8
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    base = GPT(cfg)
    params = sum(p.numel() for p in base.parameters())
    out = {"params": params, "steps": steps, "batch": [batch, cfg.block_size]}
    x, y = _batch(cfg, batch, device, 3)
    for side in ("vescale FSDP", "torch FSDP2"):
        _reset_peak(device)
        m = copy.deepcopy(base).to(device)
        if side == "vescale FSDP":
            m = fully_shard(
                m,
                mesh,
                "dp",
                mixed_precision=MixedPrecision(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                ),
            )
        else:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for blk in m.blocks:
                torch_fully_shard(blk, mesh=mesh, mp_policy=mp)
            torch_fully_shard(m, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        times, losses = [], []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            loss = F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
        out[side] = {
            "median_ms": statistics.median(times[1:] or times) * 1e3,
            "peak_bytes": _peak(device),
            "losses": losses,
        }
        del m, opt
    v, t = out["vescale FSDP"], out["torch FSDP2"]
    out["time_ratio"] = v["median_ms"] / t["median_ms"]
    if v["peak_bytes"] and t["peak_bytes"]:
        out["memory_ratio"] = v["peak_bytes"] / t["peak_bytes"]
    first = abs(v["losses"][0] - t["losses"][0]) / abs(t["losses"][0])
    out["first_loss_rel_err"] = first
    out["ok"] = first < 2e-2
    return out


def section_dmodule(dry: bool) -> dict:
    import torch.distributed as dist

    device = _device(dry)
    backend = _init_single(device)
    out = {"backend": backend, "device": str(device)}
    try:
        for name, fn in (
            ("fsdp_bf16_vs_plain", _fsdp_bf16_vs_plain),
            ("tp_bf16_vs_plain", _tp_bf16_vs_plain),
            ("fsdp_vs_torch_fsdp2", _fsdp_vs_fsdp2),
        ):
            try:
                out[name] = fn(device, dry)
            except Exception as e:  # noqa: BLE001 - one failing check must not hide the others
                out[name] = {
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-2000:],
                }
    finally:
        dist.destroy_process_group()
    out["ok"] = all(v.get("ok") for v in out.values() if isinstance(v, dict))
    return out


# --------------------------------------------------------------------------- trainer
def trainer_flags(dry: bool, run_dir: str) -> list[str]:
    """Flags of the trainer run (50 bf16 steps on CUDA; 2 tiny steps on CPU in a dry run)."""
    flags = [
        "--parallel.dp", "1", "--parallel.tp", "1",
        "--train.run_dir", run_dir,
        "--train.progress", "false", "--train.tensorboard", "false",
        "--train.sample_tokens", "0", "--train.log_interval", "10",
        "--train.eval_interval", "1000", "--checkpoint.interval", "1000",
        "--checkpoint.final", "false",
    ]  # fmt: skip
    if dry:
        flags += ["--parallel.device", "cpu", "--train.steps", "2", "--train.batch_size", "2"]
        flags += ["--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2"]
        flags += ["--model.block_size", "32", "--data.max_bytes", "200000"]
    else:
        flags += ["--parallel.device", "cuda", "--train.steps", "50", "--train.dtype", "bf16"]
        flags += ["--model.n_layer", "8", "--model.n_embd", "768", "--model.n_head", "12"]
        flags += ["--model.block_size", "512", "--train.batch_size", "16"]
    return flags


def section_trainer(dry: bool) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="vescale-gpu-trainer-"))
    flags = trainer_flags(dry, str(run_dir))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        str(REPO / "examples" / "gpt" / "train.py"), *flags,
    ]  # fmt: skip
    limit = SECTIONS["trainer"][1 if dry else 0] - 10
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=limit)
    out = {
        "command": "torchrun --standalone --nproc-per-node 1 examples/gpt/train.py "
        + " ".join(flags),
        "returncode": res.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    metrics = run_dir / "metrics.json"
    if metrics.exists():
        summary = json.loads(metrics.read_text()).get("summary", {})
        out["summary"] = summary
    out["ok"] = res.returncode == 0 and "TRAINING COMPLETE" in res.stdout + res.stderr
    if not out["ok"]:
        out["output_tail"] = (res.stdout + res.stderr)[-3000:]
    return out


# --------------------------------------------------------------------------- checkpoint
def section_checkpoint(dry: bool) -> dict:
    import shutil

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    import vescale.checkpoint as vckpt

    device = _device(dry)
    backend = _init_single(device)
    mb = 4 if dry else 512
    rows = max(1, mb * 2**20 // 4 // 4096 // 8)
    model = nn.ParameterDict(
        {f"w{i}": nn.Parameter(torch.randn(rows, 4096, device=device)) for i in range(8)}
    )
    nbytes = sum(p.numel() * p.element_size() for p in model.values())
    gb = nbytes / 1e9
    root = Path(tempfile.mkdtemp(prefix="vescale-gpu-ckpt-"))
    out = {"backend": backend, "device": str(device), "bytes": nbytes}
    try:
        reps = 1 if dry else 2
        times: dict[str, float] = {}

        def best(name, fn):
            b = math.inf
            for i in range(reps):
                _sync(device)
                t0 = time.perf_counter()
                fn(i)
                _sync(device)
                b = min(b, time.perf_counter() - t0)
            times[name] = b

        best("vescale save", lambda i: vckpt.save(root / f"v{i}", {"model": model}))
        handles = []

        def async_save(i):
            handles.append(vckpt.save(root / f"a{i}", {"model": model}, async_op=True))

        async_save(99)  # allocates the pinned staging buffers (reused below)
        handles.pop().wait()
        best("vescale async save: blocking", async_save)
        t0 = time.perf_counter()
        for h in handles:
            h.wait()
        times["vescale async save: wait"] = time.perf_counter() - t0
        best(
            "DCP save",
            lambda i: dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / f"d{i}")),
        )
        expect = {k: v.detach().clone() for k, v in model.items()}
        with torch.no_grad():
            for p in model.values():
                p.zero_()
        best("vescale load", lambda i: vckpt.load(root / "v0", {"model": model}))
        loaded_ok = all(torch.equal(model[k], v) for k, v in expect.items())
        with torch.no_grad():
            for p in model.values():
                p.zero_()
        sd = model.state_dict()
        best("DCP load", lambda i: dcp.load({"model": sd}, checkpoint_id=str(root / "d0")))
        dcp_ok = all(torch.equal(sd[k], v) for k, v in expect.items())
        out["rows"] = [
            {"op": k, "seconds": v, "GB/s": gb / v if v > 0 else math.inf} for k, v in times.items()
        ]
        out["round_trip_equal"] = {"vescale": loaded_ok, "dcp": dcp_ok}
        out["ok"] = loaded_ok and dcp_ok
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    return out


# --------------------------------------------------------------------------- multirank
def _rank_main(rank: int, world: int, port: int, backend: str, dry: bool, results) -> None:
    """One rank of a multi-rank check (spawned); puts ``(rank, dict)`` on ``results``."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK="0", OMP_NUM_THREADS="1",
    )  # fmt: skip
    res: dict = {}
    try:
        device = torch.device("cpu") if dry else torch.device("cuda", 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world)
        if backend == "nccl":
            t = torch.ones(4, device=device)
            dist.all_reduce(t)
            torch.cuda.synchronize()
            res["nccl all_reduce"] = "ok" if t[0].item() == world else f"wrong value {t.tolist()}"
        else:
            res.update(_gloo_checks(device, rank, world, dry))
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported per rank
        res["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    results.put((rank, res))


def _try(res: dict, name: str, fn) -> None:
    try:
        ok = fn()
        if ok is None or ok is True:
            res[name] = "ok"
        elif isinstance(ok, str) and ok.startswith("skipped"):
            res[name] = ok
        else:
            res[name] = f"wrong result: {ok}"
    except Exception as e:  # noqa: BLE001 - gloo may refuse an op on CUDA tensors: record it
        res[name] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _gloo_checks(device, rank: int, world: int, dry: bool) -> dict:
    import torch
    import torch.distributed as dist

    res: dict = {}
    n = 8

    def all_reduce():
        t = torch.full((n,), float(rank + 1), device=device)
        dist.all_reduce(t)
        return bool((t == world * (world + 1) / 2).all())

    def broadcast():
        t = torch.full((n,), float(rank), device=device)
        dist.broadcast(t, src=world - 1)
        return bool((t == world - 1).all())

    def all_gather_into_tensor():
        out = torch.empty(world * n, device=device)
        dist.all_gather_into_tensor(out, torch.full((n,), float(rank), device=device))
        return bool(out.equal(torch.arange(world, device=device).float().repeat_interleave(n)))

    def reduce_scatter_tensor():
        out = torch.empty(n, device=device)
        dist.reduce_scatter_tensor(out, torch.ones(world * n, device=device))
        return bool((out == world).all())

    def all_to_all_single():
        src = torch.full((world * 2,), float(rank), device=device)
        out = torch.empty_like(src)
        dist.all_to_all_single(out, src)
        return bool(out.equal(torch.arange(world, device=device).float().repeat_interleave(2)))

    def async_on_stream():
        # an async all-reduce issued from a side stream, waited on, then used there
        t = torch.full((n,), 1.0, device=device)
        if device.type == "cuda":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                work = dist.all_reduce(t, async_op=True)
                work.wait()
                t.mul_(2)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
        else:
            dist.all_reduce(t, async_op=True).wait()
            t.mul_(2)
        return bool((t == 2 * world).all())

    def pinned_copies():
        if device.type != "cuda":
            return True  # pinned memory needs CUDA
        host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
        dev = torch.empty_like(host, device=device)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            dev.copy_(host, non_blocking=True)
            back = torch.empty_like(host).pin_memory()
            back.copy_(dev, non_blocking=True)
        s.synchronize()
        return bool(back.equal(host))

    for name, fn in (
        ("all_reduce", all_reduce),
        ("broadcast", broadcast),
        ("all_gather_into_tensor", all_gather_into_tensor),
        ("reduce_scatter_tensor", reduce_scatter_tensor),
        ("all_to_all_single", all_to_all_single),
        ("async all_reduce on a side stream", async_on_stream),
        ("pinned host<->device copies", pinned_copies),
        ("vescale FSDP step vs one device", lambda: _fsdp_multirank(device, dry)),
        ("vescale async checkpoint save+load", lambda: _ckpt_multirank(device, dry)),
    ):
        _try(res, name, fn)
        dist.barrier()
    return res


def _fsdp_multirank(device, dry: bool):
    """One vescale FSDP step over the ranks vs one device: loss and updated weights."""
    import copy

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from vescale.dmodule import fully_shard
    from vescale.dmodule.testing import GPT
    from vescale.dtensor import init_device_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _gpt_cfg(True)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    with torch.no_grad():  # one model on every rank (threaded ranks share the RNG)
        for p in base.parameters():
            dist.broadcast(p, src=0)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    model = fully_shard(copy.deepcopy(base), mesh, "dp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(base.parameters(), lr=0.1)
    x, y = _batch(cfg, 2 * world, device, 11)
    mine = slice(2 * rank, 2 * rank + 2)
    loss = F.cross_entropy(model(x[mine]).flatten(0, 1), y[mine].flatten())
    loss.backward()
    opt.step()
    F.cross_entropy(base(x).flatten(0, 1), y.flatten()).backward()
    ref_opt.step()
    named = dict(base.named_parameters())
    worst = max(_rel_err(_full(p.detach()), named[k].detach()) for k, p in model.named_parameters())
    return True if worst < 1e-5 else f"max relative weight error {worst:.2e}"


def _ckpt_multirank(device, dry: bool):
    import shutil

    import torch
    import torch.distributed as dist

    import vescale.checkpoint as vckpt
    from vescale.dtensor import Shard, distribute_tensor, init_device_mesh

    if dry:
        # the async save's own gloo group needs real processes (the GPU run has them)
        return "skipped: threaded ranks"
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    full = torch.randn(world * 64, 32, device=device)
    dt = distribute_tensor(full, mesh, [Shard(0)])
    path = [tempfile.mkdtemp(prefix="vescale-gpu-mr-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        h = vckpt.save(path[0] + "/c", {"w": dt}, async_op=True)
        h.wait()
        back = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])}
        vckpt.load(path[0] + "/c", back)
        return bool(back["w"].full_tensor().equal(full))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def _spawn(world: int, backend: str, dry: bool, timeout: float) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, backend, dry, results))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout
    while len(got) < world and time.monotonic() < deadline:
        try:
            r, res = results.get(timeout=max(0.1, deadline - time.monotonic()))
            got[r] = res
        except Exception:  # noqa: BLE001 - queue.Empty: timed out
            break
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
    if len(got) < world:
        missing = sorted(set(range(world)) - set(got))
        got["timeout"] = f"ranks {missing} did not report within {timeout:.0f} s"
    return got


def _threaded_rank(results: dict) -> None:
    """A rank of the dry run's threaded process group (same checks, CPU tensors)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    results[rank] = _gloo_checks(torch.device("cpu"), rank, world, True)


def section_multirank(dry: bool) -> dict:
    out: dict = {"device": "cpu (dry run)" if dry else "cuda:0, shared by every rank"}
    worlds = (2,) if dry else (2, 4)
    if dry:
        # threads in this process (vescale.dtensor.testing's threaded group): the same
        # checks, without paying two interpreter start-ups
        from vescale.dtensor.testing import run_on_ranks

        got: dict = {}
        run_on_ranks(_threaded_rank, 2, got, mode="thread", timeout=60)
        out["gloo 2 ranks"] = got
        out["device"] = "cpu (dry run: 2 ranks as threads of one process)"
    else:
        out["nccl 2 ranks on one GPU"] = _spawn(2, "nccl", dry, timeout=20)
        for world, limit in zip(worlds, (25, 35)):
            out[f"gloo {world} ranks"] = _spawn(world, "gloo", dry, timeout=limit)
    checks = {}
    for world in worlds:
        per_rank = out[f"gloo {world} ranks"]
        names = sorted({k for r in per_rank.values() if isinstance(r, dict) for k in r})
        for name in names:
            vals = {str(r.get(name)) for r in per_rank.values() if isinstance(r, dict)}
            checks[f"gloo {world} ranks: {name}"] = (
                vals.pop() if len(vals) == 1 else " / ".join(sorted(vals))
            )
        if "timeout" in per_rank:
            checks[f"gloo {world} ranks: timeout"] = per_rank["timeout"]
    out["checks"] = checks
    # refusals by gloo are findings (reported), not failures of the check itself
    out["ok"] = all(
        not k.endswith("error") and "wrong" not in v and "did not report" not in v
        for k, v in checks.items()
    )
    return out


SECTION_FNS = {
    "pytest": section_pytest,
    "pack": section_pack,
    "dmodule": section_dmodule,
    "trainer": section_trainer,
    "checkpoint": section_checkpoint,
    "multirank": section_multirank,
}


# --------------------------------------------------------------------------- driver
def _environment() -> dict:
    import torch

    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version()))
        if torch.cuda.is_available()
        else None,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def _table(rows: list[dict], keys: list[str]) -> str:
    out = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(k, "")).replace("|", "\\|") for k in keys) + " |")
    return "\n".join(out)


def markdown(report: dict) -> str:
    """The report as a markdown page."""
    env, dry = report["environment"], report["dry_run"]
    lines = [
        "# GPU check" + (" (dry run on CPU)" if dry else ""),
        "",
        f"{env['date']}: torch {env['torch']}, CUDA {env['cuda']}, GPU {env['gpu']}, "
        f"NCCL {env['nccl']}, Triton {env['triton']}, Python {env['python']}. "
        f"Written by `benchmarks/gpu/check.py{' --dry-run' if dry else ''}` in "
        f"{report['seconds']:.0f} s.",
        "",
        "| section | result | seconds |",
        "|---|---|---|",
    ]
    for name, sec in report["sections"].items():
        status = (
            "ok"
            if sec.get("ok")
            else ("FAILED" if "error" not in sec else f"FAILED: {sec['error'][:120]}")
        )
        lines.append(f"| {name} | {status} | {sec.get('_seconds', 0):.0f} |")
    s = report["sections"]
    if "pytest" in s:
        p = s["pytest"]
        lines += ["", "## `pytest -m gpu`", "", f"`{p.get('command', '')}`: {p.get('summary', '')}"]
    if "pack" in s and "rows" in s["pack"]:
        p = s["pack"]
        lines += [
            "", "## Pack kernels", "",
            f"Device {p['device']}; kernels selected for it: `{p['selected_kernels']}`; "
            f"Triton: {p['triton']}. `vs copy`: time over one device-to-device `copy_` of the "
            "same fp32 bytes (1.0 = copy bandwidth).", "",
            _table(p["rows"], ["case", "tensors", "elements", "op", "ms", "GB/s", "vs cat", "vs copy"]),
        ]  # fmt: skip
        if p.get("errors"):
            lines += ["", "Errors:", *(f"- {e}" for e in p["errors"])]
    if "dmodule" in s:
        d = s["dmodule"]
        lines += [
            "",
            "## DModule on one rank",
            "",
            f"Backend {d.get('backend')} on {d.get('device')}.",
            "",
        ]
        for k in ("fsdp_bf16_vs_plain", "tp_bf16_vs_plain"):
            v = d.get(k, {})
            lines.append(
                f"- `{k}`: {'ok' if v.get('ok') else 'FAILED'}; "
                + ", ".join(f"{a} {_fmt(b)}" for a, b in v.items() if a not in ("ok", "trace"))
            )
        f = d.get("fsdp_vs_torch_fsdp2", {})
        if "vescale FSDP" in f:
            rows = [{"side": k, **f[k]} for k in ("vescale FSDP", "torch FSDP2")]
            lines += [
                "", f"vescale FSDP vs torch FSDP2, bf16 MixedPrecision, {f['params']:,} parameters, "
                f"batch {f['batch']}: time ratio {f['time_ratio']:.3f}"
                + (f", peak memory ratio {f['memory_ratio']:.3f}" if "memory_ratio" in f else ""),
                "", _table(rows, ["side", "median_ms", "peak_bytes"]),
            ]  # fmt: skip
        elif f:
            lines.append(f"- `fsdp_vs_torch_fsdp2`: {f.get('error')}")
    if "trainer" in s:
        t = s["trainer"]
        summ = t.get("summary", {})
        lines += [
            "", "## GPT trainer", "", f"`{t.get('command', '')}`", "",
            f"tokens/s {summ.get('tokens_per_s')}, peak memory {summ.get('peak_memory_bytes')} B, "
            f"loss {summ.get('start_loss')} -> {summ.get('end_loss_mean_last_10')}, "
            f"{t.get('seconds')} s in all.",
        ]  # fmt: skip
    if "checkpoint" in s and "rows" in s["checkpoint"]:
        c = s["checkpoint"]
        lines += [
            "", "## Checkpoint", "",
            f"{c['bytes']:,} bytes of {c['device']} tensors, backend {c['backend']}; round trips "
            f"equal: {c['round_trip_equal']}. The async save stages into pinned host buffers "
            "(allocated by one untimed save first); `blocking` is the time the call holds the "
            "caller.", "", _table(c["rows"], ["op", "seconds", "GB/s"]),
        ]  # fmt: skip
    if "multirank" in s:
        m = s["multirank"]
        lines += [
            "", "## Several ranks on one device", "",
            f"Device: {m.get('device')}. Backend of every path below:", "",
        ]  # fmt: skip
        if "nccl 2 ranks on one GPU" in m:
            lines.append(
                f"- NCCL, 2 ranks on one GPU: `{json.dumps(m['nccl 2 ranks on one GPU'])[:400]}`"
            )
        lines += ["", "| path (backend gloo) | result |", "|---|---|"]
        for k, v in m.get("checks", {}).items():
            lines.append(f"| {k} | {str(v).replace('|', '/')} |")
    lines.append("")
    return "\n".join(lines)


def _run_section(name: str, dry: bool) -> dict:
    """One section in this process; an exception becomes a failed section."""
    try:
        return SECTION_FNS[name](dry)
    except Exception as e:  # noqa: BLE001 - the report says what failed
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "trace": traceback.format_exc()[-3000:],
        }


def run_all(out_dir: Path, dry: bool, only: list[str] | None, inline: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sections = {}
    for name, limits in SECTIONS.items():
        if only and name not in only:
            continue
        limit = limits[1 if dry else 0]
        tmp = out_dir / f".{name}.json"
        tmp.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--section", name, "--json", str(tmp)]
        if dry:
            cmd.append("--dry-run")
        s0 = time.perf_counter()
        print(f"== {name}" + ("" if inline else f" (limit {limit} s)"), flush=True)
        if inline:
            sections[name] = sec = _run_section(name, dry)
            sec["_seconds"] = time.perf_counter() - s0
            print(
                f"   {'ok' if sec.get('ok') else 'FAILED'} in {sec['_seconds']:.1f} s", flush=True
            )
            continue
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=REPO)
            if tmp.exists():
                sec = json.loads(tmp.read_text())
            else:
                sec = {"ok": False, "error": f"exit {res.returncode}: {res.stderr.strip()[-1500:]}"}
        except subprocess.TimeoutExpired:
            sec = {"ok": False, "error": f"timed out after {limit} s"}
        sec["_seconds"] = time.perf_counter() - s0
        tmp.unlink(missing_ok=True)
        sections[name] = sec
        print(f"   {'ok' if sec.get('ok') else 'FAILED'} in {sec['_seconds']:.1f} s", flush=True)
    report = {
        "dry_run": dry,
        "environment": _environment(),
        "seconds": time.perf_counter() - t0,
        "sections": sections,
        "ok": all(s.get("ok") for s in sections.values()),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "report.md").write_text(markdown(report))
    print(f"wrote {out_dir / 'report.md'} and report.json; ok={report['ok']}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes; skip what needs CUDA")
    ap.add_argument("--out", default="gpu-report", help="directory for report.md / report.json")
    ap.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections")
    ap.add_argument(
        "--inline", action="store_true", help="run the sections in this process (no time limits)"
    )
    ap.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:  # one section, in this (child) process
        res = _run_section(args.section, args.dry_run)
        Path(args.json).write_text(json.dumps(res, default=str))
        return 0
    report = run_all(Path(args.out), args.dry_run, args.only, args.inline)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
