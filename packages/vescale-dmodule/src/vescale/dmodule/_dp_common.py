"""Shared pieces of the data-parallel engines (`._ddp`, `._fsdp`).

* input validation that runs before any collective (mesh dims by name or index
  through `vescale.dtensor.resolve_mesh_dim`, one device for all parameters, a module is wrapped only once);
* parameter paths: every ``(submodule, attribute)`` under which a parameter is
  registered, so that tied weights are swapped together;
* `MixedPrecision`;
* `dp_memory_bytes`, the per-rank accounting of parameters, gradients and
  optimizer state used by the tests and the benchmark.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vescale.dmodule import _compat
from vescale.dmodule._module_state import dp_engine

__all__ = [
    "MixedPrecision",
    "resolve_mixed_precision",
    "cast_floating",
    "check_not_wrapped",
    "check_one_device",
    "check_src_rank",
    "broadcast_buffers",
    "param_paths",
    "swap_param",
    "dp_memory_bytes",
    "local_tensor",
    "dp_last_mesh",
    "check_dp_replicated",
    "placements_on",
    "select_submodules",
]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Mixed-precision policy of `fully_shard` and `replicate`.

    The same four fields as torch's ``torch.distributed.fsdp.MixedPrecisionPolicy``,
    which both functions also accept (``mp_policy=``).

    Args:
        param_dtype: dtype of the unsharded (compute) parameters; the sharded
            parameters stay in their own dtype (fp32 masters). ``None``: no cast.
        reduce_dtype: dtype of the gradient reduction (reduce-scatter, all-reduce);
            ``None``: ``param_dtype``.
        output_dtype: dtype that floating-point outputs of the module's forward are
            cast to; ``None``: no cast.
        cast_forward_inputs: Cast floating-point tensor inputs of every sharded
            group (DDP: of the module) to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def resolve_mixed_precision(
    mixed_precision: Any, mp_policy: Any, what: str
) -> MixedPrecision | None:
    """One `MixedPrecision` from ``mixed_precision=`` or ``mp_policy=`` (not both).

    Either may be a `MixedPrecision` or torch's ``MixedPrecisionPolicy``;
    anything else is a ``TypeError`` naming the argument.
    """
    if mixed_precision is not None and mp_policy is not None:
        raise TypeError(f"{what}: pass mixed_precision= or mp_policy=, not both")
    value, arg = (
        (mixed_precision, "mixed_precision")
        if mixed_precision is not None
        else (mp_policy, "mp_policy")
    )
    if value is None or isinstance(value, MixedPrecision):
        return value
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if isinstance(value, MixedPrecisionPolicy):
        return MixedPrecision(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            output_dtype=value.output_dtype,
            cast_forward_inputs=value.cast_forward_inputs,
        )
    raise TypeError(
        f"{what}: {arg} must be a vescale.dmodule.MixedPrecision or a "
        f"torch.distributed.fsdp.MixedPrecisionPolicy, got {type(value).__name__}"
    )


def cast_floating(values: Any, dtype: torch.dtype | None) -> Any:
    """``values`` (any pytree) with floating-point tensors cast to ``dtype`` (differentiable)."""
    if dtype is None:
        return values
    flat, spec = _compat.tree_flatten(values)
    return _compat.tree_unflatten(
        [
            t.to(dtype)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype
            else t
            for t in flat
        ],
        spec,
    )


def check_not_wrapped(module: nn.Module, what: str) -> None:
    """Raise if ``module`` or one of its submodules already has a DDP/FSDP engine."""
    for name, sub in module.named_modules():
        state = dp_engine(sub)
        if state is not None:
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"{what}: {where} is already data-parallel ({type(state).__name__}); "
                "a module can be wrapped by replicate()/fully_shard() only once"
            )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of ``t`` (``t`` itself if it is not a DTensor)."""
    return _compat.local_tensor(t)


def dp_last_mesh(mesh: DeviceMesh, dp_dim: int) -> DeviceMesh:
    """The same ranks as ``mesh`` with mesh dim ``dp_dim`` moved last (built once per mesh).

    Mesh dims apply left to right, so a placement on the last dim cuts the local
    tensor the other dims leave: ``[Shard(0), RaggedShard(...)]`` on ``("tp", "dp")``
    is "tensor parallel first, then FSDP over the tensor-parallel shard". Building
    it creates the new mesh's process groups: a collective over all ranks of ``mesh``.
    """
    if dp_dim == mesh.ndim - 1:
        return mesh
    cache = mesh.__dict__.setdefault("_vescale_dp_last_meshes", {})
    out = cache.get(dp_dim)
    if out is None:
        from vescale.dtensor import DeviceMesh as _VDeviceMesh

        order = [i for i in range(mesh.ndim) if i != dp_dim] + [dp_dim]
        names = mesh.mesh_dim_names
        out = _VDeviceMesh(
            mesh.device_type,
            mesh.mesh.permute(order),
            mesh_dim_names=tuple(names[i] for i in order) if names else None,
        )
        cache[dp_dim] = out
    return out


