"""``DistributedOptimizer``: ZeRO-1/2 optimizer-state sharding over a data-parallel mesh dim."""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from vescale.dtensor import (
    distribute_tensor,
    drop_dim,
    from_local,
    lift_placements,
    redistribute,
    resolve_mesh_dim,
)
from vescale.dtensor.collectives import all_gather_uneven
from vescale.optim import _compat
from vescale.optim._clip import total_norm_of_locals
from vescale.optim._utils import (
    dim_label,
    local_of,
    normalize_param_groups,
    ragged_shard,
    sharded_mesh_dims,
)

__all__ = ["DistributedOptimizer", "ELEMENTWISE_OPTIMIZERS"]

#: torch optimizers whose update of each element depends only on that element's
#: gradient and state (plus scalars), so they can run on flat slices of parameters.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, n)
    for n in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
    )
    if hasattr(torch.optim, n)
)

#: Known optimizers that are *not* element-wise (they need whole parameters).
_STRUCTURED = tuple(
    getattr(torch.optim, n)
    for n in ("Muon", "LBFGS", "SparseAdam", "Adafactor")
    if hasattr(torch.optim, n)
)


def _check_optimizer_cls(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass, got {cls!r}")
    flag = getattr(cls, "_vescale_elementwise", None)
    if flag is True:
        return
    structured = issubclass(cls, _STRUCTURED) or flag is False
    if not structured and issubclass(cls, ELEMENTWISE_OPTIMIZERS):
        return
    why = (
        "its update needs whole parameters (matrix / factored / line-search state)"
        if structured
        else "it is not a known element-wise optimizer"
    )
    raise TypeError(
        f"DistributedOptimizer cannot shard {cls.__module__}.{cls.__qualname__}: {why}. "
        "It steps the inner optimizer on flat 1-D slices of every parameter, which is "
        "only correct for element-wise optimizers ("
        + ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
        + "). For Muon use vescale.optim.Muon, the structure-aware path that gathers "
        "each matrix to one rank; for other optimizers use them directly on the DTensor "
        "parameters. If your optimizer is element-wise, set the class attribute "
        "`_vescale_elementwise = True`."
    )


#: Bucket size used by ``overlap_param_gather=True`` when ``bucket_cap_mb`` is not given.
DEFAULT_OVERLAP_BUCKET_MB = 25.0

#: On gloo, the average parameter piece (bytes) from which one broadcast per piece,
#: straight into the parameters, beats one broadcast per rank slice plus the copies
#: in and out of a flat buffer (a gloo broadcast costs ~0.2-0.4 ms on 2-4 CPU ranks,
#: the time to copy ~2 MB at this machine's ~7 GB/s).
_PIECE_BROADCAST_BYTES = 1 << 20


@dataclass
class _ParamInfo:
    index: int
    name: str
    param: DTensor
    placements: tuple[Placement, ...]
    numel: int  # local (TP-shard) numel
    offset: int = 0  # in the bucket's flat buffer
    counts: list[int] = field(default_factory=list)  # elements owned by each dp rank
    lo: int = 0  # my slice [lo, hi) of the param's flattened local tensor
    hi: int = 0
    shard: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]
    sharded_dims: tuple[int, ...] = ()
    bucket: int = 0


@dataclass
class _Bucket:
    """One dtype's flat buffer (a `vescale.ragged.FlatBuffer` over the dp dim)."""

    index: int
    dtype: torch.dtype
    params: list[_ParamInfo]
    fb: Any = field(default=None, repr=False)  # FlatBuffer; local: the master slices, if any
    # [start, stop) of the padding inside this rank's slice (zeroed in what it sends)
    slice_padding: list[tuple[int, int]] = field(default_factory=list)
    pending: Any = field(default=None, repr=False)  # FlatWork of the parameter all-gather
    # how the updated slices travel: "all_gather" (one collective), "slices" (one
    # broadcast per rank into a flat buffer) or "pieces" (one broadcast per parameter
    # piece, in place); see DistributedOptimizer._plan_paths
    gather: str = "all_gather"


def _waiting_hook(ref: weakref.ReferenceType, buckets: tuple[int, ...], reason: str):
    """A module hook (any signature) that waits for ``buckets`` of the optimizer ``ref``."""

    def hook(*_args: Any) -> None:
        opt = ref()
        if opt is not None:
            opt._wait_buckets(buckets, reason)

    return hook


class GradientsReleasedError(RuntimeError):
    """A backward after a ZeRO-2 ``step()`` without ``optimizer.zero_grad()`` in between."""


