"""Sharding plans: parsing, validation and resolution against a module.

Everything here is pure bookkeeping: no communication happens, so every error in a
plan is raised on every rank before any collective runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from vescale.dtensor import PluginPlacement

__all__ = ["SECTIONS", "ResolvedPlan", "normalize_plan", "resolve_plan"]

#: Allowed top-level sections of a sharding plan.
SECTIONS = ("parameter", "forward")
_IO_SUFFIXES = ("input", "output")

PlacementList = tuple[Placement, ...]


@dataclasses.dataclass
class ParamEntry:
    """One resolved parameter or buffer."""

    names: list[str]  # every name the tensor is reachable under (tied weights)
    kind: str  # "parameter" or "buffer"
    placements: PlacementList
    key: str | None  # plan key that chose the placements (None: default Replicate)
    shape: tuple[int, ...]


@dataclasses.dataclass
class ResolvedPlan:
    """A plan matched against one module: what to place where."""

    params: list[ParamEntry]
    inputs: dict[str, tuple[str, Any]]  # module name -> (key, spec)
    outputs: dict[str, tuple[str, Any]]


# ----------------------------------------------------------------------------- parsing
def _is_placement_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(p, Placement) for p in value)


def normalize_plan(plan: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Return ``{"parameter": {...}, "forward": {...}}`` for any accepted plan form.

    A flat dict whose values are all placement lists is the parameter section.

    Raises:
        ValueError: Unknown top-level section, or a forward key without
            ``.input``/``.output``.
        TypeError: The plan or a section is not a dict.
    """
    if plan is None:
        return {"parameter": {}, "forward": {}}
    if not isinstance(plan, Mapping):
        raise TypeError(f"a sharding plan must be a dict, got {type(plan).__name__}")
    if (
        plan
        and not (set(plan) & set(SECTIONS))
        and all(isinstance(v, (list, tuple)) for v in plan.values())
    ):
        return {"parameter": dict(plan), "forward": {}}
    unknown = [k for k in plan if k not in SECTIONS]
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(str(k), SECTIONS, n=1)
            hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(
            f"unknown sharding-plan section(s) {', '.join(hints)}; allowed sections are "
            f"{list(SECTIONS)} (a flat dict of parameter keys to placement lists is also "
            "accepted as the 'parameter' section)"
        )
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        value = plan.get(section) or {}
        if not isinstance(value, Mapping):
            raise TypeError(
                f"sharding-plan section {section!r} must be a dict, got {type(value).__name__}"
            )
        out[section] = dict(value)
    for key in out["forward"]:
        if _split_io_key(key) is None:
            raise ValueError(
                f"forward plan key {key!r} must end with '.input' or '.output' "
                "(or be 'input'/'output' for the root module)"
            )
    return out


def merge_plans(user: dict[str, dict[str, Any]], auto: dict[str, dict[str, Any]]) -> dict:
    """User keys first (they win when both match a name), then automatic keys not overridden."""
    merged: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        merged[section] = dict(user.get(section, {}))
        for k, v in auto.get(section, {}).items():
            merged[section].setdefault(k, v)
    return merged


def _split_io_key(key: str) -> tuple[str, str] | None:
    if key in _IO_SUFFIXES:
        return "", key
    for suffix in _IO_SUFFIXES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return None


def _compile(key: str, section: str) -> re.Pattern:
    try:
        return re.compile(key)
    except re.error as e:
        raise ValueError(f"{section} plan key {key!r} is not a valid regex: {e}") from None


def _no_match(key: str, section: str, candidates: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(key, candidates, n=5, cutoff=0.4)
    if not close:  # compare with backslashes of regex escapes removed
        close = difflib.get_close_matches(key.replace("\\", ""), candidates, n=5, cutoff=0.4)
    hint = f"; nearest names: {close}" if close else ""
    return ValueError(f"{section} plan key {key!r} matches no name in the module{hint}")


# ------------------------------------------------------------------------- validation
def _check_placements(value: Any, mesh: DeviceMesh, where: str) -> PlacementList:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: expected a list of placements (one per mesh dim), got {value!r}")
    for p in value:
        if not isinstance(p, Placement):
            raise TypeError(f"{where}: {p!r} is not a Placement")
    if len(value) != mesh.ndim:
        raise ValueError(
            f"{where}: got {len(value)} placement(s) {[str(p) for p in value]} for a "
            f"{mesh.ndim}-dim mesh {_mesh_desc(mesh)}; give one placement per mesh dim"
        )
    return tuple(value)


def _mesh_desc(mesh: DeviceMesh) -> str:
    names = mesh.mesh_dim_names
    if names:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape)) + ")"
    return str(tuple(mesh.shape))