def placements_on(p: DTensor, mesh: DeviceMesh, dp_dims: Iterable[int]) -> tuple | None:
    """``p``'s placements read on ``mesh``, or ``None`` if ``p`` lives elsewhere.

    ``p`` lives on ``mesh`` itself, or on the sub-mesh of ``mesh`` without the
    data-parallel dims ``dp_dims`` (the tensor-parallel mesh ``parallelize_module``
    computes on under data parallelism; ``Replicate()`` is read on the dropped dims).
    """
    from vescale.dtensor import lift_placements

    pm = p.device_mesh
    if pm.ndim == mesh.ndim and torch.equal(pm.mesh, mesh.mesh):
        return tuple(p.placements)
    return lift_placements(pm, p.placements, mesh, tuple(dp_dims))


def check_dp_replicated(
    module: nn.Module,
    mesh: DeviceMesh,
    dp_dim: int,
    what: str,
    skip: Iterable[int] = (),
    dp_dims: Iterable[int] | None = None,
) -> None:
    """DTensor parameters: on ``mesh``, ``Replicate()`` on ``dp_dim``, same local shape everywhere.

    A parameter may also live on the sub-mesh of ``mesh`` without the data-parallel
    dims ``dp_dims`` (default: ``dp_dim``), see `placements_on`. The last condition (every rank's local tensor has one shape) lets one
    ``RaggedShard`` describe the dp cut of every tensor-parallel shard; it fails for
    uneven ``Shard`` placements (e.g. 5 rows over 2 ranks).
    """
    import itertools

    from torch.distributed.tensor import Replicate

    from vescale.dtensor import localize

    coords = list(itertools.product(*(range(n) for n in mesh.shape)))
    skip = set(skip)
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor) or id(p) in skip:
            continue
        pm = p.device_mesh
        lifted = placements_on(p, mesh, (dp_dim,) if dp_dims is None else dp_dims)
        if lifted is None:
            raise ValueError(
                f"{what}: parameter {name!r} lives on mesh {pm.mesh.tolist()} but the "
                f"data-parallel mesh is {mesh.mesh.tolist()}; both must be the same mesh "
                "(or the parameter's mesh that mesh without its data-parallel dims)"
            )
        pl = lifted
        if pl[dp_dim] != Replicate():
            dn = mesh.mesh_dim_names[dp_dim] if mesh.mesh_dim_names else dp_dim
            raise ValueError(
                f"{what}: parameter {name!r} has placements {[str(q) for q in pl]}; it must be "
                f"Replicate() on the data-parallel mesh dim {dn!r}"
            )
        if any(q.is_partial() for q in pl):
            raise ValueError(f"{what}: parameter {name!r} has Partial placements {pl}")
        shapes = {tuple(localize(mesh, pl, tuple(p.shape), c)[1]) for c in coords}
        if len(shapes) > 1:
            raise ValueError(
                f"{what}: parameter {name!r} (shape {tuple(p.shape)}, placements "
                f"{[str(q) for q in pl]}) has local shards of different shapes "
                f"{sorted(shapes)} on different ranks; FSDP over tensor parallelism needs even "
                "tensor-parallel shards"
            )


def check_src_rank(src: int | None, mesh: DeviceMesh, dims: Iterable[int], what: str) -> None:
    """``src`` is ``None`` or a coordinate of every mesh dim in ``dims`` (no collective)."""
    if src is None:
        return
    sizes = {d: mesh.size(d) for d in dims}
    if (
        isinstance(src, bool)
        or not isinstance(src, int)
        or not all(0 <= src < n for n in sizes.values())
    ):
        names = [mesh.mesh_dim_names[d] if mesh.mesh_dim_names else d for d in sizes]
        raise ValueError(
            f"{what}: src_data_rank={src!r} is not a rank of the data-parallel mesh dims "
            f"{names} (sizes {list(sizes.values())}); use 0 <= src_data_rank < "
            f"{min(sizes.values(), default=1)} or None"
        )


def broadcast_buffers(module: nn.Module, mesh: DeviceMesh, dims: Iterable[int], src: int) -> None:
    """Every rank's buffers take the values of coordinate ``src`` on the mesh ``dims``.

    One broadcast per buffer and dim (of a DTensor buffer: its local tensor, which is
    ``Replicate()`` over ``dims``); buffers are usually few and small.
    """
    import torch.distributed as dist

    bufs = [local_tensor(b) for _, b in module.named_buffers()]
    for d in dims:
        if mesh.size(d) > 1:
            for b in bufs:
                t = b if b.is_contiguous() else b.contiguous()
                dist.broadcast(t, group=mesh.get_group(d), group_src=src)
                if t is not b:
                    b.copy_(t)


