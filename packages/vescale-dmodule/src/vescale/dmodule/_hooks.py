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

from vescale.dmodule import _compat
from vescale.dmodule._plan import LocalLayout
from vescale.dtensor import redistribute

__all__ = [
    "to_placements",
    "make_input_hook",
    "make_output_hook",
    "make_tensor_hooks",
    "implicit_replication",
]


def to_placements(
    x: Any, mesh: DeviceMesh, placements: tuple[Placement, ...] | LocalLayout | None
) -> Any:
    """Move one value to ``placements`` (differentiable).

    A DTensor is redistributed (nothing happens if it already has them). A plain
    tensor is taken to hold the same full value on every rank (``Replicate()``)
    and then redistributed, so ``Shard`` picks each rank's chunk locally. Other
    values are returned unchanged. A `LocalLayout` entry (torch
    ``ParallelStyle`` semantics) takes a plain tensor as this rank's local part.
    """
    if placements is None:
        return x
    if isinstance(placements, LocalLayout):
        return _apply_local_layout(x, mesh, placements)
    if not isinstance(x, torch.Tensor):
        # a container argument (dict, list, tuple, dataclass): every tensor in it
        return _map_tensors(x, lambda t: to_placements(t, mesh, placements))
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


def _norm_dims(placements: tuple[Placement, ...], ndim: int) -> tuple[Placement, ...]:
    return tuple(
        Shard(p.dim + ndim) if isinstance(p, Shard) and p.dim < 0 else p for p in placements
    )


def _apply_local_layout(x: Any, mesh: DeviceMesh, layout: LocalLayout) -> Any:
    if not isinstance(x, torch.Tensor):
        return _map_tensors(x, lambda t: _apply_local_layout(t, mesh, layout))
    if not isinstance(x, DTensor) and layout.src is not None:
        # this rank's local part, laid out as `src`: no communication
        x = DTensor.from_local(x, mesh, _norm_dims(layout.src, x.ndim), run_check=False)
    if layout.dst is not None:
        x = to_placements(x, mesh, layout.dst)
    if layout.to_local and isinstance(x, DTensor):
        x = x.to_local()
    return x


def _map_tensors(x: Any, fn) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        items = {k: _map_tensors(v, fn) for k, v in x.items()}
        if type(x) is dict:
            return items
        try:
            return type(x)(items)
        except TypeError:
            return items
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_map_tensors(v, fn) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(
            x,
            **{
                f.name: _map_tensors(getattr(x, f.name), fn)
                for f in dataclasses.fields(x)
                if f.init
            },
        )
    return x


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


def _is_placements(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(p, Placement) for p in value)


def _apply_seq(values: tuple, spec: tuple, mesh: DeviceMesh) -> tuple:
    out = list(values)
    for i, p in enumerate(spec):
        if i < len(out):
            out[i] = to_placements(out[i], mesh, p)
    return tuple(out)


