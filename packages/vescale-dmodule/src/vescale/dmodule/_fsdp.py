"""Zero-copy fully sharded data parallelism on ``RaggedShard`` flat buffers.

`fully_shard` splits a module into *groups* (by default every element of an
``nn.ModuleList``, i.e. every transformer block, plus the root for the rest). The
parameters of a group are laid out by `vescale.ragged.plan_flat_buffers` in one
padding-free flat buffer per dtype, sharded over the data-parallel mesh dim by a
`vescale.ragged.FlatBuffer`. Each parameter becomes an ordinary leaf
``nn.Parameter`` DTensor whose placement on the dp dim is its ``RaggedShard`` and
whose local tensor is a view of the rank's slice, so any ``torch.optim`` optimizer
steps the shards directly.

Per group and step (``N`` ranks on the dp dim, ``P`` the group's parameter bytes):

* **forward pre-hook**: one all-gather of the whole slice lands directly in the
  unsharded buffer (no copy-in, no copy-out); the module's parameters are swapped
  to persistent leaf tensors that are views of that buffer; the next group's
  all-gather is started asynchronously (``prefetch``).
* **forward post-hook**: parameters swapped back to the sharded DTensors; with
  ``reshard_after_forward`` the unsharded storage is freed (``storage.resize_(0)``;
  the views and the tensors autograd saved keep pointing at the same storage).
* **pre-backward** (hook on the group's outputs): re-gather if resharded; allocate
  and zero the flat *gradient* buffer whose views are the unsharded leaves'
  ``.grad`` (autograd accumulates into them in place); prefetch the next group.
* **post-backward** (an identity autograd function on the group's inputs): free the
  unsharded parameters and start one asynchronous reduce-scatter (average) of the
  flat gradient buffer straight into the sharded gradient slice, whose views are the
  sharded parameters' ``.grad``. A group whose inputs need no gradient (the root)
  is reduced in the end-of-backward callback, which also waits for everything.

**Tensor parallelism.** DTensor parameters (e.g. from ``parallelize_module``) must be
``Replicate()`` on the dp dim and have one local shape on every rank (even
tensor-parallel shards). FSDP then shards each parameter's *TP-local* tensor: the
flat buffers hold ``p.to_local()``, so the all-gather over dp reassembles exactly the
TP-local shard. Mesh dims apply left to right, so "tp first, then dp" is written on
a view of the same ranks with the dp dim moved last (``engine.shard_mesh``, e.g.
``("tp", "dp")``): a sharded parameter is ``[<its tp placements>, RaggedShard]``
there, with the parameter's global shape. The unsharded compute parameters are
DTensors on the original mesh with the original placements, views of the unsharded
buffer, and their ``.grad`` are DTensors viewing the gradient buffer. A gradient
that arrives ``Partial`` on a tp dim (sequence parallelism: norms, row-parallel
biases) is reduced over tp by DTensor's in-place add as autograd accumulates it,
so the dp reduce-scatter sees complete TP-local gradients; ``parallelize_module``'s
own ``PartialGradSync`` is released (it watched the replaced parameters).

Bytes sent per rank and step (ring): ``3 (N-1)/N P`` with ``reshard_after_forward``,
``2 (N-1)/N P`` without; no bytes are copied besides the collectives (mixed
precision adds the casts, counted in `FSDPEngine.cast_copy_bytes`).

**HSDP** (``replicate_dim``): the sharded parameters are also ``Replicate()`` on a
second data-parallel dim (``R`` ranks). When a group's reduce-scatter has been
waited, one asynchronous ``all_reduce(AVG)`` of its sharded gradient runs over that
dim; the end-of-backward callback waits for them and then installs the gradients
(``+ 2 (R-1)/R P/N`` bytes per step).

**Activation checkpointing** (`._activation_checkpoint`): a group's forward may
run again in backward. `FSDPEngine.recompute_context` unshards and swaps in the
groups enclosing the recomputed module; the hooks of groups inside it see
`FSDPEngine.in_recompute` and only unshard and swap in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.dmodule import _compat
from vescale.dmodule._dp_common import (
    DP_STATE_ATTR,
    MixedPrecision,
    SyncToggle,
    cast_floating,
    check_dp_replicated,
    check_one_device,
    dp_last_mesh,
    local_tensor,
    param_paths,
    resolve_dp_dim,
    resolve_mixed_precision,
    swap_param,
)
from vescale.dtensor.hooks import weak_hook

__all__ = ["fully_shard", "FSDPEngine", "get_dp_engine", "no_sync"]


# every sharded parameter an engine made, by id (weak: an id counts while its tensor lives)
_SHARDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def get_dp_engine(module: nn.Module):
    """The DDP/FSDP engine of ``module`` (``None`` if it has none)."""
    return module.__dict__.get(DP_STATE_ATTR)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Accumulate gradients locally (no communication) in backward passes inside the block.

    A module without a data-parallel engine (tensor parallelism only, or a
    ``DistributedOptimizer`` that reduces gradients in ``step()``) has no gradient
    synchronisation to skip: the block then changes nothing, so one training loop
    runs under every engine.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_sync expects an nn.Module, got {type(module).__name__}")
    engine = get_dp_engine(module)
    if engine is None:
        yield
        return
    with engine.no_sync():
        yield


def _alloc(t: torch.Tensor) -> int:
    s = t.untyped_storage()
    need = t.numel() * t.element_size()
    if s.nbytes() >= need:
        return 0
    s.resize_(need)
    return need


def _free(t: torch.Tensor) -> int:
    s = t.untyped_storage()
    n = s.nbytes()
    if n:
        s.resize_(0)
    return n


def _is_alloc(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


@dataclasses.dataclass
class _Buf:
    """One dtype of one group."""

    fb: Any  # FlatBuffer (master dtype, sharded)
    names: list[str]
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    full: torch.Tensor  # unsharded params, compute dtype (storage freed when resharded)
    gfull: torch.Tensor  # unsharded grads, compute dtype (storage freed when reduced)
    gshard: torch.Tensor  # sharded grads, master dtype (persistent)
    cshard: torch.Tensor | None  # compute-dtype copy of the shard (mixed precision)
    sharded: dict[str, nn.Parameter]
    leaves: dict[str, torch.Tensor]
    grad_dts: dict[str, DTensor]
    trainable: list[str]
    # CPU offload: the shard (fb.local) and gshard live on the offload device; dshard
    # is the compute-device copy of the shard for the all-gather (storage freed after)
    dshard: torch.Tensor | None
    offloaded: bool


@dataclasses.dataclass
class _Group:
    index: int
    name: str
    module: nn.Module
    bufs: list[_Buf]
    paths: dict[str, list]  # param name -> module paths
    mp: MixedPrecision = dataclasses.field(default_factory=MixedPrecision)
    # None: FSDP2's default (False for the engine's root group, True for the others)
    reshard_after_forward: bool | None = True
    # set_requires_gradient_sync(False): this group's gradients accumulate locally
    sync: bool = True
    unsharded: bool = False
    swapped_in: bool = False
    gather_works: list = dataclasses.field(default_factory=list)
    gather_versions: list = dataclasses.field(default_factory=list)
    pre_bwd_done: bool = False
    post_bwd_done: bool = False
    # grad-enabled forwards whose backward has not reached the group's inputs yet
    # (several forwards before one backward: the group reduces after the last)
    fwd_pending: int = 0
    grads_live: bool = False
    used: dict[str, bool] = dataclasses.field(default_factory=dict)
    # whether a parameter's sharded gradient existed before this backward's reduction
    had_grad: dict[str, bool] = dataclasses.field(default_factory=dict)
    handles: list = dataclasses.field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return [n for b in self.bufs for n in b.names]

    def unsharded_bytes(self) -> int:
        return sum(b.full.numel() * b.full.element_size() for b in self.bufs)


class _UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, engine: FSDPEngine | None, group: _Group | None) -> None:
        self._engine = engine
        self._group = group

    def wait(self) -> None:
        """Wait for the all-gather; the module's parameters are the unsharded ones after."""
        if self._engine is None:
            return
        engine, g = self._engine, self._group
        self._engine = self._group = None
        engine._unshard(g)
        engine._swap(g, True)


