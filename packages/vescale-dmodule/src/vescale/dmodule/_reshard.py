"""Live resharding: move a running model, its optimizer and the RNG to another layout.

`reshard` builds the model again under the new `Layout` (from the meta skeleton that
`apply_layout` / ``DModule(..., strategy=...)`` recorded, or from ``model_fn``),
then moves every parameter, persistent buffer and optimizer-state tensor by
redistribution, one tensor at a time: ``full_tensor()`` on the old mesh (an
all-gather over the ranks that shard it) and a local cut to the new placements
(``distribute_tensor(..., src_data_rank=None)``: no further communication). The state
dicts are torch's (``torch.distributed.checkpoint.state_dict``), keyed by parameter
name, the same ones `vescale.checkpoint` saves, so the result equals a checkpoint
saved under the old layout and loaded under the new one. No files are written.

A `vescale.optim.DistributedOptimizer` (ZeRO) moves too: its sharded state is
gathered per tensor (``full_tensor()`` of its ``RaggedShard`` DTensors) and the new
ZeRO optimizer, built on the new mesh with the same inner class, hyperparameters and
options, cuts its own slices from it. ZeRO reduces the gradients itself, so the new
model gets no DDP engine (``data_parallel=None``), and the target must keep a
replicated ``"dp"`` dim to shard the state over: a target with FSDP or without a
``"dp"`` dim is refused before any communication (or pass ``optimizer_fn``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from vescale.dmodule._cost_model import Layout
from vescale.dmodule._rng_sync import sync_default_rng
from vescale.dmodule._strategy import _skeleton, apply_layout, choose
from vescale.dtensor import distribute_tensor  # plugin placements (RaggedShard) too

__all__ = ["reshard", "ReshardError"]


class ReshardError(ValueError):
    """`reshard` cannot move this model or optimizer (the message says why)."""


def _no_init(module: nn.Module) -> None:
    """``param_init_fn`` of the new model: every value is overwritten by the old one."""


def _full(v: Any) -> Any:
    return v.full_tensor() if isinstance(v, DTensor) else v


def _like(full: Any, like: Any, key: str) -> Any:
    if not isinstance(full, torch.Tensor):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ReshardError(
            f"reshard: {key!r} has shape {tuple(full.shape)} in the old layout but "
            f"{tuple(like.shape)} in the new one"
        )
    full = full.to(dtype=like.dtype)
    if isinstance(like, DTensor):
        # every rank holds the full value: cut locally, no communication
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full.to(like.device)


def _zero_dp_dim(optimizer: Any, target: Layout, optimizer_fn: Any) -> str | None:
    """The dp dim name of a `DistributedOptimizer` that `reshard` rebuilds (``None``
    for other optimizers or with ``optimizer_fn``); refuses targets it cannot shard over."""
    from vescale.optim import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer) or optimizer_fn is not None:
        return None
    names = optimizer.mesh.mesh_dim_names
    dp_name = names[optimizer.dp_dim] if names else None
    dims = dict(target.mesh_dims)
    why = None
    if dp_name != "dp":
        why = f"its dp dim is {dp_name!r}, not the layouts' 'dp'"
    elif target.fsdp > 1 or target.pp > 1:
        why = "the target shards parameters over 'fsdp' or splits them into pipeline stages"
    elif dims.get("dp", 1) <= 1:
        why = "the target has no 'dp' dim (dp=1) to shard the optimizer state over"
    if why:
        raise ReshardError(
            f"reshard: cannot move a DistributedOptimizer (ZeRO) to {target.describe()}: "
            f"{why}. Choose a target with dp > 1 and fsdp = 1 (e.g. Layout(dp=2, tp=2)), or "
            "pass optimizer_fn=<builds the new optimizer> (its state is loaded by name)"
        )
    return dp_name


def _sync_rng() -> None:
    """Every rank's default generators take rank 0's state (as a checkpoint resume does)."""
    sync_default_rng(None, 0)


def reshard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    target: Layout | str,
    *,
    model_fn: Callable[[], nn.Module] | None = None,
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    sync_rng: bool = True,
    **auto: Any,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Change a running model's layout in-process; return the new model and optimizer.

    Call it between steps (gradients are not moved). The returned model is a new
    object parallelized under ``target`` with the old values; the optimizer is a new
    one of the same class and hyperparameters (``param_groups`` by parameter name)
    holding the old state; the old objects should be dropped. Every rank's default
    random generators take rank 0's state (what loading a checkpoint that saved
    ``torch.get_rng_state()`` gives), so dropout continues identically.

    Args:
        model: A model parallelized by `apply_layout` or ``DModule(...,
            strategy=...)`` (its skeleton was recorded), or any parallelized model
            with ``model_fn``.
        optimizer: Its optimizer (``None``: model only).
        target: The new `Layout` (same world size), or ``"auto"`` to search again
            (``auto`` keywords as for ``DModule(..., strategy="auto")``:
            ``global_batch`` required, ``device``, ``device_memory``, ...).
        model_fn: Builds the plain model again (any device, meta included); needed
            when the model was parallelized without a recorded layout.
        optimizer_fn: ``fn(new_model) -> optimizer``; default: the optimizer's class
            with its ``defaults`` and its groups' hyperparameters (a
            `DistributedOptimizer`: the same inner class, options and dp dim on the
            new mesh). Needed for other optimizers whose constructor takes more than
            parameter groups.
        sync_rng: Give every rank rank 0's generator state.
        **auto: Keywords of the ``"auto"`` search.

    Returns:
        ``(new_model, new_optimizer)``.

    Raises:
        ReshardError: No recorded skeleton and no ``model_fn``; state keys or shapes
            differ between the layouts; the optimizer holds parameters that are not
            the model's; a `DistributedOptimizer` and a target without a replicated
            ``"dp"`` dim. Raised before any communication where possible.
    """
    from vescale.optim import DistributedOptimizer

    rec = _skeleton(model)
    if rec is None and model_fn is None:
        raise ReshardError(
            f"reshard: {type(model).__qualname__} was not parallelized by apply_layout or "
            "DModule(..., strategy=...); pass model_fn=<builds the plain model>"
        )
    zero = isinstance(optimizer, DistributedOptimizer)
    if optimizer is not None:
        ids = {id(p) for p in model.parameters()}
        held = (
            optimizer.params if zero else [p for g in optimizer.param_groups for p in g["params"]]
        )
        stray = [p for p in held if id(p) not in ids]
        if stray:
            raise ReshardError(
                f"reshard: the optimizer holds {len(stray)} parameter(s) that are not the model's"
            )
    if isinstance(target, str):
        if target != "auto":
            raise ReshardError(f"reshard: target must be a Layout or 'auto', got {target!r}")
        base = rec[0] if rec is not None else model_fn()  # type: ignore[misc]
        if zero and optimizer_fn is None:
            auto.setdefault("allow", {"dp_modes": {"ddp"}})  # ZeRO shards over "dp"
        target = choose(base, **auto).layout
    elif not isinstance(target, Layout):
        raise ReshardError(
            f"reshard: target must be a Layout or 'auto', got {type(target).__name__}"
        )
    elif auto:
        raise TypeError(f"reshard: unexpected keyword(s) {sorted(auto)} with a Layout target")

    dp_name = _zero_dp_dim(optimizer, target, optimizer_fn)
    if rec is not None:
        skeleton, options = copy.deepcopy(rec[0]), dict(rec[1])
    else:
        skeleton, options = model_fn(), {}  # type: ignore[misc]
    options["param_init_fn"] = _no_init
    # every value is overwritten: no rank's values (or generators) need distributing
    options["src_data_rank"] = None
    if dp_name is not None:
        options["data_parallel"] = None  # ZeRO reduces the gradients itself
        optimizer.wait_param_gather()
    new = apply_layout(skeleton, target, **options)

    # ---- parameters and buffers, one tensor at a time
    old_sd = get_model_state_dict(model)
    like_sd = get_model_state_dict(new)
    if set(old_sd) != set(like_sd):
        raise ReshardError(
            f"reshard: state keys differ between the layouts: {sorted(set(old_sd) ^ set(like_sd))}"
        )
    moved = {k: _like(_full(old_sd[k]), like_sd[k], k) for k in like_sd}
    del old_sd
    set_model_state_dict(new, moved)
    del moved, like_sd

    new_opt = None
    if optimizer is not None:
        old_osd = optimizer.state_dict() if zero else get_optimizer_state_dict(model, optimizer)
        if optimizer_fn is not None:
            new_opt = optimizer_fn(new)
        else:
            named = dict(new.named_parameters())
            groups = []
            for g in old_osd["param_groups"]:
                hyper = {k: v for k, v in g.items() if k != "params"}
                groups.append({**hyper, "params": [named[n] for n in g["params"]]})
            # the groups carry every hyperparameter; the constructor gets the defaults it takes
            cls = optimizer.optimizer_cls if dp_name is not None else type(optimizer)
            accepted = inspect.signature(cls).parameters
            kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            if dp_name is not None:
                mesh = next(p.device_mesh for p in new.parameters() if isinstance(p, DTensor))
                new_opt = DistributedOptimizer(
                    groups,
                    cls,
                    mesh=mesh,
                    dp_dim=dp_name,
                    model=new,
                    master_dtype=optimizer.master_dtype,
                    grad_reduce_dtype=optimizer.grad_reduce_dtype,
                    clip_grad_norm=optimizer.clip_grad_norm,
                    norm_type=optimizer.norm_type,
                    zero_stage=optimizer.zero_stage,
                    overlap_param_gather=optimizer.overlap_param_gather,
                    bucket_cap_mb=optimizer.bucket_cap_mb,
                    **kwargs,
                )
            else:
                new_opt = type(optimizer)(groups, **kwargs)
        params = dict(new.named_parameters())
        state = {}
        for name, st in old_osd["state"].items():
            p = params.get(name)
            entry = {}
            for k, v in st.items():
                full = _full(v)
                if isinstance(new_opt, DistributedOptimizer):
                    entry[k] = full  # it cuts its slice of a full tensor locally
                elif isinstance(full, torch.Tensor) and p is not None and full.shape == p.shape:
                    entry[k] = _like(full, p, f"{name}.{k}")
                else:
                    entry[k] = full  # step counters and other scalars
            state[name] = entry
        new_osd = {"state": state, "param_groups": old_osd["param_groups"]}
        del old_osd
        if type(new_opt).state_dict is torch.optim.Optimizer.state_dict:
            set_optimizer_state_dict(new, new_opt, new_osd)
        else:
            new_opt.load_state_dict(new_osd)  # e.g. DistributedOptimizer: keyed by name
    if sync_rng:
        _sync_rng()
    return new, new_opt
