"""``factory=``: tensors made by factory functions inside ``forward`` become DTensors.

veScale's ``parallelize_module(..., factory=True)``: inside the parallelized module's
``forward``, ``torch.zeros`` / ``ones`` / ``empty`` / ``full`` / ``rand`` / ``randn`` /
``arange`` return DTensors (``Replicate()`` on every mesh dim unless configured
otherwise) instead of plain tensors. A ``torch.overrides.TorchFunctionMode`` is
active while the root module's forward runs; per-class settings are pushed and popped
by forward hooks of the modules of those classes, so the innermost one applies.

Random factories draw on every rank independently: with ``Replicate()`` their values
agree across ranks only when every rank's generator has the same state (seed with
``vescale.dtensor.random.manual_seed``).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.overrides import TorchFunctionMode

from vescale.dtensor import distribute_tensor, normalize_placements

__all__ = ["FACTORY_FUNCTIONS", "install_factory"]

#: The factory functions ``factory=True`` converts.
FACTORY_FUNCTIONS = (
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.rand,
    torch.randn,
    torch.arange,
)

_Config = dict[Any, tuple[Placement, ...]]  # factory function -> placements


def _config_of(value: Any, mesh: DeviceMesh, where: str) -> _Config:
    """``True`` / ``False`` / ``{}`` / ``{torch.zeros: [Shard(0)], ...}`` -> checked config."""
    if value is True:
        return {f: (Replicate(),) * mesh.ndim for f in FACTORY_FUNCTIONS}
    if value is False or value is None:
        return {}
    if isinstance(value, Mapping):
        out: _Config = {}
        for fn, placements in value.items():
            if fn not in FACTORY_FUNCTIONS:
                names = ", ".join(f"torch.{f.__name__}" for f in FACTORY_FUNCTIONS)
                raise ValueError(
                    f"{where}: {fn!r} is not a factory function vescale converts ({names})"
                )
            try:
                out[fn] = normalize_placements(placements, mesh.ndim)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{where}[torch.{fn.__name__}]: {e}") from None
            if any(p.is_partial() for p in out[fn]):
                raise ValueError(
                    f"{where}[torch.{fn.__name__}]: Partial is not a factory placement"
                )
        return out
    raise TypeError(
        f"{where}: expected True, False or a dict of factory function -> placements, got {value!r}"
    )


def parse_factory(factory: Any, mesh: DeviceMesh) -> tuple[_Config, dict[type, _Config]]:
    """Check a ``factory=`` option before any communication: (root config, per-class)."""
    if isinstance(factory, Mapping) and any(isinstance(k, type) for k in factory):
        per_class = {}
        for cls, value in factory.items():
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(
                    f"factory: keys must be nn.Module classes (or factory functions), got {cls!r}"
                )
            per_class[cls] = _config_of(value, mesh, f"factory[{cls.__name__}]")
        return {}, per_class
    return _config_of(factory, mesh, "factory"), {}


class _FactoryMode(TorchFunctionMode):
    def __init__(self, mesh: DeviceMesh, stack: list[_Config]) -> None:
        super().__init__()
        self.mesh = mesh
        self.stack = stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        placements = self.stack[-1].get(func) if self.stack else None
        if placements is None or not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
            return out
        # only calls written in the model's code: torch's and vescale's own internals
        # (collectives, redistribution) keep their plain tensors
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.partition(".")[0] in ("torch", "vescale"):
            return out
        if all(isinstance(p, Replicate) for p in placements):
            return DTensor.from_local(out, self.mesh, placements, run_check=False)
        # every rank made the full tensor: cut this rank's shard locally
        return distribute_tensor(out, self.mesh, placements, src_data_rank=None)


def install_factory(model: nn.Module, mesh: DeviceMesh, factory: Any) -> list:
    """Register the hooks of ``factory=`` on ``model``; returns their handles."""
    root, per_class = parse_factory(factory, mesh)
    if not root and not per_class:
        return []
    stack: list[_Config] = []
    modes: list[_FactoryMode] = []

    def root_pre(mod, args):
        stack.append(root)
        mode = _FactoryMode(mesh, stack)
        mode.__enter__()
        modes.append(mode)

    def root_post(mod, args, out):
        if modes:
            modes.pop().__exit__(None, None, None)
            stack.pop()

    handles = [
        model.register_forward_pre_hook(root_pre, prepend=True),
        model.register_forward_hook(root_post, always_call=True),
    ]
    if per_class:

        def push(config):
            return lambda mod, args: stack.append(config)

        def pop(mod, args, out):
            if len(stack) > 1:
                stack.pop()

        for sub in model.modules():
            # the most derived listed class of this module wins
            hits = [c for c in per_class if isinstance(sub, c)]
            if not hits:
                continue
            cls = max(hits, key=lambda c: len(c.__mro__))
            cfg = per_class[cls]
            if sub is model:
                root.update(cfg)
                continue
            handles.append(sub.register_forward_pre_hook(push(cfg)))
            handles.append(sub.register_forward_hook(pop, always_call=True))
    return handles
