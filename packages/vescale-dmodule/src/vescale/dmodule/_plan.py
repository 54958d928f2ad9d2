"""Sharding plans: parsing, validation and resolution against a module.

Everything here is pure bookkeeping: no communication happens, so every error in a
plan is raised on every rank before any collective runs.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from vescale.dmodule._compat import StridedShard as _StridedShard
from vescale.dtensor import PluginPlacement, normalize_placements

__all__ = [
    "SECTIONS",
    "PlanSectionError",
    "LocalLayout",
    "ResolvedPlan",
    "normalize_plan",
    "resolve_plan",
]

SECTIONS = ("parameter", "forward")
"""Allowed top-level sections of a sharding plan."""
_IO_SUFFIXES = ("input", "output")
_FORWARD_KEY_HELP = (
    "forward plan key {key!r} must end with '.input' or '.output' (or be 'input'/'output' "
    "for the root module), or name a parameter or buffer of a submodule (e.g. 'fc1.weight')"
)

PlacementList = tuple[Placement, ...]


class PlanSectionError(KeyError, ValueError):
    """A sharding plan has an unknown top-level section.

    Both a ``KeyError`` (what veScale programs catch for a misspelled section) and a
    ``ValueError`` (vescale's plan errors); the message suggests the nearest section.
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclasses.dataclass(frozen=True)
class LocalLayout:
    """A forward-plan entry with torch ``ParallelStyle`` semantics (from ``_torch_styles``).

    Unlike a placement list (a plain tensor is the full value, ``Replicate()``), a plain
    tensor here is this rank's **local** part laid out as ``src``; it is wrapped
    without communication, redistributed to ``dst`` (``None``: left as it is), and
    turned back into its local tensor when ``to_local`` is set. A DTensor is only
    redistributed (and made local).
    """

    src: PlacementList | None
    dst: PlacementList | None
    to_local: bool = False

    def __str__(self) -> str:
        def fmt(pl: PlacementList) -> str:
            return "[" + ", ".join(str(p) for p in pl) + "]"

        parts = [] if self.src is None else [f"from_local {fmt(self.src)}"]
        if self.dst is not None:
            parts.append(f"-> {fmt(self.dst)}")
        if self.to_local:
            parts.append("-> to_local")
        return " ".join(parts) or "unchanged"


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
    # module name -> {own parameter/buffer name: (key, placements)}: redistributed
    # before the module's forward (veScale's forward-section parameter entries)
    tensors: dict[str, dict[str, tuple[str, PlacementList]]] = dataclasses.field(
        default_factory=dict
    )


# ----------------------------------------------------------------------------- parsing
def _is_placement_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(p, Placement) for p in value)