class _PostBackward(torch.autograd.Function):
    """Identity on a group's inputs; its backward marks the group's backward as done."""

    @staticmethod
    def forward(ctx, engine, group, *inputs):  # type: ignore[override]
        ctx.engine = engine
        ctx.group = group
        return inputs

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.engine._post_backward(ctx.group)
        return (None, None, *grads)


class FSDPEngine(SyncToggle):
    """State and hooks of one `fully_shard`-ed module (see the module docs).

    Attributes:
        groups: The parameter groups, in module order (the root first).
        tensor_parallel: Whether the module's parameters were DTensors.
        shard_mesh: Mesh of the sharded parameters: ``mesh`` itself, or with tensor
            parallelism the same ranks with the dp dim moved last.
        offload_device: Device of the sharded parameters, their gradients and the
            optimizer state under CPU offload (``None``: no offload).
        cast_copy_bytes: Bytes written by mixed-precision casts (reset freely).
        offload_copy_bytes: Bytes copied between the offload device and the compute
            device (shards before their all-gather, gradient shards after their
            reduce-scatter; reset freely).
        peak_unsharded_bytes: Largest sum of unsharded parameter and gradient bytes
            allocated at once (reset freely).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        dp_dim: int,
        group_modules: list[tuple[str, nn.Module]],
        *,
        replicate_dim: int | None = None,
        reshard_after_forward: bool | None,
        prefetch: bool,
        mixed_precision: MixedPrecision | None,
        granularity,
        find_unused_parameters: bool,
        device: torch.device,
        offload_device: torch.device | None = None,
        pin_memory: bool = False,
        adopt: Sequence[FSDPEngine] = (),
        ignored: frozenset[int] = frozenset(),
    ) -> None:
        from vescale.ragged import FlatBuffer, layouts_from_tensors

        self.module = module
        self.mesh = mesh
        self.dp_dim = dp_dim
        self.world = mesh.size(dp_dim)
        self.pg = mesh.get_group(dp_dim)
        # HSDP: the sharded gradients are also averaged over this mesh dim
        self.replicate_dim = replicate_dim
        self.rep_world = 1 if replicate_dim is None else mesh.size(replicate_dim)
        self.rep_pg = None if replicate_dim is None else mesh.get_group(replicate_dim)
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.mp = mixed_precision or MixedPrecision()
        self.find_unused_parameters = find_unused_parameters
        self.offload_device = offload_device
        self.device = device
        self.cast_copy_bytes = 0
        self.offload_copy_bytes = 0
        self._own_copy_bytes = 0
        self.peak_unsharded_bytes = 0
        self._live_bytes = 0
        self._sync = True
        self._cb_queued = False
        self._fwd_order: list[_Group] = []
        self._cur_fwd_order: list[_Group] = []
        self._post_fwd_order: list[_Group] = []
        self._bwd_order: list[_Group] = []
        self._pending_reduce: tuple | None = None
        self._pending_rep: list[tuple[list, list]] = []
        self._recomputing = 0
        self._enclosing: dict[int, list[_Group]] = {}

        paths = param_paths(module)
        # parameters already sharded by the engines adopted here (fully_shard called on
        # submodules first) and ignored ones are not this call's to shard
        adopted = {
            id(sp) for e in adopt for g in e.groups for b in g.bufs for sp in b.sharded.values()
        }
        params = {
            id(p): p for p in module.parameters() if id(p) not in adopted and id(p) not in ignored
        }
        # the original parameters this engine replaced, by id (tied-weight checks; weak,
        # so an id is only taken for the tensor while that tensor lives)
        self.replaced: weakref.WeakValueDictionary = weakref.WeakValueDictionary(params)
        for e in adopt:
            self.replaced.update(e.replaced)
        # Tensor parallelism: DTensor parameters (Replicate on dp) are sharded as their
        # TP-local tensors; the sharded parameters live on the mesh with dp moved last.
        self.tensor_parallel = any(isinstance(p, DTensor) for p in params.values()) or any(
            e.tensor_parallel for e in adopt
        )
        self.shard_mesh = dp_last_mesh(mesh, dp_dim) if self.tensor_parallel else mesh
        owner = _assign_groups(group_modules, paths, params)
        rank = mesh.get_local_rank(dp_dim)
        self.groups: list[_Group] = []
        for gi, (gname, gmod) in enumerate(group_modules):
            mine = [params[i] for i in params if owner[i] == gi]
            if not mine:
                continue
            named = [(paths[id(p)][0][2], p) for p in mine]
            # Frozen and trainable parameters get separate buffers: a backward then
            # reduce-scatters the trainable buffer only (LoRA: the adapters, not the
            # frozen base weights, whose buffer has no gradient to reduce).
            # order="auto": the planner may reorder a buffer (same layout as the given
            # order for "element" granularity; less padding for coarse units)
            layouts = [
                item
                for subset in (
                    [(n, p) for n, p in named if p.requires_grad],
                    [(n, p) for n, p in named if not p.requires_grad],
                )
                if subset
                for item in layouts_from_tensors(
                    [(n, local_tensor(p)) for n, p in subset],
                    self.world,
                    granularity=granularity,
                    order="auto",
                ).items()
            ]
            by_name = dict(named)
            bufs = []
            for dtype, layout in layouts:
                start, stop = layout.rank_ranges[rank]
                if offload_device is not None:
                    # the shard (and the optimizer state made from it) on the offload device
                    fb = FlatBuffer(
                        layout,
                        mesh,
                        dp_dim,
                        local=torch.zeros(
                            stop - start, dtype=dtype, device=offload_device, pin_memory=pin_memory
                        ),
                    )
                else:
                    fb = FlatBuffer(layout, mesh, dp_dim, device=device)
                with torch.no_grad():
                    fb.load_full({n: local_tensor(by_name[n]).detach() for n in layout.names})
                compute = (
                    self.mp.param_dtype
                    if (self.mp.param_dtype is not None and dtype.is_floating_point)
                    else dtype
                )
                reduce = (
                    self.mp.reduce_dtype
                    if (self.mp.reduce_dtype is not None and dtype.is_floating_point)
                    else compute
                )
                full = torch.empty(layout.numel, dtype=compute, device=device)
                gfull = torch.empty(layout.numel, dtype=compute, device=device)
                gshard = torch.zeros(
                    stop - start, dtype=dtype, device=fb.local.device, pin_memory=pin_memory
                )
                cshard = (
                    torch.empty(fb.local.numel(), dtype=compute, device=device)
                    if compute != dtype
                    else None
                )
                dshard = (
                    torch.empty(fb.local.numel(), dtype=dtype, device=device)
                    if offload_device is not None and cshard is None
                    else None
                )
                sharded, leaves, grad_dts, trainable = {}, {}, {}, []
                from vescale.dtensor import from_local

                for slot in layout.params:
                    orig = by_name[slot.name]
                    geo, geo_kw = self._geometry(orig, fb, slot)
                    sp = nn.Parameter(
                        from_local(fb.local_view(slot.name).detach(), *geo, **geo_kw),
                        requires_grad=orig.requires_grad,
                    )
                    sharded[slot.name] = sp
                    _SHARDED[id(sp)] = sp
                    view = full[slot.offset : slot.stop].view(slot.shape)
                    leaf = nn.Parameter(self._compute(orig, view), requires_grad=orig.requires_grad)
                    leaves[slot.name] = leaf
                    if orig.requires_grad:
                        trainable.append(slot.name)
                    if dtype.is_floating_point:  # may require grad later (unfrozen)
                        gview = gfull[slot.offset : slot.stop].view(slot.shape)
                        leaf.grad = self._compute(orig, gview)
                        grad_dts[slot.name] = from_local(
                            fb.local_view(slot.name, gshard), *geo, **geo_kw
                        )
                _free(full)
                _free(gfull)
                if dshard is not None:
                    _free(dshard)
                bufs.append(
                    _Buf(
                        fb,
                        list(layout.names),
                        dtype,
                        compute,
                        reduce,
                        full,
                        gfull,
                        gshard,
                        cshard,
                        sharded,
                        leaves,
                        grad_dts,
                        trainable,
                        dshard,
                        offload_device is not None,
                    )
                )
            g = _Group(
                len(self.groups),
                gname,
                gmod,
                bufs,
                {n: paths[id(by_name[n])] for n in by_name},
                # outputs are cast where the module given to fully_shard returns them
                mp=self.mp if gmod is module else dataclasses.replace(self.mp, output_dtype=None),
                reshard_after_forward=reshard_after_forward,
            )
            self.groups.append(g)
        # register the sharded parameters on the module (tied aliases included)
        for g in self.groups:
            for b in g.bufs:
                for n, sp in b.sharded.items():
                    swap_param(g.paths[n], sp)
        # the FSDP2 idiom (fully_shard on submodules, then on the root): this engine
        # takes over the submodules' groups as they are (their sharded parameters,
        # which an optimizer may already hold, stay the same objects)
        for e in adopt:
            for g in e.groups:
                for h in g.handles:
                    h.remove()
                g.handles = []
                self.groups.append(g)
            e.groups = []
        names = {id(m): n for n, m in module.named_modules()}
        order = {n: i for i, n in enumerate(names.values())}
        self.groups.sort(key=lambda g: order[names[id(g.module)]])
        for i, g in enumerate(self.groups):
            g.index = i
            g.name = names[id(g.module)]
        self._hooked: set[tuple[int, str]] = set()
        for g in self.groups:
            for b in g.bufs:
                for n in b.trainable:
                    self._hook_leaf(g, b, n)
        self._requires_grad_key = self._requires_grad_now()
        self._fwd_order = list(self.groups)
        self.root = next((g for g in self.groups if g.module is module), None)
        for g in self.groups:
            g.handles.append(
                g.module.register_forward_pre_hook(self._hook_pre(g), with_kwargs=True)
            )
            g.handles.append(g.module.register_forward_hook(self._hook_post(g)))
        self._handles = []
        if self.root is None and self.mp.output_dtype is not None:
            dtype = self.mp.output_dtype
            self._handles.append(
                module.register_forward_hook(lambda m, a, out: cast_floating(out, dtype))
            )

    def _hook_leaf(self, g: _Group, b: _Buf, n: str) -> None:
        if (g.index, n) in self._hooked:
            return
        self._hooked.add((g.index, n))
        g.handles.append(
            b.leaves[n].register_hook(weak_hook(FSDPEngine._grad_guard, self, g.index))
        )
        if self.find_unused_parameters:
            g.used[n] = False
            g.handles.append(
                b.leaves[n].register_post_accumulate_grad_hook(weak_hook(_mark_used, g, n))
            )

    def _requires_grad_now(self) -> tuple[bool, ...]:
        return tuple(
            sp.requires_grad for g in self.groups for b in g.bufs for sp in b.sharded.values()
        )

    def _sync_requires_grad(self) -> None:
        """Follow ``requires_grad`` changes the user made on the sharded parameters.

        The unsharded leaves that autograd sees get the same flag, so a parameter
        frozen (or unfrozen) between steps gets a gradient exactly when it would on
        one device.
        """
        key = self._requires_grad_now()
        if key == self._requires_grad_key:
            return
        self._requires_grad_key = key
        for g in self.groups:
            for b in g.bufs:
                for n, sp in b.sharded.items():
                    if sp.requires_grad and n not in b.grad_dts:
                        raise ValueError(
                            f"fully_shard: parameter {n!r} ({sp.dtype}) cannot require grad"
                        )
                    b.leaves[n].requires_grad_(sp.requires_grad)
                b.trainable = [n for n in b.names if b.sharded[n].requires_grad]
                for n in b.trainable:
                    self._hook_leaf(g, b, n)

    # ------------------------------------------------------------------ geometry
    def _geometry(self, orig: torch.Tensor, fb, slot) -> tuple:
        """``(mesh, placements)`` + ``shape=``/``stride=`` of a sharded parameter."""
        if not self.tensor_parallel:
            return (self.mesh, fb.placements(slot.name)), {"shape": slot.shape}
        d = self.dp_dim
        orig_pl = (
            tuple(orig.placements) if isinstance(orig, DTensor) else (Replicate(),) * self.mesh.ndim
        )
        others = [orig_pl[i] for i in range(self.mesh.ndim) if i != d]
        return (self.shard_mesh, (*others, slot.placement)), {
            "shape": tuple(orig.shape),
            "stride": tuple(orig.stride()),
        }

    def _compute(self, orig: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """The compute form of an unsharded view: a DTensor like ``orig`` if it is one."""
        if not isinstance(orig, DTensor):
            return view
        from vescale.dtensor import from_local

        return from_local(
            view,
            self.mesh,
            tuple(orig.placements),
            shape=tuple(orig.shape),
            stride=tuple(orig.stride()),
        )

    # ------------------------------------------------------------------ public
    @property
    def extra_copy_bytes(self) -> int:
        """Bytes copied besides collectives and casts (flat buffers + accumulation)."""
        return self._own_copy_bytes + sum(
            b.fb.extra_copy_bytes for g in self.groups for b in g.bufs
        )

    def reset_counters(self) -> None:
        self._own_copy_bytes = 0
        self.cast_copy_bytes = 0
        self.peak_unsharded_bytes = 0
        for g in self.groups:
            for b in g.bufs:
                b.fb.extra_copy_bytes = 0

    def flat_buffers(self):
        """``[(group name, FlatBuffer), ...]``."""
        return [(g.name, b.fb) for g in self.groups for b in g.bufs]

    def padding_numel(self) -> int:
        return sum(b.fb.layout.padding for g in self.groups for b in g.bufs)

    def largest_group_bytes(self) -> int:
        """Largest group's unsharded parameter + gradient bytes (compute dtype)."""
        return max(2 * g.unsharded_bytes() for g in self.groups)

    def engine_tensors(self) -> list[torch.Tensor]:
        out = []
        for g in self.groups:
            for b in g.bufs:
                out += [b.gshard, b.full, b.gfull]
                if b.cshard is not None:
                    out.append(b.cshard)
                if b.dshard is not None:
                    out.append(b.dshard)
        return out

    def unsharded_views(self, group: int = 0) -> dict[str, torch.Tensor]:
        """The persistent unsharded parameter leaves of a group (views of its buffer)."""
        return {n: t for b in self.groups[group].bufs for n, t in b.leaves.items()}

    # ------------------------------------------------------------------ per-module control
    def module_group(self, module: nn.Module) -> _Group | None:
        """The group whose module is ``module`` (``None``: it has no parameters of its own)."""
        return next((g for g in self.groups if g.module is module), None)

    def groups_under(self, module: nn.Module, recurse: bool) -> list[_Group]:
        """``module``'s own group and, with ``recurse``, every group inside ``module``."""
        if not recurse:
            g = self.module_group(module)
            return [] if g is None else [g]
        inside = {id(m) for m in module.modules()}
        return [g for g in self.groups if id(g.module) in inside]

    def unshard_module(self, module: nn.Module, async_op: bool = False) -> _UnshardHandle:
        """All-gather ``module``'s own group and register its unsharded parameters."""
        g = self.module_group(module)
        if g is None:
            return _UnshardHandle(None, None)
        self._start_unshard(g, async_op=async_op)
        handle = _UnshardHandle(self, g)
        if not async_op:
            handle.wait()
        return handle

    def reshard_module(self, module: nn.Module) -> None:
        """Register ``module``'s sharded parameters again and free the unsharded ones."""
        g = self.module_group(module)
        if g is None:
            return
        self._swap(g, False)
        self._reshard(g)

    # ------------------------------------------------------------------ buffers
    def _track(self, delta: int) -> None:
        self._live_bytes += delta
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, self._live_bytes)

    def _start_unshard(self, g: _Group, async_op: bool) -> None:
        if g.unsharded or g.gather_works:
            return
        g.gather_versions = [b.full._version for b in g.bufs]
        for b in g.bufs:
            self._track(_alloc(b.full))
            src = b.fb.local
            with torch.no_grad(), _compat.preserve_version_counter(b.full):
                nbytes = src.numel() * src.element_size()
                if b.cshard is not None:
                    # the cast also moves an offloaded shard to the compute device
                    b.cshard.copy_(src, non_blocking=b.offloaded)
                    self.cast_copy_bytes += b.cshard.numel() * b.cshard.element_size()
                    if b.offloaded:
                        self.offload_copy_bytes += nbytes
                    src = b.cshard
                elif b.dshard is not None:
                    _alloc(b.dshard)
                    b.dshard.copy_(src, non_blocking=True)
                    self.offload_copy_bytes += nbytes
                    src = b.dshard
                if self.world == 1:
                    b.full.copy_(src)
                    if b.cshard is None:
                        self._own_copy_bytes += src.numel() * src.element_size()
                elif b.fb.layout.even:
                    w = _compat.all_gather_single(b.full, src, group=self.pg, async_op=async_op)
                    if async_op:
                        g.gather_works.append(w)
                else:
                    if b.cshard is not None or b.dshard is not None:
                        raise NotImplementedError(
                            "mixed precision and CPU offload need an even flat layout "
                            "(granularity='element')"
                        )
                    b.fb.all_gather(b.full)
        if not g.gather_works:
            g.unsharded = True
            self._free_staging(g)

    def _free_staging(self, g: _Group) -> None:
        for b in g.bufs:
            if b.dshard is not None:
                _free(b.dshard)

    def _unshard(self, g: _Group) -> None:
        if g.unsharded:
            return
        if g.gather_works:
            self._wait_gather(g)
            g.unsharded = True
            return
        self._start_unshard(g, async_op=False)

    def _wait_gather(self, g: _Group) -> None:
        # Work.wait() bumps the output's version counter; the unsharded buffer's
        # views may be saved for backward, so keep their version.
        # gloo bumps it on its own thread, so restore the version after waiting.
        fulls = tuple(b.full for b in g.bufs)
        versions = tuple(g.gather_versions)
        for w in g.gather_works:
            w.wait()
        _compat.set_version_counters(fulls, versions)
        g.gather_works.clear()
        self._free_staging(g)

    def _reshard(self, g: _Group) -> None:
        if g.gather_works:
            self._wait_gather(g)
        for b in g.bufs:
            self._track(-_free(b.full))
        g.unsharded = False

    def _prepare_grads(self, g: _Group) -> None:
        if g.grads_live:
            return
        for b in g.bufs:
            if b.trainable:
                self._track(_alloc(b.gfull))
                b.gfull.zero_()
        g.grads_live = True
        for n in g.used:
            g.used[n] = False

    def _swap(self, g: _Group, unsharded: bool) -> None:
        for b in g.bufs:
            src = b.leaves if unsharded else b.sharded
            for n, t in src.items():
                swap_param(g.paths[n], t)
        g.swapped_in = unsharded

    # ------------------------------------------------------------------ recomputation
    def in_recompute(self) -> bool:
        """Whether a forward running now is an activation-checkpoint recomputation.

        True inside `recompute_context` and whenever a forward runs inside the
        autograd engine (a non-reentrant ``torch.utils.checkpoint`` recomputes from a
        saved-tensor unpack hook during backward).
        """
        return self._recomputing > 0 or _compat.in_backward()

    @contextlib.contextmanager
    def recompute_context(self, module: nn.Module):
        """Run an activation-checkpoint recomputation of ``module`` (a submodule).

        The groups whose module contains ``module`` (its own group and the enclosing
        ones, whose forward hooks do not run again) are unsharded if needed and their
        unsharded parameters swapped in; groups inside ``module`` do it in their own
        forward hooks, which only do that while recomputing (no forward-order
        recording, prefetch, resharding, pre-backward hooks or post-backward
        wrapping: those belong to the original forward). On exit every group swapped
        in during the recomputation gets its sharded parameters back (a recomputation
        may stop early, before inner groups' forward hooks ran); groups stay
        unsharded until their post-backward reshards them.
        """
        enclosing = self._enclosing.get(id(module))
        if enclosing is None:
            enclosing = [g for g in self.groups if any(m is module for m in g.module.modules())]
            self._enclosing[id(module)] = enclosing
        before = {g.index for g in self.groups if g.swapped_in}
        self._recomputing += 1
        try:
            for g in enclosing:
                self._unshard(g)
                self._swap(g, True)
            yield
        finally:
            self._recomputing -= 1
            for g in self.groups:
                if g.swapped_in and g.index not in before:
                    self._swap(g, False)

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _cast_inputs(g: _Group, flat: list) -> list:
        mp_dtype = g.mp.param_dtype if g.mp.cast_forward_inputs else None
        return cast_floating(flat, mp_dtype)

    def _reshards_after_forward(self, g: _Group) -> bool:
        if g.reshard_after_forward is None:  # FSDP2's default: all but the root
            return g is not self.root
        return g.reshard_after_forward

    def _hook_pre(self, g: _Group) -> Callable:
        def hook(module, args, kwargs):
            if self.in_recompute():
                # activation-checkpoint recomputation in backward: only the parameters
                self._unshard(g)
                self._swap(g, True)
                if not torch.is_grad_enabled():
                    return None
                flat, spec = _compat.tree_flatten((args, kwargs))
                return _compat.tree_unflatten(self._cast_inputs(g, flat), spec)
            if g is self.root or (self.root is None and g is self._fwd_order[0]):
                self._begin_forward()
            self._cur_fwd_order.append(g)
            self._unshard(g)
            self._swap(g, True)
            if self.prefetch:
                order = self._fwd_order
                if g in order:
                    i = order.index(g)
                    if i + 1 < len(order):
                        self._start_unshard(order[i + 1], async_op=True)
            if not torch.is_grad_enabled():
                return None
            flat, spec = _compat.tree_flatten((args, kwargs))
            flat = self._cast_inputs(g, flat)
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if idx:
                outs = _PostBackward.apply(self, g, *[flat[i] for i in idx])
                g.fwd_pending += 1
                for i, t in zip(idx, outs):
                    flat[i] = t
            return _compat.tree_unflatten(flat, spec)

        return hook

    def _hook_post(self, g: _Group) -> Callable:
        def hook(module, args, output):
            self._swap(g, False)
            out_dtype = g.mp.output_dtype
            if out_dtype is not None:
                output = cast_floating(output, out_dtype)
            result = None if out_dtype is None else output
            if self.in_recompute():
                return result  # stays unsharded until its post-backward
            self._post_fwd_order.append(g)
            if not torch.is_grad_enabled():
                self._reshard(g)
                return result
            if self._reshards_after_forward(g):
                self._reshard(g)
            flat, _ = _compat.tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_pre_backward(g))
            return result

        return hook

    def _begin_forward(self) -> None:
        if any(g.fwd_pending for g in self.groups):
            return  # another forward before the backward of the previous one
        self._sync_requires_grad()
        if self._cur_fwd_order:
            self._fwd_order = self._cur_fwd_order
        self._cur_fwd_order = []
        self._post_fwd_order = []
        for g in self.groups:
            g.pre_bwd_done = False
            g.post_bwd_done = False

    def _grad_guard(self, group: int, grad: torch.Tensor) -> None:
        """Hook run before autograd accumulates into an unsharded leaf's ``.grad``.

        The leaves' gradients are views of the group's flat gradient buffer, whose
        storage is freed between backward passes: accumulating into it then would
        write to freed memory. The buffer is normally allocated by the pre-backward
        hook on the group's outputs; this makes sure of it even when that hook did not
        fire (outputs autograd reached another way), and refuses a gradient that
        arrives after the group's gradients were already reduced.
        """
        g = self.groups[group]
        if g.post_bwd_done and self._sync and g.sync:
            raise RuntimeError(
                f"fully_shard: a gradient for a parameter of group {g.name or '<root>'!r} "
                "arrived after that group's gradients were reduced; a group must run "
                "once per forward (a module called twice, or a parameter used outside "
                "its group, is not supported)"
            )
        if not g.grads_live:
            self._prepare_grads(g)

    def _make_pre_backward(self, g: _Group) -> Callable:
        def hook(grad):
            self._pre_backward(g)
            return None

        return hook

    def _pre_backward(self, g: _Group) -> None:
        if g.pre_bwd_done:
            return
        g.pre_bwd_done = True
        if not self._cb_queued:
            self._cb_queued = True
            self._bwd_order = list(reversed(self._post_fwd_order))
            _compat.queue_callback(self._finish_backward)
        self._unshard(g)
        self._prepare_grads(g)
        if self.prefetch and g in self._bwd_order:
            i = self._bwd_order.index(g)
            for h in self._bwd_order[i + 1 :]:
                if not h.pre_bwd_done:
                    self._start_unshard(h, async_op=True)
                    break

    def _post_backward(self, g: _Group, final: bool = False) -> None:
        if g.post_bwd_done:
            return
        if not final:
            g.fwd_pending -= 1
            if g.fwd_pending > 0:
                return  # an earlier forward of the group still has its backward to run
        g.fwd_pending = 0
        g.post_bwd_done = True
        self._reshard(g)
        if not g.grads_live:
            self._prepare_grads(g)
        if not (self._sync and g.sync):
            return
        self._wait_reduce()
        self._pending_reduce = (g, self._start_reduce(g))

    @torch.no_grad()
    def _start_reduce(self, g: _Group) -> list:
        pending = []
        for b in g.bufs:
            if not b.trainable:
                continue
            src = b.gfull
            if b.reduce_dtype != b.compute_dtype:
                tmp = torch.empty(b.gfull.numel(), dtype=b.reduce_dtype, device=src.device)
                tmp.copy_(src)
                self.cast_copy_bytes += tmp.numel() * tmp.element_size()
                self._track(-_free(b.gfull))
                src = tmp
            had = {n: b.sharded[n].grad is not None for n in b.grad_dts}
            g.had_grad.update(had)
            fresh = not any(had.values())
            if fresh and b.reduce_dtype == b.master_dtype and not b.offloaded:
                dst = b.gshard
            else:
                dst = torch.empty(b.gshard.numel(), dtype=b.reduce_dtype, device=src.device)
            if self.world == 1:
                dst.copy_(src)
                self._own_copy_bytes += dst.numel() * dst.element_size()
                work = None
            elif b.fb.layout.even:
                work = _compat.reduce_scatter_single(
                    dst, src, op=dist.ReduceOp.AVG, group=self.pg, async_op=True
                )
            else:
                b.fb.reduce_scatter(src, dst, op="avg")
                work = None
            pending.append((b, work, src, dst, fresh))
        return pending

    @torch.no_grad()
    def _wait_reduce(self) -> None:
        """Wait for the pending reduce-scatter; HSDP: start its replicate all-reduce."""
        if self._pending_reduce is None:
            return
        g, pending = self._pending_reduce
        self._pending_reduce = None
        done = []
        for b, work, src, dst, fresh in pending:
            if work is not None:
                work.wait()
            if src is b.gfull:
                self._track(-_free(b.gfull))
            done.append((b, dst, fresh))
        g.grads_live = False
        if self.rep_world > 1:
            # The sharded gradient (``dst``, referenced here until the work is waited)
            # is averaged over the replicate dim while backward goes on.
            works = [
                dist.all_reduce(dst, op=dist.ReduceOp.AVG, group=self.rep_pg, async_op=True)
                for _b, dst, _f in done
            ]
            self._pending_rep.append((done, works))
        else:
            self._finish_reduce(done)

    @torch.no_grad()
    def _wait_replicate(self) -> None:
        """HSDP: wait for the replicate all-reduces, then install the gradients."""
        pending, self._pending_rep = self._pending_rep, []
        for done, works in pending:
            for w in works:
                w.wait()
            self._finish_reduce(done)

    @torch.no_grad()
    def _finish_reduce(self, done: list) -> None:
        for b, dst, fresh in done:
            if dst is not b.gshard:
                if fresh:
                    # one copy: the cast to the master dtype and/or to the offload device
                    b.gshard.copy_(dst)
                    if b.offloaded:
                        self.offload_copy_bytes += dst.numel() * dst.element_size()
                    if dst.dtype != b.gshard.dtype:
                        self.cast_copy_bytes += b.gshard.numel() * b.gshard.element_size()
                else:
                    if b.offloaded:
                        dst = dst.to(b.gshard.device)
                        self.offload_copy_bytes += dst.numel() * dst.element_size()
                    for n in b.trainable:
                        piece = b.fb.local_view(n, dst)
                        sp = b.sharded[n]
                        if sp.grad is None:
                            b.fb.local_view(n, b.gshard).copy_(piece)
                        else:
                            local_tensor(sp.grad).add_(piece) if isinstance(
                                sp.grad, DTensor
                            ) else sp.grad.add_(piece)
                        self._own_copy_bytes += piece.numel() * piece.element_size()
            for n in b.trainable:
                sp = b.sharded[n]
                if sp.grad is None:
                    sp.grad = b.grad_dts[n]

    def _finish_backward(self) -> None:
        self._cb_queued = False
        for g in reversed(self._post_fwd_order):
            if not g.post_bwd_done:
                self._post_backward(g, final=True)
        self._wait_reduce()
        self._wait_replicate()
        for g in self.groups:
            if g.unsharded or g.gather_works:
                self._reshard(g)
        if self._sync and self.find_unused_parameters:
            self._drop_unused_grads()
        for g in self.groups:
            g.pre_bwd_done = False
            g.post_bwd_done = False
            g.fwd_pending = 0

    def _drop_unused_grads(self) -> None:
        # groups under set_requires_gradient_sync(False) keep accumulating locally
        names = [(g, b, n) for g in self.groups if g.sync for b in g.bufs for n in b.trainable]
        if not names:
            return
        # a gradient accumulated earlier (or kept by zero_grad(set_to_none=False)) stays
        flags = torch.tensor(
            [1.0 if g.used.get(n, False) or g.had_grad.get(n, False) else 0.0 for g, _, n in names],
            device=self.device,
        )
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
        if self.rep_world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.rep_pg)
        for (g, b, n), f in zip(names, flags.tolist()):
            if f == 0.0:
                b.sharded[n].grad = None
            g.used[n] = False


