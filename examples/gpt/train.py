"""Train a small byte-level GPT with vescale: tensor(+sequence) parallel x data parallel.

    torchrun --standalone --nproc-per-node 4 examples/gpt/train.py            # 2 x 2 mesh, CPU
    torchrun --standalone --nproc-per-node 4 examples/gpt/train.py --help     # every flag

The model (``model.py``) is a plain ``nn.Module``. This script

1. parses the config (``config.py``: ``jsonargparse`` over a dataclass tree, ``--config
   job.yaml`` plus flags) and validates it before any process-group work;
2. builds ``init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))`` (gloo
   on CPU, NCCL on CUDA; the device is picked from ``LOCAL_RANK``);
3. parallelizes the model with ``vescale.dmodule.DModule`` and its automatic
   Megatron TP(+SP) plan on ``"tp"``; data parallelism over ``"dp"`` comes from
   DModule when it offers it, otherwise from one bucketed gradient all-reduce here;
4. reads the data through a ``torch.utils.data.DataLoader`` with a
   ``DistributedSampler`` over the "dp" ranks (``data.py``);
5. trains with AdamW (or ``vescale.optim.Muon``), global gradient clipping
   (``vescale.optim.clip_grad_norm_``), a warmup + cosine schedule
   (``torch.optim.lr_scheduler.LambdaLR``), gradient accumulation and bf16 autocast on
   CUDA;
6. saves asynchronous checkpoints (model, optimizer, lr scheduler) with
   ``vescale.checkpoint`` (``--resume`` reloads the latest, resharding if the mesh
   changed);
7. on rank 0: progress bar, periodic held-out loss, ``metrics.json``,
   ``metrics.csv``, a TensorBoard log and ``loss.png`` in the run dir, samples from
   the trained model and a final ``TRAINING COMPLETE: start loss X -> end loss Y``
   line.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()

import contextlib  # noqa: E402
import csv  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

# isort: split
from config import (  # noqa: E402
    Config,
    ConfigError,
    config_yaml,
    format_config,
    parse_args,
    validate,
)
from data import batches, decode, eval_batches, load_corpus  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

try:  # optional: progress bar
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - exercised where tqdm is absent
    tqdm = None


# --------------------------------------------------------------------------- helpers
def log0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def fmt_time(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def lr_factor(step: int, cfg: Config) -> float:
    """Linear warmup over ``warmup_steps``, then cosine down to ``min_lr_ratio`` at ``steps``.

    ``step`` is the 0-based index of the optimizer step about to run (``LambdaLR``'s
    ``last_epoch``).
    """
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def pick_device(cfg: Config) -> torch.device:
    want = cfg.parallel.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--parallel.device cuda, but CUDA is not available")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


# --------------------------------------------------------------------------- model
#: ``--parallel.data_parallel auto``: DModule's engine on the "dp" mesh dim.
DEFAULT_DP_ENGINE = "fsdp"


def parallelize(model: torch.nn.Module, mesh, cfg: Config):
    """DModule with the automatic TP(+SP) plan on ``"tp"``; data parallelism on ``"dp"``.

    Returns ``(model, dp_mode)``: ``"dmodule-ddp"`` when DModule syncs the data-parallel
    gradients itself, ``"optimizer"`` when ``DistributedOptimizer`` reduce-scatters them,
    ``"trainer"`` when this script all-reduces them (``sync_dp_grads``).
    """
    from vescale.dmodule import DModule
    from vescale.dtensor import Replicate, Shard

    def plan_for(m):
        if not cfg.parallel.vocab_parallel_loss:
            return None
        # Keep the logits sharded on the vocabulary: the loss never gathers them.
        spec = [Replicate()] * m.ndim
        spec[-1] = Shard(-1)
        return {"forward": {"lm_head.output": [spec]}}

    opts = dict(auto_plan=True, tp_dim="tp", sequence_parallel=cfg.parallel.sequence_parallel)
    if cfg.optim.zero:
        # DistributedOptimizer needs parameters replicated on the "dp" dim of their mesh.
        return DModule(model, mesh, plan_for(mesh), **opts), "optimizer"
    want = cfg.parallel.data_parallel
    if mesh.size(0) > 1 and want != "trainer":
        engine = DEFAULT_DP_ENGINE if want == "auto" else want
        dm = DModule(model, mesh, plan_for(mesh), data_parallel={"dp": engine}, **opts)
        return dm, f"dmodule-{engine}"
    # "trainer" (or dp == 1): this script averages gradients over "dp" itself
    # (sync_dp_grads). The parameters then need no "dp" dim at all: parallelizing on the
    # 1-D "tp" sub-mesh gives the same TP(+SP) layout, and torch 2.13 plans DTensor ops on
    # a 1-D mesh several times faster than on a 2-D one.
    sub = mesh["tp"] if cfg.parallel.tp_submesh else mesh
    return DModule(model, sub, plan_for(sub), **opts), "trainer"


def pipeline(model: torch.nn.Module, mesh, cfg: Config, device: torch.device):
    """``--parallel.pp > 1``: stages over "pp", each one DModule'd over ("tp", "dp").

    Returns ``(pipe, dp_mode)``; ``pipe`` is a ``vescale.dmodule.PipelineParallel``
    (torch's schedule ``--parallel.pp_schedule`` over ``--parallel.microbatches``).
    """
    from vescale.dmodule import DModule, pipeline_parallelize

    p = cfg.parallel
    dp = mesh.size(mesh.mesh_dim_names.index("dp"))
    engine = DEFAULT_DP_ENGINE if p.data_parallel == "auto" else p.data_parallel

    def parallelize_stage(stage, submesh) -> None:
        if submesh is None or submesh.size() == 1:
            return  # plain stage: nothing to shard
        opts = dict(tp_dim="tp", sequence_parallel=p.sequence_parallel)
        if dp > 1:
            opts["data_parallel"] = {"dp": engine}
        DModule(stage, submesh, None, **opts)

    example = torch.zeros(cfg.train.batch_size // dp, cfg.model.block_size, dtype=torch.long)
    pipe = pipeline_parallelize(
        model,
        mesh,
        example_inputs=(example.to(device),),
        loss_fn=loss_fn,
        microbatches=p.microbatches or p.pp,
        schedule=p.pp_schedule,
        parallelize_fn=parallelize_stage,
    )
    return pipe, f"dmodule-{engine}" if dp > 1 else "pipeline"


def no_sync_context(model):
    """``model.no_sync`` or ``vescale.dmodule.no_sync(model)``, if DModule offers one."""
    fn = getattr(model, "no_sync", None)
    if callable(fn):
        return fn
    try:
        from vescale.dmodule import no_sync
    except ImportError:
        return None
    return lambda: no_sync(model)


@torch.no_grad()
def sync_dp_grads(params: list[torch.Tensor], mesh) -> None:
    """Average gradients over the ``"dp"`` mesh dim with one bucketed all-reduce.

    Fallback for DModule's data parallelism: every parameter is ``Replicate()`` on
    ``"dp"``, so each dp rank holds a full copy of its (tp-local) gradient computed on
    its own data; their average is the gradient of the global batch.
    """
    from torch.distributed.tensor import DTensor

    from vescale.dtensor.collectives import all_reduce_coalesced

    locals_ = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # keep the bucket identical on every rank
        g = p.grad
        locals_.append(g.to_local() if isinstance(g, DTensor) else g)
    reduced = all_reduce_coalesced(locals_, group=mesh.get_group("dp"), op="avg")
    for dst, src in zip(locals_, reduced):
        dst.copy_(src)


def loss_fn(logits, targets: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(logits, DTensor):
        if any(isinstance(p, Shard) for p in logits.placements):
            from vescale.dmodule import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits, targets)
        logits = logits.to_local()  # Replicate(): every rank has the full logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# --------------------------------------------------------------------------- optimizer
def build_optimizer(model, mesh, cfg: Config):
    """Returns ``(optimizer, kind)``."""
    o = cfg.optim
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if o.name == "muon":
        from vescale.optim import Muon

        opt = Muon(
            model,
            lr=o.muon_lr,
            weight_decay=o.weight_decay,
            adamw_lr=o.lr,
            adamw_betas=(o.beta1, o.beta2),
            adamw_eps=o.eps,
        )
        kind = "vescale.optim.Muon"
    elif o.zero:
        from vescale.optim import DistributedOptimizer

        opt = DistributedOptimizer(
            groups,
            torch.optim.AdamW,
            mesh=mesh,
            dp_dim="dp",
            model=model,  # state keyed by parameter name (loads into torch AdamW too)
            clip_grad_norm=o.grad_clip or None,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
        )
        kind = "vescale.optim.DistributedOptimizer(AdamW)"
    else:
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        kind = "torch.optim.AdamW"
    return opt, kind


def build_scheduler(opt, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine (``lr_factor``) as a ``LambdaLR``, stepped once per optimizer step.

    ``LambdaLR`` scales every param group's own peak lr (Muon's matrix and AdamW groups
    differ), in closed form. ``DistributedOptimizer`` is not a ``torch.optim.Optimizer``:
    the schedule drives its inner optimizer, whose param groups it shares.
    """
    from vescale.optim import DistributedOptimizer

    target = opt.optimizer if isinstance(opt, DistributedOptimizer) else opt
    return torch.optim.lr_scheduler.LambdaLR(target, lambda step: lr_factor(step, cfg))


def clip_and_norm(params: list[torch.Tensor], max_norm: float) -> float:
    try:
        from vescale.optim import clip_grad_norm_
    except ImportError:  # pragma: no cover
        from torch.nn.utils import clip_grad_norm_
    return float(clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))


