"""Detect replicated gradients that diverge across ranks (off by default)."""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.weak import WeakIdKeyDictionary

from vescale.dtensor import _compat

__all__ = [
    "GradientSyncError",
    "GradientSyncDebugHandle",
    "declare_replicated",
    "enable_gradient_sync_debug",
]

# Plain-tensor parameters that an engine keeps as full replicas over mesh dims
# (e.g. vescale DDP): parameter -> (mesh, mesh dims). Keyed by identity, weakly.
_PLAIN_REPLICAS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def declare_replicated(param: torch.Tensor, mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> None:
    """Declare a plain-tensor ``param`` a replica over ``mesh_dims`` of ``mesh``.

    Engines that keep replicated parameters as plain tensors (vescale DDP) call this
    so that `enable_gradient_sync_debug` checks their gradients like those of
    ``Replicate()`` DTensors.

    Raises:
        TypeError: ``param`` is a DTensor (its placements already say it).
        ValueError: a mesh dim out of range.
    """
    if isinstance(param, DTensor):
        raise TypeError("declare_replicated takes plain tensors; a DTensor's placements say it")
    for d in mesh_dims:
        if not 0 <= d < mesh.ndim:
            raise ValueError(f"mesh dim {d} out of range for a {mesh.ndim}-dim mesh")
    _PLAIN_REPLICAS[param] = (mesh, tuple(mesh_dims))


class GradientSyncError(RuntimeError):
    """Gradients of replicated parameters differ across the ranks of a mesh dim."""


@dataclass
class _State:
    # No strong reference to the model or its parameters: the state lives as long as
    # the check is on (in ``_active``), and must not keep a deleted model alive.
    rtol: float
    names: dict[int, str] = field(default_factory=dict)
    # keyed by identity: a WeakSet would compare tensors with ``==``
    hooked: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)
    scanned: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    handles: list = field(default_factory=list)
    pending: dict[int, nn.Parameter] = field(default_factory=dict)
    callback_queued: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


_active: list[_State] = []