def _mark_used(g: _Group, name: str, _param: torch.Tensor) -> None:
    g.used[name] = True


def _assign_groups(group_modules, paths, params) -> dict[int, int]:
    """Owner group of every parameter: the deepest group containing all of its uses."""
    names = [n for n, _ in group_modules]

    def chain(mod_qual: str) -> list[int]:
        out = []
        for gi, gname in enumerate(names):
            if gname == "" or mod_qual == gname or mod_qual.startswith(gname + "."):
                out.append(gi)
        return out

    owner = {}
    for pid in params:
        common: set[int] | None = None
        for _m, _a, qual in paths[pid]:
            mod_qual = qual.rpartition(".")[0]
            c = set(chain(mod_qual))
            common = c if common is None else common & c
        assert common, "the root group contains every parameter"
        owner[pid] = max(common, key=lambda gi: len(names[gi]))
    return owner


def _default_groups(module: nn.Module) -> list[str]:
    """Every element of an ``nn.ModuleList`` (transformer blocks), outermost lists only."""
    out: list[str] = []
    for name, mod in module.named_modules():
        if isinstance(mod, nn.ModuleList) and not any(
            name.startswith(o + ".") or name == o for o in out
        ):
            # registered keys, not range(len): a pipeline stage holds only its own blocks
            keys = [k for k, c in mod._modules.items() if c is not None]
            out.extend(f"{name}.{k}" if name else k for k in keys)
    return out


