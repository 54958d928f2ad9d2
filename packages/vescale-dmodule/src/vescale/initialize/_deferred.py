"""Deferred construction: build on ``meta``, remember the call, build again for real."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from vescale.dtensor import distribute_tensor

_TAG = "_vescale_deferred_init"


def deferred_init(module_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call ``module_fn(*args, **kwargs)`` on the ``meta`` device and remember the call.

    Args:
        module_fn: A module class or a function returning an ``nn.Module`` or a tensor.
        *args: Its positional arguments (kept until materialization).
        **kwargs: Its keyword arguments.

    Returns:
        The module or tensor with ``meta`` tensors (no memory).

    Raises:
        TypeError: ``module_fn`` is not callable or returns neither a module nor a tensor.
    """
    if not callable(module_fn):
        raise TypeError(f"deferred_init: module_fn must be callable, got {module_fn!r}")
    with torch.device("meta"):
        obj = module_fn(*args, **kwargs)
    if not isinstance(obj, (nn.Module, torch.Tensor)):
        raise TypeError(
            f"deferred_init: {getattr(module_fn, '__name__', module_fn)!r} returned "
            f"{type(obj).__name__}; expected an nn.Module or a tensor"
        )
    setattr(obj, _TAG, (module_fn, args, kwargs))
    return obj


def _meta_tensors(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def is_deferred(obj: Any) -> bool:
    """True for a module or tensor from ``deferred_init`` not materialized yet."""
    if getattr(obj, _TAG, None) is None:
        return False
    if isinstance(obj, nn.Module):
        return _meta_tensors(obj)
    return isinstance(obj, torch.Tensor) and obj.device.type == "meta"


def _replay(obj: Any, device: torch.device | str | None) -> Any:
    fn, args, kwargs = getattr(obj, _TAG)
    if device is None:
        return fn(*args, **kwargs)
    with torch.device(device):
        return fn(*args, **kwargs)


def materialize_module(obj: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Build a deferred module for real, in place (same object, real tensors).

    The recorded call runs again (on ``device``, default: the default device) and its
    parameters and buffers replace the ``meta`` ones, tied weights staying tied.

    Args:
        obj: A module from ``deferred_init``.
        device: Where to build it.

    Returns:
        ``obj`` itself.

    Raises:
        ValueError: ``obj`` was not built by ``deferred_init``, or the call built
            a module of another structure.
    """
    if not isinstance(obj, nn.Module) or getattr(obj, _TAG, None) is None:
        raise ValueError(
            "materialize_module: the module was not built by vescale.initialize.deferred_init"
        )
    if not _meta_tensors(obj):
        return obj
    real = _replay(obj, device)
    mine = dict(obj.named_modules(remove_duplicate=False))
    theirs = dict(real.named_modules(remove_duplicate=False))
    if mine.keys() != theirs.keys():
        raise ValueError(
            "materialize_module: building the module again gave another structure "
            f"({sorted(set(mine) ^ set(theirs))[:5]} differ); was it changed after deferred_init?"
        )
    for name, mod in mine.items():
        other = theirs[name]
        for table in ("_parameters", "_buffers"):
            ours, new = getattr(mod, table), getattr(other, table)
            if ours.keys() != new.keys():
                raise ValueError(
                    f"materialize_module: {name or 'the root'} has {table[1:]} "
                    f"{sorted(ours)} but was rebuilt with {sorted(new)}"
                )
            for k in ours:
                ours[k] = new[k]
    delattr(obj, _TAG)
    return obj


def materialize_dtensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
) -> DTensor:
    """Distribute a deferred (or real) global tensor over ``device_mesh``.

    A deferred tensor is built again for real on the mesh's device first; the values of
    rank 0 are distributed (``distribute_tensor``), so every rank gets its shard of one
    tensor.

    Args:
        tensor: The tensor (not an ``nn.Parameter``; see ``materialize_dparameter``).
        device_mesh: The mesh.
        placements: Placements (``None``: replicated).

    Returns:
        The DTensor.

    Raises:
        TypeError: ``tensor`` is a parameter.
        ValueError: A ``meta`` tensor that ``deferred_init`` did not build.
    """
    if isinstance(tensor, nn.Parameter):
        raise TypeError(
            "materialize_dtensor takes a tensor; use materialize_dparameter for a Parameter"
        )
    if isinstance(tensor, DTensor):
        return tensor
    if tensor.device.type == "meta":
        if getattr(tensor, _TAG, None) is None:
            raise ValueError(
                "materialize_dtensor: a meta tensor that vescale.initialize.deferred_init did "
                "not build has no values to materialize"
            )
        tensor = _replay(tensor, device_mesh.device_type)
    return distribute_tensor(tensor, device_mesh, placements)


def materialize_dparameter(
    param: nn.Parameter,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None = None,
) -> nn.Parameter:
    """``materialize_dtensor`` for a parameter (keeps ``requires_grad``).

    Raises:
        TypeError: ``param`` is not a parameter.
        ValueError: A ``meta`` parameter (of a deferred module): materialize the module
            with ``materialize_module`` or ``parallelize_module`` instead.
    """
    if not isinstance(param, nn.Parameter):
        raise TypeError("materialize_dparameter takes an nn.Parameter")
    if isinstance(param.data, DTensor):
        return param
    if param.device.type == "meta":
        raise ValueError(
            "materialize_dparameter: a parameter of a deferred module cannot be built alone; "
            "materialize its module (materialize_module, or parallelize_module(module, ...))"
        )
    dt = distribute_tensor(param.detach(), device_mesh, placements)
    return nn.Parameter(dt, requires_grad=param.requires_grad)
