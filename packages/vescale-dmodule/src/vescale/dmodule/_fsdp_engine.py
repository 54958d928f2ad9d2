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
DTensors on the original parameter's mesh with its placements, views of the unsharded
buffer, and their ``.grad`` are DTensors viewing the gradient buffer. The original
parameter may live on the mesh without the data-parallel dims (what
``parallelize_module(..., data_parallel=...)`` makes, so that activations never claim
``Replicate()`` over dp ranks that hold other samples) or on the whole mesh,
``Replicate()`` on dp. A gradient
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
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale.dmodule import _compat
from vescale.dmodule._dp_common import (
    MixedPrecision,
    cast_floating,
    dp_last_mesh,
    local_tensor,
    param_paths,
    swap_param,
)
from vescale.dmodule._fsdp_groups import (
    Buf,
    Group,
    Placing,
    alloc_storage,
    assign_groups,
    build_buffers,
    free_storage,
)
from vescale.dmodule._module_state import DataParallelEngine
from vescale.dtensor.hooks import weak_hook

__all__ = ["FSDPEngine"]


class _UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` finishes the all-gather."""

    def __init__(self, engine: FSDPEngine | None, group: Group | None) -> None:
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


class FSDPEngine(DataParallelEngine):
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
        src_data_rank: int | None = None,
    ) -> None:
        super().__init__(module, mesh, dp_dim)
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
        self._fwd_order: list[Group] = []
        self._cur_fwd_order: list[Group] = []
        self._post_fwd_order: list[Group] = []
        self._bwd_order: list[Group] = []
        self._pending_reduce: tuple | None = None
        self._pending_rep: list[tuple[list, list]] = []
        self._recomputing = 0
        self._enclosing: dict[int, list[Group]] = {}

        self._shard_groups(
            group_modules,
            adopt,
            ignored,
            granularity=granularity,
            offload_device=offload_device,
            pin_memory=pin_memory,
            src_data_rank=src_data_rank,
        )
        self._adopt_groups(adopt)
        self._register_hooks()

    # ------------------------------------------------------------------ construction
    def _shard_groups(
        self,
        group_modules: list[tuple[str, nn.Module]],
        adopt: Sequence[FSDPEngine],
        ignored: frozenset[int],
        *,
        granularity,
        offload_device: torch.device | None,
        pin_memory: bool,
        src_data_rank: int | None = None,
    ) -> None:
        """Shard this call's parameters into groups and register the sharded ones.

        ``src_data_rank``: ``None``, each rank cuts its shards from its own values;
        else every rank's shards are the values of the rank at that coordinate of the
        data-parallel dims (one scatter per flat buffer).
        """
        module, mesh, dp_dim, device = self.module, self.mesh, self.dp_dim, self.device
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
        self.placing = Placing(
            mesh, dp_dim, self.shard_mesh, self.tensor_parallel, replicate_dim=self.replicate_dim
        )
        owner = assign_groups(group_modules, paths, params)
        self.groups: list[Group] = []
        for gi, (gname, gmod) in enumerate(group_modules):
            mine = [params[i] for i in params if owner[i] == gi]
            if not mine:
                continue
            named = [(paths[id(p)][0][2], p) for p in mine]
            by_name = dict(named)
            bufs = build_buffers(
                named,
                self.placing,
                granularity=granularity,
                mp=self.mp,
                device=device,
                offload_device=offload_device,
                pin_memory=pin_memory,
                src=src_data_rank,
            )
            g = Group(
                len(self.groups),
                gname,
                gmod,
                bufs,
                {n: paths[id(by_name[n])] for n in by_name},
                # outputs are cast where the module given to fully_shard returns them
                mp=self.mp if gmod is module else dataclasses.replace(self.mp, output_dtype=None),
                reshard_after_forward=self.reshard_after_forward,
            )
            self.groups.append(g)
        # register the sharded parameters on the module (tied aliases included)
        for g in self.groups:
            for b in g.bufs:
                for n, sp in b.sharded.items():
                    swap_param(g.paths[n], sp)

    def _adopt_groups(self, adopt: Sequence[FSDPEngine]) -> None:
        """Take over the groups of engines made by earlier ``fully_shard`` calls."""
        module = self.module
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

    def _register_hooks(self) -> None:
        """Gradient hooks on the unsharded leaves; forward hooks on every group's module."""
        module = self.module
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

    def _hook_leaf(self, g: Group, b: Buf, n: str) -> None:
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

    def checkpoint_candidates(self, root: nn.Module) -> list[str]:
        """The groups' module names (the root's own group excluded)."""
        return [g.name for g in self.groups if g.module is not root]

    # ------------------------------------------------------------------ per-module control
    def module_group(self, module: nn.Module) -> Group | None:
        """The group whose module is ``module`` (``None``: it has no parameters of its own)."""
        return next((g for g in self.groups if g.module is module), None)

    def groups_under(self, module: nn.Module, recurse: bool) -> list[Group]:
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

    def _start_unshard(self, g: Group, async_op: bool) -> None:
        if g.unsharded or g.gather_works:
            return
        g.gather_versions = [b.full._version for b in g.bufs]
        for b in g.bufs:
            self._track(alloc_storage(b.full))
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
                    alloc_storage(b.dshard)
                    b.dshard.copy_(src, non_blocking=True)
                    self.offload_copy_bytes += nbytes
                    src = b.dshard
                # one all-gather straight into the unsharded buffer (FlatBuffer's engine)
                work = b.fb.all_gather(b.full, src=src, async_op=async_op)
                if async_op:
                    g.gather_works.append(work)
        if not g.gather_works:
            g.unsharded = True
            self._free_staging(g)

    def _free_staging(self, g: Group) -> None:
        for b in g.bufs:
            if b.dshard is not None:
                free_storage(b.dshard)

    def _unshard(self, g: Group) -> None:
        if g.unsharded:
            return
        if g.gather_works:
            self._wait_gather(g)
            g.unsharded = True
            return
        self._start_unshard(g, async_op=False)

    def _wait_gather(self, g: Group) -> None:
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

    def _reshard(self, g: Group) -> None:
        if g.gather_works:
            self._wait_gather(g)
        for b in g.bufs:
            self._track(-free_storage(b.full))
        g.unsharded = False

    def _prepare_grads(self, g: Group) -> None:
        if g.grads_live:
            return
        for b in g.bufs:
            if b.trainable:
                self._track(alloc_storage(b.gfull))
                b.gfull.zero_()
        g.grads_live = True
        for n in g.used:
            g.used[n] = False

    def _swap(self, g: Group, unsharded: bool) -> None:
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
    def _cast_inputs(g: Group, flat: list) -> list:
        mp_dtype = g.mp.param_dtype if g.mp.cast_forward_inputs else None
        return cast_floating(flat, mp_dtype)

    def _reshards_after_forward(self, g: Group) -> bool:
        if g.reshard_after_forward is None:  # FSDP2's default: all but the root
            return g is not self.root
        return g.reshard_after_forward

    def _hook_pre(self, g: Group) -> Callable:
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

    def _hook_post(self, g: Group) -> Callable:
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

    def _make_pre_backward(self, g: Group) -> Callable:
        def hook(grad):
            self._pre_backward(g)
            return None

        return hook

    def _pre_backward(self, g: Group) -> None:
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

    def _post_backward(self, g: Group, final: bool = False) -> None:
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
    def _start_reduce(self, g: Group) -> list:
        pending = []
        for b in g.bufs:
            if not b.trainable:
                continue
            src = b.gfull
            if b.reduce_dtype != b.compute_dtype:
                tmp = torch.empty(b.gfull.numel(), dtype=b.reduce_dtype, device=src.device)
                tmp.copy_(src)
                self.cast_copy_bytes += tmp.numel() * tmp.element_size()
                self._track(-free_storage(b.gfull))
                src = tmp
            had = {n: b.sharded[n].grad is not None for n in b.grad_dts}
            g.had_grad.update(had)
            fresh = not any(had.values())
            if fresh and b.reduce_dtype == b.master_dtype and not b.offloaded:
                dst = b.gshard
            else:
                dst = torch.empty(b.gshard.numel(), dtype=b.reduce_dtype, device=src.device)
            work = b.fb.reduce_scatter(src, dst, op="avg", async_op=True)
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
            work.wait()
            if src is b.gfull:
                self._track(-free_storage(b.gfull))
            done.append((b, dst, fresh))
        g.grads_live = False
        if self.rep_world > 1:
            # The sharded gradient (``dst``, referenced here until the work is waited)
            # is averaged over the replicate dim while backward goes on.
            works = [
                b.fb.all_reduce(dst, op="avg", mesh_dim=self.replicate_dim, async_op=True)
                for b, dst, _f in done
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


def _mark_used(g: Group, name: str, _param: torch.Tensor) -> None:
    g.used[name] = True