class GradientSyncDebugHandle:
    """Returned by `enable_gradient_sync_debug`; ``remove()`` turns the check off."""

    def __init__(self, state: _State):
        self._state = state

    def remove(self) -> None:
        for h in self._state.handles:
            h.remove()
        self._state.handles.clear()
        if self._state in _active:
            _active.remove(self._state)

    def __enter__(self) -> GradientSyncDebugHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _replicated_dims(p: torch.Tensor) -> list[int]:
    if not isinstance(p, DTensor):
        entry = _PLAIN_REPLICAS.get(p)
        return list(entry[1]) if entry is not None else []
    return [i for i, pl in enumerate(p.placements) if isinstance(pl, Replicate)]


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Three numbers that change when any element, or the order of elements, changes."""
    flat = t.detach().reshape(-1).to(torch.float64)
    if flat.numel() == 0:
        return flat.new_zeros(3)
    pos = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), (flat * flat).sum(), (flat * torch.sin(pos)).sum()])


def _check(state: _State) -> None:
    with state.lock:
        params = list(state.pending.values())
        state.pending.clear()
        state.callback_queued = False
    # group (param, local grad) by (mesh, mesh dim) where the parameter is replicated
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        name = state.names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")
        if not isinstance(p, DTensor):  # a declared plain replica
            entry = _PLAIN_REPLICAS.get(p)
            if entry is None or isinstance(g, DTensor):
                continue
            for i in entry[1]:
                groups[(entry[0], i)].append((name, g))
            continue
        if not isinstance(g, DTensor):
            continue
        for i in _replicated_dims(p):
            if not isinstance(g.placements[i], Replicate):
                continue  # Partial: reduction pending by design; Shard: not a replica
            groups[(p.device_mesh, i)].append((name, g.to_local()))
    # deterministic order on every rank
    problems: list[str] = []
    for (mesh, i), items in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        items.sort(key=lambda t: t[0])
        local = torch.stack([_checksum(t) for _, t in items]).reshape(-1)
        group = mesh.get_group(i)
        n = dist.get_world_size(group)
        out = local.new_empty(n * local.numel())
        dist.all_gather_into_tensor(out, local.contiguous(), group=group)
        per_rank = out.reshape(n, len(items), 3)
        ranks = dist.get_process_group_ranks(group)
        ref = per_rank[0]
        scale = ref.abs().clamp_min(1e-30)
        for k, (name, _) in enumerate(items):
            bad = [
                ranks[r]
                for r in range(1, n)
                if not torch.all((per_rank[r, k] - ref[k]).abs() <= state.rtol * scale[k])
            ]
            if bad:
                problems.append(
                    f"{name}: gradient on ranks {bad} differs from rank {ranks[0]} "
                    f"(mesh dim {i} of {mesh}, where the parameter is Replicate())"
                )
    problems = _agree(problems, sorted({m for m, _ in groups}, key=str))
    if problems:
        raise GradientSyncError(
            "replicated gradients diverged across ranks:\n  " + "\n  ".join(problems)
        )


def _agree(problems: list[str], meshes: list[DeviceMesh]) -> list[str]:
    """Every rank of the checked meshes learns every rank's findings.

    A divergence is seen only by the ranks of the mesh-dim groups where it happens (on a
    2x2 mesh, rank 1 out of step is seen in its groups {0, 1} and {1, 3}, not by rank 2):
    the others would carry on into the next collective and wait there for ever. A
    reduction over each mesh dim in turn reaches the whole mesh; the findings are
    exchanged the same way, only when there are some.
    """
    if not meshes:
        return problems
    seen = 1.0 if problems else 0.0
    for mesh in meshes:
        flag = torch.tensor([seen], device=mesh.device_type)
        for i in range(mesh.ndim):
            group = mesh.get_group(i)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        seen = max(seen, flag.item())
    if not seen:
        return problems
    found = set(problems)
    for mesh in meshes:
        for i in range(mesh.ndim):
            group = mesh.get_group(i)
            n = dist.get_world_size(group)
            if n > 1:
                everyone: list = [None] * n
                dist.all_gather_object(everyone, sorted(found), group=group)
                found.update(*everyone)
    return sorted(found)


def _make_hook(state: _State):
    def hook(p: torch.Tensor) -> None:
        with state.lock:
            state.pending[id(p)] = p  # type: ignore[assignment]
            if state.callback_queued:
                return
            state.callback_queued = True
        _compat.queue_callback(lambda: _check(state))

    return hook


def _watch(state: _State, p: nn.Parameter, name: str | None) -> None:
    if p in state.hooked or not p.requires_grad or not _replicated_dims(p):
        return
    state.hooked[p] = True
    if name is not None:
        state.names.setdefault(id(p), name)
    state.handles.append(p.register_post_accumulate_grad_hook(_make_hook(state)))


def enable_gradient_sync_debug(
    model: nn.Module | None = None, *, rtol: float = 0.0
) -> GradientSyncDebugHandle:
    """Check after every backward that replicated gradients agree across ranks.

    For every DTensor parameter that is ``Replicate()`` on some mesh dim (and every
    plain parameter declared a replica with `declare_replicated`), a cheap
    checksum of its gradient (sum, sum of squares and a position-weighted sum, in
    float64) is all-gathered over that mesh dim once per backward (one collective
    per mesh dim, for all parameters together) and compared; a one-element all-reduce
    per mesh dim then tells every rank of the mesh whether any group diverged. A
    divergence raises `GradientSyncError` from `backward()` on every rank of
    the mesh, naming the parameters and the ranks that differ.

    Off by default and zero cost when off: nothing is hooked until this is called.

    Args:
        model: The model to watch (parameter names come from it). Without it,
            parameters are discovered in the forward pass of any module and named
            ``ClassName.param``.
        rtol: Relative tolerance of the comparison (``0.0``: bitwise-equal sums).

    Returns:
        A handle; ``handle.remove()`` (or leaving a ``with`` block) turns it off.
    """
    state = _State(rtol=rtol)
    _active.append(state)
    if model is not None:
        for name, p in model.named_parameters():
            _watch(state, p, name)
    else:

        def discover(module: nn.Module, args: object) -> None:
            # The outermost module runs its pre-hook first: its names (e.g.
            # ``linear.weight``) qualify every parameter below it.
            if module not in state.scanned:
                state.scanned.add(module)
                for qual, p in module.named_parameters():
                    state.names.setdefault(id(p), qual)
            for pname, p in module.named_parameters(recurse=False):
                _watch(state, p, f"{type(module).__name__}.{pname}")

        state.handles.append(nn.modules.module.register_module_forward_pre_hook(discover))
    return GradientSyncDebugHandle(state)