def _forward_params(module: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def make_input_hook(module: nn.Module, spec: Any, mesh: DeviceMesh):
    """A ``forward_pre_hook`` (with kwargs) that applies an input spec.

    A spec by position (a list) and a spec by name (a dict) both apply whether the
    caller passes the argument positionally or by keyword: positions and names are
    matched through ``forward``'s signature.
    """
    params = _forward_params(module)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_keyword = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
    var_pos = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    extra: tuple = ()  # specs of the values of *args, in order
    if isinstance(spec, Mapping):
        named = dict(spec)
        if var_pos is not None and var_pos in named:
            value = named.pop(var_pos)
            extra = value if isinstance(value, tuple) and not _is_placements(value) else (value,)
    else:
        # positions past the named parameters can only come positionally (*args)
        named = {positional[i]: p for i, p in enumerate(spec) if i < len(positional)}
        extra = tuple(spec[len(positional) :])
    position = {n: i for i, n in enumerate(positional)}

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        args = list(args)
        kwargs = dict(kwargs)
        for name, p in named.items():
            i = position.get(name)
            if i is not None and i < len(args):
                args[i] = to_placements(args[i], mesh, p)
            elif name in kwargs and (name in by_keyword or var_kw or not params):
                kwargs[name] = to_placements(kwargs[name], mesh, p)
        if extra and len(args) > len(positional):
            args[len(positional) :] = _apply_seq(tuple(args[len(positional) :]), extra, mesh)
        return tuple(args), kwargs

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


def make_tensor_hooks(specs: dict[str, tuple[Placement, ...]], mesh: DeviceMesh):
    """``(pre, post)`` forward hooks that redistribute a module's own tensors for its forward.

    ``specs`` maps a parameter or buffer name of the module to placements. The pre-hook
    puts the redistributed (differentiable) value in the module's parameter/buffer
    table for the duration of ``forward``; the post-hook (registered with
    ``always_call``) puts the original back, so optimizers, state dicts and data-parallel
    engines only ever see the original tensors, which receive the gradient.
    """
    saved: list[list[tuple[dict, str, torch.Tensor]]] = []

    def pre(mod: nn.Module, args: tuple) -> None:
        swapped = []
        for attr, placements in specs.items():
            table = mod._parameters if mod._parameters.get(attr) is not None else mod._buffers
            orig = table[attr]
            if not isinstance(orig, DTensor):
                raise TypeError(
                    f"{type(mod).__name__}.{attr} is not a DTensor; forward-section "
                    "parameter entries need a parallelized parameter"
                )
            swapped.append((table, attr, orig))
            table[attr] = to_placements(orig, mesh, placements)
        saved.append(swapped)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        if saved:
            for table, attr, orig in saved.pop():
                table[attr] = orig

    return pre, post


# ------------------------------------------------------------- implicit replication
def _get_flag() -> bool:
    return _compat.get_implicit_replication()


def _set_flag(value: bool) -> None:
    _compat.set_implicit_replication(value)


@contextmanager
def implicit_replication():
    """Like torch's ``implicit_replication`` but restores the previous state (nests)."""
    old = _get_flag()
    _set_flag(True)
    try:
        yield
    finally:
        _set_flag(old)


@torch.compiler.disable
def _refuse_compile(message: str) -> None:
    # called (eagerly, outside the graph) while torch.compile traces the forward, so the
    # user gets this error instead of one from deep inside dynamo or AOTAutograd
    raise NotImplementedError(f'{message}; see "torch.compile" in docs/dmodule.md')


def _implicit_replication_message(name: str) -> str:
    return (
        f"torch.compile of {name}, parallelized with implicit_replication=True (the default "
        "for vescale plans), is not supported: its plain tensors act as replicated only "
        "through a thread-local flag and saved-tensor hooks, which compiled graphs do not "
        "see. Parallelize with implicit_replication=False and plan the root input (e.g. "
        '{"forward": {"input": [[Replicate()]]}}), or use a torch ParallelStyle plan'
    )


def refuse_compile_hook(name: str):
    """A forward pre-hook that raises a clear error while torch.compile traces the
    row-parallel embedding ``name``."""
    message = (
        f"torch.compile of a model whose embedding {name!r} is row-parallel "
        "(vocabulary-parallel, weight Shard(0)) is not supported yet: tracing it fails "
        'inside torch ("Mixing fake modes NYI" at F.embedding). Shard the embedding '
        "by columns (Shard(1)), keep it replicated, or run without torch.compile"
    )

    def hook(mod: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            _refuse_compile(message)

    return hook


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
        if torch.compiler.is_compiling():
            _refuse_compile(_implicit_replication_message(type(mod).__qualname__))
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._stack.append((_get_flag(), ctx))
        _set_flag(True)
        ctx.__enter__()

    def post(self, mod: nn.Module, args: tuple, out: Any) -> None:
        if self._stack:
            flag, ctx = self._stack.pop()
            ctx.__exit__(None, None, None)
            _set_flag(flag)
