"""Search over parallel layouts and ``DModule(model, strategy="auto", ...)``.

`search` enumerates every layout of a world size (each factorization into
``dp x fsdp x tp`` (``pp x dp x fsdp x tp`` when pipeline degrees are allowed),
sequence parallelism on/off, activation checkpointing on/off and each micro-batch size
that divides the per-rank batch), predicts each with `vescale.dmodule.estimate`, keeps
those that fit the device memory and ranks them by predicted step time. Pipeline
layouts are predicted only: `apply_layout` refuses them (build them with
`pipeline_parallelize`), and ``strategy="auto"`` searches without them. `apply_layout` builds the mesh and calls `parallelize_module`
with the layout's options; `parallelize_auto` (what ``DModule(model,
strategy="auto", ...)`` calls) does both and records the choice, which `dump_plan`
prints and `get_strategy` returns.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

from vescale.dmodule._cost_model import (
    DeviceSpec,
    Estimate,
    Layout,
    ModelProfile,
    _meta_copy,
    estimate,
    probe_device,
    profile_model,
)

__all__ = [
    "StrategyChoice",
    "candidates",
    "search",
    "apply_layout",
    "parallelize_auto",
    "get_strategy",
    "layout_of",
    "NoLayoutFitsError",
]


class NoLayoutFitsError(ValueError):
    """No candidate layout fits the device memory (the message names the closest)."""


@dataclasses.dataclass
class StrategyChoice:
    """What ``DModule(model, strategy="auto", ...)`` chose and why.

    Attributes:
        layout: The applied `Layout` (its ``micro_batch`` is for the training loop:
            run ``accumulation`` micro-batches per optimizer step).
        accumulation: Micro-batches per step on each rank.
        ranked: Every candidate that fits, fastest predicted first.
        rejected: How many candidates did not fit the memory.
        device: The `DeviceSpec` used.
        global_batch: Samples per optimizer step over all ranks.
    """

    layout: Layout
    accumulation: int
    ranked: list[Estimate]
    rejected: int
    device: DeviceSpec
    global_batch: int

    def describe(self, top: int = 5) -> str:
        """The choice, the runners-up and the device constants, as text."""
        d = self.device
        lk = ", ".join(
            f"<= {lk.ranks or 'any'} ranks: {lk.bandwidth / 1e9:.2f} GB/s, {lk.latency * 1e6:.0f} us"
            for lk in d.links
        )
        lines = [
            f"strategy: auto, global batch {self.global_batch}, chose {self.layout.describe()} "
            f"({self.accumulation} micro-batch(es) per step)",
            f"  device: {d.memory / 2**30:.2f} GiB, matmul {d.matmul_flops / 1e9:.1f} GFLOP/s, "
            f"copy {d.copy_bandwidth / 1e9:.2f} GB/s, op {d.op_overhead * 1e6:.1f} us "
            f"(DTensor {d.dtensor_op_overhead * 1e6:.1f} us), overlap {d.overlap:.2f}; links {lk}",
            f"  {len(self.ranked)} layouts fit ({self.rejected} did not); fastest predicted:",
        ]
        lines += [f"  {i + 1}. {e.describe()}" for i, e in enumerate(self.ranked[:top])]
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    profile: ModelProfile,
    world: int,
    global_batch: int,
    *,
    micro_batches: list[int] | None = None,
    allow: dict[str, Any] | None = None,
) -> list[Layout]:
    """Every layout of ``world`` ranks the model and ``global_batch`` admit.

    Args:
        profile: The model's `ModelProfile` (tensor-parallel degrees must divide
            the heads and width so that every block shards).
        world: Number of ranks.
        global_batch: Samples per step; ``dp * fsdp`` must divide it.
        micro_batches: Micro-batch sizes to consider (default: every divisor of the
            per-rank batch).
        allow: Restrict choices: ``{"dp_modes": {"ddp", "fsdp", "hsdp", "none"},
            "tp": [..], "sequence_parallel": [False, True],
            "activation_checkpointing": [False, True]}``, or widen them: ``"pp":
            [1, 2, 4]`` adds pipeline layouts (default ``[1]``: none; a degree must
            divide the world and not exceed the transformer blocks). Pipeline layouts
            are predicted only (see `apply_layout`).
    """
    allow = allow or {}
    modes = set(allow.get("dp_modes", ("none", "ddp", "fsdp", "hsdp")))
    sps = list(allow.get("sequence_parallel", (False, True)))
    acs = list(allow.get("activation_checkpointing", (False, True)))
    tps = allow.get("tp")
    pps = [p for p in allow.get("pp", (1,)) if world % p == 0]
    pps = [p for p in pps if p == 1 or p <= profile.n_blocks]
    out = []
    valid_tp: dict[int, bool] = {}
    for pp in pps:
        for tp in _divisors(world // pp):
            if tps is not None and tp not in tps:
                continue
            if tp not in valid_tp:
                valid_tp[tp] = profile.valid_tp(tp)
            if not valid_tp[tp]:
                continue
            rest = world // pp // tp
            for fsdp in _divisors(rest):
                dp = rest // fsdp
                lay0 = Layout(dp=dp, fsdp=fsdp, tp=tp, pp=pp)
                if lay0.dp_mode not in modes or global_batch % lay0.dp_degree:
                    continue
                per_rank = global_batch // lay0.dp_degree
                mbs = [m for m in (micro_batches or _divisors(per_rank)) if per_rank % m == 0]
                for sp in sps if tp > 1 else [False]:
                    for ac in acs:
                        for mb in mbs:
                            out.append(
                                dataclasses.replace(
                                    lay0,
                                    sequence_parallel=sp,
                                    activation_checkpointing=ac,
                                    micro_batch=mb,
                                )
                            )
    return out


def search(
    profile: ModelProfile,
    world: int,
    device: DeviceSpec,
    global_batch: int,
    *,
    micro_batches: list[int] | None = None,
    allow: dict[str, Any] | None = None,
    **estimate_kwargs: Any,
) -> tuple[list[Estimate], int]:
    """Rank the layouts of ``world`` ranks that fit ``device.memory``.

    Returns:
        ``(ranked, rejected)``: the fitting estimates, fastest predicted first (ties:
        less memory first), and the number of candidates that did not fit.

    Raises:
        NoLayoutFitsError: Nothing fits; the message names the smallest candidate.
        ValueError: No candidate at all (``global_batch`` not divisible, ...).
    """
    cands = candidates(profile, world, global_batch, micro_batches=micro_batches, allow=allow)
    if not cands:
        raise ValueError(
            f"no layout of {world} ranks for global_batch {global_batch}: dp*fsdp must divide "
            "the global batch and tp must divide the heads and width"
        )
    ests = [estimate(profile, c, device, global_batch, **estimate_kwargs) for c in cands]
    fits = [e for e in ests if e.fits]
    if not fits:
        best = min(ests, key=lambda e: e.memory["total"])
        raise NoLayoutFitsError(
            f"no layout of {world} ranks fits {device.memory / 2**30:.2f} GiB per device; the "
            f"smallest is {best.layout.describe()} at {best.memory['total'] / 2**30:.2f} GiB"
        )
    fits.sort(key=lambda e: (e.time["total"], e.memory["total"]))
    return fits, len(ests) - len(fits)


def apply_layout(
    model: nn.Module,
    layout: Layout,
    *,
    device_type: str | None = None,
    **options: Any,
) -> nn.Module:
    """Build ``layout``'s mesh over the world and parallelize ``model`` with it.

    The mesh is ``init_device_mesh(device_type, shape, mesh_dim_names)`` with
    ``layout.mesh_dims``; tensor parallelism is the automatic plan on ``"tp"``,
    ``data_parallel`` and ``sequence_parallel`` / ``activation_checkpointing`` follow
    the layout. ``options`` go to `parallelize_module` (e.g. ``param_init_fn``).

    Raises:
        NotImplementedError: ``layout.pp > 1``: pipeline layouts are predicted by
            `search` but not applied here; build them with `pipeline_parallelize`.
        ValueError: The layout's world size is not the process group's.
    """
    import torch.distributed as dist

    if layout.pp > 1:
        raise NotImplementedError(
            f"apply_layout({layout.describe()}): pipeline layouts are predicted by search() "
            "but not applied; build the stages with vescale.dmodule.pipeline_parallelize"
        )

    from vescale.dmodule._api import parallelize_module
    from vescale.dtensor import init_device_mesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout.world != world:
        raise ValueError(
            f"layout {layout.describe()} has {layout.world} ranks; the world has {world}"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    names = tuple(n for n, _ in layout.mesh_dims)
    shape = tuple(s for _, s in layout.mesh_dims)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    opts: dict[str, Any] = {"tp_dim": "tp"}
    if layout.data_parallel:
        opts["data_parallel"] = layout.data_parallel
    if layout.tp > 1:
        opts["sequence_parallel"] = layout.sequence_parallel
    if layout.activation_checkpointing:
        opts["activation_checkpointing"] = True
    opts.update(options)
    skeleton = _meta_copy(model)
    # tp = 1: no plan at all (the automatic plan would take a lone mesh dim for TP)
    out = parallelize_module(model, mesh, None if layout.tp > 1 else {}, **opts)
    _LAYOUTS[out] = (layout, skeleton, dict(options))
    return out


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layout_of(model: nn.Module) -> Layout | None:
    """The `Layout` a model was parallelized with by `apply_layout` / ``strategy=`` /
    `reshard` (``None`` otherwise)."""
    rec = _LAYOUTS.get(model)
    return rec[0] if rec else None


def _skeleton(model: nn.Module) -> tuple[nn.Module, dict] | None:
    rec = _LAYOUTS.get(model)
    return (rec[1], rec[2]) if rec else None


def get_strategy(model: nn.Module) -> StrategyChoice | None:
    """The `StrategyChoice` of a model parallelized with ``strategy="auto"`` (or ``None``)."""
    return _CHOICES.get(model)


def describe_strategy(model: nn.Module) -> str | None:
    """`StrategyChoice.describe` for `dump_plan` (``None`` without a strategy)."""
    choice = _CHOICES.get(model)
    return choice.describe() if choice is not None else None


def _agree(layout: Layout) -> Layout:
    """Rank 0's layout on every rank (timings differ slightly between ranks)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return layout
    obj = [dataclasses.asdict(layout)]
    dist.broadcast_object_list(obj, src=0)
    return Layout(**obj[0])


