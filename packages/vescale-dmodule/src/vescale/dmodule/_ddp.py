"""Distributed data parallelism with bucketed, overlapped gradient all-reduce.

:func:`replicate` makes every parameter a ``Replicate()`` DTensor on the mesh
(parameters that already are DTensors, e.g. tensor-parallel ones from
:func:`~vescale.dmodule.parallelize_module`, keep their placements and must be
``Replicate()`` on the dp dim). Gradients live in contiguous *buckets*: each
parameter's ``.grad`` is a DTensor whose local tensor is a view of one bucket, so
autograd accumulates into the bucket in place. When the last gradient of a bucket
has been accumulated, the bucket's ``all_reduce(AVG)`` over the dp dim starts
asynchronously while backward continues; an autograd-engine callback at the end of
backward starts the buckets still pending (parameters not used this step) and
waits for all of them.

Every bucket carries one extra element per parameter, set to 1 on ranks where the
parameter got a gradient; after the all-reduce, parameters that no rank used get
``grad = None``, as in single-device training (no hang, no extra collective).

For a plain-tensor parameter the module computes with ``param.to_local()`` (a view,
swapped in by a forward pre-hook of the root and back by its forward hook), so
compute runs on plain tensors at full speed while the parameter, its gradient and
the optimizer state stay DTensors that :func:`vescale.debug.enable_gradient_sync_debug`
can check.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

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
    param_paths,
    resolve_dp_dim,
    swap_param,
)

__all__ = ["replicate", "DDPEngine"]


@dataclasses.dataclass
class _Bucket:
    index: int
    buf: torch.Tensor  # grads then one "used" flag per parameter
    params: list[nn.Parameter]
    ranges: list[tuple[int, int]]
    grad_dts: list[DTensor]
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
        paths = param_paths(module)
        ordered: list[nn.Parameter] = []
        self._local_swaps: list[tuple[list, nn.Parameter]] = []
        for p in list(module.parameters()):  # listed first: swapping changes identities
            if isinstance(p, DTensor):
                new = p
            else:
                local = p.detach()
                dt = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)
                new = nn.Parameter(dt, requires_grad=p.requires_grad)
                swap_param(paths[id(p)], new)
                self._local_swaps.append((paths[id(p)], new))
            ordered.append(new)
        if broadcast_from is not None and self.world > 1:
            src = dist.get_global_rank(self.pg, broadcast_from)
            with torch.no_grad():
                for p in ordered:
                    dist.broadcast(p._local_tensor, src=src, group=self.pg)
        # buckets: reverse registration order (roughly the order gradients become ready)
        cap = max(1, int(bucket_cap_mb * 1024 * 1024))
        trainable = [p for p in reversed(ordered) if p.requires_grad]
        groups: list[list[nn.Parameter]] = []
        open_by_dtype: dict[torch.dtype, tuple[list, int]] = {}
        for p in trainable:
            loc = p._local_tensor
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
            locs = [p._local_tensor for p in ps]
            n = sum(t.numel() for t in locs)
            buf = torch.zeros(n + len(ps), dtype=locs[0].dtype, device=device)
            ranges, grad_dts, off = [], [], 0
            for p, t in zip(ps, locs):
                view = buf[off : off + t.numel()].view(t.shape)
                ranges.append((off, off + t.numel()))
                off += t.numel()
                grad_dts.append(
                    DTensor.from_local(
                        view,
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                )
            b = _Bucket(len(self.buckets), buf, ps, ranges, grad_dts, n)
            self.buckets.append(b)
            for i, p in enumerate(ps):
                self._bucket_of[id(p)] = (b, i)
        self._handles = []
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(b, i)))
        self._handles.append(module.register_forward_pre_hook(self._pre_forward))
        self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))

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
                b.params[i].grad = b.grad_dts[i]
        for paths, p in self._local_swaps:
            swap_param(paths, p.to_local())
        return None

    def _post_forward(self, module, args, output):
        for paths, p in self._local_swaps:
            swap_param(paths, p)
        return None

    @contextlib.contextmanager
    def recompute_context(self, module: nn.Module) -> Iterator[None]:
        """Run an activation-checkpoint recomputation of ``module`` (a submodule).

        The root's forward hooks that swap in the plain local views of the
        parameters do not run again in backward, so do it around the recomputation.
        """
        for paths, p in self._local_swaps:
            swap_param(paths, p.to_local())
        try:
            yield
        finally:
            for paths, p in self._local_swaps:
                swap_param(paths, p)

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
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            flags = b.flags.tolist()
            for i, f in enumerate(flags):
                if f == 0:
                    b.params[i].grad = None
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
