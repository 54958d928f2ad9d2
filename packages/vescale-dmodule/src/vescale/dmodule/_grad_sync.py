"""Bucketed reduction of ``Partial`` gradients of replicated parameters.

Under sequence parallelism a replicated parameter (a norm weight, a row-parallel
bias) sees only its rank's slice of the sequence, so its gradient comes out of
backward as ``Partial`` on the tensor-parallel mesh dim. Before the optimizer
step these gradients must be summed. `PartialGradSync` flattens every such
gradient of one (mesh dims, reduce op, dtype) group into one buffer and issues a
single ``all_reduce`` per mesh dim, then stores the gradients back as
``Replicate`` on that dim.

It runs automatically at the end of every backward that produced a gradient for
one of the module's parameters: a post-accumulate-grad hook on each parameter
queues one autograd-engine callback per backward pass.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from vescale.dmodule import _compat
from vescale.dtensor.hooks import weak_hook

__all__ = ["PartialGradSync"]

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class PartialGradSync:
    """Reduce ``Partial`` gradients of a module's parameters, bucketed.

    Args:
        params: The (DTensor) parameters to watch.
        mesh: Their device mesh.
        auto: Register hooks that run `sync` after every backward.
    """

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, auto: bool = True) -> None:
        self.params = params
        self.mesh = mesh
        self._queued = False
        self._handles = []
        self.last_buckets: list[tuple[tuple, int]] = []  # (group key, numel) of the last sync
        if auto:
            for p in params:
                if p.requires_grad:
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(
                            weak_hook(PartialGradSync._on_grad, self)
                        )
                    )

    def _on_grad(self, param: torch.Tensor) -> None:
        if self._queued:
            return
        self._queued = True
        _compat.queue_callback(self._callback)

    def _callback(self) -> None:
        self._queued = False
        self.sync()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def release(self) -> None:
        """Stop watching the parameters (another engine replaced them): hooks and references."""
        self.remove_hooks()
        self.params = []

    @torch.no_grad()
    def sync(self) -> int:
        """Reduce every ``Partial`` gradient now; return the number of collectives issued."""
        groups: dict[tuple, list[nn.Parameter]] = defaultdict(list)
        slow: list[nn.Parameter] = []
        for p in self.params:
            g = p.grad
            if not isinstance(g, DTensor):
                continue
            partial = tuple(
                (i, pl.reduce_op) for i, pl in enumerate(g.placements) if pl.is_partial()
            )
            if not partial:
                continue
            if any(type(g.placements[i]) is not Partial or op not in _OPS for i, op in partial):
                slow.append(p)
                continue
            groups[(partial, g.dtype, g.device)].append(p)
        issued = 0
        self.last_buckets = []
        for (partial, _dtype, _device), ps in groups.items():
            grads = [p.grad for p in ps]
            locals_ = [g.to_local() for g in grads]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            for i, op in partial:
                dist.all_reduce(flat, op=_OPS[op], group=self.mesh.get_group(i))
                issued += 1
            self.last_buckets.append((partial, flat.numel()))
            offset = 0
            for p, g, t in zip(ps, grads, locals_):
                n = t.numel()
                local = flat[offset : offset + n].view(t.shape)
                offset += n
                placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
                p.grad = DTensor.from_local(
                    local, g.device_mesh, placements, shape=g.shape, stride=g.stride()
                )
        for p in slow:
            g = p.grad
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            p.grad = g.redistribute(g.device_mesh, placements)
            issued += 1
        return issued
