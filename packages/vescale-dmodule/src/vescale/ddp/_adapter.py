"""``DistributedDataParallel``: veScale's DDP arguments mapped onto ``replicate``."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.dmodule._ddp import replicate
from vescale.dmodule._dp_common import local_tensor
from vescale.dtensor import joint_mesh, lift_placements

__all__ = ["DistributedDataParallel"]

_DEFAULT_BUCKET_ELEMENTS = 40_000_000


def _param_mesh(module: nn.Module) -> DeviceMesh | None:
    meshes = {
        id(p.device_mesh): p.device_mesh for p in module.parameters() if isinstance(p, DTensor)
    }
    if len(meshes) > 1:
        raise ValueError(
            "DistributedDataParallel: the parameters live on several device meshes "
            f"({list(meshes.values())}); expected one (the tensor-parallel mesh)"
        )
    return next(iter(meshes.values()), None)


class DistributedDataParallel(nn.Module):
    """veScale's DDP wrapper, over vescale's data-parallel engines.

    Args:
        module: The model: plain parameters, or DTensor parameters on the
            tensor-parallel mesh (``parallelize_module(m, mesh["TP"], plan)``) or on a
            mesh whose first dim is ``data_pg_or_device_mesh``.
        data_pg_or_device_mesh: The data-parallel mesh (``mesh["DP"]``); a mesh of more
            dims is data parallel over its first dim, as in veScale. Process groups are
            refused (vescale's engines work on meshes).
        accumulate_allreduce_grads_in_fp32: Reduce gradients in fp32. With
            ``use_distributed_optimizer`` the optimizer's reduce-scatter runs in fp32;
            without it, gradients of non-fp32 parameters are reduced in their own dtype
            (a warning says so).
        overlap_grad_reduce: Accepted; vescale's DDP always overlaps the bucketed
            all-reduces with backward.
        use_distributed_optimizer: The gradients are reduce-scattered by
            ``vescale.optim.distributed_optimizer.DistributedOptimizer`` in its
            ``step()`` (ZeRO-2); this wrapper issues no collective after backward.
        disable_bucketing: One gradient bucket per dtype.
        bucket_size: Elements per gradient bucket.
        module_to_enforce: Accepted; parameters unused in a step (e.g. MoE experts)
            need no marking: their gradients stay ``None`` on every rank.
        param_to_ignore: Refused unless empty (every trainable parameter is synced).
        **kwargs: Refused (named in the error).

    Raises:
        TypeError: A process group instead of a mesh, unknown keyword arguments.
        NotImplementedError: ``param_to_ignore``.
        ValueError: Parameters on meshes that do not combine with the data-parallel
            mesh, or plain parameters with ``use_distributed_optimizer`` (the
            distributed optimizer shards DTensor parameters).
    """

    def __init__(
        self,
        module: nn.Module,
        data_pg_or_device_mesh: DeviceMesh,
        accumulate_allreduce_grads_in_fp32: bool = True,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = False,
        disable_bucketing: bool = False,
        bucket_size: int = _DEFAULT_BUCKET_ELEMENTS,
        module_to_enforce: Sequence[type] | None = None,
        param_to_ignore: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(
                f"DistributedDataParallel got unknown keyword arguments {sorted(kwargs)}"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DistributedDataParallel: expected an nn.Module, got {type(module).__name__}"
            )
        mesh = data_pg_or_device_mesh
        if isinstance(mesh, dist.ProcessGroup):
            raise TypeError(
                "DistributedDataParallel: vescale's data parallelism works on device meshes; "
                "pass the data-parallel mesh (e.g. mesh['DP']) instead of a process group"
            )
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"DistributedDataParallel: expected a DeviceMesh, got {type(mesh).__name__}"
            )
        if param_to_ignore:
            raise NotImplementedError(
                "DistributedDataParallel(param_to_ignore=...) is not supported by vescale: every "
                "trainable parameter's gradient is synchronized; freeze the parameters "
                f"(requires_grad=False) instead of ignoring {list(param_to_ignore)}"
            )
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(
                f"DistributedDataParallel: bucket_size must be a positive int, got {bucket_size!r}"
            )
        self.module = module
        self.accumulate_allreduce_grads_in_fp32 = bool(accumulate_allreduce_grads_in_fp32)
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.use_distributed_optimizer = bool(use_distributed_optimizer)
        self.module_to_enforce = list(module_to_enforce or ())
        self._optimizers: list[weakref.ReferenceType] = []

        pmesh = _param_mesh(module)
        if mesh.ndim > 1 or pmesh is None or pmesh == mesh:
            self.mesh, self.dp_dim = mesh, 0  # veScale: the first dim is data parallel
        else:
            self.mesh, self.dp_dim = joint_mesh(mesh, pmesh)
        self.data_parallel_group = self.mesh.get_group(self.dp_dim)
        self.data_parallel_world_size = self.mesh.size(self.dp_dim)
        self.data_parallel_ranks = dist.get_process_group_ranks(self.data_parallel_group)

        if self.use_distributed_optimizer:
            self._check_for_distributed_optimizer()
            self._broadcast_params()
            self.bucket_size = None
        else:
            if self.accumulate_allreduce_grads_in_fp32:
                low = sorted(
                    {str(p.dtype) for p in module.parameters() if p.dtype != torch.float32}
                )
                if low:
                    warnings.warn(
                        "DistributedDataParallel(accumulate_allreduce_grads_in_fp32=True): "
                        f"gradients of {low} parameters are all-reduced in their own dtype by "
                        "vescale's DDP; use use_distributed_optimizer=True for fp32 reductions",
                        stacklevel=2,
                    )
            self.bucket_size = None if disable_bucketing else bucket_size
            itemsize = max((local_tensor(p).element_size() for p in module.parameters()), default=4)
            cap_mb = 1e9 if disable_bucketing else bucket_size * itemsize / 2**20
            replicate(module, self.mesh, self.dp_dim, bucket_cap_mb=cap_mb)

    # ------------------------------------------------------------------ checks
    def _check_for_distributed_optimizer(self) -> None:
        for name, p in self.module.named_parameters():
            if not isinstance(p, DTensor):
                raise ValueError(
                    f"DistributedDataParallel(use_distributed_optimizer=True): parameter {name!r} "
                    "is a plain tensor; the distributed optimizer shards DTensor parameters. "
                    "Parallelize the model first (parallelize_module(model, mesh['TP'], plan)) "
                    "or pass use_distributed_optimizer=False"
                )
            pls = (
                tuple(p.placements)
                if p.device_mesh == self.mesh
                else lift_placements(p.device_mesh, p.placements, self.mesh, self.dp_dim)
            )
            if pls is None or not isinstance(pls[self.dp_dim], Replicate):
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} ({list(p.placements)} on "
                    f"{p.device_mesh}) is not replicated over the data-parallel mesh {self.mesh}"
                )

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Every data-parallel replica starts from dp rank 0's values (as ``replicate``)."""
        if self.data_parallel_world_size == 1:
            return
        src = self.data_parallel_ranks[0]
        for p in self.module.parameters():
            dist.broadcast(local_tensor(p), src=src, group=self.data_parallel_group)

    # ------------------------------------------------------------------ veScale API
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*inputs, **kwargs)

    def _attach_optimizer(self, optimizer: Any) -> None:
        """Called by veScale's ``DistributedOptimizer``: ``zero_grad_buffer`` resets it too."""
        self._optimizers.append(weakref.ref(optimizer))

    def zero_grad_buffer(self, zero_buffer: bool = True) -> None:
        """Reset the gradients before a step (they become ``None``; buckets are reused).

        The distributed optimizers built over this model reset their sharded gradients
        too (``zero_grad()``), as veScale's gradient buffers are shared with them.
        """
        for p in self.module.parameters():
            p.grad = None
        for ref in self._optimizers:
            opt = ref()
            if opt is not None:
                opt.zero_grad(set_to_none=True)

    def start_grad_sync(self, *unused: Any) -> None:
        """A no-op: the bucketed all-reduces start during backward by themselves."""

    def finish_grad_sync(self) -> None:
        """Make sure every gradient is synchronized.

        vescale's DDP waits for its all-reduces at the end of each backward, and a
        ``parallelize_module`` model reduces its ``Partial`` gradients there too, so
        this only runs the latter again (a no-op when already done). With
        ``use_distributed_optimizer`` the data-parallel reduction happens in the
        optimizer's ``step()``.
        """
        sync = getattr(self.module, "finish_grad_sync", None)
        if callable(sync):
            sync()

    def state_dict(self, *args: Any, prefix: str = "", keep_vars: bool = False, **kwargs: Any):
        """The wrapped module's state dict (no ``module.`` prefix), as in veScale."""
        return self.module.state_dict(*args, prefix=prefix, keep_vars=keep_vars, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        """Load into the wrapped module."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
