"""Zero-copy fully sharded data parallelism on ``RaggedShard`` flat buffers.

:func:`fully_shard` splits a module into *groups* (by default every element of an
``nn.ModuleList``, i.e. every transformer block, plus the root for the rest). The
parameters of a group are laid out by :func:`vescale.ragged.plan_flat_buffers` in one
padding-free flat buffer per dtype, sharded over the data-parallel mesh dim by a
:class:`vescale.ragged.FlatBuffer`. Each parameter becomes an ordinary leaf
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
precision adds the casts, counted in :attr:`FSDPEngine.cast_copy_bytes`).

**HSDP** (``replicate_dim``): the sharded parameters are also ``Replicate()`` on a
second data-parallel dim (``R`` ranks). When a group's reduce-scatter has been
waited, one asynchronous ``all_reduce(AVG)`` of its sharded gradient runs over that
dim; the end-of-backward callback waits for them and then installs the gradients
(``+ 2 (R-1)/R P/N`` bytes per step).

**Activation checkpointing** (:mod:`._activation_checkpoint`): a group's forward may
run again in backward. :meth:`FSDPEngine.recompute_context` unshards and swaps in the
groups enclosing the recomputed module; the hooks of groups inside it see
:meth:`FSDPEngine.in_recompute` and only unshard and swap in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._pytree import tree_flatten, tree_unflatten

from vescale.dmodule._dp_common import (
    DP_STATE_ATTR,
    MixedPrecision,
    SyncToggle,
    check_dp_replicated,
    check_not_wrapped,
    check_one_device,
    dp_last_mesh,
    local_tensor,
    param_paths,
    resolve_dp_dim,
    swap_param,
)

__all__ = ["fully_shard", "FSDPEngine", "get_dp_engine", "no_sync"]


def get_dp_engine(module: nn.Module):
    """The DDP/FSDP engine of ``module`` (``None`` if it has none)."""
    return module.__dict__.get(DP_STATE_ATTR)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Accumulate gradients locally (no communication) in backward passes inside the block."""
    engine = get_dp_engine(module)
    if engine is None:
        raise ValueError(f"{type(module).__qualname__} has no data-parallel engine")
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


