"""The trainer's configuration: one dataclass tree, overridden from the command line.

Every field of every section is a flag ``--<section>.<field> VALUE``::

    torchrun --standalone --nproc-per-node 4 examples/gpt/train.py \\
        --model.n_layer 6 --parallel.tp 2 --optim.lr 1e-3 --train.steps 300

``--section.field=VALUE`` works too; a boolean flag given without a value means
``true`` (``--parallel.sequence_parallel false`` turns one off). Shortcuts:
``--data PATH`` is ``--data.path PATH`` and ``--resume`` is ``--checkpoint.resume``.
``--help`` lists every flag with its default.

:func:`validate` checks the values against the world size **before** any
process-group work, so a bad mesh or a tensor-parallel size that does not divide
the heads fails at once, on every rank, with a clear message.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from dataclasses import dataclass, field

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "format_config",
    "parse_args",
    "validate",
]


class ConfigError(ValueError):
    """A bad flag or value; raised before any process group exists."""


def _f(default, help: str):  # noqa: A002 - mirrors argparse's wording
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    vocab_size: int = _f(256, "vocabulary size (256: raw bytes)")
    block_size: int = _f(128, "context length in tokens")
    n_layer: int = _f(4, "transformer blocks")
    n_head: int = _f(4, "attention heads (parallel.tp must divide it)")
    n_embd: int = _f(192, "model width (n_head must divide it)")
    mlp_ratio: int = _f(4, "MLP hidden size / n_embd")
    dropout: float = _f(0.0, "dropout probability (embeddings, attention, residuals)")
    bias: bool = _f(True, "biases in linears and norms")
    tie_embeddings: bool = _f(True, "share the token embedding with lm_head")


@dataclass
class ParallelConfig:
    dp: int = _f(0, "data-parallel size; 0: world size / tp")
    tp: int = _f(2, "tensor-parallel size (Megatron TP over the 'tp' mesh dim)")
    sequence_parallel: bool = _f(True, "keep activations sequence-sharded between blocks (SP)")
    vocab_parallel_loss: bool = _f(True, "cross-entropy on vocabulary-sharded logits (no gather)")
    device: str = _f("auto", "auto | cpu | cuda (auto: cuda when available)")
    data_parallel: str = _f(
        "auto",
        "auto | ddp | fsdp | trainer: DModule's data_parallel engine on 'dp' (auto: fsdp) "
        "or the trainer's own gradient all-reduce",
    )
    tp_submesh: bool = _f(
        True,
        "when the trainer does data parallelism itself, parallelize on the 1-D 'tp' sub-mesh "
        "(faster DTensor op planning) instead of the 2-D mesh",
    )


@dataclass
class OptimConfig:
    name: str = _f("adamw", "adamw | muon (vescale.optim.Muon)")
    lr: float = _f(3e-3, "peak learning rate (AdamW; Muon's AdamW part)")
    muon_lr: float = _f(0.02, "peak learning rate of Muon's matrix updates")
    min_lr_ratio: float = _f(0.1, "final lr of the cosine schedule, as a fraction of the peak")
    warmup_steps: int = _f(15, "linear warmup steps")
    weight_decay: float = _f(0.1, "decoupled weight decay (matrices only)")
    beta1: float = _f(0.9, "Adam beta1")
    beta2: float = _f(0.95, "Adam beta2")
    eps: float = _f(1e-8, "Adam epsilon")
    grad_clip: float = _f(1.0, "max global gradient norm; 0 disables clipping")
    zero: bool = _f(False, "shard AdamW state over dp (vescale.optim.DistributedOptimizer)")


@dataclass
class DataConfig:
    path: str = _f("", "text file or directory to train on; empty: the Python stdlib sources")
    val_fraction: float = _f(0.05, "tail fraction of every document held out for evaluation")
    max_bytes: int = _f(0, "read at most this many bytes of text (0: all)")


@dataclass
class TrainConfig:
    steps: int = _f(150, "optimizer steps (total, including resumed ones)")
    batch_size: int = _f(16, "global batch in sequences per optimizer step")
    grad_accum: int = _f(1, "micro-batches per optimizer step on each dp rank")
    seed: int = _f(1337, "seed for init and data order")
    dtype: str = _f("auto", "auto | fp32 | bf16 (autocast; auto: bf16 on CUDA, fp32 on CPU)")
    log_interval: int = _f(10, "steps between log lines when there is no progress bar")
    eval_interval: int = _f(50, "steps between held-out evaluations (0: only at the end)")
    eval_batches: int = _f(4, "global batches per evaluation")
    sample_tokens: int = _f(240, "bytes to generate per sample at the end (0: none)")
    run_dir: str = _f("runs/gpt", "metrics, plot and checkpoints go here")
    progress: bool = _f(True, "tqdm progress bar on rank 0 (when tqdm is installed and a TTY)")


@dataclass
class CheckpointConfig:
    interval: int = _f(100, "steps between periodic saves (0: none)")
    keep_last: int = _f(2, "complete checkpoints kept in the checkpoint dir")
    async_save: bool = _f(True, "periodic saves write in the background")
    background_staging: bool = _f(
        True, "async saves also copy the state in the background (the next step waits for it)"
    )
    dir: str = _f("", "checkpoint dir; empty: <train.run_dir>/ckpt")
    resume: bool = _f(False, "resume from the latest complete checkpoint in the checkpoint dir")
    final: bool = _f(True, "save a checkpoint after the last step")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_ALIASES = {"--data": "data.path", "--resume": "checkpoint.resume"}
_TRUE = {"1", "true", "yes", "on", "y"}
_FALSE = {"0", "false", "no", "off", "n"}


def _flags() -> dict[str, tuple[str, str, type, str, object]]:
    """``"section.field" -> (section, field, type, help, default)``."""
    out = {}
    for sec in dataclasses.fields(Config):
        sec_cls = sec.default_factory  # type: ignore[misc]
        hints = typing.get_type_hints(sec_cls)
        for f in dataclasses.fields(sec_cls):
            out[f"{sec.name}.{f.name}"] = (
                sec.name,
                f.name,
                hints[f.name],
                f.metadata.get("help", ""),
                f.default,
            )
    return out


def _convert(flag: str, typ: type, raw: str):
    if typ is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"--{flag}: expected true/false, got {raw!r}")
    try:
        return typ(raw)
    except ValueError:
        raise ConfigError(f"--{flag}: expected {typ.__name__}, got {raw!r}") from None


def help_text() -> str:
    lines = [
        "usage: torchrun --standalone --nproc-per-node N examples/gpt/train.py [--section.field VALUE ...]",
        "",
        "shortcuts: --data PATH (= --data.path), --resume (= --checkpoint.resume)",
    ]
    section = None
    for flag, (sec, _name, typ, help_, default) in _flags().items():
        if sec != section:
            section = sec
            lines.append(f"\n{sec}:")
        lines.append(f"  --{flag:<32} {typ.__name__:<5} {default!r:<12} {help_}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Config:
    """Build a :class:`Config` from defaults plus ``--section.field VALUE`` overrides.

    Raises:
        ConfigError: Unknown flag (with the nearest names), missing or malformed value.
        SystemExit: ``-h``/``--help`` (after printing the flags).
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    cfg = Config()
    flags = _flags()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-h", "--help"):
            print(help_text())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; flags look like --train.steps 100")
        value: str | None = None
        if "=" in arg:
            arg, value = arg.split("=", 1)
        name = _ALIASES.get(arg, arg[2:])
        if name not in flags:
            close = difflib.get_close_matches(name, list(flags), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown flag --{name}{hint} (see --help)")
        sec, fname, typ, _help, _default = flags[name]
        if value is None:
            nxt = args[i] if i < len(args) else None
            if typ is bool and (
                nxt is None or nxt.startswith("--") or nxt.lower() not in _TRUE | _FALSE
            ):
                value = "true"
            elif nxt is None:
                raise ConfigError(f"--{name} needs a value")
            else:
                value = nxt
                i += 1
        setattr(getattr(cfg, sec), fname, _convert(name, typ, value))
    return cfg


def validate(cfg: Config, world_size: int) -> tuple[int, int]:
    """Check ``cfg`` against ``world_size``; return the mesh shape ``(dp, tp)``.

    Pure arithmetic, no process group needed: call it before any distributed work.

    Raises:
        ConfigError: With a message naming the flags involved.
    """
    m, p, o, t, c = cfg.model, cfg.parallel, cfg.optim, cfg.train, cfg.checkpoint
    errors: list[str] = []

    def need(cond: bool, msg: str) -> None:
        if not cond:
            errors.append(msg)

    for name, v in (
        ("model.vocab_size", m.vocab_size),
        ("model.block_size", m.block_size),
        ("model.n_layer", m.n_layer),
        ("model.n_head", m.n_head),
        ("model.n_embd", m.n_embd),
        ("model.mlp_ratio", m.mlp_ratio),
        ("parallel.tp", p.tp),
        ("train.steps", t.steps),
        ("train.batch_size", t.batch_size),
        ("train.grad_accum", t.grad_accum),
        ("train.eval_batches", t.eval_batches),
        ("train.log_interval", t.log_interval),
        ("checkpoint.keep_last", c.keep_last),
    ):
        need(v >= 1, f"--{name} must be >= 1, got {v}")
    for name, v in (
        ("parallel.dp", p.dp),
        ("optim.warmup_steps", o.warmup_steps),
        ("optim.weight_decay", o.weight_decay),
        ("optim.grad_clip", o.grad_clip),
        ("train.eval_interval", t.eval_interval),
        ("train.sample_tokens", t.sample_tokens),
        ("checkpoint.interval", c.interval),
        ("data.max_bytes", cfg.data.max_bytes),
    ):
        need(v >= 0, f"--{name} must be >= 0, got {v}")
    need(
        o.lr > 0 and o.muon_lr > 0,
        f"learning rates must be > 0, got --optim.lr {o.lr}, --optim.muon_lr {o.muon_lr}",
    )
    need(0 <= o.min_lr_ratio <= 1, f"--optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    need(0 <= m.dropout < 1, f"--model.dropout must be in [0, 1), got {m.dropout}")
    need(
        0 < cfg.data.val_fraction < 1,
        f"--data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}",
    )
    need(o.name in ("adamw", "muon"), f"--optim.name must be 'adamw' or 'muon', got {o.name!r}")
    need(
        not (o.zero and o.name != "adamw"),
        "--optim.zero (DistributedOptimizer) needs --optim.name adamw (Muon is not element-wise)",
    )
    need(
        p.data_parallel in ("auto", "ddp", "fsdp", "trainer"),
        f"--parallel.data_parallel must be auto, ddp, fsdp or trainer, got {p.data_parallel!r}",
    )
    need(
        p.device in ("auto", "cpu", "cuda"),
        f"--parallel.device must be auto, cpu or cuda, got {p.device!r}",
    )
    need(
        t.dtype in ("auto", "fp32", "bf16"),
        f"--train.dtype must be auto, fp32 or bf16, got {t.dtype!r}",
    )
    need(
        m.vocab_size >= 256,
        f"--model.vocab_size must be >= 256 for byte-level text, got {m.vocab_size}",
    )
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))

    # Shapes that tensor parallelism has to split evenly.
    if m.n_embd % m.n_head:
        errors.append(f"--model.n_head {m.n_head} does not divide --model.n_embd {m.n_embd}")
    if m.n_head % p.tp:
        divisors = [k for k in range(1, m.n_head + 1) if m.n_head % k == 0]
        errors.append(
            f"--parallel.tp {p.tp} does not divide --model.n_head {m.n_head}: every tensor-parallel "
            f"rank must hold whole attention heads (tp in {divisors} works for n_head {m.n_head})"
        )
    if m.vocab_size % p.tp:
        errors.append(f"--parallel.tp {p.tp} does not divide --model.vocab_size {m.vocab_size}")
    if p.sequence_parallel and m.block_size % p.tp:
        errors.append(
            f"--parallel.tp {p.tp} does not divide --model.block_size {m.block_size} "
            "(sequence parallelism splits the sequence; or pass --parallel.sequence_parallel false)"
        )

    # The mesh against the world.
    if p.dp == 0:
        if world_size % p.tp:
            errors.append(
                f"--parallel.tp {p.tp} does not divide the world size {world_size} "
                f"(torchrun --nproc-per-node); cannot build a (dp, tp) mesh"
            )
        dp = max(world_size // p.tp, 1)
    else:
        dp = p.dp
        if dp * p.tp > world_size:
            errors.append(
                f"the mesh --parallel.dp {dp} x --parallel.tp {p.tp} = {dp * p.tp} ranks is larger "
                f"than the world size {world_size} (torchrun --nproc-per-node)"
            )
        elif dp * p.tp != world_size:
            errors.append(
                f"--parallel.dp {dp} x --parallel.tp {p.tp} = {dp * p.tp} must equal the world size "
                f"{world_size} (or pass --parallel.dp 0 to use world size / tp)"
            )
    per_step = dp * t.grad_accum
    if t.batch_size % per_step:
        errors.append(
            f"--train.batch_size {t.batch_size} is not divisible by dp {dp} x "
            f"--train.grad_accum {t.grad_accum} = {per_step} (sequences per micro-batch must be whole)"
        )
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return dp, p.tp


def format_config(cfg: Config, extra: dict | None = None) -> str:
    """The resolved config as indented JSON (plus derived values under ``"derived"``)."""
    d = cfg.to_dict()
    if extra:
        d["derived"] = extra
    return json.dumps(d, indent=2)