def _resolve_reshard(value: Any, world: int, what: str) -> bool | None:
    """``reshard_after_forward`` as FSDP2 takes it: a bool, ``None``, or a world size."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"{what}: reshard_after_forward must be a bool, None or an int, got {value!r}"
        )
    if value < 1 or value > world or world % value:
        raise ValueError(
            f"{what}: reshard_after_forward={value} must divide the data-parallel world "
            f"size {world} (an int is the number of ranks to reshard to after forward)"
        )
    if value == 1:
        return False
    if value == world:
        return True
    raise NotImplementedError(
        f"{what}: reshard_after_forward={value} (resharding to {value} of {world} ranks after "
        "forward) is not supported; use True (reshard to all ranks) or False (keep the "
        "unsharded parameters until backward)"
    )


def _resolve_offload(
    policy: Any, device: torch.device, what: str
) -> tuple[torch.device | None, bool]:
    """``(offload device, pin memory)`` from torch's ``OffloadPolicy`` / ``CPUOffloadPolicy``."""
    if policy is None:
        return None, False
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(policy, CPUOffloadPolicy):
        # pinned host memory makes the copies to and from the GPU asynchronous; it needs CUDA
        pin = bool(policy.pin_memory) and device.type == "cuda" and torch.cuda.is_available()
        return torch.device("cpu"), pin
    if isinstance(policy, OffloadPolicy):  # the base class: no offload
        return None, False
    raise TypeError(
        f"{what}: offload_policy must be a torch.distributed.fsdp.CPUOffloadPolicy or "
        f"OffloadPolicy, got {type(policy).__name__}"
    )


