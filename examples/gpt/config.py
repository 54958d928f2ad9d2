"""The trainer's configuration: one dataclass tree, read by ``jsonargparse``.

Every field of every section is a flag ``--<section>.<field> VALUE``, and any subset of
the tree can come from a YAML file with ``--config``::

    torchrun --standalone --nproc-per-node 4 examples/gpt/train.py \\
        --config examples/gpt/configs/default.yaml --model.n_layer 6 --train.steps 300

Arguments apply left to right: a flag after ``--config`` overrides the file, a flag
before it is overridden by it. ``--section.field=VALUE`` works too; a boolean flag
given without a value means ``true`` (``--parallel.sequence_parallel false`` turns one
off). Shortcuts: ``--data PATH`` is ``--data.path PATH`` and ``--resume`` is
``--checkpoint.resume``. ``--help`` lists every flag with its default;
``--print_config`` prints the resolved configuration as YAML (a config file) and exits.

``validate`` checks the values against the world size **before** any process-group
work, so a bad mesh or a tensor-parallel size that does not divide the heads fails at
once, on every rank, with a clear message.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from argparse import ArgumentError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "build_parser",
    "config_yaml",
    "format_config",
    "parse_args",
    "validate",
]

PROG = "torchrun --standalone --nproc-per-node N examples/gpt/train.py"


class ConfigError(ValueError):
    """A bad flag, config file or value; raised before any process group exists."""


@dataclass
class ModelConfig:
    """The GPT's sizes.

    Attributes:
        vocab_size: vocabulary size (256: raw bytes)
        block_size: context length in tokens
        n_layer: transformer blocks
        n_head: attention heads (parallel.tp must divide it)
        n_embd: model width (n_head must divide it)
        mlp_ratio: MLP hidden size / n_embd
        dropout: dropout probability (embeddings, attention, residuals)
        bias: biases in linears and norms
        tie_embeddings: share the token embedding with lm_head
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 192
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True


