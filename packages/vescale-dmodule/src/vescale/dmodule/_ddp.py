"""Distributed data parallelism with bucketed, overlapped gradient all-reduce.

:func:`replicate` keeps plain-tensor parameters plain (each rank holds the full
value, as in torch DDP), so the forward, the backward and the user's optimizer run
on plain tensors at full speed; parameters that already are DTensors, e.g.
tensor-parallel ones from :func:`~vescale.dmodule.parallelize_module`, keep their
placements and must be ``Replicate()`` on the dp dim. Gradients live in contiguous
*buckets*: each parameter's ``.grad`` is a view of one bucket (a DTensor around the
view for a DTensor parameter). The first gradient after ``zero_grad()`` is copied
into the bucket by a post-accumulate-grad hook (one copy; the bucket is never
zero-filled), later ones (gradient accumulation) are added into it in place.
When the last gradient of a bucket has been accumulated, the bucket's
``all_reduce(AVG)`` over the dp dim starts asynchronously while backward continues;
an autograd-engine callback at the end of backward starts the buckets still
pending (parameters not used this step) and waits for all of them.

Every bucket carries one extra element per parameter, set to 1 on ranks where the
parameter got a gradient; after the all-reduce, parameters that no rank used get
``grad = None``, as in single-device training (no hang, no extra collective).

Plain parameters are declared replicated over the mesh
(:func:`vescale.debug.declare_replicated`), so
:func:`vescale.debug.enable_gradient_sync_debug` checks them like replicated
DTensors.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.dmodule._dp_common import (
    DP_STATE_ATTR,
    SyncToggle,
    check_not_wrapped,
    check_one_device,
    local_tensor,
    resolve_dp_dim,
)
from vescale.dtensor._grad_sync_debug import declare_replicated

__all__ = ["replicate", "DDPEngine"]


@dataclasses.dataclass
class _Bucket:
    index: int
    buf: torch.Tensor  # grads then one "used" flag per parameter
    params: list[nn.Parameter]
    ranges: list[tuple[int, int]]
    grad_views: list[torch.Tensor]  # the .grad of each parameter (a DTensor for DTensors)
    data_numel: int
    pending: int = 0
    work: object | None = None
    launched: bool = False

    @property
    def flags(self) -> torch.Tensor:
        return self.buf[self.data_numel :]


class DDPEngine(SyncToggle):
    """State and hooks of one :func:`replicate`-d module.

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
    ) -> None:
        self.module = module
        self.mesh = mesh
        self.dp_dim = dp_dim
        self.pg = mesh.get_group(dp_dim)
        self.world = mesh.size(dp_dim)
        self._sync = True
        self._cb_queued = False
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
        # buckets: reverse registration order (roughly the order gradients become ready)
        cap = max(1, int(bucket_cap_mb * 1024 * 1024))
        trainable = [p for p in reversed(ordered) if p.requires_grad]
        groups: list[list[nn.Parameter]] = []
        open_by_dtype: dict[torch.dtype, tuple[list, int]] = {}
        for p in trainable:
            loc = local_tensor(p)
            nbytes = loc.numel() * loc.element_size()
            cur = open_by_dtype.get(loc.dtype)
            if cur is None or (cur[1] + nbytes > cap and cur[0]):
                cur = ([], 0)
                groups.append(cur[0])
            cur[0].append(p)
            open_by_dtype[loc.dtype] = (cur[0], cur[1] + nbytes)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        for ps in groups:
            locs = [local_tensor(p) for p in ps]
            n = sum(t.numel() for t in locs)
            buf = torch.zeros(n + len(ps), dtype=locs[0].dtype, device=device)
            ranges, grad_views, off = [], [], 0
            for p, t in zip(ps, locs):
                view = buf[off : off + t.numel()].view(t.shape)
                ranges.append((off, off + t.numel()))
                off += t.numel()
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
            b = _Bucket(len(self.buckets), buf, ps, ranges, grad_views, n)
            self.buckets.append(b)
            for i, p in enumerate(ps):
                self._bucket_of[id(p)] = (b, i)
        self._handles = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(b, i)))
        self._handles.append(module.register_forward_pre_hook(self._pre_forward))

    # ------------------------------------------------------------------ public
    @property
    def extra_copy_bytes(self) -> int:
        """Bytes copied besides the collectives (always 0: gradients are bucket views)."""
        return 0

    def engine_tensors(self) -> list[torch.Tensor]:
        return [b.buf for b in self.buckets]

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module, args):
        for b in self.buckets:
            missing = [i for i, p in enumerate(b.params) if p.grad is None]
            if len(missing) == len(b.params):
                b.buf[: b.data_numel].zero_()
            for i in missing:
                a, e = b.ranges[i]
                if len(missing) != len(b.params):
                    b.buf[a:e].zero_()
                b.params[i].grad = b.grad_views[i]
        return None

    def _make_hook(self, b: _Bucket, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._cb_queued:
                self._cb_queued = True
                for bb in self.buckets:
                    bb.pending = len(bb.params)
                    bb.launched = False
                self.launch_log = []
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            b.flags[i] = 1
            b.pending -= 1
            if b.pending == 0 and self._sync:
                self._launch(b)

        return hook

    def _launch(self, b: _Bucket) -> None:
        if b.launched:
            return
        b.launched = True
        self.launch_log.append(b.index)
        if self.world > 1:
            b.work = dist.all_reduce(b.buf, op=dist.ReduceOp.AVG, group=self.pg, async_op=True)

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
            flags = b.flags.tolist()
            for i, f in enumerate(flags):
                # used on some rank: the averaged gradient; on none: no gradient at all
                b.params[i].grad = b.grad_views[i] if f > 0 else None
            b.flags.zero_()


def replicate(
    module: nn.Module,
    mesh: DeviceMesh,
    dp_dim: int | str = 0,
    *,
    bucket_cap_mb: float = 25,
    broadcast_from: int | None = 0,
) -> nn.Module:
    """Data-parallel ``module`` over the mesh dim ``dp_dim`` (DDP), in place.

    Args:
        module: The module (plain-tensor parameters, or DTensor parameters that are
            ``Replicate()`` on ``dp_dim``), all on one device of the mesh's type.
        mesh: Device mesh.
        dp_dim: Name or index of the data-parallel mesh dim.
        bucket_cap_mb: Largest gradient bucket in MiB (a larger parameter gets a
            bucket of its own).
        broadcast_from: Rank (on ``dp_dim``) whose parameter values every rank takes
            at wrap time; ``None`` keeps each rank's own.

    Returns:
        ``module`` itself; its engine (:class:`DDPEngine`) is
        ``get_dp_engine(module)``. Build the optimizer after this call.

    Raises:
        ValueError: ``dp_dim`` not in the mesh, module already data-parallel,
            parameters on several devices, a DTensor parameter not ``Replicate()``
            on ``dp_dim``. All before any collective.
    """
    what = "replicate"
    dim = resolve_dp_dim(mesh, dp_dim)
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")
    check_not_wrapped(module, what)
    device = check_one_device(module, mesh, what)
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and (
            p.device_mesh != mesh or not isinstance(p.placements[dim], Replicate)
        ):
            raise ValueError(
                f"{what}: parameter {name!r} must be Replicate() on the dp dim of the same "
                f"mesh, got {p.placements} on {p.device_mesh}"
            )
    if not bucket_cap_mb > 0:
        raise ValueError(f"{what}: bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    engine = DDPEngine(
        module, mesh, dim, bucket_cap_mb=bucket_cap_mb, broadcast_from=broadcast_from, device=device
    )
    module.__dict__[DP_STATE_ATTR] = engine
    return module
