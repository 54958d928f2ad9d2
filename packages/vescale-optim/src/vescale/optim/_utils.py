"""Small helpers shared by the optimizers: mesh dims, placements, parameter lists."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from vescale.dtensor import PluginPlacement
from vescale.optim import _compat

__all__ = [
    "is_sharded",
    "sharded_mesh_dims",
    "local_of",
    "normalize_param_groups",
    "ragged_shard",
]


def is_sharded(p: Placement) -> bool:
    """True if every element lives on exactly one rank of the mesh dim.

    ``Shard`` (and torch's strided shard) and every plugin placement
    (`vescale.dtensor.PluginPlacement`) count as sharded. The assumption for
    plugin placements is that they partition the logical tensor (each element on
    exactly one rank), which holds for ``RaggedShard``; a plugin placement that
    replicates elements would be over-counted by the norm.
    """
    return bool(p.is_shard()) or isinstance(p, PluginPlacement)


def sharded_mesh_dims(placements: Iterable[Placement]) -> tuple[int, ...]:
    """Indices of the mesh dims on which ``placements`` shard the tensor."""
    return tuple(i for i, p in enumerate(placements) if is_sharded(p))


def dim_label(mesh: DeviceMesh, dim: int) -> str:
    names = mesh.mesh_dim_names
    return f"{dim} ({names[dim]!r})" if names else str(dim)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the storage itself, not a copy) or ``t``."""
    return _compat.local_tensor(t)


def normalize_param_groups(
    params_or_model: Any,
) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Parameter groups (dicts with ``"params"`` lists) and a name per parameter id.

    Accepts an ``nn.Module`` (all its parameters, named), an iterable of tensors or an
    iterable of param-group dicts (as ``torch.optim.Optimizer``).
    """
    names: dict[int, str] = {}
    if isinstance(params_or_model, nn.Module):
        plist = []
        for n, p in params_or_model.named_parameters():
            names[id(p)] = n
            plist.append(p)
        groups = [{"params": plist}]
    else:
        if isinstance(params_or_model, torch.Tensor):
            raise TypeError(
                "params should be an iterable of tensors or dicts, or an nn.Module; got a tensor"
            )
        items = list(params_or_model)
        if not items:
            raise ValueError("optimizer got an empty parameter list")
        if all(isinstance(g, dict) for g in items):
            groups = []
            for g in items:
                g = dict(g)
                ps = g["params"]
                g["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
                groups.append(g)
        elif any(isinstance(g, dict) for g in items):
            raise TypeError("params must be all tensors or all param-group dicts, not a mix")
        else:
            groups = [{"params": items}]
    seen: set[int] = set()
    k = 0
    for g in groups:
        for p in g["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"optimizer can only optimize tensors, got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError("some parameters appear in more than one parameter group")
            seen.add(id(p))
            names.setdefault(id(p), f"param[{k}]")
            k += 1
    return groups, names


def ragged_shard(dims: tuple[int, ...], local_units: tuple[int, ...]) -> Placement:
    """A ``RaggedShard(dims, local_units)`` placement, found through the placement registry.

    vescale-optim does not import vescale-ragged: the placement joins through the
    ``vescale`` entry point like any plugin. Raises ``RuntimeError`` if it is missing.
    """
    from vescale.dtensor import placement_registry

    cls = placement_registry().get("RaggedShard")
    if cls is None:
        raise RuntimeError(
            "this feature needs the RaggedShard placement; install vescale-ragged "
            "(pip install vescale-ragged), which registers it through the `vescale` entry point"
        )
    return cls(dims, local_units)  # type: ignore[call-arg]
