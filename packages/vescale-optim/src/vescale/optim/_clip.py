"""Gradient norm and clipping over gradients with any mix of placements and meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.dtensor import redistribute
from vescale.dtensor.collectives import all_reduce
from vescale.optim import _compat
from vescale.optim._utils import local_of, sharded_mesh_dims

__all__ = ["clip_grad_norm_", "get_total_norm", "total_norm_of_locals", "clip_grads_with_norm_"]

#: One contribution to a global norm: a local tensor, and the mesh and mesh dims over
#: which its elements are split (each element on exactly one rank of those dims).
#: ``mesh=None`` (or no dims) means the tensor is complete on this rank.
NormEntry = tuple[torch.Tensor, "DeviceMesh | None", tuple[int, ...]]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _local_power(t: torch.Tensor, p: float) -> torch.Tensor:
    """``sum |t|^p`` (``max |t|`` for inf, nonzero count for 0) as an fp32/fp64 scalar."""
    dt = _acc_dtype(t)
    if t.numel() == 0:
        return torch.zeros((), dtype=dt, device=t.device)
    if math.isinf(p):
        return t.detach().abs().max().to(dt) if p > 0 else t.detach().abs().min().to(dt)
    if p == 0:
        return (t.detach() != 0).sum().to(dt)
    return torch.linalg.vector_norm(t.detach(), p, dtype=dt).pow(p)


def total_norm_of_locals(entries: Sequence[NormEntry], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of the concatenation of many distributed tensors.

    Each entry's local ``|x|^p`` sum (or max) is computed locally; entries with the same
    ``(mesh, dims)`` are added up first and then all-reduced once per dim of ``dims``,
    so replicated copies are counted once and there is one small collective per
    group, not per tensor. Every rank must pass the same groups in the same order.

    Args:
        entries: ``(local_tensor, mesh_or_None, sharded_mesh_dims)`` triples.
        norm_type: ``p`` (``inf`` for the max-norm, ``-inf`` for the min).

    Returns:
        The total norm, an fp32 (fp64 if any input is fp64) 0-dim tensor, equal on all
        ranks that share the meshes.
    """
    p = float(norm_type)
    is_inf = math.isinf(p)
    groups: dict[tuple, list[torch.Tensor]] = {}
    keys: dict[tuple, tuple[DeviceMesh | None, tuple[int, ...]]] = {}
    device = None
    dtype = torch.float32
    for local, mesh, dims in entries:
        dims = tuple(dims) if mesh is not None else ()
        key = (mesh, dims) if dims else (None, ())
        keys[key] = (mesh, dims)
        groups.setdefault(key, []).append(_local_power(local, p))
        device = device or local.device
        if local.dtype == torch.float64:
            dtype = torch.float64
    if device is None:
        return torch.tensor(0.0)
    parts = []
    for key, vals in groups.items():
        mesh, dims = keys[key]
        v = torch.stack([x.to(dtype) for x in vals])
        if is_inf:
            acc = v.max() if p > 0 else v.min()
        else:
            acc = v.sum()
        for d in dims:
            op = ("max" if p > 0 else "min") if is_inf else "sum"
            acc = all_reduce(acc.reshape(1), (mesh, d), op=op).reshape(())  # type: ignore[arg-type]
        parts.append(acc.to(device))
    stacked = torch.stack(parts)
    if is_inf:
        return stacked.max() if p > 0 else stacked.min()
    total = stacked.sum()
    if p == 0:
        return total
    return total.pow(1.0 / p)


def _grad_entry(g: torch.Tensor) -> NormEntry:
    if not isinstance(g, DTensor):
        return (g, None, ())
    pls = tuple(g.placements)
    if any(pl.is_partial() for pl in pls):
        # A Partial grad holds summands, not elements: reduce it first.
        pls = tuple(Replicate() if pl.is_partial() else pl for pl in pls)
        g = redistribute(g, g.device_mesh, pls)
    return (local_of(g), g.device_mesh, sharded_mesh_dims(pls))


def get_total_norm(
    tensors: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Total norm of tensors with any placements (see `clip_grad_norm_`).

    Args:
        tensors: Plain tensors and DTensors on any meshes.
        norm_type: ``p`` of the p-norm; ``inf`` for the max-norm.
        error_if_nonfinite: Raise if the norm is nan or inf.
        foreach: Accepted for signature compatibility with torch; local norms are
            always computed per tensor.

    Returns:
        The norm as a plain 0-dim tensor, equal on every rank.
    """
    del foreach
    entries = [_grad_entry(t) for t in tensors if t is not None]
    total = total_norm_of_locals(entries, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    return total


def clip_grads_with_norm_(
    tensors: Iterable[torch.Tensor],
    max_norm: float,
    total_norm: torch.Tensor,
    foreach: bool | None = None,
) -> None:
    """Scale ``tensors`` in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    Works on the local storage of DTensors (any placement, ``Partial`` included: the
    scale is linear), so no communication happens.
    """
    locals_ = [local_of(t) for t in tensors if t is not None]
    if not locals_:
        return
    coef = float(max_norm) / (total_norm + 1e-6)
    coef = torch.clamp(coef, max=1.0)
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in locals_:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), ts in by_key.items():
        c = coef.to(device=device, dtype=dtype)
        if foreach is None or foreach:
            _compat.foreach_mul_(ts, c)
        else:
            for t in ts:
                t.mul_(c)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    foreach: bool | None = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradient norm of parameters whose grads have any placements.

    A drop-in for `torch.nn.utils.clip_grad_norm_` that also accepts DTensor
    gradients with any mix of placements (``Replicate``, ``Shard``, ``Partial``,
    ``RaggedShard`` and other plugin placements) on any number of meshes, and plain
    tensors. Every element of every gradient is counted exactly once:

    - per gradient, ``sum |g|^p`` (``max |g|`` for ``inf``) of the local shard;
    - ``Partial`` gradients are reduced (to ``Replicate`` on those mesh dims) first;
    - the local values are added up per ``(mesh, sharded mesh dims)`` group and
      all-reduced only over the mesh dims on which the gradient is sharded, one
      collective per group and dim, so replicas are not double counted;
    - a mesh dim counts as sharded for ``Shard`` and for every plugin placement
      (the assumption: a plugin placement puts each element on exactly one rank of
      that mesh dim, as ``RaggedShard`` does).

    Every rank must call this with the same parameters (same meshes and placements,
    same order), like any collective.

    Args:
        parameters: A tensor or an iterable of tensors whose ``.grad`` to clip.
        max_norm: Max norm of the gradients.
        norm_type: ``p`` of the p-norm; ``float("inf")`` for the max-norm.
        foreach: Use ``torch._foreach_mul_`` for scaling (``None``: yes).
        error_if_nonfinite: Raise ``RuntimeError`` if the total norm is nan or inf.

    Returns:
        The total norm of the gradients (viewed as one vector) as a plain 0-dim tensor,
        equal on every rank.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(grads, max_norm, total, foreach)
    return total
