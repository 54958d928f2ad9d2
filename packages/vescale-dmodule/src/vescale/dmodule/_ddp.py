"""Distributed data parallelism with bucketed, overlapped gradient all-reduce.

`replicate` keeps plain-tensor parameters plain (each rank holds the full
value, as in torch DDP), so the forward, the backward and the user's optimizer run
on plain tensors at full speed; parameters that already are DTensors, e.g.
tensor-parallel ones from `parallelize_module`, keep their
placements and must be ``Replicate()`` on the dp dim. Gradients live in contiguous
*buckets*: each parameter's ``.grad`` is a view of one bucket (a DTensor around the
view for a DTensor parameter). Before a forward, a parameter without a gradient
gets its zeroed bucket view as ``.grad``, so autograd accumulates straight into the
bucket (no copy); a gradient that did not land there (``zero_grad()`` between
forward and backward, or a ``.grad`` the user replaced) is copied in by a
post-accumulate-grad hook. When the last gradient of a bucket has been accumulated,
the bucket's ``all_reduce(AVG)`` over the dp dim starts asynchronously while
backward continues; an autograd-engine callback at the end of backward starts the
buckets still pending (parameters not used this step) and waits for all of them.

Every bucket carries one extra element per parameter, set to 1 on ranks where the
parameter has a gradient (from this backward, or accumulated earlier); after the
all-reduce, parameters that have none on any rank get ``grad = None``, as in
single-device training (no hang, no extra collective). Buckets are rebuilt before a
forward when the set of parameters that require grad changed.

Plain parameters are declared replicated over the mesh
(`vescale.debug.declare_replicated`), so
`vescale.debug.enable_gradient_sync_debug` checks them like replicated
DTensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.debug import declare_replicated
from vescale.dmodule import _compat
from vescale.dmodule._dp_common import (
    MixedPrecision,
    cast_floating,
    check_not_wrapped,
    check_one_device,
    local_tensor,
    param_paths,
    resolve_mixed_precision,
    swap_param,
)
from vescale.dmodule._module_state import DataParallelEngine, module_state
from vescale.dtensor import lift_placements, resolve_mesh_dim
from vescale.dtensor.hooks import weak_hook

__all__ = ["replicate", "DDPEngine"]


#: Name of the slot of a bucket's layout that holds one "used" flag per parameter.
_FLAGS = "<used flags>"


@dataclasses.dataclass
class _Bucket:
    index: int
    fb: Any  # FlatBuffer; its unsharded buffer is ``buf``
    buf: torch.Tensor  # grads then one "used" flag per parameter (a FlatLayout, unsharded)
    params: list[nn.Parameter]
    ranges: list[tuple[int, int]]
    grad_views: list[torch.Tensor]  # the .grad of each parameter (a DTensor for DTensors)
    data_numel: int
    pending: int = 0
    work: object | None = None
    launched: bool = False
    # mixed precision: the bucket cast to the reduce dtype while its all-reduce runs
    reduce_buf: torch.Tensor | None = None
    # True where ``.grad`` is a zeroed bucket view put there by the pre-forward hook:
    # "no gradient yet" to the user (None on a single device)
    placeholder: list[bool] = dataclasses.field(default_factory=list)

    @property
    def flags(self) -> torch.Tensor:
        return self.buf[self.data_numel : self.data_numel + len(self.params)]


class DDPEngine(DataParallelEngine):
    """State and hooks of one `replicate`-d module.

    Attributes:
        buckets: Gradient buckets, in the order their all-reduces are expected.
        launch_log: Bucket indices in the order their all-reduce started during the
            last synchronising backward (``-1`` marks the end of backward).
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        dp_dim: int,
        *,
        bucket_cap_mb: float,
        broadcast_from: int | None,
        device: torch.device,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        super().__init__(module, mesh, dp_dim)
        self.launch_log: list[int] = []
        ordered = [p for p in module.parameters()]
        for p in ordered:
            if not isinstance(p, DTensor):
                declare_replicated(p, mesh, tuple(range(mesh.ndim)))
        if broadcast_from is not None and self.world > 1:
            src = dist.get_global_rank(self.pg, broadcast_from)
            with torch.no_grad():
                for p in ordered:
                    dist.broadcast(local_tensor(p), src=src, group=self.pg)
        self._params = ordered
        self._device = device
        self._cap = max(1, int(bucket_cap_mb * 1024 * 1024))
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        self._grad_handles: list = []
        self._trainable_key: tuple[bool, ...] = ()
        self._build_buckets()
        self._handles = [module.register_forward_pre_hook(self._pre_forward)]
        self.mp = mixed_precision or MixedPrecision()
        # reduce dtype as in FSDP2: reduce_dtype, else param_dtype
        self.reduce_dtype = self.mp.reduce_dtype or self.mp.param_dtype
        self.cast_copy_bytes = 0
        if self.mp != MixedPrecision():
            self._paths = param_paths(module)
            self._handles.append(module.register_forward_pre_hook(self._mp_pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._mp_post, always_call=True))

    def _build_buckets(self) -> None:
        """(Re)build the gradient buckets for the parameters that require grad now.

        Called at wrap time and again before a forward after the set of trainable
        parameters changed (``requires_grad`` flipped between steps, as in staged
        fine-tuning); gradients already accumulated are kept.
        """
        for h in self._grad_handles:
            h.remove()
        old_grads = {
            id(p): p.grad for p in self._params if p.grad is not None and id(p) in self._bucket_of
        }
        self._trainable_key = tuple(p.requires_grad for p in self._params)
        # buckets: reverse registration order (roughly the order gradients become ready),
        # one FlatLayout each (vescale.ragged, the one flat-buffer engine): the gradients
        # then one "used" flag per parameter, kept unsharded and all-reduced whole
        from vescale.ragged import FlatBuffer, ParamSpec, bucket_specs, plan_flat_buffers

        trainable = [p for p in reversed(self._params) if p.requires_grad]
        specs = [
            ParamSpec(str(i), (local_tensor(p).numel(),), local_tensor(p).dtype)
            for i, p in enumerate(trainable)
        ]
        self.buckets = []
        self._bucket_of = {}
        for group in bucket_specs(specs, self._cap):
            ps = [trainable[int(spec.name)] for spec in group]
            locs = [local_tensor(p) for p in ps]
            flags = ParamSpec(_FLAGS, (len(ps),), locs[0].dtype)
            (layout,) = plan_flat_buffers([*group, flags], self.world).values()
            buf = torch.zeros(layout.numel, dtype=layout.dtype, device=self._device)
            a, e = layout.rank_ranges[self.mesh.get_local_rank(self.dp_dim)]
            fb = FlatBuffer(layout, self.mesh, self.dp_dim, local=buf[a:e])
            views = fb.full_views(buf)
            ranges, grad_views = [], []
            for spec, p, t in zip(group, ps, locs):
                slot = layout[spec.name]
                view = views[spec.name].view(t.shape)
                ranges.append((slot.offset, slot.stop))
                if isinstance(p, DTensor):
                    view = DTensor.from_local(
                        view,
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                grad_views.append(view)
            b = _Bucket(len(self.buckets), fb, buf, ps, ranges, grad_views, layout[_FLAGS].offset)
            b.placeholder = [False] * len(ps)
            self.buckets.append(b)
            for i, p in enumerate(ps):
                self._bucket_of[id(p)] = (b, i)
                g = old_grads.get(id(p))
                if g is not None:
                    with torch.no_grad():
                        grad_views[i].copy_(g)
                    p.grad = grad_views[i]
        for p in self._params:
            if not p.requires_grad and id(p) in old_grads:
                # frozen now: keep its last gradient, no longer a bucket view
                p.grad = old_grads[id(p)].clone()
        self._grad_handles = [
            p.register_post_accumulate_grad_hook(weak_hook(DDPEngine._on_grad, self, b.index, i))
            for b in self.buckets
            for i, p in enumerate(b.params)
        ]

    # ------------------------------------------------------------------ public
    @property
    def extra_copy_bytes(self) -> int:
        """Bytes copied besides the collectives (always 0: gradients are bucket views)."""
        return 0

    def engine_tensors(self) -> list[torch.Tensor]:
        return [b.buf for b in self.buckets]

    # ------------------------------------------------------------------ mixed precision
    def _swap_params(self, cast: bool) -> None:
        """Register compute-dtype copies of the parameters (differentiable casts of the
        masters, so gradients reach the masters' buckets), or the masters again."""
        dtype = self.mp.param_dtype
        if dtype is None:
            return
        for p in self._params:
            if p.is_floating_point() and p.dtype != dtype:
                swap_param(self._paths[id(p)], p.to(dtype) if cast else p)
                if cast:
                    self.cast_copy_bytes += p.numel() * dtype.itemsize

    def _mp_pre(self, module, args, kwargs):
        self._swap_params(True)
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            return cast_floating((args, kwargs), self.mp.param_dtype)
        return None

    def _mp_post(self, module, args, output):
        self._swap_params(False)
        if self.mp.output_dtype is not None:
            return cast_floating(output, self.mp.output_dtype)
        return None

    @contextlib.contextmanager
    def recompute_context(self, module: nn.Module) -> Iterator[None]:
        """Activation-checkpoint recomputation: the compute-dtype parameters again."""
        if self.mp.param_dtype is None:
            yield
            return
        self._swap_params(True)
        try:
            yield
        finally:
            self._swap_params(False)

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module, args):
        if any(p.requires_grad is not k for p, k in zip(self._params, self._trainable_key)):
            self._build_buckets()
        for b in self.buckets:
            missing = [i for i, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.buf[: b.data_numel].zero_()
            for i in missing:
                b.placeholder[i] = True
                a, e = b.ranges[i]
                if len(missing) != len(b.params):
                    b.buf[a:e].zero_()
                b.params[i].grad = b.grad_views[i]
        return None

    def _on_grad(self, bucket: int, i: int, p: torch.Tensor) -> None:
        b = self.buckets[bucket]
        if not self._cb_queued:
            self._cb_queued = True
            for bb in self.buckets:
                bb.pending = len(bb.params)
                bb.launched = False
                # a parameter keeps a gradient it already had (accumulation without
                # zero_grad, zero_grad(set_to_none=False)) even if unused now
                for j, q in enumerate(bb.params):
                    if not bb.placeholder[j] and q.grad is bb.grad_views[j]:
                        bb.flags[j] = 1
            self.launch_log = []
            _compat.queue_callback(self._finish)
        view = b.grad_views[i]
        if p.grad is not view:
            # The gradient did not accumulate into the bucket: ``.grad`` was reset
            # after the forward (``zero_grad()`` between forward and backward) or
            # replaced by the user. Move it into the bucket (one copy).
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view
        b.flags[i] = 1
        b.placeholder[i] = False
        b.pending -= 1
        if b.pending == 0 and self._sync:
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        if b.launched:
            return
        b.launched = True
        self.launch_log.append(b.index)
        if self.world > 1:
            buf = b.buf
            if self.reduce_dtype is not None and self.reduce_dtype != buf.dtype:
                b.reduce_buf = buf = buf.to(self.reduce_dtype)
                self.cast_copy_bytes += buf.numel() * buf.element_size()
            b.work = b.fb.all_reduce(buf, op="avg", async_op=True)

    @torch.no_grad()
    def _finish(self) -> None:
        self._cb_queued = False
        if not self._sync:
            return
        self.launch_log.append(-1)
        for b in self.buckets:
            if not b.launched:
                # parameters without a gradient on this rank contribute zeros
                for i, p in enumerate(b.params):
                    if p.grad is not b.grad_views[i]:
                        a, e = b.ranges[i]
                        b.buf[a:e].zero_()
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if b.reduce_buf is not None:
                b.buf.copy_(b.reduce_buf)
                self.cast_copy_bytes += b.buf.numel() * b.buf.element_size()
                b.reduce_buf = None
            flags = b.flags.tolist()
            for i, f in enumerate(flags):
                # a gradient on some rank: the average; on none: no gradient at all
                b.params[i].grad = b.grad_views[i] if f > 0 else None
            b.flags.zero_()


def replicate(
    module: nn.Module,
    mesh: DeviceMesh,
    dp_dim: int | str = 0,
    *,
    bucket_cap_mb: float = 25,
    broadcast_from: int | None = 0,
    mixed_precision: MixedPrecision | Any | None = None,
    mp_policy: Any | None = None,
) -> nn.Module:
    """Data-parallel ``module`` over the mesh dim ``dp_dim`` (DDP), in place.

    Args:
        module: The module (plain-tensor parameters, or DTensor parameters that are
            ``Replicate()`` on ``dp_dim`` or live on the sub-mesh of ``mesh`` without
            ``dp_dim``, as veScale's ``parallelize_module(m, mesh["TP"], ...)`` leaves
            them), all on one device of the mesh's type.
        mesh: Device mesh.
        dp_dim: Name or index of the data-parallel mesh dim.
        bucket_cap_mb: Largest gradient bucket in MiB (a larger parameter gets a
            bucket of its own).
        broadcast_from: Rank (on ``dp_dim``) whose parameter values every rank takes
            at wrap time; ``None`` keeps each rank's own.
        mixed_precision: `MixedPrecision` or torch's
            ``MixedPrecisionPolicy``: the module's parameters stay the (e.g. fp32)
            masters the optimizer steps; each forward runs on ``param_dtype`` casts of
            them (differentiable, so the gradients accumulate in the masters' dtype),
            floating-point inputs are cast to ``param_dtype`` if
            ``cast_forward_inputs``, outputs to ``output_dtype``, and each bucket is
            all-reduced in ``reduce_dtype`` (``None``: ``param_dtype``, as in FSDP2).
        mp_policy: FSDP2's name for ``mixed_precision``.

    Returns:
        ``module`` itself, its class swapped for a subclass of
        `ReplicatedModule` and the original class
        (``set_requires_gradient_sync()``); its engine (`DDPEngine`) is
        ``get_dp_engine(module)``. Build the optimizer after this call.

    Raises:
        ValueError: ``dp_dim`` not in the mesh, module already data-parallel,
            parameters on several devices, a DTensor parameter not ``Replicate()``
            on ``dp_dim``. All before any collective.
    """
    what = "replicate"
    dim = resolve_mesh_dim(mesh, dp_dim, "dp_dim")
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")
    check_not_wrapped(module, what)
    device = check_one_device(module, mesh, what)
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if p.device_mesh == mesh:
            pls: tuple | None = tuple(p.placements)
        else:  # veScale's layout: on the sub-mesh without the dp dim (replicated over it)
            pls = lift_placements(p.device_mesh, p.placements, mesh, dim)
        if pls is None or not isinstance(pls[dim], Replicate):
            raise ValueError(
                f"{what}: parameter {name!r} must be Replicate() on the dp dim of the same "
                f"mesh, or live on the sub-mesh without the dp dim; got {p.placements} on "
                f"{p.device_mesh}"
            )
    if not bucket_cap_mb > 0:
        raise ValueError(f"{what}: bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    mp = resolve_mixed_precision(mixed_precision, mp_policy, what)
    # a module tensor-parallelised on this very mesh: its computation moves to the mesh
    # without the dp dim (the dp ranks hold other samples)
    from vescale.dmodule._api import compute_without_dp_dims

    compute_without_dp_dims(module, mesh, (dim,))
    engine = DDPEngine(
        module,
        mesh,
        dim,
        bucket_cap_mb=bucket_cap_mb,
        broadcast_from=broadcast_from,
        device=device,
        mixed_precision=mp,
    )
    module_state(module, create=True).dp_engine = engine
    from vescale.dmodule._dp_module import ReplicatedModule, swap_class

    swap_class(module, ReplicatedModule, "Replicated")
    return module