def _child_engines(
    module: nn.Module, mesh: DeviceMesh, dim: int, rep_dim: int | None, what: str
) -> list[FSDPEngine]:
    """FSDP engines of submodules already passed to ``fully_shard`` (the FSDP2 idiom).

    Raises (before any collective) if the module itself is wrapped, a submodule is DDP,
    or a submodule's engine is on another mesh or dims.
    """
    own = module.__dict__.get(DP_STATE_ATTR)
    if own is not None:
        raise ValueError(
            f"{what}: the module is already data-parallel ({type(own).__name__}); a module "
            "can be wrapped by replicate()/fully_shard() only once"
        )
    inside = {id(m) for m in module.modules()}
    found: list[FSDPEngine] = []
    for name, sub in module.named_modules():
        state = sub.__dict__.get(DP_STATE_ATTR)
        if state is None or any(state is e for e in found):
            continue
        if not isinstance(state, FSDPEngine):
            raise ValueError(
                f"{what}: submodule {name!r} is already data-parallel ({type(state).__name__}); "
                "fully_shard() can only take over submodules that fully_shard() wrapped"
            )
        if id(state.module) not in inside:
            raise ValueError(
                f"{what}: submodule {name!r} is already sharded by fully_shard() on an "
                "enclosing module; call fully_shard() on submodules first, then on the root"
            )
        same_mesh = state.mesh.device_type == mesh.device_type and torch.equal(
            state.mesh.mesh, mesh.mesh
        )
        if not same_mesh or state.dp_dim != dim or state.replicate_dim != rep_dim:
            raise ValueError(
                f"{what}: submodule {name!r} was sharded on mesh {state.mesh.mesh.tolist()} "
                f"(dp dim {state.dp_dim}, replicate dim {state.replicate_dim}) but this call "
                f"uses mesh {mesh.mesh.tolist()} (dp dim {dim}, replicate dim {rep_dim}); every "
                "fully_shard() of one model must use the same mesh and dims"
            )
        found.append(state)
    return found


