"""The one place where vescale-dmodule touches torch internals.

Probed by feature when imported (see ``vescale.dtensor.compat.TorchInternals``). An
internal that is missing or changed is replaced by a slower public path where one
exists; otherwise the one feature that needs it raises a clear error when used. Either
way the package imports, and one ``TorchInternalsWarning`` names the internal.
`check_torch_internals` reports what was found; the test suite compares it with
the report recorded for the torch under test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vescale.dtensor.compat import StridedShard, local_tensor, queue_callback, sibling_internals

__all__ = [
    "StridedShard",
    "local_tensor",
    "queue_callback",
    "get_implicit_replication",
    "set_implicit_replication",
    "top_saved_tensors_hooks",
    "preserve_version_counter",
    "set_version_counters",
    "in_backward",
    "tree_flatten",
    "tree_unflatten",
    "check_torch_internals",
]

_INTERNALS = sibling_internals(
    "vescale-dmodule",
    shared=(
        "torch.distributed.tensor.placement_types._StridedShard",
        "DTensor._local_tensor",
        "torch.autograd.Variable._execution_engine.queue_callback",
    ),
)


def _missing(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} is not available in torch {torch.__version__}; "
        "see vescale.dmodule._compat.check_torch_internals()"
    )


# ------------------------------------------------------------------ implicit replication
_GET_IR = getattr(torch._C, "_get_dtensor_allow_implicit_replication", None)
_SET_IR = getattr(torch._C, "_set_dtensor_allow_implicit_replication", None)


def _ir_problem() -> str | None:
    if not (callable(_GET_IR) and callable(_SET_IR)):
        return "is missing"
    before = bool(_GET_IR())
    try:
        _SET_IR(not before)
        if bool(_GET_IR()) == before:
            return "setting the flag has no effect"
    finally:
        _SET_IR(before)
    return None


_IR_OK = _INTERNALS.probe(
    "torch._C._get/_set_dtensor_allow_implicit_replication",
    _ir_problem,
    instead="DModule's implicit replication of plain tensors raises",
    required=True,
)


def get_implicit_replication() -> bool:
    """Whether DTensor ops currently treat plain tensors as replicated."""
    return bool(_GET_IR()) if _IR_OK else False


def set_implicit_replication(value: bool) -> None:
    """Let DTensor ops treat plain tensors as replicated (``True``) or not."""
    if not _IR_OK:
        raise _missing("torch._C._set_dtensor_allow_implicit_replication")
    _SET_IR(value)


# ------------------------------------------------------------------ saved-tensor hooks
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_TOP_HOOKS_OK = _INTERNALS.probe(
    "torch._C._autograd._top_saved_tensors_default_hooks",
    lambda: None if callable(_TOP_HOOKS) else "is missing",
    instead="activation checkpointing of an implicitly replicating DModule raises",
    required=True,
)


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost active ``saved_tensors_hooks`` pair (``None``: none active)."""
    if not _TOP_HOOKS_OK:
        raise _missing("torch._C._autograd._top_saved_tensors_default_hooks")
    return _TOP_HOOKS(False)


# ------------------------------------------------------------------ version counters
_PRESERVE = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
_SET_VERSIONS = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)


def _versions_problem() -> str | None:
    if not (callable(_PRESERVE) and callable(_SET_VERSIONS)):
        return "is missing"
    t = torch.zeros(2)
    before = t._version
    with _PRESERVE(t):
        t.add_(1)
    if t._version != before:
        return "_unsafe_preserve_version_counter no longer preserves the version"
    t.add_(1)
    _SET_VERSIONS((t,), (before,))
    if t._version != before:
        return "_unsafe_set_version_counter no longer sets the version"
    return None


_VERSIONS_OK = _INTERNALS.probe(
    "torch.autograd._unsafe_preserve_version_counter / _unsafe_set_version_counter",
    _versions_problem,
    instead="FSDP's in-place all-gathers bump versions: backward may report in-place modification",
    required=True,
)


@contextlib.contextmanager
def preserve_version_counter(t: torch.Tensor) -> Iterator[None]:
    """Write into ``t`` in place without bumping its autograd version counter."""
    if not _VERSIONS_OK:
        yield
        return
    with _PRESERVE(t):
        yield


def set_version_counters(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Set the autograd version counters of ``tensors`` (no-op where torch cannot)."""
    if _VERSIONS_OK:
        _SET_VERSIONS(tensors, versions)


# ------------------------------------------------------------------ inside backward?
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)
_GRAPH_TASK_OK = _INTERNALS.probe(
    "torch._C._current_graph_task_id",
    lambda: None if callable(_GRAPH_TASK_ID) and _GRAPH_TASK_ID() == -1 else "is missing",
    instead="FSDP counts a non-reentrant checkpoint recomputation as a forward",
    required=True,
)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return _GRAPH_TASK_OK and _GRAPH_TASK_ID() != -1


# ------------------------------------------------------------------ pytrees
def _pytree() -> tuple[Callable | None, Callable | None]:
    try:
        from torch.utils import _pytree
    except ImportError:
        return None, None
    return getattr(_pytree, "tree_flatten", None), getattr(_pytree, "tree_unflatten", None)


_TREE_FLATTEN, _TREE_UNFLATTEN = _pytree()


def _pytree_problem() -> str | None:
    if not (callable(_TREE_FLATTEN) and callable(_TREE_UNFLATTEN)):
        return "is missing"
    tree = ((1, [2, {"a": 3}]), {"k": (4,)})
    leaves, spec = _TREE_FLATTEN(tree)
    if leaves != [1, 2, 3, 4] or _TREE_UNFLATTEN([5, 6, 7, 8], spec) != (
        (5, [6, {"a": 7}]),
        {"k": (8,)},
    ):
        return "tree_flatten/tree_unflatten changed"
    return None


_PYTREE_OK = _INTERNALS.probe(
    "torch.utils._pytree.tree_flatten / tree_unflatten",
    _pytree_problem,
    instead="a flattener of tuples, lists and dicts",
)


def _flatten_public(tree: Any) -> tuple[list[Any], Any]:
    if isinstance(tree, (tuple, list)):
        kids = [_flatten_public(x) for x in tree]
        return [leaf for ls, _ in kids for leaf in ls], (type(tree), [s for _, s in kids])
    if isinstance(tree, dict):
        kids = [_flatten_public(v) for v in tree.values()]
        return [leaf for ls, _ in kids for leaf in ls], (dict, list(tree), [s for _, s in kids])
    return [tree], None


def _unflatten_public(leaves: list[Any], spec: Any) -> Any:
    it = iter(leaves)

    def build(s: Any) -> Any:
        if s is None:
            return next(it)
        if s[0] is dict:
            return {k: build(c) for k, c in zip(s[1], s[2])}
        items = [build(c) for c in s[1]]
        return s[0](items) if s[0] in (tuple, list) else s[0](*items)

    return build(spec)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """Leaves of nested tuples/lists/dicts (torch's pytree where available) and a spec."""
    return _TREE_FLATTEN(tree) if _PYTREE_OK else _flatten_public(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """Inverse of `tree_flatten`."""
    return _TREE_UNFLATTEN(leaves, spec) if _PYTREE_OK else _unflatten_public(list(leaves), spec)


def check_torch_internals() -> dict[str, str]:
    """What vescale-dmodule found of the torch internals it relies on.

    Returns:
        ``{internal: status}``, statuses as in ``vescale.dtensor.compat.check_torch_internals``.
    """
    return _INTERNALS.report()
