"""torch ``ParallelStyle`` plans, translated to vescale plan entries.

``{"attn.q": ColwiseParallel(), "norm": SequenceParallel(), ...}`` (the plan torch's
``torch.distributed.tensor.parallel.parallelize_module`` takes) becomes a
``{"parameter": ..., "forward": ...}`` plan: parameter placements on the
tensor-parallel mesh dim, and `LocalLayout` forward
entries that reproduce the styles' input/output handling (a plain tensor is this
rank's local part; ``use_local_output`` hands back local tensors). Only the styles'
public attributes are read; no communication happens here.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from vescale.dmodule._plan import (
    SECTIONS,
    LocalLayout,
    _is_placement_list,
    _no_match,
    _split_io_key,
)

__all__ = ["TorchStyleError", "has_torch_styles", "translate_torch_plan"]

_SUPPORTED = (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    PrepareModuleInputOutput,
)


class TorchStyleError(ValueError):
    """A torch ``ParallelStyle`` plan entry that vescale cannot express."""


def has_torch_styles(plan: Any) -> bool:
    """True if ``plan`` is a ``ParallelStyle`` or a dict with one as a value."""
    if isinstance(plan, ParallelStyle):
        return True
    return isinstance(plan, Mapping) and any(isinstance(v, ParallelStyle) for v in plan.values())


def _match(names: list[str], key: str) -> list[str]:
    """Module names matched by a torch plan key: ``fnmatch`` per dot-separated token."""
    if key == "":
        return [""]
    tokens = key.split(".")
    out = []
    for name in names:
        parts = name.split(".") if name else []
        if len(parts) == len(tokens) and all(fnmatch.fnmatch(p, t) for p, t in zip(parts, tokens)):
            out.append(name)
    return out


def _attr(style: ParallelStyle, key: str, *names: str) -> Any:
    for name in names:
        if hasattr(style, name):
            return getattr(style, name)
    raise TorchStyleError(
        f"torch plan key {key!r}: {type(style).__name__} has no attribute "
        f"{' / '.join(names)} in this torch; vescale cannot read the style's options"
    )


class _Translator:
    def __init__(self, model: nn.Module, mesh: DeviceMesh, tp_dim: int) -> None:
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.mesh = mesh
        self.tp_dim = tp_dim
        self.params: dict[str, tuple[str, list[Placement]]] = {}  # regex -> (torch key, pl)
        self.forward: dict[str, tuple[str, Any]] = {}
        self.names: dict[str, Any] = {}  # plan key -> parameter name / (module name, io)

    # -------------------------------------------------------------- helpers
    def pl(self, p: Placement | None, key: str, option: str) -> tuple[Placement, ...] | None:
        """One torch layout (for the 1-D tp mesh) as placements on every mesh dim."""
        if p is None:
            return None
        if isinstance(p, (list, tuple)) and len(p) == 1:
            p = p[0]
        if not isinstance(p, Placement):
            raise TorchStyleError(
                f"torch plan key {key!r}: {option}={p!r} is not a single Placement; torch's "
                "styles place on one (the tensor-parallel) mesh dim"
            )
        out = [Replicate()] * self.mesh.ndim
        out[self.tp_dim] = p
        return tuple(out)

    def one(self, layouts: Any, key: str, option: str) -> Placement | None:
        if layouts is None:
            return None
        if isinstance(layouts, Placement):
            return layouts
        if len(layouts) != 1:
            raise TorchStyleError(
                f"torch plan key {key!r}: {option} has {len(layouts)} layouts; this style "
                "takes one (its module's single input/output)"
            )
        return layouts[0]

    def add_param(self, name: str, placement: Placement, key: str) -> None:
        rx = re.escape(name)
        pl = list(self.pl(placement, key, "parameter"))
        old = self.params.get(rx)
        if old is not None and old[1] != pl:
            raise TorchStyleError(
                f"torch plan keys {old[0]!r} and {key!r} place parameter {name!r} differently "
                f"({[str(p) for p in old[1]]} vs {[str(p) for p in pl]})"
            )
        self.params[rx] = (key, pl)
        self.names[rx] = name

    def add_forward(self, mod_name: str, io: str, spec: Any, key: str) -> None:
        fkey = (re.escape(mod_name) + "." + io) if mod_name else io
        old = self.forward.get(fkey)
        if old is not None:
            raise TorchStyleError(
                f"torch plan keys {old[0]!r} and {key!r} both prepare the {io} of module "
                f"{mod_name or '<root>'!r}; vescale applies one {io} entry per module: merge "
                "them into one style"
            )
        self.forward[fkey] = (key, spec)
        self.names[fkey] = (mod_name, io)

    # --------------------------------------------------------------- styles
    def apply(self, key: str, name: str, style: ParallelStyle) -> None:
        mod = self.modules[name]
        kind = type(style)
        if kind in (ColwiseParallel, RowwiseParallel):
            self.linear_style(key, name, mod, style)
        elif kind is SequenceParallel:
            self.sequence_parallel(key, name, mod, style)
        elif kind is PrepareModuleInput:
            self.prepare_input(key, name, mod, style)
        elif kind is PrepareModuleOutput:
            self.prepare_output(key, name, style)
        elif kind is PrepareModuleInputOutput:
            self.prepare_input(key, name, mod, _attr(style, key, "prepare_module_input"))
            self.prepare_output(key, name, _attr(style, key, "prepare_module_output"))
        else:
            raise TorchStyleError(
                f"torch plan key {key!r}: {kind.__qualname__} is not one of torch's styles "
                f"vescale translates ({', '.join(c.__name__ for c in _SUPPORTED)}); a subclass "
                "may change their behaviour, so it is not treated as its base: apply it with "
                "torch.distributed.tensor.parallel.parallelize_module instead"
            )

    def linear_style(self, key: str, name: str, mod: nn.Module, style: ParallelStyle) -> None:
        colwise = type(style) is ColwiseParallel
        style_name = type(style).__name__
        if isinstance(mod, nn.Linear):
            weight = Shard(0) if colwise else Shard(1)
            desired = Replicate() if colwise else Shard(-1)
        elif isinstance(mod, nn.Embedding):
            weight = Shard(1) if colwise else Shard(0)
            desired = Replicate()
        else:
            raise TorchStyleError(
                f"torch plan key {key!r}: {style_name} on {name or '<root>'!r}, a "
                f"{type(mod).__name__}; it supports nn.Linear and nn.Embedding only (as in torch)"
            )
        prefix = f"{name}." if name else ""
        for pname, _ in mod.named_parameters():
            if colwise or pname == "weight" or not isinstance(mod, nn.Linear):
                placement = weight
            else:
                placement = Replicate()  # a row-parallel Linear's bias
            self.add_param(prefix + pname, placement, key)
        src = self.one(_attr(style, key, "input_layouts"), key, "input_layouts")
        out = self.one(_attr(style, key, "output_layouts"), key, "output_layouts")
        local = bool(_attr(style, key, "use_local_output"))
        src_pl = self.pl(src, key, "input_layouts")
        self.add_forward(
            name, "input", [LocalLayout(src_pl, self.pl(desired, key, "input"), False)], key
        )
        self.add_forward(
            name, "output", [LocalLayout(None, self.pl(out, key, "output_layouts"), local)], key
        )

    def sequence_parallel(self, key: str, name: str, mod: nn.Module, style: Any) -> None:
        seq = getattr(style, "sequence_sharding", None)
        if seq is None:
            seq = (Shard(_attr(style, key, "sequence_dim")),)
        seq_pl = self.pl(self.one(seq, key, "sequence_dim"), key, "sequence_dim")
        prefix = f"{name}." if name else ""
        for pname, _ in mod.named_parameters():
            self.add_param(prefix + pname, Replicate(), key)
        self.add_forward(name, "input", [LocalLayout(seq_pl, seq_pl, False)], key)
        if bool(_attr(style, key, "use_local_output")):
            self.add_forward(name, "output", [LocalLayout(None, None, True)], key)

    def prepare_input(self, key: str, name: str, mod: nn.Module, style: Any) -> None:
        layouts = _attr(style, key, "input_layouts")
        desired = _attr(style, key, "desired_input_layouts")
        kw_layouts = dict(_attr(style, key, "input_kwarg_layouts") or {})
        kw_desired = dict(_attr(style, key, "desired_input_kwarg_layouts") or {})
        local = bool(_attr(style, key, "use_local_output"))
        if isinstance(layouts, Placement):
            layouts = (layouts,)
        if isinstance(desired, Placement):
            desired = (desired,)
        layouts = tuple(layouts or ())
        desired = tuple(desired or (None,) * len(layouts))

        def entry(src: Any, dst: Any, option: str) -> LocalLayout | None:
            if src is None:
                return None  # torch leaves such an input alone
            return LocalLayout(self.pl(src, key, option), self.pl(dst, key, option), local)

        positional = [
            entry(s, d, f"input_layouts[{i}]") for i, (s, d) in enumerate(zip(layouts, desired))
        ]
        if not kw_layouts:
            if any(e is not None for e in positional):
                self.add_forward(name, "input", positional, key)
            return
        try:
            params = list(inspect.signature(mod.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        pos_names = [
            p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        var_pos = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        spec: dict[str, Any] = {}
        for i, e in enumerate(positional):
            if i < len(pos_names):
                spec[pos_names[i]] = e
            elif var_pos is not None:
                spec.setdefault(var_pos, []).append(e)
            else:
                raise TorchStyleError(
                    f"torch plan key {key!r}: input_layouts has {len(positional)} entries but "
                    f"{type(mod).__name__}.forward takes {len(pos_names)} positional argument(s)"
                )
        if var_pos in spec:
            spec[var_pos] = tuple(spec[var_pos])
        for kw, src in kw_layouts.items():
            spec[kw] = entry(src, kw_desired.get(kw), f"input_kwarg_layouts[{kw!r}]")
        self.add_forward(name, "input", spec, key)

    def prepare_output(self, key: str, name: str, style: Any) -> None:
        layouts = _attr(style, key, "output_layouts")
        desired = _attr(style, key, "desired_output_layouts")
        local = bool(_attr(style, key, "use_local_output"))
        if isinstance(layouts, Placement):
            layouts = (layouts,)
        if isinstance(desired, Placement):
            desired = (desired,)
        spec = [
            None
            if s is None
            else LocalLayout(
                self.pl(s, key, f"output_layouts[{i}]"),
                self.pl(d, key, f"desired_output_layouts[{i}]"),
                local,
            )
            for i, (s, d) in enumerate(zip(layouts, desired))
        ]
        self.add_forward(name, "output", spec, key)


def translate_torch_plan(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Any,
    *,
    tp_dim: int,
    unmatched: str = "error",
) -> dict[str, dict[str, Any]]:
    """A torch ``ParallelStyle`` plan as a vescale ``{"parameter", "forward"}`` plan.

    Keys are module names with ``fnmatch`` wildcards per dot-separated name
    component (``"layers.*.attn.q"``; ``""`` is the root), as torch matches them; a
    plan may also be a single style (for the root). The dict may also hold vescale's
    own ``"parameter"``/``"forward"`` sections and parameter keys with placement
    lists; those are listed first, so they win where both match.

    Args:
        model: The module the plan is for.
        mesh: The device mesh.
        plan: The plan.
        tp_dim: The mesh dim the styles place on (others ``Replicate()``).
        unmatched: ``"error"``: a key that matches no module raises; ``"warn"``: it is
            skipped with a warning (torch's behaviour).

    Returns:
        The vescale plan (before ``normalize_plan``).

    Raises:
        TorchStyleError: A style, option or module the translation cannot express
            (naming the plan key and the option).
        ValueError: A key matches no module (``unmatched="error"``).
    """
    if isinstance(plan, ParallelStyle):
        plan = {"": plan}
    tr = _Translator(model, mesh, tp_dim)
    own: dict[str, dict[str, Any]] = {"parameter": {}, "forward": {}}
    names = list(tr.modules)
    for key, value in plan.items():
        if key in SECTIONS:
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"sharding-plan section {key!r} must be a dict, got {type(value).__name__}"
                )
            own[key].update(value)
            continue
        if _is_placement_list(value) and value:
            own["parameter"][key] = value
            continue
        if not isinstance(value, ParallelStyle):
            raise TorchStyleError(
                f"plan key {key!r}: {value!r} is neither a torch ParallelStyle nor a placement "
                f"list; a plan with torch styles takes module keys -> styles, the sections "
                f"{list(SECTIONS)} and parameter keys -> placement lists"
            )
        if not isinstance(key, str):
            raise TypeError(f"torch plan keys must be str, got {key!r}")
        matched = _match(names, key)
        if not matched:
            err = _no_match(key, "torch", [n for n in names if n])
            if unmatched == "error":
                raise err
            warnings.warn(f"{err}; the key is skipped", stacklevel=3)
            continue
        for name in matched:
            tr.apply(key, name, value)
    # vescale's own entries win: drop translated ones for what they already cover
    own_params = [_rx(k) for k in own["parameter"]]
    for k, (_, v) in tr.params.items():
        name = tr.names[k]
        if not any(rx is not None and rx.fullmatch(name) for rx in own_params):
            own["parameter"][k] = v
    own_io = []
    for k in own["forward"]:
        split = _split_io_key(k) if isinstance(k, str) else None
        if split is not None:
            own_io.append((_rx(split[0]), split[1]))
    for k, (_, v) in tr.forward.items():
        name, io = tr.names[k]
        if not any(rx is not None and rx.fullmatch(name) and io == i for rx, i in own_io):
            own["forward"][k] = v
    return own


def _rx(key: Any) -> re.Pattern | None:
    try:
        return re.compile(key)
    except (re.error, TypeError):
        return None  # reported by the plan's own validation
