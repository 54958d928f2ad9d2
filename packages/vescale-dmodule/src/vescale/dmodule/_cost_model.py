"""A cost model of one training step under a parallel layout (pure Python, no communication).

Three pieces:

* `profile_model` runs one forward and backward of the model **on the meta device**
  (no memory, no compute) at batch 1 and counts what the cost model needs: the
  parameters (tied weights once) and which of them the automatic tensor-parallel plan
  shards, matmul FLOPs forward and backward (``torch.utils.flop_counter``), the bytes
  autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``) split by
  how tensor/sequence parallelism divides them and by transformer block, the bytes the
  non-matmul ops read and write, and the number of ops per forward.
* `DeviceSpec` holds the device constants: memory, matmul FLOP/s, copy bandwidth,
  per-op overheads and collective bandwidth/latency per link tier (a mesh dim whose
  group spans at most ``Link.ranks`` consecutive ranks uses that tier). `probe_device`
  measures them on the running process group; or give them.
* `estimate` predicts per-rank memory (parameters, gradients, optimizer state,
  activations with or without checkpointing, engine buffers) and step time (compute,
  memory-bound ops, op overhead, each collective, overlap, optimizer) of one `Layout`.

Everything here is arithmetic on the profile: `estimate` takes microseconds, so a
search over every factorization of a large world is cheap.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

from vescale.dmodule._auto_plan import COLWISE, ROWWISE, default_sharding_plan

__all__ = [
    "Layout",
    "Link",
    "DeviceSpec",
    "ModelProfile",
    "Estimate",
    "profile_model",
    "probe_device",
    "estimate",
    "is_parameter_view",
    "saved_activation_bytes",
]

_DP_MODES = ("none", "ddp", "fsdp", "hsdp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout: degrees per mesh dim and the per-step choices.

    The mesh is ``(pp, dp, fsdp, tp)`` with size-1 dims left out, ``tp`` innermost
    (neighbouring ranks), named ``"pp"``, ``"dp"``, ``"fsdp"``, ``"tp"``. The
    data-parallel mode follows from the degrees: ``dp`` alone is DDP, ``fsdp`` alone
    FSDP, both HSDP (replicated over ``dp``, sharded over ``fsdp``). Each field is
    documented below.

    A layout with ``pp > 1`` is predicted by `estimate` and ranked by `search` (1F1B
    schedule, ``global_batch / (dp * fsdp) / micro_batch`` pipeline micro-batches) but
    not applied by `apply_layout` / ``DModule(strategy="auto")``: build it with
    `pipeline_parallelize`.
    """

    dp: int = 1
    """Replicated data-parallel degree (DDP, or HSDP's replica dim)."""
    fsdp: int = 1
    """Sharded data-parallel degree (FSDP, or HSDP's shard dim)."""
    tp: int = 1
    """Tensor-parallel degree (the automatic Megatron plan)."""
    pp: int = 1
    """Pipeline-parallel degree: stages of contiguous transformer blocks."""
    sequence_parallel: bool = False
    """Keep activations sequence-sharded between TP regions."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward."""
    micro_batch: int = 1
    """Samples per forward/backward on one rank; the per-rank batch is run as
    ``per_rank_batch // micro_batch`` accumulated micro-batches (pipeline micro-batches
    with ``pp > 1``)."""

    def __post_init__(self) -> None:
        for f in ("dp", "fsdp", "tp", "pp", "micro_batch"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout.{f} must be a positive int, got {v!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("Layout: sequence_parallel needs tp > 1")

    @property
    def world(self) -> int:
        """Number of ranks."""
        return self.dp * self.fsdp * self.tp * self.pp

    @property
    def dp_degree(self) -> int:
        """Ranks that split the batch (``dp * fsdp``)."""
        return self.dp * self.fsdp

    @property
    def dp_mode(self) -> str:
        """``"none"``, ``"ddp"``, ``"fsdp"`` or ``"hsdp"``."""
        if self.dp > 1 and self.fsdp > 1:
            return "hsdp"
        if self.fsdp > 1:
            return "fsdp"
        if self.dp > 1:
            return "ddp"
        return "none"

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """``((name, size), ...)`` outermost first; a 1-rank layout is ``(("dp", 1),)``."""
        dims = (("pp", self.pp), ("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp))
        kept = tuple((n, s) for n, s in dims if s > 1)
        return kept or (("dp", 1),)

    @property
    def data_parallel(self) -> dict[str, str] | None:
        """The ``data_parallel=`` option of `parallelize_module` for this layout."""
        out = {}
        if self.dp > 1:
            out["dp"] = "ddp"
        if self.fsdp > 1:
            out["fsdp"] = "fsdp"
        if not out and self.tp == 1 and self.pp == 1:
            out["dp"] = "ddp"  # one rank: a plain (1-rank) DDP keeps the model a DModule
        return out or None

    def describe(self) -> str:
        """A short label, e.g. ``"fsdp2 x tp2 +sp +ac mb4"``."""
        parts = []
        if self.pp > 1:
            parts.append(f"pp{self.pp}")
        if self.dp_mode == "hsdp":
            parts.append(f"hsdp{self.dp}x{self.fsdp}")
        elif self.dp > 1:
            parts.append(f"ddp{self.dp}")
        elif self.fsdp > 1:
            parts.append(f"fsdp{self.fsdp}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        label = " x ".join(parts) or "single"
        if self.sequence_parallel:
            label += " +sp"
        if self.activation_checkpointing:
            label += " +ac"
        return f"{label} mb{self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class Link:
    """One tier of the interconnect.

    Args:
        ranks: A collective whose group spans at most this many consecutive ranks
            (e.g. the GPUs of one node) uses this tier; ``0`` means any span.
        bandwidth: Bus bandwidth per rank in bytes/s (a ring all-reduce of ``S``
            bytes over ``n`` ranks takes ``2 (n-1)/n S / bandwidth``).
        latency: Seconds per ring step.
        call_latency: Seconds per collective call on top of its ring steps (launch
            and host synchronisation; what a one-step all-gather costs beyond one
            step).
    """

    ranks: int
    bandwidth: float
    latency: float
    call_latency: float = 0.0


def _interp(table: tuple[tuple[float, float], ...], x: float, default: float) -> float:
    """``table`` (sorted ``(x, y)`` pairs) interpolated at ``x`` in log-log; flat outside."""
    if not table:
        return default
    pts = sorted(table)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    return pts[-1][1]


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Per-device constants of the cost model.

    Args:
        memory: Bytes of device memory a rank may use.
        matmul_flops: Peak matmul FLOP/s of one device.
        copy_bandwidth: Bytes/s that memory-bound ops (elementwise, norms, softmax,
            optimizer) read plus write, on large tensors.
        links: Interconnect tiers, innermost first; the last should have ``ranks=0``.
        op_overhead: Host seconds per torch function call in forward on plain
            tensors (Python, module calls, building the autograd graph).
        dtensor_op_overhead: The same on DTensors (dispatch and sharding
            propagation); used for layouts with tensor parallelism.
        overlap: Fraction (0..1) of the data-parallel communication that runs hidden
            behind compute.
        device_type: ``"cpu"`` or ``"cuda"``: the mesh's device type.
        matmul_by_size: ``((size, FLOP/s), ...)``: square-matmul throughput by size
            (small matmuls run below peak); a matmul ``(m, k) x (k, n)`` runs at the
            figure of size ``(m k n) ** (1/3)`` (log-log interpolation).
        copy_by_size: ``((bytes, bytes/s), ...)``: memory-bound throughput by tensor
            size (small tensors stay in cache).
        node_overhead: Host seconds per autograd node in backward on plain tensors.
        dtensor_node_overhead: The same on DTensors.
        optimizer_param_overhead: Host seconds per parameter tensor of an optimizer
            step (AdamW, one tensor at a time) on plain tensors.
        optimizer_dtensor_param_overhead: The same on DTensor parameters (tensor
            parallelism, FSDP's sharded parameters).
        dtensor_collective_overhead: Host seconds DTensor adds to each collective it
            issues (a redistribution: tensor-parallel all-reduces and gathers).
        cores: Cores that the ranks of one node share; ``0``: each rank has its own
            device (GPUs). With more ranks than cores on a node (CPU ranks), compute
            and host time stretch by ``ranks / cores``.
        ranks_per_node: Ranks on one node (``0``: all of a layout's ranks).
    """

    memory: float
    matmul_flops: float
    copy_bandwidth: float
    links: tuple[Link, ...]
    op_overhead: float = 0.0
    dtensor_op_overhead: float = 0.0
    overlap: float = 0.0
    device_type: str = "cpu"
    matmul_by_size: tuple[tuple[int, float], ...] = ()
    copy_by_size: tuple[tuple[int, float], ...] = ()
    node_overhead: float = 0.0
    dtensor_node_overhead: float = 0.0
    optimizer_param_overhead: float = 0.0
    optimizer_dtensor_param_overhead: float = 0.0
    dtensor_collective_overhead: float = 0.0
    cores: int = 0
    ranks_per_node: int = 0

    def flops_at(self, size: float) -> float:
        """Matmul FLOP/s at square size ``size`` (``matmul_by_size``, else peak)."""
        return _interp(self.matmul_by_size, max(size, 1.0), self.matmul_flops)

    def copy_at(self, nbytes: float) -> float:
        """Memory-bound bytes/s on tensors of ``nbytes`` (``copy_by_size``, else the peak)."""
        return _interp(self.copy_by_size, max(nbytes, 1.0), self.copy_bandwidth)

    def host_share(self, world: int) -> float:
        """How much slower a rank computes when ``world`` ranks run (CPU oversubscription).

        ``max(1, ranks on a node / cores)``; 1 when ``cores`` is 0 (a device per rank).
        """
        if self.cores <= 0:
            return 1.0
        local = min(world, self.ranks_per_node) if self.ranks_per_node else world
        return max(1.0, local / self.cores)

    def __post_init__(self) -> None:
        if not self.links:
            raise ValueError("DeviceSpec.links: give at least one Link")
        for f in ("memory", "matmul_flops", "copy_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"DeviceSpec.{f} must be positive, got {getattr(self, f)!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"DeviceSpec.overlap must be in [0, 1], got {self.overlap!r}")
        for f in ("cores", "ranks_per_node"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DeviceSpec.{f} must be an int >= 0, got {v!r}")

    def link(self, span: int) -> Link:
        """The tier a group spanning ``span`` consecutive ranks uses."""
        for lk in self.links:
            if lk.ranks == 0 or span <= lk.ranks:
                return lk
        return self.links[-1]

    def all_reduce(self, nbytes: float, n: int, span: int) -> float:
        """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        lk = self.link(span)
        return 2 * (n - 1) / n * nbytes / lk.bandwidth + 2 * (n - 1) * lk.latency + lk.call_latency

    def all_gather(self, nbytes: float, n: int, span: int) -> float:
        """Seconds for a ring all-gather (or reduce-scatter) whose full size is ``nbytes``."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        lk = self.link(span)
        return (n - 1) / n * nbytes / lk.bandwidth + (n - 1) * lk.latency + lk.call_latency

    def send(self, nbytes: float, span: int) -> float:
        """Seconds for a point-to-point send of ``nbytes`` (pipeline stages)."""
        if nbytes <= 0:
            return 0.0
        lk = self.link(span)
        return nbytes / lk.bandwidth + lk.latency + lk.call_latency


@dataclasses.dataclass
class ModelProfile:
    """What `profile_model` counted (per sample: batch 1 at ``seq_len``).

    Attributes:
        seq_len: Tokens per sample.
        hidden: Width of the residual stream.
        vocab: Output vocabulary (last dim of the logits).
        params: ``(name, numel, bytes per element, trainable)`` per parameter, tied
            weights once.
        fwd_flops: Matmul FLOPs of one forward (with the loss).
        bwd_flops: Matmul FLOPs of one backward.
        block_fwd_flops: Forward FLOPs inside the transformer blocks (recomputed
            under activation checkpointing).
        ew_bytes: Bytes read and written by non-matmul ops in one forward, by class.
        block_ew_bytes: The part of ``ew_bytes`` inside the blocks, by class.
        n_ops: Torch function calls in one forward.
        block_ops: The part of ``n_ops`` inside the blocks.
        n_nodes: Autograd nodes that one backward runs (gradient accumulators
            included).
        act: Bytes saved for backward, by class (``"seq"``: residual-stream tensors,
            divided by tp only with sequence parallelism; ``"gathered"``: inputs of
            column-parallel linears, never divided; ``"vocab"``: logits-sized, never
            divided; ``"inner"``: divided by tp).
        block_act: The part of ``act`` saved inside blocks, by class.
        n_blocks: Transformer blocks (elements of the largest ``nn.ModuleList``).
        block_input_bytes: Bytes of one block's input (what checkpointing keeps).
        block_param_numel: Parameters of the largest block (FSDP's unsharded group).
        n_row: Row-parallel linears (one activation all-reduce each in forward).
        n_col_groups: Distinct inputs of column-parallel linears (one input-gradient
            all-reduce each in backward).
        vocab_parallel_embedding: Whether the token embedding is vocabulary-parallel.
        blocks_name: Qualified name of the blocks' ``nn.ModuleList``.
        matmuls: One ``(batch, m, k, n, weight, in_block)`` per forward matmul at
            batch 1: ``batch`` independent ``(m, k) x (k, n)`` products, ``weight``
            the parameter name of a linear layer's weight (``""`` for a product of
            two activations, e.g. attention scores), ``in_block`` whether it runs
            inside a transformer block.
        ew_count: Non-matmul ops with a floating-point output in one forward.
    """

    seq_len: int
    hidden: int
    vocab: int
    params: list[tuple[str, int, int, bool]]
    fwd_flops: float
    bwd_flops: float
    block_fwd_flops: float
    ew_bytes: dict[str, float]
    block_ew_bytes: dict[str, float]
    n_ops: int
    block_ops: int
    act: dict[str, float]
    block_act: dict[str, float]
    n_blocks: int
    block_input_bytes: float
    block_param_numel: int
    n_row: int
    n_col_groups: int
    vocab_parallel_embedding: bool
    blocks_name: str = ""
    matmuls: list[tuple[int, int, int, int, str, bool]] = dataclasses.field(default_factory=list)
    ew_count: int = 0
    n_nodes: int = 0
    model: nn.Module = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]
    plan_model: nn.Module = dataclasses.field(repr=False, default=None)  # type: ignore[assignment]
    _tp_cache: dict = dataclasses.field(repr=False, default_factory=dict)

    @property
    def num_params(self) -> int:
        """Parameter count (tied weights once)."""
        return sum(n for _, n, _, _ in self.params)

    def tp_sharded(self, tp: int, fsdp: bool) -> dict[str, bool]:
        """Parameter name -> whether the automatic plan shards it over ``tp`` ranks."""
        key = (tp, fsdp)
        if key not in self._tp_cache:
            self._tp_cache[key] = _tp_sharded(self, tp, fsdp)
        return self._tp_cache[key]

    def tp_local_sums(self, tp: int, fsdp: bool) -> tuple[float, float, float, float]:
        """``(param bytes, trainable bytes, trainable numel, numel)`` of one tp rank."""
        key = ("sums", tp, fsdp)
        if key not in self._tp_cache:
            sharded = self.tp_sharded(tp, fsdp)
            pb = gb = nt = nn_ = 0.0
            for name, numel, elt, trainable in self.params:
                local = numel / tp if sharded.get(name) else numel
                pb += local * elt
                nn_ += local
                if trainable:
                    gb += local * elt
                    nt += local
            self._tp_cache[key] = (pb, gb, nt, nn_)
        return self._tp_cache[key]

    def valid_tp(self, tp: int) -> bool:
        """Whether ``tp`` divides the heads/width so that the plan shards every block."""
        if tp == 1:
            return True
        if self.hidden % tp:
            return False
        sharded = self.tp_sharded(tp, False)
        # every block shards its matmuls: as many sharded weights as at tp = 2 (or more)
        base = sum(sharded.values())
        return base > 0 and base >= _n_tp_weights(self)


class _ShapeMesh:
    """The shape of a 1-dim ``"tp"`` mesh: all `default_sharding_plan` reads."""

    ndim = 1
    mesh_dim_names = ("tp",)

    def __init__(self, n: int) -> None:
        self._n = n

    def size(self, dim: int | None = None) -> int:
        return self._n


def _tp_sharded(profile: ModelProfile, tp: int, fsdp: bool) -> dict[str, bool]:
    out = {name: False for name, _, _, _ in profile.params}
    if tp == 1 or profile.model is None:
        return out
    plan = default_sharding_plan(profile.plan_model, _ShapeMesh(tp), "tp")  # type: ignore[arg-type]
    if not plan:
        return out
    keys = [(re.compile(k), v) for k, v in plan.get("parameter", {}).items()]
    # the plan was derived on one block: every block's names map to block 0's
    to_first = (
        re.compile("^" + re.escape(profile.blocks_name) + r"\.\d+\.")
        if profile.blocks_name
        else None
    )
    for name in out:
        probe = to_first.sub(profile.blocks_name + ".0.", name) if to_first else name
        for rx, placements in keys:
            if rx.fullmatch(probe):
                p = placements[0]
                strided = type(p).__name__ == "_StridedShard"
                out[name] = not isinstance(p, Replicate) and not (fsdp and strided)
                break
    return out


def _n_tp_weights(profile: ModelProfile) -> int:
    key = ("n_tp_weights",)
    if key not in profile._tp_cache:
        # the plan at the smallest tp that divides the width: what "every block" shards
        best = 0
        for t in (2, 3, 4, 5, 7):
            if profile.hidden % t == 0:
                best = sum(_tp_sharded(profile, t, False).values())
                break
        profile._tp_cache[key] = best
    return profile._tp_cache[key]


def _meta_copy(model: nn.Module) -> nn.Module:
    """``model`` deep-copied with its parameters and persistent buffers on ``meta``.

    Tied weights stay tied (one memo entry per tensor); non-persistent buffers (rotary
    tables) stay real, since nothing re-creates them.
    """
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    persistent = {id(v) for v in model.state_dict(keep_vars=True).values()}
    for b in model.buffers():
        if id(b) in persistent and id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _blocks(model: nn.Module) -> tuple[str, list[nn.Module]]:
    """The ``nn.ModuleList`` holding the most parameters (the transformer blocks)."""
    best, best_n, best_name = [], -1, ""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod):
            n = sum(p.numel() for p in mod.parameters())
            if n > best_n:
                best, best_n, best_name = list(mod), n, name
    return best_name, best


def _one_block_model(model: nn.Module, blocks_name: str, blocks: list[nn.Module]) -> nn.Module:
    """``model`` (a meta copy) with its block list cut to the first block when all blocks look alike.

    The automatic plan generalises layer indices to ``\\d+``, so deriving it on one
    block gives the same keys as on all of them, at a fraction of the cost.
    """

    def shapes(b: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, tuple(p.shape)) for n, p in b.named_parameters()]

    if len(blocks) < 2 or any(shapes(b) != shapes(blocks[0]) for b in blocks[1:]):
        return model
    parent_name, _, last = blocks_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, last, nn.ModuleList([blocks[0]]))  # the meta copy: ours to cut
    return model


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    lg = getattr(out, "logits", None)
    if isinstance(lg, torch.Tensor):
        return lg
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"profile_model: cannot find logits in the model's output ({type(out).__name__}); "
        "pass loss_fn=fn(output, batch) returning a scalar"
    )


_MATMUL_FUNCS = {
    F.linear,
    torch.matmul,
    torch.bmm,
    torch.mm,
    torch.addmm,
    torch.baddbmm,
    torch.einsum,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.Tensor.bmm,
    torch.Tensor.mm,
    F.scaled_dot_product_attention,
    F.embedding,
}
_SKIP_FUNCS = {"size", "dim", "__get__", "__getattribute__", "__len__", "numel", "stride"}


_VIEW_FNS = (
    "TBackward0",
    "ViewBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "AliasBackward0",
    "UnsqueezeBackward0",
    "ReshapeAliasBackward0",
    "ToCopyBackward0",
)


def is_parameter_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view (transpose, reshape, cast) of one.

    Autograd saves weights (``weight.t()`` for ``addmm``) next to activations;
    activation accounting leaves them out (they are counted as parameters).
    """
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEW_FNS:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        fn = nxt[0] if nxt else None
    return fn is not None and type(fn).__name__ == "AccumulateGrad"


def _storage_key(t: torch.Tensor) -> Any:
    """Identify ``t``'s storage on the meta device (where there are no addresses).

    A view (reshape, transpose, ...) of the same size as its base shares the base's
    storage: both map to the autograd node that made the base. Tensors outside
    autograd are their own key.
    """
    fn = t.grad_fn
    if fn is None:
        return ("tensor", id(t))
    views = set(_VIEW_FNS) - {"ToCopyBackward0"} | {"UnsafeViewBackward0"}
    while type(fn).__name__ in views:
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if not nxt:
            break
        fn = nxt[0]
    return ("node", id(fn), t.numel(), t.dtype)


def _classify(t: torch.Tensor, hidden: int, vocab: int, tokens: int) -> str:
    if t.ndim >= 1 and t.shape[-1] == vocab and t.numel() >= tokens * vocab and vocab != hidden:
        return "vocab"
    if t.ndim >= 2 and t.shape[-1] == hidden and t.numel() == tokens * hidden:
        return "seq"
    return "inner"


def _count_nodes(t: torch.Tensor) -> int:
    """Autograd nodes reachable from ``t`` (what its backward runs)."""
    seen: set[int] = set()
    todo = [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        todo.extend(f for f, _ in fn.next_functions)
    return len(seen)


def _record_matmul(
    func: Any,
    args: tuple,
    kwargs: dict,
    out: Any,
    names: dict[int, str],
    in_block: bool,
    into: list[tuple[int, int, int, int, str, bool]],
) -> None:
    """Append ``(batch, m, k, n, weight name or "", in_block)`` for one matmul call."""
    if func is F.embedding or func is torch.einsum:
        return  # a gather; einsum: counted by FLOPs only
    if func is F.scaled_dot_product_attention:
        q, k = args[0], args[1]
        b = q.numel() // (q.shape[-1] * q.shape[-2])
        t, d, s_ = q.shape[-2], q.shape[-1], k.shape[-2]
        into += [(b, t, d, s_, "", in_block), (b, t, s_, d, "", in_block)]
        return
    if func is F.linear:
        x = args[0]
        w = args[1] if len(args) > 1 else kwargs["weight"]
        k = x.shape[-1]
        into.append((1, x.numel() // max(k, 1), k, w.shape[0], names.get(id(w), ""), in_block))
        return
    if func in (torch.addmm, torch.baddbmm):
        a, b = args[1], args[2]
    elif func is torch.Tensor.__rmatmul__:
        b, a = args[0], args[1]
    else:
        a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return
    if a.ndim < 2 or b.ndim < 2 or not isinstance(out, torch.Tensor):
        return
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = out.numel() // max(m * n, 1)
    into.append((batch, m, k, n, names.get(id(b), ""), in_block))


def profile_model(
    model: nn.Module,
    seq_len: int,
    *,
    input_fn: Callable[[int, int], Any] | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> ModelProfile:
    """Count ``model`` on the meta device (one forward + backward at batch 1).

    The model itself is not touched: a copy with meta parameters runs.

    Args:
        model: A plain (not yet parallelized) module; any device, meta included.
        seq_len: Tokens per sample.
        input_fn: ``(batch, seq_len) -> inputs`` on the meta device: a tensor or a tuple
            of positional arguments, or a dict of keyword arguments. Default: token ids
            ``[batch, seq_len]`` (``torch.long``), the first positional argument.
        loss_fn: ``(output, inputs) -> scalar loss``. Default: cross-entropy of the
            logits (the output, its ``logits`` attribute or key, or its first element)
            against token ids.

    Returns:
        The `ModelProfile`.
    """
    from torch.autograd.graph import saved_tensors_hooks
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode

    meta = _meta_copy(model)
    meta.train()
    blocks_name, blocks = _blocks(meta)
    block_ids = {id(b): i for i, b in enumerate(blocks)}
    modules = dict(meta.named_modules())
    names = {id(m): n for n, m in modules.items()}

    # parameters (tied once)
    seen: set[int] = set()
    params = []
    for name, p in meta.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params.append((name, p.numel(), p.element_size(), p.requires_grad))
    emb = [m for m in meta.modules() if isinstance(m, nn.Embedding)]
    hidden = emb[0].embedding_dim if emb else 0
    vocab = emb[0].num_embeddings if emb else 0

    if input_fn is None:

        def input_fn(b: int, t: int) -> Any:
            return torch.zeros(b, t, dtype=torch.long, device="meta")

    inputs = input_fn(1, seq_len)

    def call(inp: Any) -> Any:
        if isinstance(inp, dict):
            return meta(**inp)
        if isinstance(inp, tuple):
            return meta(*inp)
        return meta(inp)

    def default_loss(out: Any, inp: Any) -> torch.Tensor:
        logits = _logits(out)
        tgt = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))

    loss_fn = loss_fn or default_loss

    # which block / module is running (for attributing saved tensors and ops)
    stack: list[nn.Module] = []
    handles = []

    def push(mod: nn.Module, args: Any) -> None:
        stack.append(mod)

    def pop(mod: nn.Module, args: Any, out: Any) -> None:
        stack.pop()

    for m in meta.modules():
        handles.append(m.register_forward_pre_hook(push))
        handles.append(m.register_forward_hook(pop))

    def current_block() -> int | None:
        for m in reversed(stack):
            if id(m) in block_ids:
                return block_ids[id(m)]
        return None

    tokens = seq_len
    counts = {
        "act": {"seq": 0.0, "gathered": 0.0, "vocab": 0.0, "inner": 0.0},
        "block_act": {"seq": 0.0, "gathered": 0.0, "vocab": 0.0, "inner": 0.0},
        "ew": {"seq": 0.0, "vocab": 0.0, "inner": 0.0},
        "block_ew": {"seq": 0.0, "vocab": 0.0, "inner": 0.0},
    }
    ops = [0, 0]
    ew_count = [0]
    matmuls: list[tuple[int, int, int, int, str, bool]] = []
    param_names = {id(p): n for n, p in meta.named_parameters()}
    saved: dict[int, torch.Tensor] = {}
    saved_keys: set[Any] = set()
    col_inputs: set[int] = set()
    row_mods: set[int] = set()
    block_input = [0.0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or is_parameter_view(t):
            return t
        owner = stack[-1] if stack else None
        key = _storage_key(t)
        if key in saved_keys:
            return t
        saved_keys.add(key)
        saved[id(t)] = t  # keep alive: ids stay unique
        nbytes = t.numel() * t.element_size()
        leaf = names.get(id(owner), "").rsplit(".", 1)[-1].lower() if owner is not None else ""
        cls = _classify(t, hidden, vocab, tokens)
        if isinstance(owner, nn.Linear) and leaf in ROWWISE and cls != "vocab":
            cls = "inner"
        elif isinstance(owner, nn.Linear) and leaf in COLWISE and cls == "seq":
            cls = "gathered"
            col_inputs.add(key)
        counts["act"][cls] += nbytes
        if current_block() is not None:
            counts["block_act"][cls] += nbytes
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    class _Ops(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            fname = getattr(func, "__name__", "")
            if fname in _SKIP_FUNCS or fname.startswith("_"):
                return out
            ops[0] += 1
            in_block = current_block() is not None
            if in_block:
                ops[1] += 1
            if func in _MATMUL_FUNCS:
                _record_matmul(func, args, kwargs, out, param_names, in_block, matmuls)
                return out
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    ew_count[0] += 1
                    cls = _classify(t, hidden, vocab, tokens)
                    cls = "inner" if cls == "gathered" else cls
                    # read the input(s) and write the output: about twice the output
                    nbytes = 2.0 * t.numel() * t.element_size()
                    counts["ew"][cls] += nbytes
                    if in_block:
                        counts["block_ew"][cls] += nbytes
            return out

    def block_in_hook(mod, args):
        if args and isinstance(args[0], torch.Tensor) and block_input[0] == 0:
            block_input[0] = args[0].numel() * args[0].element_size()

    if blocks:
        handles.append(blocks[0].register_forward_pre_hook(block_in_hook))
    for name, m in modules.items():
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1].lower() in ROWWISE:
            row_mods.add(id(m))

    flops_fwd = FlopCounterMode(display=False)
    try:
        with flops_fwd, saved_tensors_hooks(pack, unpack), _Ops():
            out = call(inputs)
            loss = loss_fn(out, inputs)
        block_flops = 0.0
        counts_by_mod = flops_fwd.get_flop_counts()
        for mod_name, table in counts_by_mod.items():
            # FlopCounterMode names modules "Global", "<Class>.<fqn>" ...
            tail = mod_name.split(".", 1)[1] if "." in mod_name else ""
            if blocks_name and re.fullmatch(re.escape(blocks_name) + r"\.\d+", tail):
                block_flops += sum(table.values())
        fwd = float(flops_fwd.get_total_flops())
        flops_bwd = FlopCounterMode(display=False)
        with flops_bwd:
            n_nodes = _count_nodes(loss)
            loss.backward()
        bwd = float(flops_bwd.get_total_flops())
    finally:
        for h in handles:
            h.remove()
    n_row = sum(
        1
        for n, m in modules.items()
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1].lower() in ROWWISE
    )
    vpe = any(
        isinstance(m, nn.Embedding) and not re.search(r"(^|_)(wpe|pos|position)", n.lower())
        for n, m in modules.items()
    )
    block_param = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    return ModelProfile(
        seq_len=seq_len,
        hidden=hidden,
        vocab=vocab,
        params=params,
        fwd_flops=fwd,
        bwd_flops=bwd,
        block_fwd_flops=block_flops,
        ew_bytes=counts["ew"],
        block_ew_bytes=counts["block_ew"],
        n_ops=ops[0],
        block_ops=ops[1],
        act=counts["act"],
        block_act=counts["block_act"],
        n_blocks=len(blocks),
        block_input_bytes=block_input[0],
        block_param_numel=block_param,
        n_row=n_row,
        n_col_groups=len(col_inputs),
        vocab_parallel_embedding=vpe,
        blocks_name=blocks_name,
        matmuls=matmuls,
        ew_count=ew_count[0],
        n_nodes=n_nodes,
        model=meta,
        plan_model=_one_block_model(meta, blocks_name, blocks),
    )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one layout.

    Attributes:
        layout: The `Layout`.
        accumulation: Micro-batches per step on each rank (pipeline micro-batches
            with ``pp > 1``).
        memory: Per-rank bytes (the busiest pipeline stage with ``pp > 1``):
            ``params``, ``grads``, ``optimizer``, ``engine`` (data-parallel buffers
            kept between steps: none for vescale's engines), ``activations`` (what
            autograd keeps from the end of forward to backward: saved tensors, or with
            checkpointing the blocks' inputs; 1F1B keeps up to ``pp`` micro-batches),
            ``recompute`` (checkpointing: one block's saved tensors while it is
            recomputed) and ``total``.
        time: Seconds per step: ``compute`` (matmuls), ``memory_bound``,
            ``overhead`` (per-op host time), ``tp_comm``, ``dp_comm`` (all of it),
            ``dp_exposed`` (not hidden by overlap), ``optimizer``, ``pp_comm`` (sends
            between stages), ``pp_bubble`` (the pipeline's idle time) and ``total``.
        fits: ``memory["total"]`` is at most the device memory.
        traffic: Bytes one rank sends per step: ``pp`` (point-to-point between
            stages), ``tp``, ``dp`` (ring collectives, ``(n-1)/n`` of the size per
            all-gather or reduce-scatter, twice that per all-reduce).
    """

    layout: Layout
    accumulation: int
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool
    traffic: dict[str, float] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """One line: layout, step time and memory."""
        m, t = self.memory, self.time
        pp = (
            f", pp {t['pp_comm'] * 1e3:.1f} + bubble {t['pp_bubble'] * 1e3:.1f}"
            if self.layout.pp > 1
            else ""
        )
        return (
            f"{self.layout.describe():<28} step {t['total'] * 1e3:9.2f} ms "
            f"(compute {t['compute'] * 1e3:.1f}, mem-bound {t['memory_bound'] * 1e3:.1f}, "
            f"overhead {t['overhead'] * 1e3:.1f}, tp {t['tp_comm'] * 1e3:.1f}, "
            f"dp {t['dp_exposed'] * 1e3:.1f}/{t['dp_comm'] * 1e3:.1f}, "
            f"optim {t['optimizer'] * 1e3:.1f}{pp})  memory {m['total'] / 2**20:9.1f} MiB "
            f"(state {(m['params'] + m['grads'] + m['optimizer']) / 2**20:.1f}, "
            f"act {m['activations'] / 2**20:.1f}, engine {m['engine'] / 2**20:.1f})"
            + ("" if self.fits else "  DOES NOT FIT")
            + ("  (predicted only: apply with pipeline_parallelize)" if self.layout.pp > 1 else "")
        )


def _state_split(profile: ModelProfile, tp: int, fsdp: bool) -> dict[str, tuple[float, ...]]:
    """``{"block": sums, "outside": sums}`` of `ModelProfile.tp_local_sums` (one tp rank)."""
    key = ("split", tp, fsdp)
    if key not in profile._tp_cache:
        sharded = profile.tp_sharded(tp, fsdp)
        prefix = profile.blocks_name + "." if profile.blocks_name else None
        out = {"block": [0.0] * 4, "outside": [0.0] * 4}
        for name, numel, elt, trainable in profile.params:
            part = out["block" if prefix and name.startswith(prefix) else "outside"]
            local = numel / tp if sharded.get(name) else numel
            part[0] += local * elt
            part[3] += local
            if trainable:
                part[1] += local * elt
                part[2] += local
        profile._tp_cache[key] = {k: tuple(v) for k, v in out.items()}
    return profile._tp_cache[key]


def _n_norm_params(profile: ModelProfile) -> int:
    """Parameters of normalization layers (``*Norm*`` modules) inside the blocks."""
    key = ("norms",)
    if key not in profile._tp_cache:
        n = 0
        if profile.model is not None and profile.blocks_name:
            blocks = profile.model.get_submodule(profile.blocks_name)
            for m in blocks.modules():
                if "norm" in type(m).__name__.lower():
                    n += sum(1 for _ in m.parameters(recurse=False))
        profile._tp_cache[key] = n
    return profile._tp_cache[key]


def _matmul_seconds(
    profile: ModelProfile, device: DeviceSpec, tp: int, mb: int, fsdp: bool
) -> tuple[float, float]:
    """``(forward + backward of every matmul, forward of the blocks' matmuls)`` in
    seconds for one micro-batch on one rank, each matmul at the throughput of its size."""
    key = ("mm", tp, mb, fsdp, device.matmul_by_size, device.matmul_flops)
    if key in profile._tp_cache:
        return profile._tp_cache[key]
    sharded = profile.tp_sharded(tp, fsdp)
    total = block = recorded = 0.0
    for b, m, k, n, w, inb in profile.matmuls:
        f1 = 2.0 * b * m * k * n
        recorded += f1
        div = tp if (sharded.get(w, False) if w else inb) else 1
        # a linear's rows grow with the micro-batch; a batched product's count does
        size = (m * mb * k * n / div) ** (1 / 3) if w else (m * k * n) ** (1 / 3)
        t = f1 * mb / div / device.flops_at(size)
        total += 3.0 * t  # backward: two products of the same three sizes
        if inb:
            block += t
    rest = max(profile.fwd_flops - recorded, 0.0)  # products not recorded (einsum)
    if rest:
        t = rest * mb / tp / device.flops_at(max(profile.hidden / tp, 1.0))
        total += 3.0 * t
    profile._tp_cache[key] = (total, block)
    return total, block


def estimate(
    profile: ModelProfile,
    layout: Layout,
    device: DeviceSpec,
    global_batch: int,
    *,
    optimizer_state_per_param: float = 2.0,
    optimizer_bytes_per_element: float = 28.0,
    ddp_bucket_bytes: float = 25 * 2**20,
) -> Estimate:
    """Predict per-rank memory and step time of ``layout``.

    Args:
        profile: From `profile_model`.
        layout: The candidate.
        device: Device constants (`probe_device` or given).
        global_batch: Samples per optimizer step over all ranks; must divide by
            ``layout.dp_degree * layout.micro_batch``.
        optimizer_state_per_param: Optimizer state per parameter, in parameter-sized
            tensors (Adam/AdamW: 2; SGD with momentum: 1).
        optimizer_bytes_per_element: Bytes the optimizer step reads and writes per
            parameter element (AdamW in fp32: 28).
        ddp_bucket_bytes: DDP's gradient bucket size (one all-reduce per bucket).

    Raises:
        ValueError: ``global_batch`` does not divide as required, or ``pp`` exceeds
            the transformer blocks.
    """
    lay = layout
    if global_batch % (lay.dp_degree * lay.micro_batch):
        raise ValueError(
            f"global_batch {global_batch} does not divide by dp*fsdp ({lay.dp_degree}) x "
            f"micro_batch ({lay.micro_batch})"
        )
    pp = lay.pp
    if pp > 1 and pp > profile.n_blocks:
        raise ValueError(
            f"Layout.pp {pp}: the model has {profile.n_blocks} transformer block(s) to split"
        )
    accum = global_batch // (lay.dp_degree * lay.micro_batch)
    tp, mb, sp = lay.tp, lay.micro_batch, lay.sequence_parallel
    fsdp_on = lay.fsdp > 1
    ac = lay.activation_checkpointing and profile.n_blocks > 0
    elt = profile.params[0][2] if profile.params else 4
    # a pipeline stage holds 1/pp of the blocks; the busiest stage also everything
    # outside them (embeddings on the first, final norm, head and loss on the last)
    wb = 1.0 / pp

    # ---- per-rank state
    split = _state_split(profile, tp, fsdp_on)
    blk, out_ = split["block"], split["outside"]
    p_bytes = (blk[0] * wb + out_[0]) / lay.fsdp
    g_bytes = (blk[1] * wb + out_[1]) / lay.fsdp
    n_local = (blk[2] * wb + out_[2]) / lay.fsdp
    opt_bytes = g_bytes * optimizer_state_per_param
    # FSDP reshards every group, the root included, after backward (measured: no
    # unsharded buffer is left between steps); DDP's buckets are the gradients
    engine = 0.0

    # ---- activations (per micro-batch, per rank)
    a, ba = profile.act, profile.block_act
    seq_div = tp if sp else 1

    def act_bytes(part: dict[str, float]) -> float:
        return part["seq"] / seq_div + part["gathered"] + part["vocab"] + part["inner"] / tp

    full = act_bytes(a)
    blocks_act = act_bytes(ba)
    outside = full - blocks_act
    recompute = 0.0
    if ac:
        recompute = blocks_act / profile.n_blocks * mb  # one block, during its backward
        kept_blocks = profile.n_blocks * profile.block_input_bytes / seq_div
    else:
        kept_blocks = blocks_act
    if pp > 1:
        # 1F1B: the first stage keeps min(m, pp) micro-batches of its blocks, the last
        # one micro-batch of its blocks and the head
        acts = max(min(accum, pp) * kept_blocks * wb, kept_blocks * wb + outside) * mb
    else:
        acts = (kept_blocks + outside) * mb

    memory = {
        "params": p_bytes,
        "grads": g_bytes,
        "optimizer": opt_bytes,
        "engine": engine,
        "activations": acts,
        "recompute": recompute,
    }
    memory["total"] = sum(memory.values())

    # ---- time of one micro-batch: (inside the blocks, outside them)
    share = device.host_share(lay.world)
    mm_all, mm_block_fwd = _matmul_seconds(profile, device, tp, mb, fsdp_on)
    mm_block = 3.0 * mm_block_fwd + (mm_block_fwd if ac else 0.0)
    compute = (mm_block, mm_all - 3.0 * mm_block_fwd)
    ew, bew = profile.ew_bytes, profile.block_ew_bytes

    def ew_part(part: dict[str, float]) -> float:
        return part["seq"] / seq_div + part["vocab"] + part["inner"] / tp

    bw = device.copy_at(ew_part(ew) * mb / max(profile.ew_count, 1))
    ew_b = ew_part(bew)
    memory_bound = (
        (3.0 * ew_b + (ew_b if ac else 0.0)) * mb / bw,
        3.0 * (ew_part(ew) - ew_b) * mb / bw,  # backward ~ 2x forward
    )
    per_op = device.dtensor_op_overhead if tp > 1 else device.op_overhead
    per_node = device.dtensor_node_overhead if tp > 1 else device.node_overhead
    # backward nodes split like the forward calls
    nodes_block = profile.n_nodes * profile.block_ops / max(profile.n_ops, 1)
    overhead = (
        profile.block_ops * (2 if ac else 1) * per_op + nodes_block * per_node,  # recompute
        (profile.n_ops - profile.block_ops) * per_op + (profile.n_nodes - nodes_block) * per_node,
    )

    tp_block = tp_out = 0.0
    tp_bytes = 0.0
    if tp > 1:
        act_b = mb * profile.seq_len * profile.hidden * elt
        n_fwd = profile.n_row * (2 if ac else 1)
        n_bwd = profile.n_col_groups
        dcall = device.dtensor_collective_overhead  # DTensor issues every TP collective
        if sp:
            # each all-reduce becomes a reduce-scatter and an all-gather (same ring
            # steps, twice the calls), and the norms' weight gradients, computed from
            # sequence shards, are all-reduced
            per = 2 * (device.all_gather(act_b, tp, tp) + dcall)
            norms = _n_norm_params(profile) * (device.all_reduce(4.0, tp, tp) + dcall)
        else:
            per = device.all_reduce(act_b, tp, tp) + dcall
            norms = 0.0
        tp_block = (n_fwd + n_bwd) * per + norms
        logits = mb * profile.seq_len * profile.vocab * elt
        vpe = 1 if profile.vocab_parallel_embedding else 0
        tp_out = vpe * (device.all_reduce(act_b, tp, tp) + dcall) + (
            device.all_gather(logits, tp, tp) + dcall
        )
        ring = (tp - 1) / tp
        tp_bytes = ((n_fwd + n_bwd + vpe) * 2 * act_b + logits) * ring * accum
    tp_comm = (tp_block, tp_out)

    def stage(part: tuple[float, float]) -> float:
        return part[0] * wb + part[1]

    # ---- pipeline: the busiest stage runs m + pp - 1 slots (1F1B), each with a send
    # of the boundary activations forward and of their gradient backward
    pp_p2p = pp_bytes = 0.0
    if pp > 1:
        boundary = mb * profile.seq_len * profile.hidden * elt
        span = lay.world // pp
        pp_p2p = 2 * device.send(boundary, span + 1)
        pp_bytes = 2 * boundary * accum

    # ---- data-parallel communication (the stage's parameters), per collective call:
    # FSDP one all-gather in forward, one in backward and a reduce-scatter per group
    # (each block and the root); DDP one all-reduce per bucket
    grad_tp_local = g_bytes * lay.fsdp  # trainable bytes of this tp rank, unsharded
    param_tp_local = p_bytes * lay.fsdp
    dp_per_step = dp_per_micro = dp_bytes = 0.0
    if fsdp_on:
        n = lay.fsdp
        span = lay.fsdp * tp
        groups = max(1, round(profile.n_blocks * wb)) + 1
        lk = device.link(span)
        call = (n - 1) * lk.latency + lk.call_latency
        ag = (n - 1) / n * param_tp_local / lk.bandwidth + groups * call
        rs = (n - 1) / n * grad_tp_local / lk.bandwidth + groups * call
        dp_per_micro = 2 * ag + rs
        dp_bytes = (n - 1) / n * (2 * param_tp_local + grad_tp_local) * accum
        if lay.dp > 1:
            dp_per_micro += device.all_reduce(g_bytes, lay.dp, lay.world)
            dp_bytes += 2 * (lay.dp - 1) / lay.dp * g_bytes * accum
    elif lay.dp > 1:
        n = lay.dp
        lk = device.link(lay.world)
        buckets = max(1, math.ceil(grad_tp_local / ddp_bucket_bytes))
        dp_per_step = device.all_reduce(grad_tp_local, n, lay.world) + (
            (buckets - 1) * (2 * (n - 1) * lk.latency + lk.call_latency)
        )
        dp_bytes = 2 * (n - 1) / n * grad_tp_local

    micro_host = (stage(compute) + stage(memory_bound) + stage(overhead)) * share
    micro = micro_host + stage(tp_comm)
    dp_comm = dp_per_step + accum * dp_per_micro
    hidden_by = device.overlap * accum * micro
    dp_exposed = max(dp_comm - hidden_by, 0.0) if dp_comm else 0.0
    n_param_tensors = len(profile.params)
    if pp > 1:
        if ("n_block_params",) not in profile._tp_cache:
            prefix = profile.blocks_name + "."
            profile._tp_cache[("n_block_params",)] = sum(
                1 for n_, *_ in profile.params if n_.startswith(prefix)
            )
        n_blk = profile._tp_cache[("n_block_params",)]
        n_param_tensors = round(n_blk * wb) + (len(profile.params) - n_blk)
    dtensor_params = tp > 1 or fsdp_on
    per_param = (
        device.optimizer_dtensor_param_overhead
        if dtensor_params
        else device.optimizer_param_overhead
    )
    optimizer = (
        n_local * optimizer_bytes_per_element / device.copy_bandwidth + n_param_tensors * per_param
    ) * share
    t = {
        "compute": accum * stage(compute) * share,
        "memory_bound": accum * stage(memory_bound) * share,
        "overhead": accum * stage(overhead) * share,
        "tp_comm": accum * stage(tp_comm),
        "dp_comm": dp_comm,
        "dp_exposed": dp_exposed,
        "optimizer": optimizer,
        "pp_comm": accum * pp_p2p,
        "pp_bubble": (pp - 1) * (micro + pp_p2p),
    }
    t["total"] = (
        t["compute"]
        + t["memory_bound"]
        + t["overhead"]
        + t["tp_comm"]
        + dp_exposed
        + optimizer
        + t["pp_comm"]
        + t["pp_bubble"]
    )
    traffic = {"pp": pp_bytes, "tp": tp_bytes, "dp": dp_bytes}
    return Estimate(lay, accum, memory, t, memory["total"] <= device.memory, traffic)


def _timed(
    fn: Callable[[], Any],
    reps: int,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per call of ``fn``: the fastest of ``repeats`` batches of ``reps`` calls
    after a warm-up batch (the minimum filters out time lost to other processes)."""
    for _ in range(reps):
        fn()
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        for _ in range(reps):
            fn()
        best = min(best, (clock() - t0) / reps)
    return best


def _host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else ``os.cpu_count``)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _adamw_step_time(
    params: list[torch.Tensor], sync: Callable[[], None], timed: Callable[..., float]
) -> float:
    """Seconds per parameter tensor of one AdamW step (one tensor at a time)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)

    def step() -> None:
        opt.step()
        sync()

    return timed(step, 1) / len(params)


def probe_device(
    memory: float | None = None,
    *,
    group: Any = None,
    matmul_sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024),
    copy_sizes: tuple[int, ...] = (2**16, 2**20),
    copy_mb: float = 32.0,
    collective_mb: float = 8.0,
    overlap: float | None = None,
    repeats: int = 5,
) -> DeviceSpec:
    """Measure the device constants on this process group (a collective; ~2-5 s).

    Measured: matmul FLOP/s by square size and memory-bound bandwidth by tensor size
    (both net of the host time of an empty call, which the per-op figure counts), the
    host time per forward call and per backward autograd node of a chain of small layers
    on plain tensors and on DTensors, the time per parameter tensor of an AdamW step (plain and
    DTensor), and of the whole group the all-reduce bandwidth, the latency per ring
    step and per call (a 4-byte all-reduce and all-gather) and what a DTensor
    redistribution adds to a collective. Every
    figure is the fastest of several short timed batches after a warm-up (``repeats``
    for the collectives, four times as many, at least 20, for the per-device figures),
    and on CPU the per-device figures are the process's CPU time, so time lost to
    other processes on a shared machine does not enter.

    On CPU, when the ranks of a node share its cores, one rank measures the per-device
    figures while the others wait (alone, as a rank that has a core to itself), and
    `DeviceSpec.cores` / ``ranks_per_node`` tell `estimate` how much running all
    ranks at once stretches them. On GPUs every rank measures its own device and the
    slowest rank's figures are kept. Either way every rank returns the same
    `DeviceSpec`, so a search over it picks the same layout everywhere. Without a
    process group only the local figures are measured and the collective tier is a
    placeholder that no 1-rank layout uses.

    Args:
        memory: Bytes per device; default: the CUDA device's total memory, or the
            machine's memory divided by the ranks on it (CPU).
        group: The process group (default: the world).
        matmul_sizes: Square matmul sizes for the FLOP/s figures.
        copy_sizes: Tensor sizes in bytes for the small-tensor bandwidth figures.
        copy_mb: Tensor size for the large-tensor copy bandwidth.
        collective_mb: All-reduce size for the bandwidth (latency uses 4 bytes).
        overlap: Fraction of data-parallel communication hidden by compute; default
            ``0.0`` on CPU (gloo runs its collectives on the cores that compute) and
            ``0.8`` on CUDA.
        repeats: Timed batches per figure (the fastest is kept).
    """
    import os

    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if on else 1
    cuda = torch.cuda.is_available() and (
        not on or dist.get_backend(group) in ("nccl", "cuda:nccl")
    )
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = 0 if cuda else _host_cores()
    # CPU ranks sharing cores take no turns here: rank 0 measures alone
    turns = on and world > 1 and not cuda
    me = not turns or dist.get_rank(group) == 0

    # models for the host-overhead figures: a chain of small layers
    depth = 16
    chain = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(8, 8), nn.GELU()))).to(dev)
    inp = torch.randn(4, 8, device=dev)
    n_ops = 2 * depth + 1
    opt_params = [torch.randn(8, 8, device=dev) for _ in range(32)]
    dchain = dinp = None
    dparams: list[torch.Tensor] = []
    if on:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import distribute_module, distribute_tensor

        mesh = init_device_mesh(dev.type, (world,))
        dchain = distribute_module(copy.deepcopy(chain), mesh)
        dinp = distribute_tensor(inp, mesh, [Replicate()])
        dparams = [distribute_tensor(p, mesh, [Replicate()]) for p in opt_params]

    def fwd(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        sync()
        return out

    def step(model: nn.Module, x: torch.Tensor) -> None:
        model(x).sum().backward()
        sync()

    n_nodes = _count_nodes(chain(inp).sum())
    host_repeats = max(4 * repeats, 20)  # short windows: the fastest finds a quiet moment

    # per-device figures on CPU: the process's CPU time, which other processes taking
    # the cores do not inflate (on GPUs: wall time, synchronized)
    clock = time.perf_counter if cuda else time.process_time

    def timed(fn: Callable[[], Any], reps: int) -> float:
        return _timed(fn, reps, host_repeats, clock)

    figures: list[float] = []
    by_size: list[tuple[int, float]] = []
    copies: list[tuple[int, float]] = []
    if turns:
        dist.barrier(group=group)
    if me:
        # the host time of a call that computes nothing: the per-op overhead counts it,
        # so the throughput figures leave it out
        one = torch.ones(1, 1, device=dev)

        def nop() -> None:
            torch.mm(one, one)
            sync()

        t_call = timed(nop, 50)

        def net(t: float) -> float:
            return max(t - t_call, 0.1 * t)

        for size in matmul_sizes:
            a = torch.randn(size, size, device=dev)
            b = torch.randn(size, size, device=dev)

            def mm(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
                torch.mm(a, b)
                sync()

            t = net(timed(mm, max(1, 2**20 // size**2)))
            by_size.append((size, 2 * size**3 / t))
        for nbytes in (*copy_sizes, int(copy_mb * 2**20)):
            n = max(nbytes // 4, 1)
            x = torch.randn(n, device=dev)
            y = torch.empty_like(x)

            def cp(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
                torch.add(x, 1.0, out=y)
                sync()

            t = net(timed(cp, max(1, 2**20 // nbytes)))
            copies.append((n * 4, 2 * n * 4 / t))

        def host(model: nn.Module, x: torch.Tensor) -> tuple[float, float]:
            t_f = timed(lambda: fwd(model, x), 1)
            t_fb = timed(lambda: step(model, x), 1)
            return t_f / n_ops, max(t_fb - t_f, 0.0) / n_nodes

        t_op, t_node = host(chain, inp)
        t_dop, t_dnode = host(dchain, dinp) if dchain is not None else (t_op, t_node)
        t_opt = _adamw_step_time(opt_params, sync, timed)
        t_dopt = _adamw_step_time(dparams, sync, timed) if dparams else t_opt
        figures = [
            *(f for _, f in by_size),
            *(b for _, b in copies),
            t_op,
            t_dop,
            t_opt,
            t_dopt,
            t_node,
            t_dnode,
        ]
    else:
        by_size = [(s, 0.0) for s in matmul_sizes]
        copies = [(max(n // 4, 1) * 4, 0.0) for n in (*copy_sizes, int(copy_mb * 2**20))]
        figures = [0.0] * (len(by_size) + len(copies) + 6)
    k, c = len(by_size), len(copies)
    bw, lat, call, dcall = 1e12, 0.0, 0.0, 0.0
    if on and world > 1:
        from torch.distributed.tensor import DTensor, Partial

        big = torch.ones(int(collective_mb * 2**20 / 4), device=dev)
        small = torch.ones(1, device=dev)
        gathered = torch.empty(world, device=dev)

        def ar(t: torch.Tensor) -> Callable[[], None]:
            def f() -> None:
                dist.all_reduce(t, group=group)
                sync()

            return f

        def ag() -> None:
            dist.all_gather_into_tensor(gathered, small, group=group)
            sync()

        def dt_ar() -> None:
            DTensor.from_local(small, mesh, [Partial()]).redistribute(
                mesh, [Replicate()]
            ).to_local()
            sync()

        dist.barrier(group=group)
        t_small = _timed(ar(small), 20, repeats)
        t_ag = _timed(ag, 20, repeats)
        t_big = _timed(ar(big), 2, repeats)
        t_dt = _timed(dt_ar, 10, repeats) if group is None else t_small
        # an all-reduce is 2 (n-1) ring steps, an all-gather n-1, each call one launch:
        # t_ar = call + 2 (n-1) lat, t_ag = call + (n-1) lat
        lat = max(t_small - t_ag, 0.0) / (world - 1)
        call = max(t_ag - (world - 1) * lat, 0.0)
        dcall = max(t_dt - t_small, 0.0)
        nbytes = big.numel() * 4
        bw = 2 * (world - 1) / world * nbytes / max(t_big - t_small, 1e-9)
    if on:
        # rates as they are, times negated: MIN keeps the slowest rank's figures
        vals = [*figures[: k + c], *(-x for x in figures[k + c :]), bw, -lat, -call, -dcall]
        f = torch.tensor(vals, dtype=torch.float64, device=dev)
        if turns:
            src = 0 if group is None else dist.get_global_rank(group, 0)
            # rank 0's per-device figures; the collective figures of the slowest rank
            coll = f[-4:].clone()
            dist.all_reduce(coll, op=dist.ReduceOp.MIN, group=group)
            dist.broadcast(f, src=src, group=group)
            f[-4:] = coll
        else:
            dist.all_reduce(f, op=dist.ReduceOp.MIN, group=group)
        vals = f.cpu().tolist()
        figures = [*vals[: k + c], *(-x for x in vals[k + c : -4])]
        bw, lat, call, dcall = vals[-4], -vals[-3], -vals[-2], -vals[-1]
    by_size = [(s, figures[i]) for i, (s, _) in enumerate(by_size)]
    copies = [(s, figures[k + i]) for i, (s, _) in enumerate(copies)]
    t_op, t_dop, t_opt, t_dopt, t_node, t_dnode = figures[k + c : k + c + 6]
    if memory is None:
        if cuda:
            memory = float(torch.cuda.get_device_properties(dev).total_memory)
        else:
            memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / local_ranks
    return DeviceSpec(
        memory=memory,
        matmul_flops=max(f for _, f in by_size),
        copy_bandwidth=copies[-1][1],
        links=(Link(0, bw, lat, call),),
        op_overhead=t_op,
        dtensor_op_overhead=t_dop,
        node_overhead=t_node,
        dtensor_node_overhead=t_dnode,
        overlap=(0.8 if cuda else 0.0) if overlap is None else overlap,
        device_type=dev.type,
        matmul_by_size=tuple(by_size),
        copy_by_size=tuple(copies),
        optimizer_param_overhead=t_opt,
        optimizer_dtensor_param_overhead=t_dopt,
        dtensor_collective_overhead=dcall,
        cores=cores,
        ranks_per_node=local_ranks if not cuda else 0,
    )


class saved_activation_bytes:
    """Context manager measuring the bytes autograd saves for backward (real tensors).

    Counts every storage once (views of one tensor share it), DTensors by their local
    tensor, and leaves out parameters and views of them. ``with
    saved_activation_bytes() as m: loss = step(...)`` then ``m.bytes``.

    Args:
        model: A parallelized model whose forward installs its own saved-tensor hooks
            (``implicit_replication``, the default under tensor parallelism): those
            would hide its tensors from an outer hook, so the meter also enters,
            inside every forward of ``model``, a hook that counts what the model's hook
            packs.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.bytes = 0
        self._seen: set[tuple[int, int]] = set()
        self._hooks: Any = None
        self._model = model
        self._handles: list[Any] = []
        self._inner: list[Any] = []

    def count(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage too (once), e.g. a checkpointed block's kept input."""
        local = t.to_local() if hasattr(t, "to_local") else t
        st = local.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in self._seen and key[1] > 0:
            self._seen.add(key)
            self.bytes += key[1]

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not is_parameter_view(t):
            self.count(t)
        return t

    def _pre(self, mod: nn.Module, args: Any) -> None:
        from torch.autograd.graph import saved_tensors_hooks

        from vescale.dmodule import _compat

        top = _compat.top_saved_tensors_hooks()
        if top is None:
            ctx = saved_tensors_hooks(self._pack, lambda t: t)
        else:
            pack, unpack = top

            def chained(t: torch.Tensor) -> Any:
                self._pack(t)
                return pack(t)

            ctx = saved_tensors_hooks(chained, unpack)
        ctx.__enter__()
        self._inner.append(ctx)

    def _post(self, mod: nn.Module, args: Any, out: Any) -> None:
        if self._inner:
            self._inner.pop().__exit__(None, None, None)

    def __enter__(self) -> saved_activation_bytes:
        from torch.autograd.graph import saved_tensors_hooks

        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        if self._model is not None:
            # after the model's own pre-hooks (its hook is then the top one); ours exits first
            self._handles = [
                self._model.register_forward_pre_hook(self._pre),
                self._model.register_forward_hook(self._post, prepend=True, always_call=True),
            ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._hooks.__exit__(*exc)