def choose(
    model: nn.Module,
    *,
    global_batch: int,
    seq_len: int | None = None,
    world: int | None = None,
    device: DeviceSpec | None = None,
    device_memory: float | None = None,
    profile: ModelProfile | None = None,
    micro_batches: list[int] | None = None,
    allow: dict[str, Any] | None = None,
    input_fn: Any = None,
    loss_fn: Any = None,
) -> StrategyChoice:
    """Profile ``model``, probe (or take) the device constants and rank the layouts.

    Collective when ``device`` is not given (the probe) and when the world has
    several ranks (rank 0's choice is broadcast).
    """
    import torch.distributed as dist

    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ValueError(f"strategy='auto' needs global_batch=<positive int>, got {global_batch!r}")
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    if profile is None:
        if seq_len is None:
            cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
            seq_len = getattr(cfg, "block_size", None) or getattr(
                cfg, "max_position_embeddings", None
            )
        if not isinstance(seq_len, int):
            raise ValueError(
                "strategy='auto' needs seq_len=<tokens per sample> (not found in the model's "
                "cfg.block_size / config.max_position_embeddings)"
            )
        profile = profile_model(model, seq_len, input_fn=input_fn, loss_fn=loss_fn)
    if device is None:
        device = probe_device(device_memory)
    elif device_memory is not None:
        device = dataclasses.replace(device, memory=float(device_memory))
    ranked, rejected = search(
        profile, world, device, global_batch, micro_batches=micro_batches, allow=allow
    )
    best = _agree(ranked[0].layout)
    chosen = next((e for e in ranked if e.layout == best), ranked[0])
    return StrategyChoice(best, chosen.accumulation, ranked, rejected, device, global_batch)