@dataclass
class ParallelConfig:
    """The (dp, tp) mesh and how the model is spread over it.

    Attributes:
        dp: data-parallel size; 0: world size / tp
        tp: tensor-parallel size (Megatron TP over the 'tp' mesh dim)
        sequence_parallel: keep activations sequence-sharded between blocks (SP)
        vocab_parallel_loss: cross-entropy on vocabulary-sharded logits (no gather)
        device: auto: cuda when available
        data_parallel: DModule's data_parallel engine on 'dp' (auto: fsdp) or the
            trainer's own gradient all-reduce
        tp_submesh: when the trainer does data parallelism itself, parallelize on the
            1-D 'tp' sub-mesh (faster DTensor op planning) instead of the 2-D mesh
        pp: pipeline-parallel size (stages over a 'pp' mesh dim; 1: no pipeline)
        pp_schedule: torch.distributed.pipelining schedule of the stages
        microbatches: micro-batches per pipeline step (0: pp); they replace grad_accum
    """

    dp: int = 0
    tp: int = 2
    sequence_parallel: bool = True
    vocab_parallel_loss: bool = True
    device: Literal["auto", "cpu", "cuda"] = "auto"
    data_parallel: Literal["auto", "ddp", "fsdp", "trainer"] = "auto"
    tp_submesh: bool = True
    pp: int = 1
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = "1f1b"
    microbatches: int = 0


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule.

    Attributes:
        name: AdamW (torch.optim.AdamW) or vescale.optim.Muon
        lr: peak learning rate (AdamW; Muon's AdamW part)
        muon_lr: peak learning rate of Muon's matrix updates
        min_lr_ratio: final lr of the cosine schedule, as a fraction of the peak
        warmup_steps: linear warmup steps
        weight_decay: decoupled weight decay (matrices only)
        beta1: Adam beta1
        beta2: Adam beta2
        eps: Adam epsilon
        grad_clip: max global gradient norm; 0 disables clipping
        zero: shard AdamW state over dp (vescale.optim.DistributedOptimizer)
    """

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 3e-3
    muon_lr: float = 0.02
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    zero: bool = False


@dataclass
class DataConfig:
    """The text to train on.

    Attributes:
        path: text file or directory to train on; empty: the Python stdlib sources
        val_fraction: tail fraction of every document held out for evaluation
        max_bytes: read at most this many bytes of text (0: all)
    """

    path: str = ""
    val_fraction: float = 0.05
    max_bytes: int = 0


@dataclass
class TrainConfig:
    """The loop, its logs and outputs.

    Attributes:
        steps: optimizer steps (total, including resumed ones)
        batch_size: global batch in sequences per optimizer step
        grad_accum: micro-batches per optimizer step on each dp rank
        seed: seed for init and data order
        dtype: autocast; auto: bf16 on CUDA, fp32 on CPU
        log_interval: steps between log lines when there is no progress bar
        eval_interval: steps between held-out evaluations (0: only at the end)
        eval_batches: global batches per evaluation
        sample_tokens: bytes to generate per sample at the end (0: none)
        run_dir: metrics, TensorBoard log, plot and checkpoints go here
        progress: tqdm progress bar on rank 0 (when tqdm is installed and a TTY)
        tensorboard: TensorBoard event files in <run_dir>/tb (when tensorboard is
            installed)
    """

    steps: int = 150
    batch_size: int = 16
    grad_accum: int = 1
    seed: int = 1337
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    log_interval: int = 10
    eval_interval: int = 50
    eval_batches: int = 4
    sample_tokens: int = 240
    run_dir: str = "runs/gpt"
    progress: bool = True
    tensorboard: bool = True


@dataclass
class CheckpointConfig:
    """Periodic saves and resuming.

    Attributes:
        interval: steps between periodic saves (0: none)
        keep_last: complete checkpoints kept in the checkpoint dir
        async_save: periodic saves write in the background
        background_staging: async saves also copy the state in the background (the
            next step waits for it)
        dir: checkpoint dir; empty: <train.run_dir>/ckpt
        resume: resume from the latest complete checkpoint in the checkpoint dir
        final: save a checkpoint after the last step
    """

    interval: int = 100
    keep_last: int = 2
    async_save: bool = True
    background_staging: bool = True
    dir: str = ""
    resume: bool = False
    final: bool = True


@dataclass
class InitConfig:
    """Where the weights start.

    Attributes:
        from_pretrained: a save_pretrained-style directory of this GPT (safetensors,
            e.g. written by --export.hf) read into the parallelized model, each rank its
            own shards (vescale.checkpoint.load_hf); empty: random init
    """

    from_pretrained: str = ""


@dataclass
class ExportConfig:
    """The trained model as a save_pretrained-style directory.

    Attributes:
        hf: write the final weights here (safetensors shards + index + config.json;
            each rank writes its own files, vescale.checkpoint.export); empty: none
        max_shard_size: largest safetensors file, e.g. 5GB or 500MiB
    """

    hf: str = ""
    max_shard_size: str = "5GB"


@dataclass
class Config:
    """The whole job.

    Attributes:
        model: the GPT's sizes
        parallel: the (dp, tp) mesh and how the model is spread over it
        optim: optimizer and learning-rate schedule
        data: the text to train on
        train: the loop, its logs and outputs
        checkpoint: periodic saves and resuming
        init: where the weights start (random or a pretrained directory)
        export: the trained model as a save_pretrained-style directory
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_ALIASES = {"--data": "--data.path", "--resume": "--checkpoint.resume"}


def _field_types() -> dict[str, type]:
    """``"section.field" -> type`` for every leaf of ``Config``."""
    out = {}
    for sec in dataclasses.fields(Config):
        sec_cls = typing.get_type_hints(Config)[sec.name]
        for name, typ in typing.get_type_hints(sec_cls).items():
            out[f"{sec.name}.{name}"] = typ
    return out


def build_parser() -> typing.Any:
    """The ``jsonargparse.ArgumentParser`` of the trainer (``--config`` plus every field).

    Errors raise ``argparse.ArgumentError`` instead of exiting, so that
    ``parse_args`` can turn them into a ``ConfigError``.
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(
        prog=PROG,
        usage=f"{PROG} [--config FILE] [--section.field VALUE ...]",
        description=(
            "Train a byte-level GPT with vescale on a (dp, tp) device mesh. Arguments apply "
            "left to right: flags after --config override the file, flags before it are "
            "overridden by it. A boolean flag without a value means true. Shortcuts: "
            "--data PATH is --data.path PATH (not a section file), --resume is "
            "--checkpoint.resume."
        ),
        exit_on_error=False,
    )
    parser.add_argument(
        "--config",
        action="config",
        help="YAML file with any subset of the sections below (see examples/gpt/configs/)",
    )
    parser.add_class_arguments(Config, nested_key=None, fail_untyped=True)
    return parser


def _normalize(args: list[str], bools: set[str]) -> list[str]:
    """Expand the shortcuts; give a value-less boolean flag the value ``true``."""
    out: list[str] = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        name = _ALIASES.get(name, name)
        out.append(f"{name}={value}" if eq else name)
        if not eq and name.startswith("--") and name[2:] in bools:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is None or nxt.startswith("-"):
                out.append("true")
    return out


def _hint(args: list[str], known: list[str]) -> str:
    """Nearest known flags for every unknown ``--flag`` in ``args`` (empty if none)."""
    hints = []
    for arg in args:
        name = arg.partition("=")[0]
        if not name.startswith("--") or name[2:] in known:
            continue
        close = difflib.get_close_matches(name[2:], known, n=3, cutoff=0.5)
        if close:
            hints.append(f"{name}: did you mean {', '.join('--' + c for c in close)}?")
    return ("\n" + "\n".join(hints)) if hints else ""


def _config_files(args: list[str]) -> list[str]:
    files = []
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.partition("=")[2])
    return files


def _file_flags(path: str) -> list[str]:
    """The keys of a YAML config file as flags (``--model.n_layer``); empty if unreadable."""
    import yaml  # a dependency of jsonargparse

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(data, dict):
        return []
    flags = []
    for sec, body in data.items():
        keys = [f"{sec}.{k}" for k in body] if isinstance(body, dict) else [str(sec)]
        flags += [f"--{k}" for k in keys]
    return flags


def _explain(err: ArgumentError, args: list[str], known: list[str]) -> str:
    """``err`` plus the config file it comes from (if one) and the nearest known names."""
    for path in _config_files(args):
        try:
            build_parser().parse_args(["--config", path])
        except ArgumentError as file_err:
            return f"--config {path}: {file_err}{_hint(_file_flags(path), known)}"
    return f"{err} (see --help){_hint(args, known)}"


def parse_args(argv: list[str] | None = None) -> Config:
    """Build a ``Config`` from defaults, ``--config`` files and flags, left to right.

    Args:
        argv: The arguments (default: ``sys.argv[1:]``).

    Returns:
        The configuration.

    Raises:
        ConfigError: Unknown flag or config-file key (with the nearest names), a missing
            file, a malformed value or one outside a field's choices.
        SystemExit: ``-h``/``--help`` or ``--print_config`` (after printing).
    """
    types = _field_types()
    bools = {k for k, t in types.items() if t is bool}
    args = _normalize(list(sys.argv[1:] if argv is None else argv), bools)
    parser = build_parser()
    try:
        ns = parser.parse_args(args)
    except ArgumentError as e:
        known = [*types, "config", "print_config", *(f.name for f in dataclasses.fields(Config))]
        raise ConfigError(_explain(e, args, known)) from None
    sections = parser.instantiate(ns)
    return Config(**{f.name: sections[f.name] for f in dataclasses.fields(Config)})


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
        ("parallel.pp", p.pp),
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
        ("parallel.microbatches", p.microbatches),
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
    # The choices are Literal types (the parser checks them); a Config built in code is not parsed.
    for name, value in (
        ("optim.name", o.name),
        ("parallel.data_parallel", p.data_parallel),
        ("parallel.pp_schedule", p.pp_schedule),
        ("parallel.device", p.device),
        ("train.dtype", t.dtype),
    ):
        choices = typing.get_args(_field_types()[name])
        need(value in choices, f"--{name} must be one of {', '.join(choices)}, got {value!r}")
    need(
        not (o.zero and o.name != "adamw"),
        "--optim.zero (DistributedOptimizer) needs --optim.name adamw (Muon is not element-wise)",
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

    # Pipeline parallelism: the (pp, tp, dp) mesh; the rest of the checks see world / pp.
    if p.pp > 1:
        stages = p.pp * (2 if p.pp_schedule == "interleaved1f1b" else 1)
        micro = p.microbatches or p.pp
        need(
            world_size % p.pp == 0,
            f"--parallel.pp {p.pp} does not divide the world size {world_size}",
        )
        need(
            m.n_layer >= stages,
            f"--parallel.pp {p.pp} with {p.pp_schedule} needs {stages} stages: --model.n_layer "
            f"{m.n_layer} is too small",
        )
        need(
            not m.tie_embeddings,
            "--parallel.pp > 1 needs --model.tie_embeddings false (the embedding and lm_head "
            "live on different stages)",
        )
        need(
            t.grad_accum == 1,
            "--parallel.pp > 1: use --parallel.microbatches, not --train.grad_accum",
        )
        need(not o.zero, "--parallel.pp > 1 does not combine with --optim.zero")
        need(
            p.data_parallel != "trainer",
            "--parallel.pp > 1 needs DModule's data parallelism (--parallel.data_parallel auto/ddp/fsdp)",
        )
        need(
            p.pp_schedule != "1f1b" or micro >= stages,
            f"1F1B needs --parallel.microbatches >= {stages} stages, got {micro}",
        )
        need(
            p.pp_schedule != "interleaved1f1b" or micro % p.pp == 0,
            f"interleaved 1F1B needs --parallel.microbatches ({micro}) divisible by pp {p.pp}",
        )
        if errors:
            raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
        world_size //= p.pp

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
    for flag, value in (
        ("--init.from_pretrained", cfg.init.from_pretrained),
        ("--export.hf", cfg.export.hf),
    ):
        if value and p.pp > 1:
            errors.append(f"{flag} needs --parallel.pp 1 (pipeline stages hold parts of the model)")
    if cfg.init.from_pretrained and not Path(cfg.init.from_pretrained).is_dir():
        errors.append(f"--init.from_pretrained {cfg.init.from_pretrained}: no such directory")
    per_step = dp * t.grad_accum * ((p.microbatches or p.pp) if p.pp > 1 else 1)
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


def config_yaml(cfg: Config) -> str:
    """``cfg`` as a YAML config file: ``--config`` of it gives back ``cfg``."""
    import yaml  # a dependency of jsonargparse

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