def check_one_device(
    module: nn.Module, mesh: DeviceMesh, what: str, skip: Iterable[int] = ()
) -> torch.device:
    """All parameters (but those in ``skip``, by id) on one device of the mesh's type; returns it."""
    devices: dict[torch.device, str] = {}
    skip = set(skip)
    for name, p in module.named_parameters():
        if id(p) not in skip:
            devices.setdefault(local_tensor(p).device, name)
    if len(devices) > 1:
        desc = ", ".join(f"{d} (e.g. {n!r})" for d, n in devices.items())
        raise ValueError(f"{what}: parameters are on different devices: {desc}; move them to one")
    if not devices:
        raise ValueError(f"{what}: the module has no parameters")
    (device,) = devices
    if device.type != mesh.device_type:
        raise ValueError(
            f"{what}: parameters are on {device} but the mesh is of type {mesh.device_type!r}"
        )
    return device


def param_paths(module: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """``id(param) -> [(owner module, attribute, qualified name), ...]`` incl. tied aliases."""
    out: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            qual = f"{mod_name}.{attr}" if mod_name else attr
            paths = out.setdefault(id(p), [])
            if not any(m is mod and a == attr for m, a, _ in paths):
                paths.append((mod, attr, qual))
    return out


def swap_param(paths: Iterable[tuple[nn.Module, str, str]], value: torch.Tensor) -> None:
    """Register ``value`` under every path (no ``nn.Parameter`` checks, no copies)."""
    for mod, attr, _ in paths:
        mod._parameters[attr] = value  # type: ignore[assignment]


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    t = local_tensor(t)
    if t.device.type == "meta":
        return None
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes())


def dp_memory_bytes(
    module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients, optimizer state and engine buffers.

    Every tensor is counted by its whole storage (so a view of a flat buffer counts
    the buffer) and every storage once, in the first category that reaches it:
    ``params``, ``grads``, ``optim`` (optimizer state), then ``engine`` (buffers a
    DDP/FSDP engine holds beyond those, e.g. unsharded buffers still allocated).

    Returns:
        ``{"params", "grads", "optim", "engine", "total"}`` in bytes.
    """
    seen: set[tuple[int, int]] = set()
    out = {"params": 0, "grads": 0, "optim": 0, "engine": 0}

    def add(kind: str, t: torch.Tensor | None) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        key = _storage_key(t)
        if key is None or key in seen or key[1] == 0:
            return
        seen.add(key)
        out[kind] += key[1]

    params = list(module.parameters())
    for p in params:
        add("params", p)
    for p in params:
        add("grads", p.grad)
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                add("optim", v)
    for sub in module.modules():
        state = dp_engine(sub)
        if state is not None:
            for t in state.engine_tensors():
                add("engine", t)
    out["total"] = sum(out.values())
    return out


def select_submodules(model: nn.Module, which: Any, what: str) -> list[str]:
    """Names (``named_modules()``) of the submodules ``which`` selects, in module order.

    ``which`` is a predicate ``(name, module) -> bool`` or a list of regexes (full
    match; each must match a submodule) and/or submodules of ``model``; the root
    (name ``""``) is never selected. Used for FSDP's ``groups=`` and for
    ``activation_checkpointing=``.

    Raises:
        ValueError: A regex that matches nothing (with the nearest names) or a module
            that is not in ``model``, naming ``what``.
        TypeError: An item that is neither a regex string nor a module.
    """
    mods = dict(model.named_modules())
    if callable(which) and not isinstance(which, (nn.Module, list, tuple)):
        return [n for n, m in mods.items() if n and which(n, m)]
    by_id = {id(m): n for n, m in mods.items()}
    chosen: list[str] = []
    for item in which:
        if isinstance(item, nn.Module):
            if id(item) not in by_id:
                raise ValueError(
                    f"{what}: {type(item).__name__} is not a submodule of the model "
                    "(it is not in the module)"
                )
            chosen.append(by_id[id(item)])
        elif isinstance(item, str):
            hits = [n for n in mods if n and re.fullmatch(item, n)]
            if not hits:
                near = difflib.get_close_matches(item, [n for n in mods if n], n=3)
                hint = f"; did you mean {near}?" if near else ""
                raise ValueError(f"{what}: {item!r} matches no submodule name{hint}")
            chosen.extend(hits)
        else:
            raise TypeError(f"{what}: expected regex strings or modules, got {type(item).__name__}")
    order = {n: i for i, n in enumerate(mods)}
    return sorted({n for n in chosen if n}, key=order.__getitem__)
