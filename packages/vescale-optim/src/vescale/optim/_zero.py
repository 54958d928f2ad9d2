"""``DistributedOptimizer``: ZeRO-1/2 optimizer-state sharding over a data-parallel mesh dim."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from vescale.dtensor import distribute_tensor, from_local, redistribute
from vescale.dtensor.collectives import all_gather_uneven, reduce_scatter_uneven
from vescale.optim._clip import total_norm_of_locals
from vescale.optim._utils import (
    dim_label,
    local_of,
    normalize_param_groups,
    ragged_shard,
    resolve_mesh_dim,
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


def _even_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """Contiguous per-rank ranges of ``total`` elements; sizes differ by at most one."""
    return [(r * total // n, (r + 1) * total // n) for r in range(n)]


@dataclass
class _ParamInfo:
    index: int
    name: str
    param: DTensor
    placements: tuple[Placement, ...]
    numel: int  # local (TP-shard) numel
    offset: int  # in the bucket's flat buffer
    counts: list[int]  # elements of this param owned by each dp rank
    lo: int  # my slice [lo, hi) of the param's flattened local tensor
    hi: int
    shard: torch.Tensor = field(repr=False, default=None)  # type: ignore[assignment]
    sharded_dims: tuple[int, ...] = ()


@dataclass
class _Bucket:
    dtype: torch.dtype
    params: list[_ParamInfo]
    sizes: list[int]  # per dp rank


class DistributedOptimizer:
    """ZeRO-1/2: shard the optimizer state of data-parallel replicated parameters.

    Parameters are DTensors on ``mesh`` that are ``Replicate()`` on the data-parallel
    mesh dim ``dp_dim`` (any placements on the other dims, e.g. tensor-parallel
    ``Shard``). Their local tensors are concatenated, per dtype, into a virtual flat
    buffer that is cut into ``N`` contiguous, padding-free ranges (sizes differ by at
    most one element); dp rank ``r`` owns range ``r``. A parameter's piece of a range
    is a ``RaggedShard``-style view: one contiguous slice of its flattened local
    tensor. Each ``step()``:

    1. packs the gradients into one flat buffer per dtype (cast to
       ``grad_reduce_dtype``) and reduce-scatters it with the average over dp
       (``Partial`` grads on the dp dim are summed instead);
    2. optionally clips by the global gradient norm (each element counted once);
    3. runs the inner ``optimizer_cls`` on this rank's slices (fp32 master slices
       when ``master_dtype`` is set): each rank holds state for 1/N of every
       parameter;
    4. all-gathers the updated slices into the parameters' local tensors.

    With ``zero_stage=2`` (default) the full gradients are released right after the
    reduce-scatter (``param.grad = None``), so between steps only the sharded
    gradients stay alive; ``zero_stage=1`` keeps them (e.g. for inspection).

    Only element-wise optimizers can run on flat slices (SGD, Adam, AdamW, Adagrad,
    ...); ``Muon``, ``LBFGS`` and the like raise ``TypeError``.

    Args:
        params_or_model: An ``nn.Module``, an iterable of DTensor parameters, or a
            list of param-group dicts (extra keys are passed to the inner optimizer).
        optimizer_cls: The element-wise ``torch.optim.Optimizer`` class.
        mesh: The device mesh of the parameters.
        dp_dim: Index or name of the data-parallel mesh dim.
        master_dtype: Dtype of the master copy the inner optimizer steps (e.g.
            ``torch.float32`` for bf16 params). ``None``: the parameters' dtype.
        grad_reduce_dtype: Dtype of the gradient reduce-scatter (e.g.
            ``torch.float32``). ``None``: the parameters' dtype.
        clip_grad_norm: Max global gradient norm; ``None`` disables clipping.
        norm_type: ``p`` of the clipping norm.
        zero_stage: ``1`` or ``2`` (see above).
        **optimizer_kwargs: Passed to ``optimizer_cls``.

    Raises:
        TypeError: For a non element-wise ``optimizer_cls`` or non-DTensor params.
        ValueError: For a ``dp_dim`` not in the mesh, parameters on another mesh, or
            parameters not replicated over ``dp_dim``.
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
        **optimizer_kwargs: Any,
    ) -> None:
        _check_optimizer_cls(optimizer_cls)
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {zero_stage!r}")
        self.mesh = mesh
        self.dp_dim = resolve_mesh_dim(mesh, dp_dim)
        self.dp_size = mesh.size(self.dp_dim)
        self.dp_rank = mesh.get_local_rank(self.dp_dim)
        self.master_dtype = master_dtype
        self.grad_reduce_dtype = grad_reduce_dtype
        self.clip_grad_norm = clip_grad_norm
        self.norm_type = norm_type
        self.zero_stage = zero_stage
        self.optimizer_cls = optimizer_cls

        groups, names = normalize_param_groups(params_or_model)
        self._infos: list[_ParamInfo] = []
        for g in groups:
            for p in g["params"]:
                self._infos.append(self._check_param(p, names[id(p)], len(self._infos)))
        self._buckets = self._plan_buckets()

        inner_groups = []
        k = 0
        for g in groups:
            ig = {key: v for key, v in g.items() if key != "params"}
            ig["params"] = [self._infos[k + i].shard for i in range(len(g["params"]))]
            k += len(g["params"])
            inner_groups.append(ig)
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)
        self._state_mesh: DeviceMesh | None = None

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
        if pm is not self.mesh and (
            pm.device_type != self.mesh.device_type
            or pm.ndim != self.mesh.ndim
            or not torch.equal(pm.mesh, self.mesh.mesh)
        ):
            raise ValueError(
                f"parameter {name!r} lives on {pm}, not on the optimizer's mesh {self.mesh}"
            )
        pls = tuple(p.placements)
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
        numel = local_of(p).numel()
        dims = tuple(d for d in sharded_mesh_dims(pls) if d != self.dp_dim)
        return _ParamInfo(index, name, p, pls, numel, 0, [], 0, 0, sharded_dims=dims)

    def _plan_buckets(self) -> list[_Bucket]:
        by_dtype: dict[torch.dtype, list[_ParamInfo]] = {}
        for info in self._infos:
            by_dtype.setdefault(info.param.dtype, []).append(info)
        buckets = []
        n, r = self.dp_size, self.dp_rank
        for dtype, infos in by_dtype.items():
            total = 0
            for info in infos:
                info.offset = total
                total += info.numel
            bounds = _even_bounds(total, n)
            for info in infos:
                a, b = info.offset, info.offset + info.numel
                info.counts = [max(0, min(b, hi) - max(a, lo)) for lo, hi in bounds]
                lo, hi = bounds[r]
                info.lo = min(max(lo - a, 0), info.numel)
                info.hi = max(min(hi - a, info.numel), info.lo)
                src = local_of(info.param).detach().reshape(-1)[info.lo : info.hi]
                sdtype = self.master_dtype or dtype
                info.shard = src.to(sdtype, copy=True)
            buckets.append(_Bucket(dtype, infos, [hi - lo for lo, hi in bounds]))
        return buckets

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
        """The managed parameters, in order."""
        return [i.param for i in self._infos]

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's slices (master copies if ``master_dtype``), one per parameter."""
        return [i.shard for i in self._infos]

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the parameters' gradients and the sharded gradients."""
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
        pls = tuple(g.placements)
        scale = 1.0
        if pls[self.dp_dim].is_partial():
            scale = float(self.dp_size)  # sum over dp, the reduce below averages
        want = list(info.placements)
        want[self.dp_dim] = Replicate() if not pls[self.dp_dim].is_partial() else pls[self.dp_dim]
        if tuple(want) != pls:
            # e.g. a Partial grad on a tensor-parallel dim: bring it to the param's layout
            want[self.dp_dim] = pls[self.dp_dim]
            g = redistribute(g, g.device_mesh, want)
        local = local_of(g).reshape(-1)
        return local * scale if scale != 1.0 else local

    def _reduce_scatter_grads(self) -> None:
        group = (self.mesh, self.dp_dim)
        for bucket in self._buckets:
            rdtype = self.grad_reduce_dtype or bucket.dtype
            pieces = []
            has_grad = []
            for info in bucket.params:
                g = info.param.grad
                has_grad.append(g is not None)
                if g is None:
                    pieces.append(torch.zeros(info.numel, dtype=rdtype, device=info.shard.device))
                else:
                    pieces.append(self._local_grad(info, g).to(rdtype))
            flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=rdtype)
            mine = reduce_scatter_uneven(flat, bucket.sizes, group, op="avg")
            off = 0
            for info, hg in zip(bucket.params, has_grad):
                m = info.hi - info.lo
                if hg:
                    info.shard.grad = mine[off : off + m].to(info.shard.dtype)
                else:
                    info.shard.grad = None
                off += m
                if self.zero_stage >= 2:
                    info.param.grad = None

    def _all_gather_params(self) -> None:
        group = (self.mesh, self.dp_dim)
        for bucket in self._buckets:
            mine = torch.cat([i.shard.detach().to(bucket.dtype) for i in bucket.params])
            full = all_gather_uneven(mine, group, sizes=bucket.sizes)
            # full is in rank order; every param's elements are contiguous in it
            for info in bucket.params:
                local_of(info.param).view(-1).copy_(full[info.offset : info.offset + info.numel])

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
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce-scatter grads, (clip,) step the inner optimizer, all-gather params.

        Args:
            closure: Optional closure that re-evaluates the model (called once, with
                grad enabled, before anything else).

        Returns:
            The global gradient norm (before clipping) when ``clip_grad_norm`` is set,
            else the closure's loss (or ``None``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce_scatter_grads()
        norm = None
        if self.clip_grad_norm is not None:
            norm = self.clip_grad_norm_(self.clip_grad_norm)
        self.optimizer.step()
        self._all_gather_params()
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

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state with per-parameter tensors as DTensors.

        Each sharded state tensor (e.g. ``exp_avg``) becomes a DTensor of the
        parameter's global shape on the mesh with the dp dim moved last (the mesh
        itself if dp is already its last dim): the parameter's placements on the other
        dims and ``RaggedShard(all dims, counts)`` on dp, where ``counts`` are the
        elements each dp rank owns. ``full_tensor()`` gives the unsharded state, and a
        checkpoint can reshard it to another dp size. Scalars (``step``) stay plain.
        With ``master_dtype`` the master weights are saved as ``"master_param"``.

        Returns:
            ``{"state": {index: {name: value}}, "param_groups": [...]}`` in the layout
            of ``torch.optim.Optimizer.state_dict()`` (parameter indices in order).
        """
        inner = self.optimizer.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for idx, info in enumerate(self._infos):
            st = inner["state"].get(idx)
            out: dict[str, Any] = {}
            if st is not None:
                for k, v in st.items():
                    out[k] = self._wrap(info, v) if self._is_sharded_state(info, k, v) else v
            if self.master_dtype is not None:
                out["master_param"] = self._wrap(info, info.shard.detach())
            if out:
                state[idx] = out
        return {"state": state, "param_groups": inner["param_groups"]}

    def _my_slice(self, info: _ParamInfo, v: torch.Tensor) -> torch.Tensor:
        """This rank's flat slice of a state tensor given in any layout."""
        p = info.param
        if isinstance(v, DTensor):
            if v.device_mesh is self._state_mesh and tuple(v.placements) == self._state_placements(
                info
            ):
                return local_of(v).reshape(-1)
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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, on any dp size.

        Sharded states may be DTensors in this optimizer's layout (loaded without
        communication), DTensors in any other layout (e.g. saved with another dp size:
        unsharded with ``full_tensor()`` and re-sliced) or full plain tensors of the
        parameter's shape. ``master_param`` entries overwrite the master copies and the
        parameters (all-gathered).
        """
        inner_state: dict[int, dict[str, Any]] = {}
        got_master = False
        for idx, info in enumerate(self._infos):
            st = state_dict["state"].get(idx, state_dict["state"].get(str(idx)))
            if st is None:
                continue
            new: dict[str, Any] = {}
            for k, v in st.items():
                if k == "master_param":
                    info.shard.copy_(self._my_slice(info, v).to(info.shard.dtype))
                    got_master = True
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
        self.optimizer.load_state_dict(
            {"state": inner_state, "param_groups": state_dict["param_groups"]}
        )
        if got_master:
            with torch.no_grad():
                self._all_gather_params()

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({self.optimizer_cls.__name__}, dp_dim="
            f"{dim_label(self.mesh, self.dp_dim)}, dp_size={self.dp_size}, "
            f"params={len(self._infos)}, master_dtype={self.master_dtype})"
        )
