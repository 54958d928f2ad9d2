"""Split an unmodified model into pipeline stages that keep the model's parameter names.

Three steps, none of which changes the model's code:

1. `trace_model`: run the model once on the ``meta`` device (a copy whose tensors
   are meta, so nothing is computed or allocated) and record the order in which its
   modules are first called and the tensor arguments of every candidate split point.
2. `auto_split_points` / `check_split_points`: the module names where stages begin,
   either given or chosen by balancing parameter counts over the largest
   ``nn.ModuleList``.
3. `build_stage_module`: for one stage, a *shell* of the model: the same class (so
   the model's own ``forward`` runs), holding the stage's modules under their
   original names and, for everything else, meta "ghost" modules that are not
   registered (they live in the instance ``__dict__``), so ``named_parameters()`` and
   ``state_dict()`` list only the stage's tensors, under the unmodified model's names.

A stage runs the model's own ``forward``. Before its first module the code runs on
meta tensors (ghosts), the first module's arguments are replaced by the tensors
received from the previous stage, and the forward stops at the next stage's first
module, whose tensor arguments are sent on (see ``vescale.dmodule._pipeline``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vescale.dmodule._compat import tree_flatten

__all__ = [
    "PipelineSplitError",
    "TraceResult",
    "trace_model",
    "auto_split_points",
    "check_split_points",
    "stage_of_modules",
    "build_stage_module",
    "merge_stage_modules",
    "stub_ghosts",
    "meta_like",
]

_GHOSTS = "_vescale_pp_ghosts"
_ALL_CHILDREN = "_vescale_pp_children"


class PipelineSplitError(ValueError):
    """A pipeline split that cannot work: unknown or repeated split points, a module
    shared by two stages, more stages than blocks, or a shape the split cannot send."""


def meta_like(x: Any) -> Any:
    """``x`` with every tensor leaf replaced by an empty meta tensor (same shape/dtype)."""
    if isinstance(x, torch.Tensor):
        t = torch.empty(x.shape, dtype=x.dtype, device="meta")
        return t.requires_grad_(x.requires_grad) if t.is_floating_point() else t
    if isinstance(x, (list, tuple)):
        items = [meta_like(v) for v in x]
        return type(x)(items) if not hasattr(x, "_fields") else type(x)(*items)
    if isinstance(x, dict):
        return {k: meta_like(v) for k, v in x.items()}
    return x


def _meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta (nothing is copied)."""
    memo: dict[int, Any] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad
            )
    for _, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return copy.deepcopy(module, memo)


@dataclasses.dataclass
class TraceResult:
    """What one meta forward of the model recorded.

    Attributes:
        order: Module name -> index of its first call (modules never called are absent).
        calls: Module name -> number of calls.
        arg_leaves: Module name -> the tensor leaves (meta) of its first call's
            positional and keyword arguments, in ``tree_flatten`` order.
        output: The model's output (meta tensors).
        outputs: Module name -> its first call's output (meta tensors).
    """

    order: dict[str, int]
    calls: dict[str, int]
    arg_leaves: dict[str, list[torch.Tensor]]
    output: Any
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)