def _default_mesh() -> DeviceMesh:
    """FSDP2's default: a 1-D mesh over every rank of the default process group."""
    from vescale.dtensor import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: mesh=None needs an initialised default process group "
            "(torch.distributed.init_process_group, or torchrun)"
        )
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    dp_dim: int | str = 0,
    *,
    replicate_dim: int | str | None = None,
    groups: Sequence[str | nn.Module] | Callable[[str, nn.Module], bool] | None = None,
    reshard_after_forward: bool | int | None = True,
    prefetch: bool = True,
    mixed_precision: MixedPrecision | Any | None = None,
    mp_policy: Any | None = None,
    offload_policy: Any | None = None,
    granularity: Any = "element",
    find_unused_parameters: bool = True,
    ignored_params: Any | None = None,
    shard_placement_fn: Callable | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the mesh dim ``dp_dim`` (FSDP), in place.

    Both call styles work: ``fully_shard(model, mesh, "dp", ...)`` wraps the whole model
    at once (every ``nn.ModuleList`` element becomes a group), and FSDP2's
    ``for layer in model.layers: fully_shard(layer, mesh=mesh)`` then
    ``fully_shard(model, mesh=mesh)``: each call shards the module's remaining
    parameters at once (build the optimizer after the last call), and a call on a
    module whose submodules were wrapped before takes their groups over unchanged into
    one engine, the submodules' groups running in module order with the outer module's
    parameters as its own group.

    Args:
        module: The module; its parameters must be on one device of the mesh's type,
            with the same values on every rank of the dp dim: plain tensors, or
            DTensors on ``mesh`` that are ``Replicate()`` on ``dp_dim`` (tensor
            parallelism, e.g. from ``parallelize_module``) with evenly sized local
            shards.
        mesh: Device mesh; plain parameters become ``RaggedShard`` on ``dp_dim`` and
            ``Replicate()`` on every other dim. With DTensor parameters every
            parameter lives on ``engine.shard_mesh`` (``mesh`` with ``dp_dim`` moved
            last) as ``[<other dims' placements>, RaggedShard]``: the ``RaggedShard``
            cuts the TP-local tensor. ``None`` (FSDP2's default): a 1-D mesh over
            every rank of the default process group.
        dp_dim: Name or index of the data-parallel mesh dim the parameters are
            sharded over.
        replicate_dim: HSDP: name or index of a second data-parallel mesh dim over
            which the sharded parameters are replicated (``Replicate()`` there). After
            each group's gradient reduce-scatter over ``dp_dim``, the sharded
            gradient is averaged over this dim by one asynchronous all-reduce
            (``2 (R-1)/R P/N`` more bytes per step, ``R`` its size), waited at the
            end of backward. ``None``: plain FSDP.
        groups: Submodules gathered together (one flat buffer per group and dtype):
            names from ``named_modules()`` (regexes, full match), modules, or a
            predicate ``(name, module) -> bool``. The root is always a group and
            takes the remaining parameters. Default: every element of an
            ``nn.ModuleList`` (transformer blocks); when submodules were already
            wrapped by ``fully_shard`` (FSDP2's idiom), FSDP2's default: none, the
            module's remaining parameters form one group.
        reshard_after_forward: Free each group's unsharded parameters after its
            forward and gather them again in backward (3 (N-1)/N P bytes per step
            instead of 2 (N-1)/N P, less memory). ``None``: FSDP2's default, ``True``
            for groups inside an outer ``fully_shard`` and ``False`` for the engine's
            root group. An int is FSDP2's number of ranks to reshard to: the dp size
            (``True``) or 1 (``False``); other divisors raise ``NotImplementedError``.
        prefetch: Start the next group's all-gather asynchronously, in forward and
            in backward.
        mixed_precision: `MixedPrecision` (or torch's ``MixedPrecisionPolicy``);
            e.g. ``MixedPrecision(torch.bfloat16, torch.float32)`` computes in bf16
            with fp32 sharded masters and an fp32 gradient reduce-scatter.
        mp_policy: FSDP2's name for ``mixed_precision`` (a
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` or `MixedPrecision`).
        offload_policy: ``torch.distributed.fsdp.CPUOffloadPolicy()``: the sharded
            parameters, their gradients and so the optimizer state and step live in
            CPU memory (pinned where CUDA exists); each group's shard is copied to the
            compute device before its all-gather and each gradient shard back after
            its reduce-scatter (``engine.offload_copy_bytes``). On a CPU mesh the
            placement does not change but the copies still run. ``None`` or
            ``OffloadPolicy()``: no offload.
        granularity: Where the planner may cut a parameter (``"element"``,
            ``"row"`` or a block shape; see `vescale.ragged`).
        find_unused_parameters: Parameters that have no gradient on any rank (unused
            in this backward and none accumulated before) keep ``grad = None``, as in
            single-device training, at the cost of one tiny all-reduce (a flag per
            parameter) per backward. ``False`` saves it: such parameters then get zero
            gradients, which optimizers with weight decay or momentum step, unlike on
            one device.
        ignored_params: Parameters left as they are (not sharded, gradients not
            reduced), as in FSDP2.
        shard_placement_fn: FSDP2's per-parameter ``Shard`` placements; only
            ``None`` (every group is one ``RaggedShard`` flat buffer).

    Returns:
        ``module`` itself, its class swapped for a subclass of
        `FullyShardedModule` and the original class (``unshard()``,
        ``reshard()``, ``set_requires_gradient_sync()``, ...); its engine is
        ``get_dp_engine(module)`` (`FSDPEngine`).

    Raises:
        ValueError: ``dp_dim`` (or ``replicate_dim``) not in the mesh, both the same
            dim, the module already data-parallel (or inside a ``fully_shard``-ed
            module, or a submodule DDP or sharded on another mesh), a parameter
            shared between an already wrapped submodule and the rest of the module,
            parameters on several devices or not on the mesh's device type, a group
            name that matches nothing, a DTensor parameter on another mesh, not
            ``Replicate()`` on ``dp_dim``, ``Partial``, or with local shards of
            different shapes on different ranks (uneven tensor-parallel sharding),
            naming the parameter. All before any collective.
        TypeError: A malformed ``mp_policy``/``offload_policy``/``reshard_after_forward``.
        NotImplementedError: ``shard_placement_fn``, or an int
            ``reshard_after_forward`` other than 1 and the dp size.
    """
    what = "fully_shard"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # as FSDP2: the hooks that gather and reduce run around forward()
        raise ValueError(
            f"{what}: does not support containers that do not implement forward: "
            f"{type(module).__name__}; wrap its elements (or the module that calls them)"
        )
    if shard_placement_fn is not None:
        raise NotImplementedError(
            f"{what}: shard_placement_fn is not supported; vescale lays each group's "
            "parameters into one RaggedShard flat buffer (choose the cut with granularity=)"
        )
    if mesh is None:
        mesh = _default_mesh()
    dim = resolve_dp_dim(mesh, dp_dim)
    rep_dim = None if replicate_dim is None else resolve_dp_dim(mesh, replicate_dim)
    if rep_dim == dim:
        raise ValueError(
            f"{what}: replicate_dim {replicate_dim!r} is the sharded dim {dp_dim!r}; HSDP "
            "needs two different mesh dims"
        )
    reshard = _resolve_reshard(reshard_after_forward, mesh.size(dim), what)
    mp = resolve_mixed_precision(mixed_precision, mp_policy, what)
    children = _child_engines(module, mesh, dim, rep_dim, what)
    adopted = {
        id(sp) for e in children for g in e.groups for b in g.bufs for sp in b.sharded.values()
    }
    ignored = frozenset(id(p) for p in (ignored_params or ()))
    skip = adopted | ignored
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in adopted and _SHARDED.get(id(p)) is p:
            raise ValueError(
                f"{what}: parameter {name!r} is already sharded by fully_shard() on an "
                "enclosing module; call fully_shard() on submodules first, then on the root"
            )
        for e in children:
            if e.replaced.get(id(p)) is p:
                raise ValueError(
                    f"{what}: parameter {name!r} is shared with submodule "
                    f"{_module_name(module, e.module)!r}, which fully_shard() already sharded; "
                    "a shared parameter must be sharded with the module that contains all its "
                    "uses: wrap a module that contains both (or only the root)"
                )
    if children and all(id(p) in skip for p in module.parameters()):
        device = children[0].device  # the outer module has no parameters of its own
    else:
        device = check_one_device(module, mesh, what, skip=skip)
    offload_device, pin = _resolve_offload(offload_policy, device, what)
    check_dp_replicated(module, mesh, dim, what, skip=skip)
    if rep_dim is not None:
        check_dp_replicated(module, mesh, rep_dim, what, skip=skip)
    mods = dict(module.named_modules())
    if groups is None:
        chosen = [] if children else _default_groups(module)
    elif callable(groups) and not isinstance(groups, (list, tuple)):
        chosen = [n for n, m in mods.items() if n and groups(n, m)]
    else:
        chosen = []
        by_id = {id(m): n for n, m in mods.items()}
        for item in groups:
            if isinstance(item, nn.Module):
                if id(item) not in by_id:
                    raise ValueError(
                        f"{what}: group module {type(item).__name__} is not in the module"
                    )
                chosen.append(by_id[id(item)])
            else:
                hits = [n for n in mods if n and re.fullmatch(item, n)]
                if not hits:
                    raise ValueError(f"{what}: group {item!r} matches no submodule name")
                chosen.extend(hits)
    taken = {id(e.module) for e in children} | {id(g.module) for e in children for g in e.groups}
    order = {n: i for i, n in enumerate(mods)}
    chosen = sorted({n for n in chosen if n and id(mods[n]) not in taken}, key=order.__getitem__)
    group_modules = [("", module)] + [(n, mods[n]) for n in chosen]
    engine = FSDPEngine(
        module,
        mesh,
        dim,
        group_modules,
        replicate_dim=rep_dim,
        reshard_after_forward=reshard,
        prefetch=prefetch,
        mixed_precision=mp,
        granularity=granularity,
        find_unused_parameters=find_unused_parameters,
        device=device,
        offload_device=offload_device,
        pin_memory=pin,
        adopt=children,
        ignored=ignored,
    )
    module.__dict__[DP_STATE_ATTR] = engine
    for e in children:  # the submodules' controls now reach the engine that runs them
        for sub in module.modules():
            if sub.__dict__.get(DP_STATE_ATTR) is e:
                sub.__dict__[DP_STATE_ATTR] = engine
    # A module tensor-parallelised by parallelize_module: its PartialGradSync watches
    # the original parameters, which FSDP replaced (their tp-Partial gradients are
    # reduced while they accumulate into the unsharded gradient buffer). Release them
    # so the unsharded TP-local tensors are freed.
    sync = getattr(module.__dict__.get("_vescale_dmodule"), "grad_sync", None)
    if sync is not None and hasattr(sync, "remove_hooks"):
        sync.remove_hooks()
        sync.params = []
    from vescale.dmodule._dp_module import FullyShardedModule, swap_class

    swap_class(module, FullyShardedModule, "FSDP")
    return module


def _module_name(root: nn.Module, sub: nn.Module) -> str:
    return next((n for n, m in root.named_modules() if m is sub), "?")
