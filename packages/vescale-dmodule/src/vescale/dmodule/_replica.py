"""Replica mesh dims: tensor-parallel computation on the mesh without them.

A mesh dim on which a sharding plan places nothing but ``Replicate()`` (parameters,
buffers, module inputs and outputs, forward-section tensors, ``factory=``), while
another dim carries tensor parallelism, is a *replica* dim: its ranks hold the same
parameters, and a training program may feed each of them its own samples (data
parallelism by ``vescale.optim.DistributedOptimizer`` or the program itself).
Activations computed on the whole mesh would claim ``Replicate()`` there; DTensor
may then cut such an activation on that dim (a local slice) and reduce the partial
results back over it, mixing the ranks' samples. So `parallelize_module` keeps the
parameters on the whole mesh (``Replicate()`` on the replica dims: optimizers,
clipping, checkpoints and the gradient-sync check see them unchanged), and the
model computes on the sub-mesh without the replica dims:

* `ReplicaCompute` swaps, for the duration of a module's ``forward``, each of the
  module's own parameters and buffers for a differentiable view on the sub-mesh
  (same local tensor, no communication); the parameter itself stays in place
  afterwards and receives the gradient;
* the view's backward lifts the gradient back onto the whole mesh, ``Replicate()``
  on the replica dims, without communication: each rank's gradient is its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from vescale.dmodule import _plan
from vescale.dtensor import lift_placements

__all__ = ["replica_dims", "ReplicaCompute"]


def _placement_lists(spec: Any) -> Iterator[tuple[Placement, ...]]:
    """Every placement list in a resolved forward spec."""
    if spec is None:
        return
    if isinstance(spec, _plan.LocalLayout):
        yield from _placement_lists(spec.src)
        yield from _placement_lists(spec.dst)
    elif isinstance(spec, dict):
        for v in spec.values():
            yield from _placement_lists(v)
    elif _plan._is_placement_list(spec):
        if spec:
            yield tuple(spec)
    elif isinstance(spec, (list, tuple)):
        for v in spec:
            yield from _placement_lists(v)


def _factory_lists(factory: Any, ndim: int) -> Iterator[tuple[Placement, ...]]:
    from vescale.dtensor import normalize_placements

    if isinstance(factory, dict):
        for k, v in factory.items():
            if isinstance(k, type):
                yield from _factory_lists(v, ndim)
            elif v not in (True, False, None):
                yield tuple(normalize_placements(v, ndim))


def replica_dims(resolved: _plan.ResolvedPlan, mesh: DeviceMesh, factory: Any) -> set[int]:
    """The mesh dims on which ``resolved`` (and ``factory=``) place only ``Replicate()``.

    Empty when that is every dim (nothing is tensor parallel: the model computes on
    ``mesh`` as before).
    """
    lists = [e.placements for e in resolved.params]
    for table in (resolved.inputs, resolved.outputs):
        for _key, spec in table.values():
            lists += _placement_lists(spec)
    for table in resolved.tensors.values():
        for _key, spec in table.values():
            lists += _placement_lists(spec)
    if factory not in (False, None):
        lists += _factory_lists(factory, mesh.ndim)
    dims = {d for d in range(mesh.ndim) if all(pl[d].is_replicate() for pl in lists)}
    return set() if len(dims) == mesh.ndim else dims


class _ComputeView(torch.autograd.Function):
    """A DTensor on the whole mesh, ``Replicate()`` on the replica dims -> the same
    local tensor on the compute sub-mesh; the gradient goes back lifted."""

    @staticmethod
    def forward(ctx: Any, t: DTensor, rc: ReplicaCompute) -> DTensor:  # type: ignore[override]
        ctx.rc = rc
        kept = tuple(p for i, p in enumerate(t.placements) if i not in rc.dims)
        ctx.kept = kept
        ctx.shape, ctx.stride = t.shape, t.stride()
        return DTensor.from_local(
            t.to_local(), rc.sub, kept, run_check=False, shape=t.shape, stride=t.stride()
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:  # type: ignore[override]
        rc: ReplicaCompute = ctx.rc
        if not isinstance(grad, DTensor):  # a local gradient laid out like the view
            grad = DTensor.from_local(
                grad, rc.sub, ctx.kept, run_check=False, shape=ctx.shape, stride=ctx.stride
            )
        # each rank's own gradient: Replicate() on the replica dims, nothing reduced
        lifted = lift_placements(grad.device_mesh, grad.placements, rc.mesh, tuple(rc.dims))
        if lifted is None:
            raise RuntimeError(
                f"gradient on {grad.device_mesh}, expected the compute mesh {rc.sub} "
                f"(the mesh {rc.mesh} without dims {sorted(rc.dims)})"
            )
        out = DTensor.from_local(
            grad.to_local(), rc.mesh, lifted, run_check=False, shape=grad.shape,
            stride=grad.stride(),
        )  # fmt: skip
        return out, None


class ReplicaCompute:
    """Per-module forward hooks presenting whole-mesh tensors on the compute sub-mesh.

    Args:
        mesh: The mesh the parameters and buffers live on.
        sub: ``mesh`` without ``dims`` (at this rank's coordinate).
        dims: The replica dims of ``mesh``.
    """

    def __init__(self, mesh: DeviceMesh, sub: DeviceMesh, dims: set[int]) -> None:
        self.mesh = mesh
        self.sub = sub
        self.dims = frozenset(dims)
        self._saved: dict[int, list[list[tuple[dict, str, torch.Tensor]]]] = {}

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the compute mesh (differentiable), if it is a whole-mesh DTensor
        replicated on the replica dims; otherwise ``t`` itself."""
        if not isinstance(t, DTensor) or not self._on_mesh(t):
            return t
        if not all(t.placements[d].is_replicate() for d in self.dims):
            return t
        return _ComputeView.apply(t, self)

    def _on_mesh(self, t: DTensor) -> bool:
        # equal, not necessarily identical: torch may hand out an equal mesh object
        # from an earlier DTensor spec
        return t.device_mesh is self.mesh or t.device_mesh == self.mesh

    def _swap_in(self, mod: nn.Module) -> None:
        swapped = []
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is None:
                    continue
                v = self.view(t)
                if v is not t:
                    swapped.append((table, attr, t))
                    table[attr] = v
        self._saved.setdefault(id(mod), []).append(swapped)

    def _swap_out(self, mod: nn.Module) -> None:
        stack = self._saved.get(id(mod))
        if stack:
            for table, attr, orig in stack.pop():
                table[attr] = orig

    def install(self, model: nn.Module) -> list:
        """Hooks on every module of ``model`` that owns a whole-mesh DTensor.

        Register after the plan's other hooks: the pre-hook is prepended (the plan's
        forward-section tensor hooks then see the views) and the post-hook (always
        called) runs last, after they put the views back.
        """
        handles = []
        seen: set[int] = set()
        for mod in model.modules():
            if id(mod) in seen:
                continue
            seen.add(id(mod))
            own = list(mod._parameters.values()) + list(mod._buffers.values())
            if not any(isinstance(t, DTensor) and self._on_mesh(t) for t in own):
                continue
            handles.append(
                mod.register_forward_pre_hook(lambda m, a: self._swap_in(m), prepend=True)
            )
            handles.append(
                mod.register_forward_hook(lambda m, a, o: self._swap_out(m), always_call=True)
            )
        return handles

    @contextlib.contextmanager
    def recompute_context(self, module: nn.Module) -> Iterator[None]:
        """An activation-checkpoint recomputation of ``module``: its own hooks do not run
        again (they sit outside the checkpointed region), so its tensors are swapped here."""
        self._swap_in(module)
        try:
            yield
        finally:
            self._swap_out(module)