def trace_model(model: nn.Module, args: tuple, kwargs: dict) -> TraceResult:
    """Run ``model`` on meta copies of ``args``/``kwargs`` and record module calls."""
    ghost = _meta_copy(model)
    order: dict[str, int] = {}
    calls: dict[str, int] = {}
    arg_leaves: dict[str, list[torch.Tensor]] = {}
    outputs: dict[str, Any] = {}
    handles = []

    def make(name: str):
        def pre(_mod, a, kw):
            calls[name] = calls.get(name, 0) + 1
            if name not in order:
                order[name] = len(order)
                leaves, _ = tree_flatten((a, kw))
                arg_leaves[name] = [x for x in leaves if isinstance(x, torch.Tensor)]

        def post(_mod, _a, out):
            outputs.setdefault(name, out)

        return pre, post

    for name, mod in ghost.named_modules():
        if name:
            pre, post = make(name)
            handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(mod.register_forward_hook(post))
    try:
        out = ghost(*meta_like(tuple(args)), **meta_like(dict(kwargs)))
    except Exception as exc:  # noqa: BLE001
        raise PipelineSplitError(
            f"the pipeline split runs {type(model).__name__}.forward once on the meta device "
            f"to find where each module is called, and it failed: {exc}"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    return TraceResult(order, calls, arg_leaves, out, outputs)


def stub_ghosts(ghosts: dict[str, nn.Module], trace: TraceResult, keep: str | None) -> None:
    """Let ghosts return their traced (meta) output instead of running on meta.

    A stage runs the modules of earlier stages only for the shapes they produce, and
    torch's meta kernels cost about as much Python time as the real CPU kernels of a
    small model: a ghost called once per forward returns a fresh meta copy of the
    output it had in the trace instead. The ghost that holds ``keep`` (the next stage's
    first module, whose hook ends the stage) below its top runs as it is.
    """
    for name, g in ghosts.items():
        if trace.calls.get(name) != 1 or name not in trace.outputs:
            continue
        if keep is not None and keep.startswith(name + "."):
            continue
        out = trace.outputs[name]
        g.__dict__["forward"] = lambda *_a, _out=out, **_k: meta_like(_out)


def _blocks_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if best is None or n > best[0]:
                best = (n, name, mod)
    if best is None:
        raise PipelineSplitError(
            f"{type(model).__name__} has no nn.ModuleList of blocks to split automatically; "
            "pass split_points=['<module name where stage 1 begins>', ...]"
        )
    return best[1], best[2]


def _balanced_bounds(weights: Sequence[int], n: int) -> list[int]:
    """Start indices of ``n`` contiguous groups minimising the largest group sum."""
    k = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: smallest possible max-sum splitting the first i items into j groups
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for s in range(j - 1, i):
                cost = max(best[j - 1][s], prefix[i] - prefix[s])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, s
    starts, i = [], k
    for j in range(n, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return sorted(starts)


def auto_split_points(model: nn.Module, num_stages: int) -> list[str]:
    """Split points that balance parameter counts over the model's largest ``ModuleList``.

    Args:
        model: The unmodified model.
        num_stages: Total number of stages (virtual stages included).

    Returns:
        ``num_stages - 1`` module names (the first block of stages 1, 2, ...).
    """
    name, blocks = _blocks_list(model)
    if len(blocks) < num_stages:
        raise PipelineSplitError(
            f"{num_stages} pipeline stages need at least {num_stages} blocks, but "
            f"{name or type(model).__name__} has {len(blocks)}"
        )
    weights = [max(1, sum(p.numel() for p in b.parameters())) for b in blocks]
    starts = _balanced_bounds(weights, num_stages)
    prefix = f"{name}." if name else ""
    return [f"{prefix}{i}" for i in starts[1:]]


def check_split_points(
    model: nn.Module, split_points: Sequence[str], trace: TraceResult, num_stages: int
) -> list[str]:
    """Validate given split points against the model and the trace; returns them."""
    names = dict(model.named_modules())
    points = list(split_points)
    if len(points) != num_stages - 1:
        raise PipelineSplitError(
            f"{num_stages} pipeline stages need {num_stages - 1} split points, got "
            f"{len(points)}: {points}"
        )
    for p in points:
        if p not in names or not p:
            import difflib

            near = difflib.get_close_matches(p, list(names), n=3)
            raise PipelineSplitError(
                f"split point {p!r} is not a submodule of {type(model).__name__}"
                + (f"; did you mean {near}?" if near else "")
            )
        if trace.calls.get(p, 0) != 1:
            raise PipelineSplitError(
                f"split point {p!r} is called {trace.calls.get(p, 0)} times in one forward; "
                "a stage boundary must be a module called exactly once"
            )
    idx = [trace.order[p] for p in points]
    if idx != sorted(idx) or len(set(idx)) != len(idx):
        raise PipelineSplitError(
            f"split points {points} are not in the order the forward calls them"
        )
    return points


def _tensor_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {
        n: m
        for n, m in model.named_modules()
        if any(True for _ in m.parameters(recurse=False))
        or any(True for _ in m.buffers(recurse=False))
    }


def stage_of_modules(
    model: nn.Module, split_points: Sequence[str], trace: TraceResult
) -> dict[str, int]:
    """The stage of every module that holds parameters or buffers of its own.

    A module belongs to the stage in which the forward first calls it; the root's own
    tensors and modules the forward never calls belong to stage 0. A parameter held by
    modules of two stages (tied weights) is an error naming both.
    """
    bounds = [trace.order[p] for p in split_points]
    stage: dict[str, int] = {}
    for name in _tensor_modules(model):
        first = trace.order.get(name)
        if not name or first is None:
            stage[name] = 0
        else:
            stage[name] = sum(1 for b in bounds if b <= first)
    owner: dict[int, tuple[str, int]] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        s = stage.get(name)
        if s is None:
            continue
        for pname, t in list(mod.named_parameters(recurse=False)) + list(
            mod.named_buffers(recurse=False)
        ):
            full = f"{name}.{pname}" if name else pname
            prev = owner.setdefault(id(t), (full, s))
            if prev[1] != s:
                raise PipelineSplitError(
                    f"{prev[0]} (stage {prev[1]}) and {full} (stage {s}) are the same tensor "
                    "(tied weights): a tensor must live on one pipeline stage; untie them or "
                    "choose split points that keep both modules on one stage"
                )
    return stage


def _subtree_stages(module: nn.Module, prefix: str, stage: dict[str, int]) -> set[int]:
    out = set()
    for name, _ in module.named_modules(prefix=prefix):
        if name in stage:
            out.add(stage[name])
    return out


def _ghost(module: nn.Module) -> nn.Module:
    """A meta copy of ``module`` with no registered parameters or buffers.

    Every parameter and buffer is moved from the registries into the instance
    ``__dict__``, so attribute access inside ``forward`` finds them while
    ``parameters()``, ``buffers()`` and ``state_dict()`` see nothing.
    """
    g = _meta_copy(module)
    for m in g.modules():
        for table in ("_parameters", "_buffers"):
            reg = getattr(m, table)
            for k in list(reg):
                m.__dict__[k] = reg.pop(k)
    return g


class _ContainerView:
    """Iteration, length and indexing of a shell container over all its children."""

    def _all(self) -> list[tuple[str, nn.Module]]:
        return self.__dict__[_ALL_CHILDREN]

    def __iter__(self):
        if isinstance(self, nn.ModuleDict):
            return iter([k for k, _ in self._all()])
        return iter([m for _, m in self._all()])

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, idx):
        if isinstance(self, nn.ModuleDict):
            return dict(self._all())[idx]
        if isinstance(idx, slice):
            return [m for _, m in self._all()][idx]
        return self._all()[idx][1]

    def keys(self):
        return [k for k, _ in self._all()]

    def values(self):
        return [m for _, m in self._all()]

    def items(self):
        return list(self._all())


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(cls: type) -> type:
    if cls not in _VIEW_CLASSES:
        _VIEW_CLASSES[cls] = type(f"PipelineStage{cls.__name__}", (_ContainerView, cls), {})
    return _VIEW_CLASSES[cls]


@dataclasses.dataclass
class StageShell:
    """The stage's module and where its code meets the other stages.

    Attributes:
        module: The shell (same class as the model; stage tensors registered under
            their original names).
        entry_modules: Top-most modules of this stage called from code that ran on
            meta tensors (their meta arguments are replaced by received tensors).
        ghosts: Name -> ghost module (not registered) of the other stages' modules.
    """

    module: nn.Module
    entry_modules: dict[str, nn.Module]
    ghosts: dict[str, nn.Module]


def build_stage_module(model: nn.Module, stage_index: int, stage: dict[str, int]) -> StageShell:
    """The shell of ``model`` for ``stage_index`` (see the module docstring)."""
    entry: dict[str, nn.Module] = {}
    ghosts: dict[str, nn.Module] = {}

    def build(mod: nn.Module, prefix: str) -> nn.Module:
        stages = _subtree_stages(mod, prefix, stage)
        if stages == {stage_index}:
            if prefix:
                entry[prefix] = mod
            return mod  # wholly this stage's: the module itself
        if not stages:
            return copy.deepcopy(mod)  # no tensors: a private copy
        # partly this stage's: a shallow shell whose children are built recursively
        shell = copy.copy(mod)
        shell.__dict__ = dict(mod.__dict__)
        for attr in list(vars(shell)):
            val = vars(shell)[attr]
            if attr.startswith("_") and isinstance(val, dict):
                vars(shell)[attr] = type(val)(val) if not isinstance(val, type) else val
        own = stage.get(prefix) == stage_index
        for table in ("_parameters", "_buffers"):
            reg = getattr(shell, table)
            for k in list(reg):
                if not own and reg[k] is not None:
                    t = reg.pop(k)
                    shell.__dict__[k] = (
                        nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"))
                        if isinstance(t, nn.Parameter)
                        else torch.empty(t.shape, dtype=t.dtype, device="meta")
                    )
        children = list(mod._modules.items())
        shell._modules = type(mod._modules)()
        all_children: list[tuple[str, nn.Module]] = []
        for name, child in children:
            cprefix = f"{prefix}.{name}" if prefix else name
            if child is None:
                shell._modules[name] = None
                continue
            child_stages = _subtree_stages(child, cprefix, stage)
            if stage_index in child_stages or not child_stages:
                built = build(child, cprefix)
                shell._modules[name] = built
            else:
                built = _ghost(child)
                ghosts[cprefix] = built
                shell.__dict__[name] = built
            all_children.append((name, built))
        if isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            shell.__class__ = _view_class(type(mod))
            shell.__dict__[_ALL_CHILDREN] = all_children
        return shell

    root = build(model, "")
    root.__dict__[_GHOSTS] = ghosts
    return StageShell(root, entry, ghosts)


def merge_stage_modules(parts: Sequence[nn.Module]) -> nn.Module:
    """One module holding several stage shells' tensors under their original names.

    For a rank with one stage this is that stage's module. With several (interleaved
    schedules), a tree of plain ``nn.Module`` containers whose leaves are the stages'
    own submodules: ``state_dict()``, ``named_parameters()`` and optimizers keyed by
    parameter name see the unmodified model's names. It is never called.
    """
    if len(parts) == 1:
        return parts[0]

    def merge(mods: list[nn.Module]) -> nn.Module:
        if len(mods) == 1:
            return mods[0]
        out = nn.Module()
        for m in mods:
            for table in ("_parameters", "_buffers"):
                for k, t in getattr(m, table).items():
                    if t is not None:
                        getattr(out, table)[k] = t
            out._non_persistent_buffers_set |= set(m._non_persistent_buffers_set)
        names: list[str] = []
        for m in mods:
            names += [k for k, c in m._modules.items() if c is not None and k not in names]
        for k in names:
            kids = [m._modules[k] for m in mods if m._modules.get(k) is not None]
            unique = list({id(c): c for c in kids}.values())
            out._modules[k] = merge(unique)
        return out

    return merge(list(parts))