# --------------------------------------------------------------------------- checkpoints
_STEP_DIR = re.compile(r"^step_(\d+)$")


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    import vescale.checkpoint as vckpt

    if not ckpt_dir.is_dir():
        return None
    found = []
    for d in ckpt_dir.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and d.is_dir() and vckpt.is_complete(d):
            found.append((int(m.group(1)), d))
    return max(found)[1] if found else None


def checkpoint_state(model, opt, sched, step: int, tokens: int) -> dict:
    return {"model": model, "optimizer": opt, "lr_scheduler": sched, "step": step, "tokens": tokens}


# --------------------------------------------------------------------------- data
def train_kwargs(cfg: Config, dp_rank: int, dp_size: int, start_step: int) -> dict:
    """``data.batches`` arguments of this dp rank's training micro-batches."""
    return dict(
        seed=cfg.train.seed,
        batch_size=cfg.train.batch_size,
        grad_accum=cfg.train.grad_accum,
        dp_rank=dp_rank,
        dp_size=dp_size,
        block_size=cfg.model.block_size,
        start_step=start_step,
    )


def eval_kwargs(cfg: Config, dp_rank: int, dp_size: int) -> dict:
    """``data.eval_batches`` arguments: global batches of ``batch_size / grad_accum``."""
    return dict(
        seed=cfg.train.seed,
        batch_size=cfg.train.batch_size // cfg.train.grad_accum,
        dp_rank=dp_rank,
        dp_size=dp_size,
        block_size=cfg.model.block_size,
    )


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(model, corpus, cfg: Config, mesh, amp, pipe=None) -> float:
    model.eval()
    dp_size = mesh.size(mesh.mesh_dim_names.index("dp"))
    dp_rank = mesh.get_local_rank("dp")
    device = next(iter(model.parameters())).device
    total = torch.zeros((), dtype=torch.float64)
    n = 0
    for x, y in eval_batches(
        corpus.val, **eval_kwargs(cfg, dp_rank, dp_size), n_batches=cfg.train.eval_batches
    ):
        with amp():
            if pipe is None:
                total += loss_fn(model(x.to(device)), y.to(device)).double().cpu()
            else:  # forward only through the stages; the loss is on the last one
                loss = pipe.eval_step(x.to(device), target=y.to(device))
                total += 0.0 if loss is None else loss.double().cpu()
        n += 1
    model.train()
    t = (total / n).to(device)
    if pipe is not None:
        dist.all_reduce(t, group=mesh.get_group("pp"))  # from the last stage to every rank
    if dp_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
    return float(t)