@dataclasses.dataclass
class _Group:
    index: int
    name: str
    module: nn.Module
    bufs: list[_Buf]
    paths: dict[str, list]  # param name -> module paths
    unsharded: bool = False
    swapped_in: bool = False
    gather_works: list = dataclasses.field(default_factory=list)
    gather_versions: list = dataclasses.field(default_factory=list)
    pre_bwd_done: bool = False
    post_bwd_done: bool = False
    grads_live: bool = False
    used: dict[str, bool] = dataclasses.field(default_factory=dict)
    handles: list = dataclasses.field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return [n for b in self.bufs for n in b.names]

    def unsharded_bytes(self) -> int:
        return sum(b.full.numel() * b.full.element_size() for b in self.bufs)


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
    """State and hooks of one :func:`fully_shard`-ed module (see the module docs).

    Attributes:
        groups: The parameter groups, in module order (the root first).
        tensor_parallel: Whether the module's parameters were DTensors.
        shard_mesh: Mesh of the sharded parameters: ``mesh`` itself, or with tensor
            parallelism the same ranks with the dp dim moved last.
        cast_copy_bytes: Bytes written by mixed-precision casts (reset freely).
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
        reshard_after_forward: bool,
        prefetch: bool,
        mixed_precision: MixedPrecision | None,
        granularity,
        find_unused_parameters: bool,
        device: torch.device,
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
        self.cast_copy_bytes = 0
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
        params = {id(p): p for p in module.parameters()}
        # Tensor parallelism: DTensor parameters (Replicate on dp) are sharded as their
        # TP-local tensors; the sharded parameters live on the mesh with dp moved last.
        self.tensor_parallel = any(isinstance(p, DTensor) for p in params.values())
        self.shard_mesh = dp_last_mesh(mesh, dp_dim) if self.tensor_parallel else mesh
        owner = _assign_groups(group_modules, paths, params)
        self.groups: list[_Group] = []
        for gi, (gname, gmod) in enumerate(group_modules):
            mine = [params[i] for i in params if owner[i] == gi]
            if not mine:
                continue
            named = [(paths[id(p)][0][2], p) for p in mine]
            # order="auto": the planner may reorder a group's buffer (same layout as the
            # given order for "element" granularity; less padding for coarse units)
            layouts = layouts_from_tensors(
                [(n, local_tensor(p)) for n, p in named],
                self.world,
                granularity=granularity,
                order="auto",
            )
            by_name = dict(named)
            bufs = []
            for dtype, layout in layouts.items():
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
                gshard = torch.zeros_like(fb.local)
                cshard = (
                    torch.empty(fb.local.numel(), dtype=compute, device=device)
                    if compute != dtype
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
                    view = full[slot.offset : slot.stop].view(slot.shape)
                    leaf = nn.Parameter(self._compute(orig, view), requires_grad=orig.requires_grad)
                    leaves[slot.name] = leaf
                    if orig.requires_grad:
                        trainable.append(slot.name)
                        gview = gfull[slot.offset : slot.stop].view(slot.shape)
                        leaf.grad = self._compute(orig, gview)
                        grad_dts[slot.name] = from_local(
                            fb.local_view(slot.name, gshard), *geo, **geo_kw
                        )
                _free(full)
                _free(gfull)
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
                    )
                )
            g = _Group(
                len(self.groups), gname, gmod, bufs, {n: paths[id(by_name[n])] for n in by_name}
            )
            self.groups.append(g)
        # register the sharded parameters on the module (tied aliases included)
        for g in self.groups:
            for b in g.bufs:
                for n, sp in b.sharded.items():
                    swap_param(g.paths[n], sp)
                for n in b.trainable:
                    g.handles.append(b.leaves[n].register_hook(self._grad_guard(g)))
                if find_unused_parameters:
                    for n in b.trainable:
                        g.handles.append(
                            b.leaves[n].register_post_accumulate_grad_hook(_mark_used(g, n))
                        )
        self._fwd_order = list(self.groups)
        self.root = next((g for g in self.groups if g.module is module), None)
        for g in self.groups:
            g.handles.append(
                g.module.register_forward_pre_hook(self._hook_pre(g), with_kwargs=True)
            )
            g.handles.append(g.module.register_forward_hook(self._hook_post(g)))

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
        return out

    def unsharded_views(self, group: int = 0) -> dict[str, torch.Tensor]:
        """The persistent unsharded parameter leaves of a group (views of its buffer)."""
        return {n: t for b in self.groups[group].bufs for n, t in b.leaves.items()}

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
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(b.full):
                if b.cshard is not None:
                    b.cshard.copy_(src)
                    self.cast_copy_bytes += b.cshard.numel() * b.cshard.element_size()
                    src = b.cshard
                if self.world == 1:
                    b.full.copy_(src)
                    if b.cshard is None:
                        self._own_copy_bytes += src.numel() * src.element_size()
                elif b.fb.layout.even:
                    w = dist.all_gather_single(b.full, src, group=self.pg, async_op=async_op)
                    if async_op:
                        g.gather_works.append(w)
                else:
                    if b.cshard is not None:
                        raise NotImplementedError("mixed precision needs an even flat layout")
                    b.fb.all_gather(b.full)
        if not g.gather_works:
            g.unsharded = True

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
        torch._C._autograd._unsafe_set_version_counter(fulls, versions)
        g.gather_works.clear()

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

        True inside :meth:`recompute_context` and whenever a forward runs inside the
        autograd engine (a non-reentrant ``torch.utils.checkpoint`` recomputes from a
        saved-tensor unpack hook during backward).
        """
        return self._recomputing > 0 or torch._C._current_graph_task_id() != -1

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
    def _cast_inputs(self, flat: list) -> list:
        mp_dtype = self.mp.param_dtype if self.mp.cast_forward_inputs else None
        if mp_dtype is None:
            return flat
        return [
            t.to(mp_dtype)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != mp_dtype
            else t
            for t in flat
        ]

    def _hook_pre(self, g: _Group) -> Callable:
        def hook(module, args, kwargs):
            if self.in_recompute():
                # activation-checkpoint recomputation in backward: only the parameters
                self._unshard(g)
                self._swap(g, True)
                if not torch.is_grad_enabled():
                    return None
                flat, spec = tree_flatten((args, kwargs))
                return tree_unflatten(self._cast_inputs(flat), spec)
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
            flat, spec = tree_flatten((args, kwargs))
            flat = self._cast_inputs(flat)
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if idx:
                outs = _PostBackward.apply(self, g, *[flat[i] for i in idx])
                for i, t in zip(idx, outs):
                    flat[i] = t
            return tree_unflatten(flat, spec)

        return hook

    def _hook_post(self, g: _Group) -> Callable:
        def hook(module, args, output):
            self._swap(g, False)
            if self.in_recompute():
                return None  # stays unsharded until its post-backward
            self._post_fwd_order.append(g)
            if not torch.is_grad_enabled():
                self._reshard(g)
                return None
            if self.reshard_after_forward:
                self._reshard(g)
            flat, _ = tree_flatten(output)
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_pre_backward(g))
            return None

        return hook

    def _begin_forward(self) -> None:
        if self._cur_fwd_order:
            self._fwd_order = self._cur_fwd_order
        self._cur_fwd_order = []
        self._post_fwd_order = []
        for g in self.groups:
            g.pre_bwd_done = False
            g.post_bwd_done = False

    def _grad_guard(self, g: _Group) -> Callable:
        """Hook run before autograd accumulates into an unsharded leaf's ``.grad``.

        The leaves' gradients are views of the group's flat gradient buffer, whose
        storage is freed between backward passes: accumulating into it then would
        write to freed memory. The buffer is normally allocated by the pre-backward
        hook on the group's outputs; this makes sure of it even when that hook did not
        fire (outputs autograd reached another way), and refuses a gradient that
        arrives after the group's gradients were already reduced.
        """

        def hook(grad):
            if g.post_bwd_done and self._sync:
                raise RuntimeError(
                    f"fully_shard: a gradient for a parameter of group {g.name or '<root>'!r} "
                    "arrived after that group's gradients were reduced; a group must run "
                    "once per forward (a module called twice, or a parameter used outside "
                    "its group, is not supported)"
                )
            if not g.grads_live:
                self._prepare_grads(g)
            return None

        return hook

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
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._unshard(g)
        self._prepare_grads(g)
        if self.prefetch and g in self._bwd_order:
            i = self._bwd_order.index(g)
            for h in self._bwd_order[i + 1 :]:
                if not h.pre_bwd_done:
                    self._start_unshard(h, async_op=True)
                    break

    def _post_backward(self, g: _Group) -> None:
        if g.post_bwd_done:
            return
        g.post_bwd_done = True
        self._reshard(g)
        if not g.grads_live:
            self._prepare_grads(g)
        if not self._sync:
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
            fresh = all(b.sharded[n].grad is None for n in b.trainable)
            if fresh and b.reduce_dtype == b.master_dtype:
                dst = b.gshard
            else:
                dst = torch.empty(b.gshard.numel(), dtype=b.reduce_dtype, device=src.device)
            if self.world == 1:
                dst.copy_(src)
                self._own_copy_bytes += dst.numel() * dst.element_size()
                work = None
            elif b.fb.layout.even:
                work = dist.reduce_scatter_single(
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
                    b.gshard.copy_(dst)
                    self.cast_copy_bytes += b.gshard.numel() * b.gshard.element_size()
                else:
                    for n in b.trainable:
                        piece = b.fb.local_view(n, dst)
                        sp = b.sharded[n]
                        if sp.grad is None:
                            b.fb.local_view(n, b.gshard).copy_(piece)
                        else:
                            sp.grad._local_tensor.add_(piece) if isinstance(
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
                self._post_backward(g)
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

    def _drop_unused_grads(self) -> None:
        names = [(g, b, n) for g in self.groups for b in g.bufs for n in b.trainable]
        flags = torch.tensor(
            [1.0 if g.used.get(n, False) else 0.0 for g, _, n in names],
            device=self.groups[0].bufs[0].fb.local.device,
        )
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
        if self.rep_world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.rep_pg)
        for (g, b, n), f in zip(names, flags.tolist()):
            if f == 0.0:
                b.sharded[n].grad = None
            g.used[n] = False


def _mark_used(g: _Group, name: str):
    g.used[name] = False

    def hook(_p):
        g.used[name] = True

    return hook


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
            out.extend(f"{name}.{i}" if name else str(i) for i in range(len(mod)))
    return out


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    dp_dim: int | str = 0,
    *,
    replicate_dim: int | str | None = None,
    groups: Sequence[str | nn.Module] | Callable[[str, nn.Module], bool] | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    mixed_precision: MixedPrecision | None = None,
    granularity: Any = "element",
    find_unused_parameters: bool = False,
) -> nn.Module:
    """Shard ``module``'s parameters over the mesh dim ``dp_dim`` (FSDP), in place.

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
            cuts the TP-local tensor.
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
            ``nn.ModuleList`` (transformer blocks).
        reshard_after_forward: Free each group's unsharded parameters after its
            forward and gather them again in backward (3 (N-1)/N P bytes per step
            instead of 2 (N-1)/N P, less memory).
        prefetch: Start the next group's all-gather asynchronously, in forward and
            in backward.
        mixed_precision: :class:`MixedPrecision`; e.g.
            ``MixedPrecision(torch.bfloat16, torch.float32)`` computes in bf16 with
            fp32 sharded masters and an fp32 gradient reduce-scatter.
        granularity: Where the planner may cut a parameter (``"element"``,
            ``"row"`` or a block shape; see :mod:`vescale.ragged`).
        find_unused_parameters: One extra tiny all-reduce per backward so that
            parameters that got no gradient on any rank keep ``grad = None`` (as in
            single-device training). Without it they get zero gradients.

    Returns:
        ``module`` itself; its engine is ``get_dp_engine(module)`` (:class:`FSDPEngine`).

    Raises:
        ValueError: ``dp_dim`` (or ``replicate_dim``) not in the mesh, both the same
            dim, the module (or a submodule) already
            data-parallel, parameters on several devices or not on the mesh's device
            type, a group name that matches nothing, a DTensor parameter on another
            mesh, not ``Replicate()`` on ``dp_dim``, ``Partial``, or with local shards
            of different shapes on different ranks (uneven tensor-parallel
            sharding), naming the parameter. All before any collective.
    """
    what = "fully_shard"
    dim = resolve_dp_dim(mesh, dp_dim)
    rep_dim = None if replicate_dim is None else resolve_dp_dim(mesh, replicate_dim)
    if rep_dim == dim:
        raise ValueError(
            f"{what}: replicate_dim {replicate_dim!r} is the sharded dim {dp_dim!r}; HSDP "
            "needs two different mesh dims"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")
    check_not_wrapped(module, what)
    device = check_one_device(module, mesh, what)
    check_dp_replicated(module, mesh, dim, what)
    if rep_dim is not None:
        check_dp_replicated(module, mesh, rep_dim, what)
    mods = dict(module.named_modules())
    if groups is None:
        chosen = _default_groups(module)
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
    order = {n: i for i, n in enumerate(mods)}
    chosen = sorted({n for n in chosen if n}, key=order.__getitem__)
    group_modules = [("", module)] + [(n, mods[n]) for n in chosen]
    engine = FSDPEngine(
        module,
        mesh,
        dim,
        group_modules,
        replicate_dim=rep_dim,
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
        mixed_precision=mixed_precision,
        granularity=granularity,
        find_unused_parameters=find_unused_parameters,
        device=device,
    )
    module.__dict__[DP_STATE_ATTR] = engine
    # A module tensor-parallelised by parallelize_module: its PartialGradSync watches
    # the original parameters, which FSDP replaced (their tp-Partial gradients are
    # reduced while they accumulate into the unsharded gradient buffer). Release them
    # so the unsharded TP-local tensors are freed.
    sync = getattr(module.__dict__.get("_vescale_dmodule"), "grad_sync", None)
    if sync is not None and hasattr(sync, "remove_hooks"):
        sync.remove_hooks()
        sync.params = []
    return module