def normalize_plan(plan: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Return ``{"parameter": {...}, "forward": {...}}`` for any accepted plan form.

    A flat dict whose values are all placement lists is the parameter section.
    Forward keys end with ``.input``/``.output`` or name a parameter or buffer of the
    module (``"fc1.weight"``: redistributed before ``fc1`` runs); the latter are
    checked against the module by ``resolve_plan``.

    Raises:
        PlanSectionError: Unknown top-level section (a ``KeyError`` and a
            ``ValueError``).
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
        raise PlanSectionError(
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
        if not isinstance(key, str):
            raise TypeError(f"forward plan keys must be str, got {key!r}")
        if _split_io_key(key) is None and _split_tensor_key(key) is None:
            raise ValueError(_FORWARD_KEY_HELP.format(key=key))
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
        # the separator as a regex (``\.input``) or as written (``.input``)
        for sep in ("\\.", "."):
            if key.endswith(sep + suffix):
                return key[: -len(suffix) - len(sep)], suffix
    return None


def _split_tensor_key(key: str) -> tuple[str, str] | None:
    """``"h.\\d+.mlp.fc1.weight"`` -> (module regex, attribute name), or None."""
    for sep in ("\\.", "."):
        head, found, attr = key.rpartition(sep)
        if found and head and attr.isidentifier():
            return head, attr
    return None


def _compile(key: str, section: str) -> re.Pattern:
    try:
        return re.compile(key)
    except re.error as e:
        raise ValueError(f"{section} plan key {key!r} is not a valid regex: {e}") from None


class _NoMatch(ValueError):
    """A forward key naming a parameter/buffer that no module has."""


def _no_match(key: str, section: str, candidates: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(key, candidates, n=5, cutoff=0.4)
    if not close:  # compare with backslashes of regex escapes removed
        close = difflib.get_close_matches(key.replace("\\", ""), candidates, n=5, cutoff=0.4)
    hint = f"; nearest names: {close}" if close else ""
    return ValueError(f"{section} plan key {key!r} matches no name in the module{hint}")


# ------------------------------------------------------------------------- validation
def _check_placements(value: Any, mesh: DeviceMesh, where: str) -> PlacementList:
    """One placement per mesh dim; a shorter list is padded with ``Replicate()``."""
    try:
        return normalize_placements(value, mesh.ndim)
    except TypeError as e:
        raise TypeError(f"{where}: {e}") from None
    except ValueError:
        raise ValueError(
            f"{where}: got {len(value)} placement(s) {[str(p) for p in value]} for a "
            f"{mesh.ndim}-dim mesh {_mesh_desc(mesh)}; give at most one placement per mesh "
            "dim (a shorter list is padded with Replicate())"
        ) from None


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


def _check_entry(value: Any, mesh: DeviceMesh, where: str) -> Any:
    """One tensor's forward entry: ``None``, a placement list or a `LocalLayout`."""
    if value is None:
        return None
    if isinstance(value, LocalLayout):
        return LocalLayout(
            None if value.src is None else _check_placements(value.src, mesh, f"{where} (src)"),
            None if value.dst is None else _check_placements(value.dst, mesh, f"{where} (dst)"),
            bool(value.to_local),
        )
    return _check_placements(value, mesh, where)


def _check_forward_spec(
    spec: Any,
    mesh: DeviceMesh,
    where: str,
    names: set[str] | None,
    var_positional: str | None = None,
):
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
            if (
                name == var_positional
                and v is not None
                and not _is_placement_list(v)
                and not isinstance(v, LocalLayout)
            ):
                # veScale's {"args": [[Shard(1)], None]}: one entry per extra positional
                if not isinstance(v, (list, tuple)):
                    raise TypeError(
                        f"{where}[{name!r}]: expected a list with one entry per value of "
                        f"*{name}, got {v!r}"
                    )
                out[name] = tuple(
                    _check_entry(e, mesh, f"{where}[{name!r}][{i}]") for i, e in enumerate(v)
                )
                continue
            out[name] = _check_entry(v, mesh, f"{where}[{name!r}]")
        return out
    if isinstance(spec, (list, tuple)):
        return tuple(_check_entry(v, mesh, f"{where}[{i}]") for i, v in enumerate(spec))
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


def var_positional_name(module: nn.Module) -> str | None:
    """Name of ``module.forward``'s ``*args`` parameter, if it has one."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
    return next(
        (p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_POSITIONAL),
        None,
    )


# ------------------------------------------------------------------------- resolution
def resolve_plan(
    module: nn.Module,
    mesh: DeviceMesh,
    plan: dict[str, dict[str, Any]],
    *,
    allow_uneven: bool = False,
    unmatched: str = "error",
) -> ResolvedPlan:
    """Match a normalized plan against ``module``; raise on any problem.

    Parameters and buffers take the placements of the first parameter key that
    full-matches one of their names (tied tensors: any of their names; conflicting
    matches are an error). Unmatched ones are replicated. A plan key that matches
    nothing raises (``unmatched="error"``) or warns and is skipped (``"warn"``, veScale's
    behaviour: its nanoGPT plan names biases that ``bias=False`` models lack).
    """
    if unmatched not in ("error", "warn"):
        raise ValueError(f"unmatched_plan_keys must be 'error' or 'warn', got {unmatched!r}")

    def no_match(err: ValueError) -> None:
        if unmatched == "error":
            raise err
        warnings.warn(f"{err}; the key is skipped", stacklevel=4)

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
            no_match(_no_match(key, "parameter", all_names))

    inputs: dict[str, tuple[str, Any]] = {}
    outputs: dict[str, tuple[str, Any]] = {}
    tensors_fwd: dict[str, dict[str, tuple[str, PlacementList]]] = {}
    for key, spec in plan["forward"].items():
        split = _split_io_key(key)
        if split is None:
            try:
                _resolve_forward_tensor(
                    key, spec, modules, mesh, all_names, allow_uneven, tensors_fwd
                )
            except _NoMatch as err:
                no_match(err)
            continue
        mod_rx, io = split
        rx = _compile(mod_rx, "forward")
        matched = [n for n in modules if rx.fullmatch(n)]
        if not matched:
            no_match(_no_match(mod_rx, "forward", [n for n in modules if n]))
            continue
        target = inputs if io == "input" else outputs
        for name in matched:
            if name in target:
                continue  # an earlier key (user plan first) wins
            where = f"forward plan key {key!r} for module {name!r}"
            names = forward_arg_names(modules[name]) if io == "input" else None
            varpos = var_positional_name(modules[name]) if io == "input" else None
            target[name] = (key, _check_forward_spec(spec, mesh, where, names, varpos))
    return ResolvedPlan(params, inputs, outputs, tensors_fwd)


def _resolve_forward_tensor(
    key: str,
    spec: Any,
    modules: dict[str, nn.Module],
    mesh: DeviceMesh,
    all_names: list[str],
    allow_uneven: bool,
    out: dict[str, dict[str, tuple[str, PlacementList]]],
) -> None:
    """A forward key naming a parameter/buffer: redistribute it before the module runs."""
    split = _split_tensor_key(key)
    if split is None:
        raise ValueError(_FORWARD_KEY_HELP.format(key=key))
    mod_rx, attr = split
    rx = _compile(mod_rx, "forward")
    matched = [
        n
        for n, m in modules.items()
        if rx.fullmatch(n)
        and (m._parameters.get(attr) is not None or m._buffers.get(attr) is not None)
    ]
    if not matched:
        raise _NoMatch(
            f"{_no_match(key, 'forward', all_names)} (forward keys end with '.input' or "
            "'.output', or name a parameter or buffer of a submodule)"
        )
    if isinstance(spec, (list, tuple)) and len(spec) == 1 and isinstance(spec[0], (list, tuple)):
        spec = spec[0]  # [[Replicate()]]: one tensor
    for name in matched:
        where = f"forward plan key {key!r} for {name}.{attr}"
        placements = _check_placements(spec, mesh, where)
        m = modules[name]
        t = m._parameters.get(attr)
        if t is None:
            t = m._buffers[attr]
        check_param_placements(placements, tuple(t.shape), mesh, where, allow_uneven)
        out.setdefault(name, {}).setdefault(attr, (key, placements))