def gather_plain_model(model, cfg: Config) -> GPT | None:
    """A plain single-device copy of the trained model on rank 0 (a collective)."""
    from torch.distributed.tensor import DTensor

    full = {}
    for k, v in model.state_dict().items():
        full[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
    if dist.get_rank() != 0:
        return None
    plain = GPT(GPTConfig(**vars(cfg.model)))
    missing, unexpected = plain.load_state_dict(full, strict=False)
    if missing or unexpected:
        log0(f"warning: gathered state dict: missing {missing}, unexpected {unexpected}")
    return plain.eval()


@torch.no_grad()
def generate(model: GPT, prompt: bytes, n: int, seed: int, temperature=0.8, top_k=40) -> str:
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    for _ in range(n):
        logits = model(idx[:, -model.cfg.block_size :])[:, -1, :].float() / temperature
        if top_k:
            v, _ = torch.topk(logits, min(top_k, logits.shape[-1]))
            logits[logits < v[:, [-1]]] = -float("inf")
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    return decode(idx[0].tolist())


# --------------------------------------------------------------------------- metrics
class Metrics:
    """Rank 0's metrics: ``metrics.json`` (config, records, summary), ``metrics.csv``, ``loss.png``."""

    FIELDS = [
        "step",
        "loss",
        "eval_loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "step_time_s",
        "elapsed_s",
    ]

    def __init__(self, run_dir: Path, cfg: Config, info: dict) -> None:
        self.dir = run_dir
        self.cfg = cfg
        self.info = info
        self.records: list[dict] = []
        self.summary: dict = {}

    def load_previous(self, upto_step: int) -> None:
        f = self.dir / "metrics.json"
        if f.exists():
            try:
                old = json.loads(f.read_text())["records"]
            except (OSError, ValueError, KeyError):
                return
            self.records = [r for r in old if r["step"] <= upto_step]

    def add(self, **rec) -> None:
        self.records.append(rec)

    def set_eval(self, step: int, value: float) -> None:
        for r in reversed(self.records):
            if r["step"] == step:
                r["eval_loss"] = value
                return
        self.records.append({"step": step, "eval_loss": value})

    def write(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        body = {
            "config": self.cfg.to_dict(),
            "run": self.info,
            "summary": self.summary,
            "records": self.records,
        }
        tmp = self.dir / "metrics.json.tmp"
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(self.dir / "metrics.json")
        with open(self.dir / "metrics.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=self.FIELDS, extrasaction="ignore")
            w.writeheader()
            for r in self.records:
                w.writerow({k: r.get(k, "") for k in self.FIELDS})

    def plot(self) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        tr = [(r["step"], r["loss"]) for r in self.records if r.get("loss") is not None]
        ev = [(r["step"], r["eval_loss"]) for r in self.records if r.get("eval_loss") is not None]
        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        if tr:
            ax.plot(*zip(*tr), label="train", lw=1)
        if ev:
            ax.plot(*zip(*ev), "o-", label="held-out", lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats / byte)")
        ax.set_title(
            f"GPT {self.info.get('params', 0) / 1e6:.2f}M params, mesh {self.info.get('mesh')}"
        )
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        out = self.dir / "loss.png"
        fig.savefig(out)
        plt.close(fig)
        return out


class TensorBoard:
    """Rank 0's TensorBoard event log in ``<run_dir>/tb`` (``torch.utils.tensorboard``).

    ``tensorboard`` is an optional dependency: without it (or with
    ``--train.tensorboard false``) every call is a no-op, after one note when it is missing.
    A resumed run passes ``purge_step``: TensorBoard then drops the earlier run's events
    from that step on, so the curves show each step once.
    """

    def __init__(self, log_dir: Path, cfg: Config, rank: int, purge_step: int | None) -> None:
        self.writer = None
        self.dir = log_dir
        if rank != 0 or not cfg.train.tensorboard:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            print(
                f"note: no TensorBoard log ({e}); pip install tensorboard for one in {log_dir}",
                flush=True,
            )
            return
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self.writer.add_text("config", "```\n" + config_yaml(cfg) + "```")

    def scalars(self, step: int, **values: float | None) -> None:
        if self.writer is None:
            return
        for tag, v in values.items():
            if v is not None and math.isfinite(v):
                self.writer.add_scalar(tag, v, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Progress:
    """tqdm bar on a TTY, else a plain log line every ``log_interval`` steps (rank 0 only)."""

    def __init__(self, cfg: Config, start: int, total: int, rank: int) -> None:
        self.enabled = rank == 0
        self.total = total
        self.every = cfg.train.log_interval
        self.bar = None
        self.t_last = time.perf_counter()
        self.tokens_last = 0
        if self.enabled and cfg.train.progress and tqdm is not None and sys.stderr.isatty():
            self.bar = tqdm(
                total=total, initial=start, desc="train", unit="step", dynamic_ncols=True
            )

    def update(self, step: int, loss: float, tps: float, lr: float, eta_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss {loss:.3f} | {tps:,.0f} tok/s | lr {lr:.2e}", refresh=False
            )
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total or step == 1:
            print(
                f"step {step:>5}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
                f"{tps:,.0f} tok/s | ETA {fmt_time(eta_s)}",
                flush=True,
            )

    def write(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- main
@record  # torchrun's error summary names the failing rank and its traceback
def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        # --help and --print_config print once (on rank 0), not once per rank.
        with contextlib.redirect_stdout(io.StringIO()) if rank else contextlib.nullcontext():
            cfg = parse_args(argv)
        dp, tp = validate(cfg, world)  # before any process-group work
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2

    # ---- data (every rank reads the same bytes; batches are functions of (seed, step)).
    # Too little text fails here, before any process-group work.
    try:
        corpus = load_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.max_bytes)
        batches(corpus.train, **train_kwargs(cfg, 0, dp, 0))
        eval_batches(corpus.val, **eval_kwargs(cfg, 0, dp), n_batches=1)
    except ValueError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2

    import vescale.checkpoint as vckpt
    from vescale.dtensor import init_device_mesh

    device = pick_device(cfg)
    torch.manual_seed(cfg.train.seed)
    pp = cfg.parallel.pp
    if pp > 1:  # dp last: FSDP x TP inside a stage needs it (docs/pipeline.md)
        mesh = init_device_mesh(device.type, (pp, tp, dp), mesh_dim_names=("pp", "tp", "dp"))
    else:
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")

    use_bf16 = cfg.train.dtype == "bf16" or (cfg.train.dtype == "auto" and device.type == "cuda")
    if use_bf16 and device.type == "cpu":
        log0("note: bf16 autocast on CPU is slow on most machines")

    def amp():
        if use_bf16:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def dropout_rng():
        # Dropout masks of the global batch, as one device draws them: dp rank r holds
        # every dp-th sequence of the step's batch (the sampler's interleaved layout).
        if cfg.model.dropout > 0 and dp > 1:
            from vescale.dtensor.random import data_parallel_rng

            return data_parallel_rng(mesh, "dp", layout="interleaved")
        return contextlib.nullcontext()

    run_dir = Path(cfg.train.run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "ckpt"

    # ---- model
    with torch.device(device):
        model = GPT(GPTConfig(**vars(cfg.model)))
    n_params = model.num_params()
    pipe = None
    if pp > 1:
        pipe, dp_mode = pipeline(model, mesh, cfg, device)
        model = pipe.module  # this rank's stage(s), under the model's own parameter names
    else:
        model, dp_mode = parallelize(model, mesh, cfg)
    if cfg.init.from_pretrained:  # each rank reads its own shards of the files
        loaded = vckpt.load_hf(model, cfg.init.from_pretrained)
        log0(f"weights from {cfg.init.from_pretrained} ({loaded.bytes_read:,} bytes on rank 0)")
    params = [p for p in model.parameters() if p.requires_grad]
    opt, opt_kind = build_optimizer(model, mesh, cfg)
    sched = build_scheduler(opt, cfg)

    tokens_per_step = cfg.train.batch_size * cfg.model.block_size
    info = {
        "world_size": world,
        "mesh": f"dp={dp} x tp={tp}"
        + (f" x pp={pp} ({cfg.parallel.pp_schedule})" if pp > 1 else ""),
        "device": str(device.type),
        "backend": dist.get_backend(),
        "params": n_params,
        "data": corpus.describe(),
        "optimizer": opt_kind,
        "data_parallel": dp_mode,
        "autocast": "bf16" if use_bf16 else "fp32",
        "micro_batch_per_rank": cfg.train.batch_size // (dp * cfg.train.grad_accum),
        "tokens_per_step": tokens_per_step,
    }
    log0("resolved config:\n" + format_config(cfg, info))

    # ---- resume
    start_step, tokens_seen = 0, 0
    metrics = Metrics(run_dir, cfg, info)
    if cfg.checkpoint.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            log0(f"--resume: no complete checkpoint in {ckpt_dir}; starting from scratch")
        else:
            state = checkpoint_state(model, opt, sched, 0, 0)
            t = time.perf_counter()
            vckpt.load(path, state)
            start_step, tokens_seen = int(state["step"]), int(state["tokens"])
            log0(
                f"resumed from step {start_step} ({path}) on mesh dp={dp} x tp={tp} "
                f"in {time.perf_counter() - t:.1f} s"
            )
            if rank == 0:
                metrics.load_previous(start_step)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml(cfg))
    tb = TensorBoard(run_dir / "tb", cfg, rank, purge_step=start_step + 1 if start_step else None)
    train_iter = batches(
        corpus.train,
        **train_kwargs(cfg, dp_rank, dp, start_step),
        pin_memory=device.type == "cuda",
    )

    setup_s = time.perf_counter() - _T0
    log0(
        f"setup done in {setup_s:.1f} s: {n_params / 1e6:.2f}M params, mesh dp={dp} x tp={tp} "
        f"on {world} {device.type} rank(s) ({dist.get_backend()}), data parallel: {dp_mode}, "
        f"{tokens_per_step:,} tokens/step, steps {start_step}->{cfg.train.steps}"
    )

    # ---- train
    progress = Progress(cfg, start_step, cfg.train.steps, rank)
    model.train()
    t_train = time.perf_counter()
    recent: list[float] = []
    last_eval = None
    handle = None
    for step in range(start_step, cfg.train.steps):
        t_step = time.perf_counter()
        lr = opt.param_groups[0]["lr"]  # set by the scheduler (restored on resume)
        loss_sum = 0.0
        accum = cfg.train.grad_accum
        sync_ctx = no_sync_context(model) if dp_mode.startswith("dmodule-") else None
        if pipe is not None:  # torch's schedule runs the micro-batches through the stages
            x, y = next(train_iter)
            with dropout_rng(), amp():  # micro-batch masks nest in the data-parallel ones
                loss = pipe.step(x.to(device), target=y.to(device))
            loss_sum = 0.0 if loss is None else float(loss)
            max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
            grad_norm = float(pipe.clip_grad_norm_(max_norm))
        for micro in range(accum if pipe is None else 0):
            x, y = next(train_iter)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = micro == accum - 1
            ctx = sync_ctx() if (sync_ctx and not last) else contextlib.nullcontext()
            with ctx:
                with dropout_rng():  # backward too: activation checkpointing recomputes
                    with amp():
                        loss = loss_fn(model(x), y)
                    (loss / accum).backward()
            loss_sum += float(loss.detach())
        if dp_mode == "trainer" and dp > 1:
            sync_dp_grads(params, mesh)
        if dp_mode == "optimizer":
            grad_norm = float("nan")  # clipped inside DistributedOptimizer.step()
        elif pipe is None:
            grad_norm = clip_and_norm(params, cfg.optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

        # Loss of the global batch: average of the dp ranks' losses (tiny all-reduce).
        loss_t = torch.tensor(loss_sum / accum, dtype=torch.float64, device=device)
        if pipe is not None:  # only the last stage has the loss
            dist.all_reduce(loss_t, group=mesh.get_group("pp"))
        if dp > 1:
            dist.all_reduce(loss_t, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
        step_loss = float(loss_t)
        if not math.isfinite(step_loss):
            log0(f"error: loss is {step_loss} at step {step + 1}; stopping")
            return 1
        done = step + 1
        tokens_seen += tokens_per_step
        dt = time.perf_counter() - t_step
        recent = (recent + [dt])[-20:]
        avg_dt = sum(recent) / len(recent)
        tps = tokens_per_step / avg_dt
        eta = avg_dt * (cfg.train.steps - done)
        metrics.add(
            step=done,
            loss=round(step_loss, 5),
            lr=lr,
            grad_norm=round(grad_norm, 5) if math.isfinite(grad_norm) else None,
            tokens_per_s=round(tps, 1),
            step_time_s=round(dt, 4),
            elapsed_s=round(time.perf_counter() - _T0, 2),
        )
        tb.scalars(
            done,
            **{
                "train/loss": step_loss,
                "train/lr": lr,
                "train/grad_norm": grad_norm,
                "train/tokens_per_s": tps,
                "train/step_time_s": dt,
            },
        )
        progress.update(done, step_loss, tps, lr, eta)

        if (
            cfg.train.eval_interval
            and done % cfg.train.eval_interval == 0
            and done < cfg.train.steps
        ):
            last_eval = evaluate(model, corpus, cfg, mesh, amp, pipe)
            metrics.set_eval(done, round(last_eval, 5))
            tb.scalars(done, **{"eval/loss": last_eval})
            tb.flush()
            progress.write(f"step {done}: held-out loss {last_eval:.4f} (train {step_loss:.4f})")
            if rank == 0:
                metrics.write()
        if (
            cfg.checkpoint.interval
            and done % cfg.checkpoint.interval == 0
            and done < cfg.train.steps
        ):
            path = ckpt_dir / f"step_{done:06d}"
            handle = vckpt.save(
                path,
                checkpoint_state(model, opt, sched, done, tokens_seen),
                async_op=cfg.checkpoint.async_save,
                staging="background" if cfg.checkpoint.background_staging else "blocking",
                keep_last=cfg.checkpoint.keep_last,
            )
            progress.write(
                f"step {done}: checkpoint {path} ({'async, ' if cfg.checkpoint.async_save else ''}"
                f"blocked {handle.blocking_seconds:.2f} s)"
            )
    progress.close()
    train_s = time.perf_counter() - t_train
    steps_run = cfg.train.steps - start_step

    # ---- final evaluation, checkpoint, samples
    last_eval = evaluate(model, corpus, cfg, mesh, amp, pipe)
    metrics.set_eval(cfg.train.steps, round(last_eval, 5))
    tb.scalars(cfg.train.steps, **{"eval/loss": last_eval})
    tb.close()
    log0(f"final held-out loss {last_eval:.4f} after {cfg.train.steps} steps")
    if cfg.checkpoint.final and steps_run > 0:
        path = ckpt_dir / f"step_{cfg.train.steps:06d}"
        vckpt.save(
            path,
            checkpoint_state(model, opt, sched, cfg.train.steps, tokens_seen),
            keep_last=cfg.checkpoint.keep_last,
        )
        log0(f"final checkpoint: {path}")
    vckpt.wait_pending()
    if cfg.export.hf:  # every rank writes its own files; config.json: the GPT's sizes
        files = vckpt.export(
            model, cfg.export.hf, max_shard_size=cfg.export.max_shard_size, config=False
        )
        if rank == 0:
            conf = {"model_type": "vescale-gpt", **vars(cfg.model)}
            (Path(cfg.export.hf) / "config.json").write_text(json.dumps(conf, indent=2))
        log0(f"exported {len(files)} files to {cfg.export.hf} (--init.from_pretrained reads it)")

    # (samples need the whole model on one rank: not gathered across pipeline stages)
    plain = gather_plain_model(model, cfg) if cfg.train.sample_tokens and pipe is None else None
    if plain is not None:
        if cfg.data.path:
            prompts = [bytes(corpus.val[:24].tolist())]
        else:
            prompts = [b"def ", b"import os\n", b"class "]
        log0("samples from the trained model:")
        for i, pr in enumerate(prompts):
            text = generate(plain, pr, cfg.train.sample_tokens, seed=cfg.train.seed + i)
            log0(f"--- sample {i + 1} ---\n{text}\n")

    # ---- summary
    if rank == 0:
        losses = [r["loss"] for r in metrics.records if r.get("loss") is not None]
        start_loss = losses[0] if losses else float("nan")
        tail = losses[-10:]
        end_loss = sum(tail) / len(tail) if tail else float("nan")
        total_s = time.perf_counter() - _T0
        metrics.summary = {
            "start_loss": start_loss,
            "end_loss_mean_last_10": end_loss,
            "final_eval_loss": last_eval,
            "steps": cfg.train.steps,
            "steps_this_run": steps_run,
            "resumed_from_step": start_step,
            "tokens_seen": tokens_seen,
            "setup_s": round(setup_s, 2),
            "train_s": round(train_s, 2),
            "total_s": round(total_s, 2),
            "tokens_per_s": round(steps_run * tokens_per_step / train_s, 1) if steps_run else None,
            "peak_memory_bytes": (
                torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            ),
        }
        metrics.write()
        png = metrics.plot()
        log0(
            f"run dir {run_dir}: config.yaml, metrics.json, metrics.csv"
            + (", tb/ (TensorBoard)" if tb.writer is not None else "")
            + (", loss.png" if png else " (pip install matplotlib for loss.png)")
        )
        log0(
            f"TRAINING COMPLETE: start loss {start_loss:.4f} -> end loss {end_loss:.4f} "
            f"(held-out {last_eval:.4f}; {steps_run} steps in {fmt_time(train_s)}, "
            f"total {fmt_time(total_s)})"
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
