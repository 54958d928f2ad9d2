"""Forward hooks that move module inputs and outputs to the placements of a plan."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from vescale.dtensor import redistribute

__all__ = ["to_placements", "make_input_hook", "make_output_hook", "implicit_replication"]


def to_placements(x: Any, mesh: DeviceMesh, placements: tuple[Placement, ...] | None) -> Any:
    """Move one value to ``placements`` (differentiable).

    A DTensor is redistributed (nothing happens if it already has them). A plain
    tensor is taken to hold the same full value on every rank (``Replicate()``)
    and then redistributed, so ``Shard`` picks each rank's chunk locally. Other
    values are returned unchanged.
    """
    if placements is None or not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    placements = tuple(
        Shard(p.dim + x.ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements
    )
    if tuple(x.placements) == placements:
        return x
    src = tuple(x.placements)
    out = redistribute(x, mesh, placements)
    if out.requires_grad and any(p.is_partial() for p in src):
        out.register_hook(_grad_fixer(src, placements))
    return out


def _grad_fixer(src: tuple[Placement, ...], target: tuple[Placement, ...]):
    """A gradient hook for the output of a redistribute whose source was partial.

    The backward of ``redistribute`` sends the gradient back to the source
    placements; torch turns a ``Replicate``/``Shard`` gradient into ``Replicate``
    there but keeps a partial gradient partial, and it cannot convert between
    different partial kinds. A replicated activation that feeds column-parallel
    layers gets a ``Partial(sum)`` gradient, which then cannot go back to, e.g.,
    the ``_MaskPartial`` output of a vocabulary-parallel embedding. So on mesh dims
    where the gradient is partial of another kind than the source, reduce it to
    the forward target placement (``Replicate`` if that is partial too) first.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor):
            return grad
        gp = tuple(grad.placements)
        new = list(gp)
        for i, (g, s, t) in enumerate(zip(gp, src, target)):
            if g.is_partial() and s.is_partial() and g != s:
                new[i] = Replicate() if t.is_partial() else t
        if tuple(new) == gp:
            return grad
        return redistribute(grad, grad.device_mesh, tuple(new))

    return hook


def _apply_seq(values: tuple, spec: tuple, mesh: DeviceMesh) -> tuple:
    out = list(values)
    for i, p in enumerate(spec):
        if i < len(out):
            out[i] = to_placements(out[i], mesh, p)
    return tuple(out)


def make_input_hook(module: nn.Module, spec: Any, mesh: DeviceMesh):
    """A ``forward_pre_hook`` (with kwargs) that applies an input spec."""
    positions: dict[str, int] = {}
    if isinstance(spec, Mapping):
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        for i, p in enumerate(params):
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positions[p.name] = i

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        if isinstance(spec, Mapping):
            args = list(args)
            kwargs = dict(kwargs)
            for name, p in spec.items():
                if name in kwargs:
                    kwargs[name] = to_placements(kwargs[name], mesh, p)
                elif name in positions and positions[name] < len(args):
                    i = positions[name]
                    args[i] = to_placements(args[i], mesh, p)
            return tuple(args), kwargs
        return _apply_seq(tuple(args), spec, mesh), kwargs

    return hook


def _apply_output(out: Any, spec: Any, mesh: DeviceMesh) -> Any:
    if isinstance(spec, Mapping):
        if isinstance(out, Mapping):
            updates = {k: to_placements(out[k], mesh, p) for k, p in spec.items() if k in out}
            if isinstance(out, dict) and type(out) is not dict:
                for k, v in updates.items():  # e.g. HF ModelOutput: keep the object
                    out[k] = v
                return out
            new = dict(out)
            new.update(updates)
            return type(out)(new) if type(out) is not dict else new
        if dataclasses.is_dataclass(out) and not isinstance(out, type):
            updates = {
                k: to_placements(getattr(out, k), mesh, p)
                for k, p in spec.items()
                if hasattr(out, k)
            }
            return dataclasses.replace(out, **updates)
        raise TypeError(f"output plan is a dict but the module returned {type(out).__name__}")
    if isinstance(out, torch.Tensor):
        return to_placements(out, mesh, spec[0] if spec else None)
    if isinstance(out, tuple):
        converted = _apply_seq(out, spec, mesh)
        return type(out)(*converted) if hasattr(out, "_fields") else converted
    if isinstance(out, list):
        return list(_apply_seq(tuple(out), spec, mesh))
    raise TypeError(
        f"output plan is a list but the module returned {type(out).__name__}; use a dict "
        "plan for dict/dataclass outputs"
    )


def make_output_hook(spec: Any, mesh: DeviceMesh):
    """A ``forward_hook`` that applies an output spec."""

    def hook(mod: nn.Module, args: tuple, out: Any):
        return _apply_output(out, spec, mesh)

    return hook


# ------------------------------------------------------------- implicit replication
def _get_flag() -> bool:
    return bool(torch._C._get_dtensor_allow_implicit_replication())


def _set_flag(value: bool) -> None:
    torch._C._set_dtensor_allow_implicit_replication(value)


@contextmanager
def implicit_replication():
    """Like torch's ``implicit_replication`` but restores the previous state (nests)."""
    old = _get_flag()
    _set_flag(True)
    try:
        yield
    finally:
        _set_flag(old)


class ImplicitReplicationHooks:
    """Let plain tensors made inside a module's forward act as replicated DTensors.

    During ``forward`` torch's implicit-replication flag is on, so ops that mix
    DTensors with plain tensors created inside ``forward`` (causal masks,
    ``torch.arange`` position ids, zero caches, integer token ids) treat the plain
    ones as ``Replicate()``. Autograd saves some of those plain tensors for the
    backward (the mask of ``masked_fill``, the indices of ``embedding``), and the
    backward runs with the thread-local state captured when ``backward()`` was
    called, where the flag is off. So a saved-tensors pack hook, active only
    during ``forward``, stores every saved plain tensor that does not require grad
    as a replicated DTensor. Both are undone even if ``forward`` raises.

    Limitation: an op between plain tensors only, one of which requires grad, that
    saves a plain tensor (rare inside a parallelized model, where parameters and
    activations are DTensors) would get a DTensor in its backward; turn the
    option off (``implicit_replication=False``) for such models.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self._stack: list[tuple[bool, Any]] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and not t.requires_grad:
            with torch.no_grad():
                return DTensor.from_local(
                    t, self.mesh, [Replicate()] * self.mesh.ndim, run_check=False
                )
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def pre(self, mod: nn.Module, args: tuple) -> None:
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._stack.append((_get_flag(), ctx))
        _set_flag(True)
        ctx.__enter__()

    def post(self, mod: nn.Module, args: tuple, out: Any) -> None:
        if self._stack:
            flag, ctx = self._stack.pop()
            ctx.__exit__(None, None, None)
            _set_flag(flag)