def check_param_placements(
    placements: PlacementList,
    shape: tuple[int, ...],
    mesh: DeviceMesh,
    where: str,
    allow_uneven: bool,
) -> None:
    """Check that ``placements`` can distribute a tensor of ``shape`` over ``mesh``."""
    logical = list(shape)
    for i, p in enumerate(placements):
        n = mesh.size(i)
        if isinstance(p, Shard):
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= d < len(shape):
                raise ValueError(
                    f"{where}: {p} is out of range for a tensor of shape {tuple(shape)} "
                    f"({len(shape)} dims)"
                )
            if not allow_uneven and logical[d] % n:
                raise ValueError(
                    f"{where}: {p} on mesh dim {i} (size {n}) does not divide dim {d} of "
                    f"shape {tuple(shape)} (size {logical[d]}); pick another placement or pass "
                    "allow_uneven_shards=True"
                )
            logical[d] = -(-logical[d] // n)
        elif isinstance(p, _StridedShard):
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            k = int(p.split_factor)
            if not 0 <= d < len(shape) or logical[d] % (k * n):
                raise ValueError(
                    f"{where}: {p} on mesh dim {i} (size {n}) needs dim {p.dim} of shape "
                    f"{tuple(shape)} to split into {k} parts that each divide by {n}"
                )
            logical[d] //= n
        elif isinstance(p, PluginPlacement):
            p.check_shape(tuple(logical), n)
        elif p.is_partial():
            raise ValueError(f"{where}: {p} is not a valid placement for a parameter or buffer")


def _check_forward_spec(spec: Any, mesh: DeviceMesh, where: str, names: set[str] | None):
    if _is_placement_list(spec) and spec:
        # A bare placement list: shorthand for a single tensor ([[...]]).
        return (_check_placements(spec, mesh, where),)
    if isinstance(spec, Mapping):
        out = {}
        for name, v in spec.items():
            if names is not None and name not in names:
                raise ValueError(
                    f"{where}: argument {name!r} is not a parameter of forward(); "
                    f"known: {sorted(names)}"
                )
            out[name] = None if v is None else _check_placements(v, mesh, f"{where}[{name!r}]")
        return out
    if isinstance(spec, (list, tuple)):
        return tuple(
            None if v is None else _check_placements(v, mesh, f"{where}[{i}]")
            for i, v in enumerate(spec)
        )
    raise TypeError(
        f"{where}: expected a list (one entry per positional value) or a dict, got {spec!r}"
    )


def forward_arg_names(module: nn.Module) -> set[str] | None:
    """Names of ``module.forward``'s parameters, or ``None`` if it takes ``**kwargs``."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return set(sig.parameters)


# ------------------------------------------------------------------------- resolution
def resolve_plan(
    module: nn.Module,
    mesh: DeviceMesh,
    plan: dict[str, dict[str, Any]],
    *,
    allow_uneven: bool = False,
) -> ResolvedPlan:
    """Match a normalized plan against ``module``; raise on any problem.

    Parameters and buffers take the placements of the first parameter key that
    full-matches one of their names (tied tensors: any of their names; conflicting
    matches are an error). Unmatched ones are replicated.
    """
    modules = dict(module.named_modules(remove_duplicate=False))
    # Every tensor (by identity) with all its names.
    tensors: dict[int, tuple[torch.Tensor, str, list[str]]] = {}
    for mod_name, mod in modules.items():
        for kind, table in (("parameter", mod._parameters), ("buffer", mod._buffers)):
            for tname, t in table.items():
                if t is None:
                    continue
                full = f"{mod_name}.{tname}" if mod_name else tname
                entry = tensors.setdefault(id(t), (t, kind, []))
                if full not in entry[2]:
                    entry[2].append(full)
    all_names = [n for _, _, names in tensors.values() for n in names]

    param_keys = [(k, _compile(k, "parameter"), v) for k, v in plan["parameter"].items()]
    used: set[str] = set()
    params: list[ParamEntry] = []
    for t, kind, names in tensors.values():
        chosen: tuple[str, Any] | None = None
        for name in names:
            for key, rx, value in param_keys:
                if rx.fullmatch(name):
                    used.add(key)
                    if chosen is None:
                        chosen = (key, value)
                    elif chosen[0] != key and list(chosen[1]) != list(value):
                        raise ValueError(
                            f"tied tensor {names} gets conflicting placements from plan keys "
                            f"{chosen[0]!r} ({[str(p) for p in chosen[1]]}) and {key!r} "
                            f"({[str(p) for p in value]})"
                        )
                    break
        if chosen is None:
            placements: PlacementList = (Replicate(),) * mesh.ndim
            key = None
        else:
            key = chosen[0]
            where = f"parameter plan key {key!r} for {names[0]!r}"
            placements = _check_placements(chosen[1], mesh, where)
            check_param_placements(placements, tuple(t.shape), mesh, where, allow_uneven)
        params.append(ParamEntry(names, kind, placements, key, tuple(t.shape)))
    for key, _, _ in param_keys:
        if key not in used:
            raise _no_match(key, "parameter", all_names)

    inputs: dict[str, tuple[str, Any]] = {}
    outputs: dict[str, tuple[str, Any]] = {}
    for key, spec in plan["forward"].items():
        mod_rx, io = _split_io_key(key)  # type: ignore[misc]
        rx = _compile(mod_rx, "forward")
        matched = [n for n in modules if rx.fullmatch(n)]
        if not matched:
            raise _no_match(mod_rx, "forward", [n for n in modules if n])
        target = inputs if io == "input" else outputs
        for name in matched:
            if name in target:
                continue  # an earlier key (user plan first) wins
            where = f"forward plan key {key!r} for module {name!r}"
            names = forward_arg_names(modules[name]) if io == "input" else None
            target[name] = (key, _check_forward_spec(spec, mesh, where, names))
    return ResolvedPlan(params, inputs, outputs)