def _pending_average_hook(dp_dim: int, ref: weakref.ReferenceType):
    """A parameter hook: the incoming gradient is this rank's term of the dp average.

    Each data-parallel rank computes the gradient of its own data, but autograd labels
    it with the parameter's ``Replicate()`` on the dp dim. Relabelled ``Partial("avg")``
    (no copy, no communication), the ``.grad`` the user reads holds the global
    gradient with its reduction pending: ``full_tensor()``, norms and clipping reduce
    first; scaling and accumulation act on the terms; ``step()`` reduce-scatters it.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor | None:
        opt = ref()
        if opt is not None and opt._released:
            raise GradientsReleasedError(
                "DistributedOptimizer(zero_stage=2) released the full gradients in step(), "
                "so this backward cannot add to them as it would on one device (gradients "
                "accumulated across optimizer steps). Call optimizer.zero_grad() after "
                "step() (or before the next backward), or use zero_stage=1, which keeps "
                "the gradients between steps."
            )
        if not isinstance(grad, DTensor):
            return None
        if opt is not None and grad.device_mesh.ndim != opt.mesh.ndim:
            # on the sub-mesh without the dp dim (veScale's layout): there is no dp dim
            # to mark pending; step() averages this rank's term over dp as for a replica
            return None
        pls = list(grad.placements)
        if not isinstance(pls[dp_dim], Replicate):
            return None  # already pending (or not a replica): leave it
        pls[dp_dim] = Partial("avg")
        return from_local(
            local_of(grad), grad.device_mesh, pls, shape=grad.shape, stride=grad.stride()
        )

    return hook


class DistributedOptimizer(torch.optim.Optimizer):
    """ZeRO-1/2: shard the optimizer state of data-parallel replicated parameters.

    Parameters are DTensors on ``mesh`` that are ``Replicate()`` on the data-parallel
    mesh dim ``dp_dim`` (any placements on the other dims, e.g. tensor-parallel
    ``Shard``), or DTensors on the sub-mesh of ``mesh`` without ``dp_dim`` (veScale's
    ``parallelize_module(m, mesh["TP"], ...)``), which are read as replicated over it.
    Their local tensors are grouped, per dtype and in parameter order, into buckets (one per dtype unless ``bucket_cap_mb`` limits their size); each bucket is a
    virtual flat buffer cut into ``N`` contiguous, padding-free ranges (sizes differ by
    at most one element), and dp rank ``r`` owns range ``r``. A parameter's piece of a
    range is a ``RaggedShard``-style view: one contiguous slice of its flattened local
    tensor. Each ``step()``:

    1. packs the gradients into one flat buffer per bucket (cast to
       ``grad_reduce_dtype``) and reduce-scatters it with the average over dp
       (``Partial`` grads on the dp dim are summed instead);
    2. optionally clips by the global gradient norm (each element counted once);
    3. runs the inner ``optimizer_cls`` on this rank's slices (views of the parameters,
       updated in place; fp32 master copies when ``master_dtype`` is set): each rank
       holds state for 1/N of every parameter;
    4. all-gathers the updated slices into the parameters' local tensors, one
       all-gather per bucket. With ``overlap_param_gather=True`` the all-gathers are
       only launched: ``step()`` returns at once and forward pre-hooks on the modules
       owning the parameters wait for a bucket right before the first module that
       uses it runs, so the gathers overlap the forward of the layers before.

    That is the NCCL path. On gloo, whose reduce-scatter runs an all-reduce inside and
    whose all-gather is slower than broadcasts of the same bytes, step 1 all-reduces
    the bucket (this rank keeps a copy of its slice) and step 4 broadcasts the updated
    pieces from their owners: straight into the parameters when a bucket's pieces
    average at least 1 MiB, else one broadcast per rank slice into a flat buffer.
    Same elements, same results.

    Between ``backward()`` and ``step()`` each parameter's ``.grad`` is the global
    (dp-averaged) gradient with its reduction pending: a DTensor that is
    ``Partial("avg")`` on the dp dim, so whatever the user reads (``full_tensor()``,
    ``norm()``, ``torch.nn.utils.clip_grad_norm_``) is what one device would see, and
    in-place scaling or unscaling acts on it exactly; no collective runs until
    something needs the reduced value. ``step()`` reduce-scatters it once. (A parameter
    on the sub-mesh without the dp dim has no dp dim to mark: its ``.grad`` is this
    rank's term, averaged by ``step()`` the same way.)

    It is a ``torch.optim.Optimizer``, so torch's LR schedulers drive it; its
    ``param_groups`` are the inner optimizer's.

    With ``zero_stage=2`` (default) the full gradients are released right after the
    reduce-scatter (``param.grad = None``), so between steps only the sharded
    gradients stay alive; ``zero_stage=1`` keeps them (e.g. for inspection). A
    backward after a ZeRO-2 ``step()`` without ``zero_grad()`` in between (gradients
    accumulated across steps) raises ``GradientsReleasedError``: the gradients it
    would add to are gone.

    Only element-wise optimizers can run on flat slices (SGD, Adam, AdamW, Adagrad,
    ...); ``Muon``, ``LBFGS`` and the like raise ``TypeError``.

    Args:
        params_or_model: An ``nn.Module``, an iterable of DTensor parameters, or a
            list of param-group dicts (extra keys are passed to the inner optimizer).
        optimizer_cls: The element-wise ``torch.optim.Optimizer`` class.
        mesh: The device mesh of the parameters.
        dp_dim: Index or name of the data-parallel mesh dim.
        master_dtype: Dtype of the master copy the inner optimizer steps (e.g.
            ``torch.float32`` for bf16 params). ``None``: no copy, the inner optimizer
            steps views of the parameters.
        grad_reduce_dtype: Dtype of the gradient reduce-scatter (e.g.
            ``torch.float32``). ``None``: the parameters' dtype.
        clip_grad_norm: Max global gradient norm; ``None`` disables clipping.
        norm_type: ``p`` of the clipping norm.
        zero_stage: ``1`` or ``2`` (see above).
        model: The module that owns the parameters, when ``params_or_model`` is a
            list of parameters or param groups (implied when it is a module). State
            dicts are keyed by the parameters' names in it, and the overlap hooks are
            registered on its submodules.
        overlap_param_gather: Launch the parameter all-gathers asynchronously at the
            end of ``step()`` and wait for each bucket in a forward pre-hook of the
            modules owning its parameters (needs the model). ``state_dict()``,
            ``load_state_dict()``, the next ``step()``, the model's ``state_dict()`` /
            ``load_state_dict()`` and `wait_param_gather` wait too; any other read
            of the parameters before the next forward must call
            `wait_param_gather` first.
        bucket_cap_mb: Largest bucket in MiB (a bigger parameter gets a bucket of its
            own). ``None``: one bucket per dtype, or ``DEFAULT_OVERLAP_BUCKET_MB`` with
            ``overlap_param_gather``.
        **optimizer_kwargs: Passed to ``optimizer_cls``.

    Attributes:
        param_gather_waits: ``Counter`` of the bucket all-gathers completed, by where
            they were waited for: ``"forward"`` (a forward pre-hook), ``"step"``,
            ``"explicit"`` (`wait_param_gather`), ``"state_dict"``,
            ``"load_state_dict"``, ``"model_state_dict"``, ``"model_load_state_dict"``.

    Raises:
        TypeError: For a non element-wise ``optimizer_cls`` or non-DTensor params.
        ValueError: For a ``dp_dim`` not in the mesh, parameters on another mesh, or
            parameters not replicated over ``dp_dim``; parameters not in ``model``;
            ``overlap_param_gather`` without a model.
    """

    def __init__(
        self,
        params_or_model: Any,
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        mesh: DeviceMesh,
        dp_dim: int | str,
        master_dtype: torch.dtype | None = None,
        grad_reduce_dtype: torch.dtype | None = None,
        clip_grad_norm: float | None = None,
        norm_type: float = 2.0,
        zero_stage: int = 2,
        model: nn.Module | None = None,
        overlap_param_gather: bool = False,
        bucket_cap_mb: float | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        _check_optimizer_cls(optimizer_cls)
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive or None, got {bucket_cap_mb!r}")
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(params_or_model, nn.Module):
            if model is not None and model is not params_or_model:
                raise ValueError("pass the model either as params_or_model or as model=, not both")
            model = params_or_model
        if overlap_param_gather and model is None:
            raise ValueError(
                "overlap_param_gather=True needs the model: its forward pre-hooks wait for "
                "the parameter all-gathers. Pass the module as the first argument or as "
                "model=..."
            )
        self.mesh = mesh
        self.dp_dim = resolve_mesh_dim(mesh, dp_dim, "dp_dim")
        self.dp_size = mesh.size(self.dp_dim)
        self.dp_rank = mesh.get_local_rank(self.dp_dim)
        self.master_dtype = master_dtype
        self.grad_reduce_dtype = grad_reduce_dtype
        self.clip_grad_norm = clip_grad_norm
        self.norm_type = norm_type
        self.zero_stage = zero_stage
        self.optimizer_cls = optimizer_cls
        self.overlap_param_gather = bool(overlap_param_gather)
        if bucket_cap_mb is None and self.overlap_param_gather:
            bucket_cap_mb = DEFAULT_OVERLAP_BUCKET_MB
        self.bucket_cap_mb = bucket_cap_mb
        self.param_gather_waits: Counter[str] = Counter()
        self._optimizer_kwargs = dict(optimizer_kwargs)

        groups, names = normalize_param_groups(params_or_model)
        if model is not None:
            model_names = {id(p): n for n, p in model.named_parameters()}
            for g in groups:
                for p in g["params"]:
                    if id(p) not in model_names:
                        raise ValueError(
                            f"parameter {names[id(p)]!r} (shape {tuple(p.shape)}) is not a "
                            "parameter of the model passed to DistributedOptimizer"
                        )
            names.update({k: v for k, v in model_names.items() if k in names})
        self._infos: list[_ParamInfo] = []
        for g in groups:
            for p in g["params"]:
                self._infos.append(self._check_param(p, names[id(p)], len(self._infos)))
        self._buckets = self._plan_buckets()
        self._plan_paths()

        inner_groups = []
        k = 0
        for g in groups:
            ig = {key: v for key, v in g.items() if key != "params"}
            ig["params"] = [self._infos[k + i].shard for i in range(len(g["params"]))]
            k += len(g["params"])
            inner_groups.append(ig)
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)
        self.defaults = self.optimizer.defaults
        # torch.optim.Optimizer's hook tables (its __init__ would build param groups of
        # the full parameters, which this optimizer does not step)
        for attr in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, attr, OrderedDict())
        self._state_mesh: DeviceMesh | None = None
        self._released = False  # ZeRO-2 freed the gradients and zero_grad() has not run
        self._hook_handles: list[Any] = [
            i.param.register_hook(_pending_average_hook(self.dp_dim, weakref.ref(self)))
            for i in self._infos
            if i.param.requires_grad
        ]
        if self.overlap_param_gather:
            assert model is not None
            self._register_hooks(model)

    # ------------------------------------------------------------------ planning
    def _check_param(self, p: torch.Tensor, name: str, index: int) -> _ParamInfo:
        if not isinstance(p, DTensor):
            raise TypeError(
                f"parameter {name!r} is a plain tensor, not a DTensor on the mesh; "
                "DistributedOptimizer shards DTensor parameters replicated over the dp "
                "dim (distribute it first, e.g. distribute_tensor(p, mesh, [Replicate(), ...]) "
                "or DModule)"
            )
        pm = p.device_mesh
        if pm is self.mesh or (
            pm.device_type == self.mesh.device_type
            and pm.ndim == self.mesh.ndim
            and torch.equal(pm.mesh, self.mesh.mesh)
        ):
            pls = tuple(p.placements)
        else:
            # veScale's layout: on the sub-mesh without the dp dim, replicated over it
            lifted = lift_placements(pm, p.placements, self.mesh, self.dp_dim)
            if lifted is None:
                raise ValueError(
                    f"parameter {name!r} lives on {pm}, not on the optimizer's mesh "
                    f"{self.mesh} (nor on its sub-mesh without the dp dim "
                    f"{dim_label(self.mesh, self.dp_dim)})"
                )
            pls = lifted
        dp_pl = pls[self.dp_dim]
        if not isinstance(dp_pl, Replicate):
            raise ValueError(
                f"parameter {name!r} has placement {dp_pl} on dp_dim "
                f"{dim_label(self.mesh, self.dp_dim)}; DistributedOptimizer expects "
                "parameters replicated over the data-parallel dim (it shards their "
                "optimizer state itself). Is dp_dim the mesh dim your model uses for "
                "data parallelism? For FSDP-sharded parameters use a plain torch "
                "optimizer on the sharded DTensors."
            )
        if any(pl.is_partial() for pl in pls):
            raise ValueError(f"parameter {name!r} has Partial placements {pls}")
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has non-floating dtype {p.dtype}")
        local = local_of(p)
        if not local.is_contiguous():
            raise ValueError(
                f"parameter {name!r} has a non-contiguous local tensor; DistributedOptimizer "
                "slices the flattened local tensor in place"
            )
        dims = tuple(d for d in sharded_mesh_dims(pls) if d != self.dp_dim)
        return _ParamInfo(index, name, p, pls, local.numel(), sharded_dims=dims)

    def _plan_buckets(self) -> list[_Bucket]:
        """Buckets as flat buffers of the one flat-buffer engine (`vescale.ragged`).

        Parameters are grouped per dtype (capped at ``bucket_cap_mb``) by
        `vescale.ragged.bucket_specs`; each bucket's flattened local tensors are laid
        out by `vescale.ragged.plan_flat_buffers` (element granularity, given order: one
        slice of ``ceil(total / N)`` elements per dp rank, the padding at the end) and
        moved by a `vescale.ragged.FlatBuffer` (one reduce-scatter and one all-gather
        per bucket and step).
        """
        from vescale.ragged import FlatBuffer, ParamSpec, bucket_specs, plan_flat_buffers

        cap = None if self.bucket_cap_mb is None else self.bucket_cap_mb * 2**20
        specs = [ParamSpec(str(i.index), (i.numel,), i.param.dtype) for i in self._infos]
        n, r = self.dp_size, self.dp_rank
        buckets: list[_Bucket] = []
        for group in bucket_specs(specs, cap):
            (layout,) = plan_flat_buffers(group, n).values()
            infos = [self._infos[int(spec.name)] for spec in group]
            device = local_of(infos[0].param).device
            start, stop = layout.rank_ranges[r]
            if self.master_dtype is not None:
                # the master slices are views of one flat buffer (the rank's slice)
                local = torch.zeros(stop - start, dtype=self.master_dtype, device=device)
            else:
                # the slices are views of the parameters: the buffer needs no storage
                local = torch.empty(stop - start, dtype=layout.dtype, device=device)
                local.untyped_storage().resize_(0)
            fb = FlatBuffer(layout, self.mesh, self.dp_dim, local=local)
            b = _Bucket(len(buckets), layout.dtype, infos, fb)
            b.slice_padding = [
                (max(a, start) - start, min(e, stop) - start)
                for a, e in fb.padding_ranges()
                if min(e, stop) > max(a, start)
            ]
            for info in infos:
                name = str(info.index)
                slot = layout[name]
                info.offset = slot.offset
                info.bucket = b.index
                pieces = [layout.piece(name, q) for q in range(n)]
                info.counts = [e - a for a, e in pieces]
                lo, hi = pieces[r]
                info.lo = min(max(lo - slot.offset, 0), info.numel)
                info.hi = max(min(hi - slot.offset, info.numel), info.lo)
                mine = local_of(info.param).detach().view(-1)[info.lo : info.hi]
                if self.master_dtype is None:
                    # a view: the inner optimizer updates this rank's slice in place
                    info.shard = mine
                else:
                    info.shard = fb.local_view(name)
                    info.shard.copy_(mine)
            buckets.append(b)
        return buckets

    def _plan_paths(self, backend: str | None = None, gather: str | None = None) -> None:
        """Pick the collectives of each bucket for the dp group's backend.

        NCCL (and any backend but gloo): one reduce-scatter and one all-gather per
        bucket. gloo: its reduce-scatter runs an all-reduce internally and its
        all-gather stages through a second buffer, so the gradients are all-reduced
        (the average lands in the whole buffer, this rank keeps its slice) and the
        updated slices travel as broadcasts, the way torch's
        ``ZeroRedundancyOptimizer`` moves them: one per parameter piece, straight
        into the parameters, when the pieces average at least
        ``_PIECE_BROADCAST_BYTES`` (no copy at all); else one per rank slice into a
        flat buffer. Every path moves the same elements to the same places.

        Args:
            backend: Override the detected backend (tests use it to run each path).
            gather: Override every bucket's gather path (``"all_gather"``,
                ``"slices"`` or ``"pieces"``; tests).
        """
        if backend is None:
            backend = (
                dist.get_backend(self.mesh.get_group(self.dp_dim)) if self.dp_size > 1 else "none"
            )
        self._reduce_by_all_reduce = backend == "gloo"
        for b in self._buckets:
            if backend != "gloo":
                b.gather = "all_gather"
                continue
            nbytes = b.fb.layout.numel * b.dtype.itemsize
            pieces = max(1, b.fb.num_pieces())
            b.gather = "pieces" if nbytes / pieces >= _PIECE_BROADCAST_BYTES else "slices"
        if gather is not None:
            if gather not in ("all_gather", "slices", "pieces"):
                raise ValueError(f"unknown gather path {gather!r}")
            for b in self._buckets:
                b.gather = gather

    def _register_hooks(self, model: nn.Module) -> None:
        """Forward pre-hooks (and model state-dict pre-hooks) that wait for the buckets."""
        by_id = {id(i.param): i for i in self._infos}
        ref = weakref.ref(self)
        for mod in model.modules():
            owned = sorted(
                {by_id[id(p)].bucket for p in mod._parameters.values() if id(p) in by_id}
            )
            if not owned:
                continue
            bs = tuple(owned)
            self._hook_handles += [
                # prepend: run before any other pre-hook that could read the parameters
                mod.register_forward_pre_hook(_waiting_hook(ref, bs, "forward"), prepend=True),
                mod.register_state_dict_pre_hook(_waiting_hook(ref, bs, "model_state_dict")),
                mod.register_load_state_dict_pre_hook(
                    _waiting_hook(ref, bs, "model_load_state_dict")
                ),
            ]

    # ------------------------------------------------------------------ properties
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (their ``params`` are this rank's slices)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The inner optimizer's state (keyed by this rank's slices)."""
        return self.optimizer.state

    @property
    def params(self) -> list[DTensor]:
        """The managed parameters, in order (waits for pending all-gathers first)."""
        self._wait_all("explicit")
        return [i.param for i in self._infos]

    @property
    def param_names(self) -> list[str]:
        """The managed parameters' names (the keys of `state_dict`), in order."""
        return [i.name for i in self._infos]

    @property
    def num_buckets(self) -> int:
        """Number of buckets (one reduce-scatter and one all-gather each per step)."""
        return len(self._buckets)

    @property
    def num_pending_param_gathers(self) -> int:
        """Buckets whose all-gather was launched by ``step()`` and not waited for yet."""
        return sum(b.pending is not None for b in self._buckets)

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's slices (master copies if ``master_dtype``), one per parameter."""
        return [i.shard for i in self._infos]

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients and the sharded gradients."""
        self._released = False
        for info in self._infos:
            p = info.param
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    local_of(p.grad).zero_()
            info.shard.grad = None

    def _local_grad(self, info: _ParamInfo, g: torch.Tensor) -> torch.Tensor:
        if not isinstance(g, DTensor):
            raise TypeError(
                f"gradient of {info.name!r} is a plain tensor; expected a DTensor like the parameter"
            )
        on_sub = g.device_mesh.ndim != self.mesh.ndim  # a grad on the sub-mesh without dp
        pls = tuple(g.placements)
        if on_sub:
            pls = (*pls[: self.dp_dim], Replicate(), *pls[self.dp_dim :])
        scale = 1.0
        dp_pl = pls[self.dp_dim]
        if dp_pl.is_partial() and getattr(dp_pl, "reduce_op", "sum") != "avg":
            scale = float(self.dp_size)  # sum over dp, the reduce below averages
        want = list(info.placements)
        want[self.dp_dim] = Replicate() if not pls[self.dp_dim].is_partial() else pls[self.dp_dim]
        if tuple(want) != pls:
            # e.g. a Partial grad on a tensor-parallel dim: bring it to the param's layout
            want[self.dp_dim] = pls[self.dp_dim]
            g = redistribute(g, g.device_mesh, drop_dim(want, self.dp_dim) if on_sub else want)
        local = local_of(g).reshape(-1)
        return local * scale if scale != 1.0 else local

    def _reduce_scatter_grads(self) -> None:
        self._had_grads = any(i.param.grad is not None for i in self._infos)
        for bucket in self._buckets:
            rdtype = self.grad_reduce_dtype or bucket.dtype
            fb = bucket.fb
            flat = fb.new_full_buffer(dtype=rdtype, device=local_of(bucket.params[0].param).device)
            for a, e in fb.padding_ranges():
                flat[a:e].zero_()
            has_grad = []
            for info in bucket.params:
                g = info.param.grad
                has_grad.append(g is not None)
                view = flat[info.offset : info.offset + info.numel]
                if g is None:
                    view.zero_()
                else:
                    view.copy_(self._local_grad(info, g))
            if self._reduce_by_all_reduce:
                a, e = fb.layout.rank_ranges[fb.rank]
                # keep only this rank's slice alive (the ZeRO-2 memory promise)
                mine = fb.all_reduce(flat, op="avg")[a:e].clone()
            else:
                mine = fb.reduce_scatter(flat, op="avg")
            for info, hg in zip(bucket.params, has_grad):
                if hg:
                    info.shard.grad = fb.local_view(str(info.index), mine).to(info.shard.dtype)
                else:
                    info.shard.grad = None
                if self.zero_stage >= 2:
                    info.param.grad = None

    def _launch_param_gather(self) -> None:
        """Start one all-gather per bucket of the updated slices (no waiting)."""
        for bucket in self._buckets:
            if bucket.pending is not None:  # never two gathers in flight for one bucket
                self._wait_bucket(bucket, "step")
            fb = bucket.fb
            if bucket.gather == "pieces":
                # the parameters are the destination: this rank's pieces go in place
                # first (the inner optimizer already updated them without masters)
                if self.master_dtype is not None:
                    for info in bucket.params:
                        local_of(info.param).detach().view(-1)[info.lo : info.hi].copy_(
                            info.shard.detach()
                        )
                dst = {str(i.index): local_of(i.param).detach().view(-1) for i in bucket.params}
                bucket.pending = fb.broadcast_pieces(dst, async_op=True)
                continue
            out = None
            if bucket.gather == "slices":
                out = fb.new_full_buffer(dtype=bucket.dtype)
                a, e = fb.layout.rank_ranges[fb.rank]
                src = out[a:e]  # packed in place: broadcast_slices copies nothing
                if self.master_dtype is not None:
                    src.copy_(fb.local.detach())
            elif self.master_dtype is not None:
                src = fb.local.detach().to(bucket.dtype)
            else:
                src = fb.new_slice(dtype=bucket.dtype)
            if self.master_dtype is None:
                for info in bucket.params:
                    fb.local_view(str(info.index), src).copy_(info.shard.detach())
            for a, e in bucket.slice_padding:
                src[a:e].zero_()
            if out is not None:
                bucket.pending = fb.broadcast_slices(out, src=src, async_op=True)
            else:
                bucket.pending = fb.all_gather(src=src, async_op=True)

    def _wait_bucket(self, bucket: _Bucket, reason: str) -> None:
        handle = bucket.pending
        if handle is None:
            return
        bucket.pending = None
        full = handle.wait()
        if full is not None:  # None: the pieces were broadcast into the parameters
            # the unsharded buffer: every param's elements are contiguous in it
            with torch.no_grad():
                for info in bucket.params:
                    local_of(info.param).view(-1).copy_(
                        full[info.offset : info.offset + info.numel]
                    )
        self.param_gather_waits[reason] += 1

    def _wait_buckets(self, indices: tuple[int, ...], reason: str) -> None:
        for b in indices:
            self._wait_bucket(self._buckets[b], reason)

    def _wait_all(self, reason: str) -> None:
        for b in self._buckets:
            self._wait_bucket(b, reason)

    def wait_param_gather(self) -> None:
        """Wait for every pending parameter all-gather and update the parameters.

        Only needed with ``overlap_param_gather=True`` before reading the parameters
        outside the model's forward (e.g. evaluating them directly); the forward
        pre-hooks, ``step()``, ``state_dict()``, ``load_state_dict()`` and the model's
        ``state_dict()`` wait by themselves. A no-op when nothing is pending. It issues
        no collective, so it is safe to call on some ranks only.
        """
        self._wait_all("explicit")

    def clip_grad_norm_(self, max_norm: float, norm_type: float | None = None) -> torch.Tensor:
        """Clip the sharded gradients (after the reduce-scatter) by their global norm."""
        p = self.norm_type if norm_type is None else norm_type
        entries = []
        for info in self._infos:
            if info.shard.grad is not None:
                dims = tuple(sorted({self.dp_dim, *info.sharded_dims}))
                entries.append((info.shard.grad, self.mesh, dims))
        total = total_norm_of_locals(entries, p)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        grads = [e[0] for e in entries]
        if grads:
            _compat.foreach_mul_(grads, coef.to(grads[0].dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce-scatter grads, (clip,) step the inner optimizer, all-gather params.

        With ``overlap_param_gather`` the all-gathers are launched and left pending
        (see the class docstring); otherwise they are complete when this returns.

        Args:
            closure: Optional closure that re-evaluates the model (called once, with
                grad enabled, before anything else).

        Returns:
            The global gradient norm (before clipping) when ``clip_grad_norm`` is set,
            else the closure's loss (or ``None``).
        """
        self._wait_all("step")  # a gather of the previous step no forward waited for
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_scatter_grads()
        norm = None
        if self.clip_grad_norm is not None:
            norm = self.clip_grad_norm_(self.clip_grad_norm)
        self.optimizer.step()
        self._launch_param_gather()
        if not self.overlap_param_gather:
            self._wait_all("step")
        self._released = self.zero_stage >= 2 and self._had_grads
        return norm if norm is not None else loss

    # ------------------------------------------------------------------ state dict
    def _get_state_mesh(self) -> DeviceMesh:
        """The mesh with the dp dim moved last, so ``RaggedShard`` on dp cuts the local shard."""
        if self._state_mesh is None:
            d = self.dp_dim
            if d == self.mesh.ndim - 1:
                self._state_mesh = self.mesh
            else:
                order = [i for i in range(self.mesh.ndim) if i != d] + [d]
                names = self.mesh.mesh_dim_names
                self._state_mesh = DeviceMesh(
                    self.mesh.device_type,
                    self.mesh.mesh.permute(order),
                    mesh_dim_names=tuple(names[i] for i in order) if names else None,
                )
        return self._state_mesh

    def _state_placements(self, info: _ParamInfo) -> tuple[Placement, ...]:
        d = self.dp_dim
        others = [info.placements[i] for i in range(self.mesh.ndim) if i != d]
        ndim = info.param.ndim
        if sum(info.counts) == 0:
            dp_pl: Placement = Replicate()
        else:
            # element granularity over the (tensor-parallel) local tensor
            dp_pl = ragged_shard(tuple(range(ndim)), tuple(info.counts))
        return (*others, dp_pl)

    def _wrap(self, info: _ParamInfo, local: torch.Tensor) -> DTensor:
        p = info.param
        mesh = self._get_state_mesh()
        shape = tuple(p.shape)
        stride = tuple(torch.empty(shape, device="meta").stride())
        pls = self._state_placements(info)
        if isinstance(pls[-1], Replicate):
            return from_local(
                local.reshape(local_of(p).shape), mesh, pls, shape=shape, stride=stride
            )
        try:
            return from_local(local, mesh, pls, shape=shape, stride=stride)
        except ValueError:
            # Not expressible as one placement: the dp split of an unevenly TP-sharded
            # parameter differs between TP coordinates. Deterministic on every rank, so
            # every rank takes this branch together: gather over dp instead.
            full = all_gather_uneven(local, (self.mesh, self.dp_dim), sizes=info.counts)
            pls = (*pls[:-1], Replicate())
            return from_local(
                full.reshape(local_of(p).shape), mesh, pls, shape=shape, stride=stride
            )

    def _is_sharded_state(self, info: _ParamInfo, key: str, v: Any) -> bool:
        return (
            isinstance(v, torch.Tensor)
            and key != "step"
            and v.ndim == 1
            and v.numel() == info.hi - info.lo
        )

    def _fresh_state(self, indices: list[int]) -> dict[int, dict[str, Any]]:
        """The state a first ``step()`` creates for the parameters at ``indices``.

        Runs the inner optimizer class once, with zero gradients, on copies of this
        rank's slices (the live optimizer and parameters are untouched), then resets
        ``step`` to 0. For Adam-type optimizers (zero moments), Adagrad, RMSprop,
        Adadelta, Adamax, RAdam, Rprop and SGD without dampening this is exactly the
        never-stepped state.
        """
        pos = {id(i.shard): k for k, i in enumerate(self._infos)}
        clones = [i.shard.detach().clone() for i in self._infos]
        groups = []
        for g in self.optimizer.param_groups:
            ng = {k: v for k, v in g.items() if k != "params"}
            ng["params"] = [clones[pos[id(p)]] for p in g["params"]]
            groups.append(ng)
        tmp = self.optimizer_cls(groups, **self._optimizer_kwargs)
        for c in clones:
            c.grad = torch.zeros_like(c)
        with torch.no_grad():
            tmp.step()
        out: dict[int, dict[str, Any]] = {}
        for k in indices:
            st = dict(tmp.state.get(clones[k], {}))
            if "step" in st:
                v = st["step"]
                st["step"] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)(0)
            out[k] = st
        return out

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, with sharded tensors as DTensors.

        The layout is that of ``torch.distributed.checkpoint.state_dict.
        get_optimizer_state_dict``: ``{"state": {name: {key: value}}, "param_groups":
        [{..., "params": [name, ...]}]}``, where names are the parameters' names in the
        model (``"param[<index>]"`` when no model was given). So
        ``vescale.checkpoint.save(path, {"model": model, "optimizer": opt})`` writes the
        same keys as for a plain torch optimizer on the same model, and the checkpoint
        loads into a ``DistributedOptimizer`` of any dp size or mesh, or into a torch
        optimizer.

        Each sharded state tensor (e.g. ``exp_avg``) is a DTensor of the parameter's
        global shape on the mesh with the dp dim moved last (the mesh itself if dp is
        already its last dim): the parameter's placements on the other dims and
        ``RaggedShard(all dims, counts)`` on dp, where ``counts`` are the elements each
        dp rank owns. ``full_tensor()`` gives the unsharded state. Scalars (``step``)
        stay plain. With ``master_dtype`` the master weights are saved as
        ``"master_param"``. Parameters without state yet (never stepped) get the state
        a first step creates (zeros, ``step`` 0; see `_fresh_state`), so a fresh
        optimizer's state dict is a complete load target.

        Waits for pending parameter all-gathers first.
        """
        self._wait_all("state_dict")
        inner = self.optimizer.state_dict()
        missing = [k for k in range(len(self._infos)) if k not in inner["state"]]
        fresh = self._fresh_state(missing) if missing else {}
        state: dict[str, dict[str, Any]] = {}
        for idx, info in enumerate(self._infos):
            st = inner["state"].get(idx, fresh.get(idx))
            out: dict[str, Any] = {}
            if st is not None:
                for k, v in st.items():
                    out[k] = self._wrap(info, v) if self._is_sharded_state(info, k, v) else v
            if self.master_dtype is not None:
                out["master_param"] = self._wrap(info, info.shard.detach())
            if out:
                state[info.name] = out
        groups = []
        for g in inner["param_groups"]:
            g = dict(g)
            g["params"] = [self._infos[i].name for i in g["params"]]
            groups.append(g)
        return {"state": state, "param_groups": groups}

    def _my_slice(self, info: _ParamInfo, v: torch.Tensor) -> torch.Tensor:
        """This rank's flat slice of a state tensor given in any layout."""
        p = info.param
        if isinstance(v, DTensor):
            if v.device_mesh is self._state_mesh:
                pls = tuple(v.placements)
                mine = self._state_placements(info)
                if pls == mine:  # our own layout: the local tensor is the slice
                    return local_of(v).reshape(-1)
                if pls == (*mine[:-1], Replicate()):  # our gathered fallback layout
                    return local_of(v).reshape(-1)[info.lo : info.hi]
            v = v.full_tensor()
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(
                f"state tensor for {info.name!r} has shape {tuple(v.shape)}, expected the "
                f"parameter's shape {tuple(p.shape)}"
            )
        pls = list(info.placements)
        pls[self.dp_dim] = Replicate()
        tp_local = local_of(distribute_tensor(v.detach(), self.mesh, pls, src_data_rank=None))
        return tp_local.reshape(-1)[info.lo : info.hi]

    def _lookup(self, state: dict[Any, Any], info: _ParamInfo) -> Any:
        for key in (info.name, info.index, str(info.index)):
            if key in state:
                return state[key]
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from `state_dict` (or a torch optimizer's), on any dp size.

        ``state`` may be keyed by parameter name (as `state_dict` and
        ``get_optimizer_state_dict`` write it) or by index (as
        ``torch.optim.Optimizer.state_dict``). Sharded states may be DTensors in this
        optimizer's layout (loaded without communication), DTensors in any other layout
        (unsharded with ``full_tensor()`` and re-sliced) or full plain tensors of the
        parameter's shape. ``param_groups`` must have this optimizer's groups, in order.

        ``master_param`` entries overwrite the master copies and the parameters
        (all-gathered); with ``master_dtype`` and no ``master_param`` in the state, the
        master copies are refreshed from the parameters (load the model first, as
        ``vescale.checkpoint.load`` does). Without ``master_dtype`` the inner optimizer
        steps views of the parameters, so a loaded model is picked up as it is.
        """
        self._wait_all("load_state_dict")
        saved_groups = state_dict["param_groups"]
        live_groups = self.optimizer.param_groups
        if len(saved_groups) != len(live_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, this optimizer has "
                f"{len(live_groups)}"
            )
        pos = {id(i.shard): k for k, i in enumerate(self._infos)}
        inner_groups = []
        for gi, (sg, lg) in enumerate(zip(saved_groups, live_groups)):
            ours = [pos[id(p)] for p in lg["params"]]
            theirs = list(sg["params"])
            if len(theirs) != len(ours):
                raise ValueError(
                    f"param group {gi} has {len(theirs)} parameters in the state dict and "
                    f"{len(ours)} in this optimizer"
                )
            names = [self._infos[k].name for k in ours]
            if all(isinstance(x, str) for x in theirs) and set(theirs) != set(names):
                raise ValueError(
                    f"param group {gi}: the state dict's parameters "
                    f"{sorted(set(theirs) - set(names))} are not in this optimizer, which has "
                    f"{sorted(set(names) - set(theirs))} instead"
                )
            ng = {k: v for k, v in sg.items() if k != "params"}
            ng["params"] = ours
            inner_groups.append(ng)

        saved_state = state_dict["state"]
        inner_state: dict[int, dict[str, Any]] = {}
        got_master = []
        for idx, info in enumerate(self._infos):
            st = self._lookup(saved_state, info)
            if st is None:
                continue
            new: dict[str, Any] = {}
            for k, v in st.items():
                if k == "master_param":
                    if self.master_dtype is None:
                        continue  # the parameters themselves are the weights
                    info.shard.copy_(self._my_slice(info, v).to(info.shard.dtype))
                    got_master.append(idx)
                elif isinstance(v, DTensor) or (
                    isinstance(v, torch.Tensor)
                    and k != "step"
                    and tuple(v.shape) == tuple(info.param.shape)
                    and v.ndim > 0
                ):
                    new[k] = self._my_slice(info, v).clone()
                else:
                    new[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if new:
                inner_state[idx] = new
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        if self.master_dtype is not None:
            loaded = set(got_master)
            with torch.no_grad():
                for idx, info in enumerate(self._infos):
                    if idx not in loaded:
                        src = local_of(info.param).detach().view(-1)[info.lo : info.hi]
                        info.shard.copy_(src.to(info.shard.dtype))
            if got_master:
                with torch.no_grad():
                    self._launch_param_gather()
                    self._wait_all("load_state_dict")

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({self.optimizer_cls.__name__}, dp_dim="
            f"{dim_label(self.mesh, self.dp_dim)}, dp_size={self.dp_size}, "
            f"params={len(self._infos)}, buckets={len(self._buckets)}, "
            f"master_dtype={self.master_dtype}, "
            f"overlap_param_gather={self.overlap_param_gather})"
        )