_AUTO_KEYS = (
    "global_batch",
    "seq_len",
    "device",
    "device_memory",
    "profile",
    "micro_batches",
    "allow",
    "input_fn",
    "loss_fn",
)


def parallelize_auto(
    model: nn.Module,
    mesh: Any = None,
    sharding_plan: Any = None,
    *,
    strategy: Any = "auto",
    device_mesh: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """``DModule(model, mesh=None, strategy="auto", device_memory=..., global_batch=...)``.

    Profiles the model on the meta device, probes the devices (unless ``device=`` is
    given), searches every layout of the world size, builds the mesh and applies the
    fastest layout that fits (rank 0's choice on every rank). `dump_plan` shows the
    ranking; `get_strategy` returns it (the micro-batch size and accumulation steps
    are for the training loop). ``strategy`` may also be a `Layout` to apply as is.

    Args:
        model: A plain module (any device, meta included).
        mesh: Must be ``None`` (the layout builds its mesh).
        sharding_plan: Must be ``None`` (the automatic plan is used).
        strategy: ``"auto"`` or a `Layout`.
        device_mesh: Alias of ``mesh``.
        **kwargs: ``global_batch`` (required for ``"auto"``), ``seq_len``,
            ``device`` (a `DeviceSpec`), ``device_memory`` (bytes),
            ``micro_batches``, ``allow``, ``input_fn``, ``loss_fn`` (see `choose`);
            anything else goes to `parallelize_module` (``param_init_fn``, ...).

    Raises:
        ValueError: A mesh or plan was given, or ``global_batch`` is missing.
        NoLayoutFitsError: Nothing fits the memory.
    """
    if mesh is not None or device_mesh is not None:
        raise ValueError(
            "strategy=... builds its own mesh: pass mesh=None (or give a mesh and no strategy)"
        )
    if sharding_plan is not None:
        raise ValueError("strategy=... uses the automatic plan: pass sharding_plan=None")
    auto = {k: kwargs.pop(k) for k in _AUTO_KEYS if k in kwargs}
    if isinstance(strategy, Layout):
        out = apply_layout(model, strategy, **kwargs)
        return out
    if strategy != "auto":
        raise ValueError(f"strategy must be 'auto' or a Layout, got {strategy!r}")
    if "global_batch" not in auto:
        raise ValueError("strategy='auto' needs global_batch=<samples per optimizer step>")
    pps = (auto.get("allow") or {}).get("pp", (1,))
    if any(p != 1 for p in pps):
        raise ValueError(
            f"strategy='auto' applies layouts without pipeline stages, got allow['pp']={pps!r}: "
            "pipeline layouts are predicted by search(..., allow={'pp': [...]}) only; build "
            "them with pipeline_parallelize"
        )
    choice = choose(model, **auto)
    out = apply_layout(model, choice.layout, device_type=choice.device.device_type, **kwargs)
    _CHOICES[out] = choice
    return out
