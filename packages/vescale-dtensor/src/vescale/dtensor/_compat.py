"""The one place where vescale-dtensor touches torch internals.

Every internal is probed by feature when this module is imported, never by version
string. One that is there and behaves as relied on is used ("native"); one that is
missing or changed is replaced by a slower public path ("fallback") or, where none
exists, by a clear error at the point of use ("missing"). Either way the package
still imports, and one `TorchInternalsWarning` names the internal.
`check_torch_internals` returns the report; the test suite compares it with
the one recorded for the torch under test, so a torch upgrade that moves an
internal fails loudly instead of silently slowing down or misbehaving.

`TorchInternals` is shared: every vescale package that touches torch
privates keeps its own instance in its own ``_compat.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = [
    "TorchInternals",
    "TorchInternalsWarning",
    "DTensorSpec",
    "TensorMeta",
    "StridedShard",
    "COMM_OP_ALIASES",
    "make_spec",
    "local_tensor",
    "queue_callback",
    "new_dtensor",
    "shard_to_replicate",
    "replicate_to_shard",
    "shard_to_shard",
    "partial_to_replicate",
    "partial_to_shard",
    "shard_size_and_offset",
    "wait_tensor",
    "norm_partial",
    "is_async_tensor",
    "default_group",
    "all_gather_single",
    "reduce_scatter_single",
    "resolve_group_name",
    "C10D_FUNCTIONAL",
    "set_pg_timeout",
    "destroy_subgroups",
    "clear_dtensor_caches",
    "ORIGINAL_REDISTRIBUTE",
    "ORIGINAL_FROM_LOCAL",
    "register_foreach_type",
    "route_subclass_dispatch",
    "install_strided_split_rules",
    "install_cpu_attention_rules",
    "install_dynamo_mesh_rule",
    "install_unsafe_view_rule",
    "install_state_dict_rules",
    "check_torch_internals",
    "set_random_op_handler",
    "TorchDispatchMode",
]


# ------------------------------------------------------------------ the report
class TorchInternalsWarning(UserWarning):
    """A torch internal a vescale package relies on is missing or changed.

    The package still works: it took a slower public path, or the one feature that
    needs the internal raises a clear error when used. ``check_torch_internals()`` of
    the package's ``_compat`` module says which.
    """


NATIVE, FALLBACK, MISSING = "native", "fallback", "missing"


class TorchInternals:
    """What one vescale package found of the torch internals it relies on.

    Each probe records one entry, keyed by the internal's name:

    * ``"native"`` (or ``"native: <how>"`` when torch offers the feature through
      another internal than the first choice): used as designed;
    * ``"fallback: <what is wrong>; <the slower path taken>"``;
    * ``"missing: <what is wrong>; <what raises>"``: no slower path exists.

    A fallback or a missing internal warns once (`TorchInternalsWarning`).

    Args:
        package: The distribution name, used in warnings (``"vescale-dtensor"``).
    """

    def __init__(self, package: str) -> None:
        self.package = package
        self._entries: dict[str, str] = {}

    def native(self, name: str, how: str = "") -> None:
        """Record ``name`` as used natively (``how``: the internal used instead of the first choice)."""
        self._entries[name] = f"{NATIVE}: {how}" if how else NATIVE

    def fallback(self, name: str, problem: str, instead: str) -> None:
        """Record ``name`` as replaced by a slower path, and warn once."""
        self._record(name, FALLBACK, problem, instead)

    def missing(self, name: str, problem: str, effect: str) -> None:
        """Record ``name`` as unavailable without a slower path, and warn once."""
        self._record(name, MISSING, problem, effect)

    def _record(self, name: str, kind: str, problem: str, then: str) -> None:
        text = f"{kind}: {problem}; {then}"
        if self._entries.get(name) == text:
            return
        self._entries[name] = text
        warnings.warn(
            f"{self.package}: torch internal {name}: {problem}; {then}",
            TorchInternalsWarning,
            stacklevel=3,
        )

    def probe(
        self, name: str, check: Callable[[], str | None], *, instead: str, required: bool = False
    ) -> bool:
        """Run ``check`` (``None``: fine, else the problem) and record the outcome.

        Args:
            name: The internal.
            check: Returns ``None`` when the internal behaves as relied on, else a
                description of the problem; an exception counts as a problem.
            instead: The slower path taken (or, with ``required``, what raises).
            required: No slower path exists: record ``"missing"`` instead of ``"fallback"``.

        Returns:
            Whether the internal can be used.
        """
        try:
            problem = check()
        except Exception as exc:  # noqa: BLE001 - any failure of a probe is a finding
            problem = f"probe failed: {exc!r}"
        if problem is None:
            self.native(name)
            return True
        (self.missing if required else self.fallback)(name, problem, instead)
        return False

    def pick(
        self,
        name: str,
        check: Callable[[Any], str | None] | None = None,
        *,
        stand_in: Any = None,
        instead: str,
        required: bool = False,
    ) -> Any:
        """Find the internal ``name``, check it, record the outcome; return it or ``stand_in``.

        Args:
            name: The internal's dotted path (``"torch._C._nn.flatten_dense_tensors"``,
                ``"torch.utils._python_dispatch.TorchDispatchMode"``): attributes are
                looked up from ``torch`` on, and a submodule that is not an attribute
                yet is imported. A path that cannot be found is a problem
                (``"cannot be imported: ..."``).
            check: Called with the internal; returns ``None`` when it behaves as
                relied on, else the problem (an exception counts as a problem).
                ``None``: being there is enough.
            stand_in: What to return when the internal cannot be used (the public
                equivalent, or a placeholder that raises when used).
            instead: As for `probe`.
            required: As for `probe`.

        Returns:
            The internal, or ``stand_in`` when it is missing or its check failed.
        """
        found: list[Any] = []

        def run() -> str | None:
            try:
                found.append(_find(name))
            except (ImportError, AttributeError) as exc:
                return f"cannot be imported: {exc}"
            return None if check is None else check(found[0])

        return found[0] if self.probe(name, run, instead=instead, required=required) else stand_in

    def adopt(self, name: str, other: TorchInternals) -> None:
        """Record ``name`` with the status another package's probe found (no second warning)."""
        self._entries[name] = other.report()[name]

    def report(self) -> dict[str, str]:
        """Every probed internal with its status (see the class docstring)."""
        return dict(self._entries)


def _find(path: str) -> Any:
    """The object at a dotted path: attributes first, importing submodules as needed."""
    head, *rest = path.split(".")
    obj = importlib.import_module(head)
    for i, part in enumerate(rest, 2):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(path.split(".")[:i]))
    return obj


_INTERNALS = TorchInternals("vescale-dtensor")


def _params_missing(fn: Any, params: Sequence[str]) -> str | None:
    if fn is None:
        return "is missing"
    try:
        got = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: presence is all we see
        return None
    missing = [p for p in params if p not in got]
    return f"parameters {missing} missing (has {got})" if missing else None


class _Unavailable:
    """Stands in for a missing torch class: never an instance of anything, raises when built."""

    _what = "a torch internal"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            f"{self._what} is not available in torch {torch.__version__}; "
            "see vescale.dtensor._compat.check_torch_internals()"
        )


def _unavailable_class(what: str) -> type:
    return type(what.rsplit(".", 1)[-1], (_Unavailable,), {"_what": what})


# ------------------------------------------------------------------ DTensor construction
def _import_spec() -> tuple[Any, Any, str | None]:
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError as exc:
        return None, None, f"cannot be imported: {exc}"
    if "placements" not in getattr(DTensorSpec, "__dataclass_fields__", {}):
        return DTensorSpec, TensorMeta, "has no dataclass field 'placements'"
    if tuple(getattr(TensorMeta, "_fields", ()))[:3] != ("shape", "stride", "dtype"):
        return DTensorSpec, TensorMeta, f"TensorMeta fields changed: {TensorMeta._fields}"
    if not hasattr(torch.Tensor, "_dtensor__new__"):
        return (
            DTensorSpec,
            TensorMeta,
            "torch.Tensor._dtensor__new__ is gone (DTensor construction changed)",
        )
    if "__torch_dispatch__" not in DTensor.__dict__:
        return DTensorSpec, TensorMeta, "DTensor.__torch_dispatch__ is gone"
    return DTensorSpec, TensorMeta, None


DTensorSpec, TensorMeta, _spec_problem = _import_spec()
_SPEC_OK = _INTERNALS.probe(
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    lambda: _spec_problem,
    instead="DTensors with plugin placements raise NotImplementedError",
    required=True,
)


def _no_plugin_dtensors() -> NotImplementedError:
    return NotImplementedError(
        f"vescale-dtensor cannot build DTensors with plugin placements on torch "
        f"{torch.__version__}: torch.distributed.tensor._dtensor_spec.DTensorSpec {_spec_problem}"
    )


def make_spec(
    mesh: DeviceMesh,
    placements: Sequence,
    shape: Sequence[int],
    stride: Sequence[int],
    dtype: torch.dtype,
) -> Any:
    """Build a ``DTensorSpec`` (private torch type) for the given layout."""
    if not _SPEC_OK:
        raise _no_plugin_dtensors()
    return DTensorSpec(
        mesh,
        tuple(placements),
        tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype),
    )


def new_dtensor(cls: type[DTensor], local: torch.Tensor, spec: Any, requires_grad: bool) -> DTensor:
    """Construct a DTensor (or subclass) around ``local`` without autograd wiring."""
    if not _SPEC_OK:
        raise _no_plugin_dtensors()
    return cls(local, spec, requires_grad=requires_grad)


# Captured before vescale patches them (see _dispatch.install_patches); public methods.
ORIGINAL_REDISTRIBUTE = DTensor.redistribute
_TORCH_FROM_LOCAL = DTensor.from_local
if _INTERNALS.probe(
    "DTensor.from_local(grad_placements=)",
    lambda: None if _params_missing(_TORCH_FROM_LOCAL, ["grad_placements"]) is None else "has none",
    instead="from_local(..., grad_placements=<not None>) raises TypeError",
    required=True,
):
    ORIGINAL_FROM_LOCAL = _TORCH_FROM_LOCAL
else:

    @functools.wraps(_TORCH_FROM_LOCAL)
    def ORIGINAL_FROM_LOCAL(  # noqa: N802 - stands in for torch's method
        local_tensor, device_mesh=None, placements=None, *, grad_placements=None, **kwargs
    ):
        if grad_placements is not None:
            raise TypeError(
                f"DTensor.from_local() of torch {torch.__version__} takes no grad_placements"
            )
        return _TORCH_FROM_LOCAL(local_tensor, device_mesh, placements, **kwargs)


# ------------------------------------------------------------------ local tensors
_LOCAL_ATTR_OK = _INTERNALS.probe(
    "DTensor._local_tensor",
    lambda: (
        None
        if "_local_tensor" in getattr(DTensor, "__annotations__", {})
        else "is no longer a DTensor attribute"
    ),
    instead="DTensor.to_local() under no_grad",
)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of DTensor ``t`` itself (its storage, no autograd), or ``t``."""
    if not isinstance(t, DTensor):
        return t
    if _LOCAL_ATTR_OK:
        return t._local_tensor
    with torch.no_grad():
        return DTensor.to_local(t)  # torch's own (a subclass's override may call this)


_SPEC_ATTR_OK = _INTERNALS.probe(
    "DTensor._spec",
    lambda: None if "_spec" in getattr(DTensor, "__annotations__", {}) else "is missing",
    instead="a DTensorSpec rebuilt from the public mesh, placements, shape and stride",
)


def dtensor_spec(t: DTensor) -> Any:
    """The DTensorSpec of ``t`` (mesh, placements, global shape and stride, dtype)."""
    if _SPEC_ATTR_OK:
        return t._spec
    return make_spec(t.device_mesh, tuple(t.placements), t.shape, t.stride(), t.dtype)


# torch's pytree (no public module in the supported range) and op overload type
def _import_pytree() -> tuple[Any, Any, Any, str | None]:
    try:
        from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
    except ImportError as exc:
        return None, None, None, f"cannot be imported ({exc})"
    return tree_flatten, tree_map, tree_unflatten, None


tree_flatten, tree_map, tree_unflatten, _pytree_problem = _import_pytree()
_INTERNALS.probe(
    "torch.utils._pytree",
    lambda: _pytree_problem,
    instead="operators on plugin-placement DTensors raise",
    required=True,
)
OpOverload = getattr(torch._ops, "OpOverload", object)


# ------------------------------------------------------------------ threaded process group
def threaded_pg() -> Any:
    """torch's threaded process group module (``torch.testing._internal``), for the test
    harness's ``mode="thread"``."""
    from torch.testing._internal.distributed import multi_threaded_pg

    return multi_threaded_pg


def current_world() -> Any:
    """torch's process-global registry of process groups (``None`` if torch moved it)."""
    return getattr(dist.distributed_c10d, "_world", None)


def set_thread_isolation(on: bool) -> None:
    """Per-thread process-group state (torch's threaded group needs it on)."""
    torch._C._distributed_c10d._set_thread_isolation_mode(on)


# ------------------------------------------------------------------ end-of-backward callbacks
def _engine_queue_callback() -> Callable[[Callable[[], None]], None] | None:
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    fn = getattr(engine, "queue_callback", None)
    return fn if callable(fn) else None


_QUEUE_CALLBACK = _engine_queue_callback()
_INTERNALS.probe(
    "torch.autograd.Variable._execution_engine.queue_callback",
    lambda: None if _QUEUE_CALLBACK is not None else "is missing",
    instead="what runs at the end of backward (DDP/FSDP gradient sync, "
    "gradient-sync debugging) raises",
    required=True,
)


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward pass finishes (call from a backward hook)."""
    if _QUEUE_CALLBACK is None:
        raise NotImplementedError(
            f"torch {torch.__version__} has no torch.autograd.Variable._execution_engine."
            "queue_callback; see vescale.dtensor._compat.check_torch_internals()"
        )
    _QUEUE_CALLBACK(fn)


# ------------------------------------------------------------------ _StridedShard
def _strided_problem(cls: type) -> str | None:
    try:
        p = cls(1, split_factor=3)
        if (p.dim, p.split_factor) != (1, 3) or p != cls(1, split_factor=3):
            return "_StridedShard(dim, split_factor=) changed"
    except Exception as exc:  # noqa: BLE001
        return f"_StridedShard(1, split_factor=3) failed: {exc!r}"
    return None


StridedShard = _INTERNALS.pick(
    "torch.distributed.tensor.placement_types._StridedShard",
    _strided_problem,
    stand_in=_unavailable_class("torch _StridedShard"),
    instead="fused (strided) parameter layouts raise NotImplementedError",
    required=True,
)
_STRIDED_OK = not issubclass(StridedShard, _Unavailable)


# ------------------------------------------------------------------ functional collectives
def _import_funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


def _async_tensor_class() -> type | None:
    try:
        return _import_funcol().AsyncCollectiveTensor
    except (ImportError, AttributeError):
        return None


_AsyncCollectiveTensor = _async_tensor_class()
_INTERNALS.probe(
    "torch.distributed._functional_collectives.AsyncCollectiveTensor",
    lambda: (
        None
        if isinstance(_AsyncCollectiveTensor, type)
        and callable(getattr(_AsyncCollectiveTensor, "wait", None))
        else "is missing"
    ),
    instead="results with a wait() method are waited for by duck typing",
)


def is_async_tensor(t: object) -> bool:
    """Whether ``t`` is a functional collective's result still in flight."""
    if _AsyncCollectiveTensor is not None:
        return isinstance(t, _AsyncCollectiveTensor)
    return isinstance(t, torch.Tensor) and callable(getattr(type(t), "wait", None))


def wait_tensor(t: torch.Tensor) -> torch.Tensor:
    """Wait for a pending functional collective result and return a plain tensor."""
    if is_async_tensor(t):
        return t.wait()  # type: ignore[attr-defined]
    return t


#: The native functional collective ops (dispatcher ops, so CommDebugMode counts them)
#: that vescale.dtensor.collectives issues.
C10D_FUNCTIONAL = getattr(torch.ops, "_c10d_functional", None)
_C10D_OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "wait_tensor",
)


def _c10d_problem() -> str | None:
    missing = [op for op in _C10D_OPS if not hasattr(C10D_FUNCTIONAL, op)]
    return f"ops {missing} are missing" if missing else None


_INTERNALS.probe(
    "torch.ops._c10d_functional",
    _c10d_problem,
    instead="vescale.dtensor.collectives raise",
    required=True,
)


# torch.distributed's tensor collectives were renamed (``*_into_tensor``/``*_tensor`` ->
# ``*_single``); the old names stay as deprecated aliases. Public API either way.
def _c10d_tensor_collective(new: str, old: str) -> Callable:
    fn = getattr(dist, new, None)
    if callable(fn):
        _INTERNALS.native(f"torch.distributed.{new}")
        return fn
    fn = getattr(dist, old, None)
    if callable(fn):
        _INTERNALS.native(f"torch.distributed.{new}", f"torch.distributed.{old}")
        return fn

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"torch {torch.__version__} has neither dist.{new} nor dist.{old}"
        )

    _INTERNALS.missing(f"torch.distributed.{new}", f"neither {new} nor {old}", "it raises")
    return unavailable


#: ``dist.all_gather_single(output, input, group=None, async_op=False)`` on every torch.
all_gather_single = _c10d_tensor_collective("all_gather_single", "all_gather_into_tensor")
#: ``dist.reduce_scatter_single(output, input, op=SUM, group=None, async_op=False)``.
reduce_scatter_single = _c10d_tensor_collective("reduce_scatter_single", "reduce_scatter_tensor")


# ------------------------------------------------------------------ Shard / Partial steps
# One mesh dim's built-in redistribution steps, through torch's own Shard/Partial
# methods; the fallbacks use vescale's collectives (torch's public functional
# collectives underneath): correct for every layout, with an extra copy or two.
_SHARD_METHODS = {
    "_to_replicate_tensor": ["local_tensor", "mesh", "mesh_dim", "current_logical_shape"],
    "_replicate_to_shard": ["local_tensor", "mesh", "mesh_dim", "shard_index"],
    "_to_new_shard_dim": [
        "local_tensor",
        "mesh",
        "mesh_dim",
        "current_logical_shape",
        "new_shard_dim",
    ],
    "local_shard_size_and_offset": ["curr_local_size", "num_chunks", "rank"],
}
_PARTIAL_METHODS = {
    "_reduce_value": ["tensor", "mesh", "mesh_dim"],
    "_reduce_shard_value": ["tensor", "mesh", "mesh_dim", "shard_spec"],
}
_NATIVE_STEP: dict[str, bool] = {}
for _cls, _methods in ((Shard, _SHARD_METHODS), (Partial, _PARTIAL_METHODS)):
    for _name, _params in _methods.items():
        _NATIVE_STEP[_name] = _INTERNALS.probe(
            f"{_cls.__name__}.{_name}",
            functools.partial(_params_missing, getattr(_cls, _name, None), _params),
            instead="vescale.dtensor.collectives (public functional collectives) instead",
        )


def _chunk_size_and_offset(size: int, num_chunks: int, rank: int) -> tuple[int, int]:
    """``torch.chunk`` semantics: ceil-sized chunks, the last ones short or empty."""
    full = -(-size // num_chunks) if num_chunks else 0
    start = min(full * rank, size)
    return min(size, start + full) - start, start


def shard_size_and_offset(size: int, num_chunks: int, rank: int) -> tuple[int, int]:
    """Local size and offset of ``rank``'s chunk under ``torch.chunk`` semantics."""
    if _NATIVE_STEP["local_shard_size_and_offset"]:
        n, off = Shard.local_shard_size_and_offset(size, num_chunks, rank)
        return int(n), int(off)
    return _chunk_size_and_offset(size, num_chunks, rank)


def _dim_sizes(size: int, n: int) -> list[int]:
    return [shard_size_and_offset(size, n, r)[0] for r in range(n)]


def _fallback_shard_to_replicate(local, mesh, mesh_dim, dim, logical_shape):
    from vescale.dtensor.collectives import all_gather_uneven

    sizes = _dim_sizes(int(logical_shape[dim]), mesh.size(mesh_dim))
    return all_gather_uneven(local, (mesh, mesh_dim), dim, sizes=sizes, method="pad")


def _fallback_replicate_to_shard(full, mesh, mesh_dim, dim, rank):
    size, off = shard_size_and_offset(full.shape[dim], mesh.size(mesh_dim), rank)
    return full.narrow(dim, off, size).clone()


def shard_to_replicate(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, logical_shape: Sequence[int]
) -> torch.Tensor:
    if _NATIVE_STEP["_to_replicate_tensor"]:
        return Shard(dim)._to_replicate_tensor(local, mesh, mesh_dim, list(logical_shape))
    return _fallback_shard_to_replicate(local, mesh, mesh_dim, dim, logical_shape)


def replicate_to_shard(
    full: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, dim: int, rank: int
) -> torch.Tensor:
    if _NATIVE_STEP["_replicate_to_shard"]:
        return Shard(dim)._replicate_to_shard(full, mesh, mesh_dim, rank)
    return _fallback_replicate_to_shard(full, mesh, mesh_dim, dim, rank)


def shard_to_shard(
    local: torch.Tensor,
    mesh: DeviceMesh,
    mesh_dim: int,
    src_dim: int,
    dst_dim: int,
    logical_shape: Sequence[int],
) -> torch.Tensor:
    if _NATIVE_STEP["_to_new_shard_dim"]:
        return Shard(src_dim)._to_new_shard_dim(local, mesh, mesh_dim, list(logical_shape), dst_dim)
    # slower: gather everything, keep this rank's slice of the new dim
    full = _fallback_shard_to_replicate(local, mesh, mesh_dim, src_dim, logical_shape)
    return _fallback_replicate_to_shard(
        full, mesh, mesh_dim, dst_dim, mesh.get_local_rank(mesh_dim)
    )


def _own_method(obj: object, name: str) -> bool:
    """Whether ``obj``'s class defines ``name`` itself, below torch's ``Partial``."""
    for klass in type(obj).__mro__:
        if klass is Partial:
            return False
        if name in vars(klass):
            return True
    return False


def _reduce_op(partial: Partial) -> str:
    op = getattr(partial, "reduce_op", None)
    if type(partial) is not Partial or op not in ("sum", "avg", "max", "min"):
        raise NotImplementedError(
            f"{partial!r}: no fallback reduction without torch's Partial._reduce_value "
            "(see vescale.dtensor._compat.check_torch_internals())"
        )
    return op


def partial_to_replicate(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, partial: Partial
) -> torch.Tensor:
    if _NATIVE_STEP["_reduce_value"] or _own_method(partial, "_reduce_value"):
        return partial._reduce_value(local, mesh, mesh_dim)
    from vescale.dtensor.collectives import all_reduce

    return all_reduce(local, (mesh, mesh_dim), op=_reduce_op(partial))


def partial_to_shard(
    local: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, partial: Partial, dim: int
) -> torch.Tensor:
    if _NATIVE_STEP["_reduce_shard_value"] or _own_method(partial, "_reduce_shard_value"):
        return partial._reduce_shard_value(local, mesh, mesh_dim, Shard(dim))
    from vescale.dtensor.collectives import reduce_scatter_uneven

    sizes = _dim_sizes(local.shape[dim], mesh.size(mesh_dim))
    return reduce_scatter_uneven(local, sizes, (mesh, mesh_dim), dim, op=_reduce_op(partial))


# ------------------------------------------------------------------ norms
def _norm_problem(cls: type) -> str | None:
    p = cls(3.0)
    if not (p.is_partial() and p.norm_type == 3.0):
        return "_NormPartial(norm_type) changed (is_partial/norm_type)"
    return None


_NormPartial = _INTERNALS.pick(
    "torch.distributed.tensor._ops._math_ops._NormPartial",
    _norm_problem,
    instead="p-norms of plugin-sharded tensors run on their fallback placement",
)


def norm_partial(norm_type: float) -> Partial | None:
    """The pending-reduction placement of a p-norm computed on shards (torch private).

    Returns ``None`` when torch has none: the caller then takes its general path.
    """
    return None if _NormPartial is None else _NormPartial(norm_type)


# ------------------------------------------------------------------ process groups
def _default_group_fn() -> Callable[[], dist.ProcessGroup] | None:
    fn = getattr(dist.distributed_c10d, "_get_default_group", None)
    return fn if callable(fn) else None


_GET_DEFAULT_GROUP = _default_group_fn()
_INTERNALS.probe(
    "torch.distributed.distributed_c10d._get_default_group",
    lambda: None if _GET_DEFAULT_GROUP is not None else "is missing",
    instead="dist.group.WORLD",
)


def default_group() -> dist.ProcessGroup:
    """The default process group (``dist.group.WORLD``)."""
    if _GET_DEFAULT_GROUP is not None:
        return _GET_DEFAULT_GROUP()
    return dist.group.WORLD  # type: ignore[return-value]


_SET_PG_TIMEOUT = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
_PG_TIMEOUT_OK = _INTERNALS.probe(
    "torch.distributed.distributed_c10d._set_pg_timeout",
    lambda: _params_missing(_SET_PG_TIMEOUT, ["timeout"]),
    instead="collectives keep the process group's own timeout",
)


def set_pg_timeout(timeout: Any, group: dist.ProcessGroup | None = None) -> bool:
    """Change a process group's collective timeout; ``False`` when torch cannot."""
    if not _PG_TIMEOUT_OK:
        return False
    _SET_PG_TIMEOUT(timeout, group)
    return True


def _world_problem() -> str | None:
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None:
        return "is missing"
    if not (hasattr(world, "pg_map") and hasattr(world, "default_pg")):
        return "has no pg_map/default_pg"
    return None


_WORLD_OK = _INTERNALS.probe(
    "torch.distributed.distributed_c10d._world",
    _world_problem,
    instead="the test pool cannot destroy the process groups a test created",
)


def destroy_subgroups() -> int:
    """Destroy every process group but the default one (local, no communication).

    Returns:
        How many groups were destroyed.
    """
    if not _WORLD_OK:
        return 0
    world = dist.distributed_c10d._world
    default = world.default_pg
    n = 0
    for pg in list(world.pg_map.keys()):
        if pg is not default:
            try:
                dist.destroy_process_group(pg)
                n += 1
            except Exception:  # noqa: BLE001, S110 - a group already gone is fine
                pass
    return n


def _dtensor_cache_clearers() -> list[Callable[[], None]]:
    out: list[Callable[[], None]] = []
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        out.append(_clear_sharding_prop_cache)
    except ImportError:
        pass
    try:
        import torch.distributed.tensor._redistribute as tr

        for name in ("clear_redistribute_planner_cache",):
            if callable(getattr(tr, name, None)):
                out.append(getattr(tr, name))
        gen = getattr(tr, "_gen_transform_infos", None)
        if callable(getattr(gen, "cache_clear", None)):
            out.append(gen.cache_clear)
    except ImportError:
        pass
    return out


_CACHE_CLEARERS = _dtensor_cache_clearers()
_INTERNALS.probe(
    "torch.distributed.tensor.debug._clear_sharding_prop_cache",
    lambda: None if _CACHE_CLEARERS else "is missing",
    instead="DTensor's sharding caches are not cleared between tests",
)


def clear_dtensor_caches() -> None:
    """Forget DTensor's sharding-propagation and redistribution caches (and its RNG tracker).

    Caches remember meshes; after their process groups are destroyed (between
    multi-rank tests) they must not be reused.
    """
    for fn in _CACHE_CLEARERS:
        fn()
    _PLANS_BY_TASK.clear()
    import sys

    rnd = sys.modules.get("torch.distributed.tensor._random")
    if rnd is not None and hasattr(rnd, "_rng_tracker"):
        rnd._rng_tracker = None


_MESH_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_layout(spec: Any) -> tuple:
    """What a redistribution plan depends on, without the mesh object (and its groups)."""
    mesh = spec.device_mesh
    layout = _MESH_LAYOUTS.get(mesh)
    if layout is None:
        coord = mesh.get_coordinate()
        layout = _MESH_LAYOUTS[mesh] = (
            mesh.device_type,
            tuple(mesh.mesh.shape),
            tuple(mesh.mesh.flatten().tolist()),
            mesh.mesh_dim_names,
            None if coord is None else tuple(coord),
        )
    meta = spec.tensor_meta
    return (
        layout,
        spec.placements,
        getattr(spec, "shard_order", None),
        None if meta is None else (tuple(meta.shape), tuple(meta.stride), meta.dtype),
    )


def _probe_transform_infos() -> str | None:
    import torch.distributed.tensor._redistribute as tr

    if not callable(getattr(tr, "_gen_transform_infos_non_cached", None)):
        return "torch.distributed.tensor._redistribute._gen_transform_infos_non_cached is missing"
    if not callable(getattr(tr, "_gen_transform_infos", None)):
        return "torch.distributed.tensor._redistribute._gen_transform_infos is missing"
    return _params_missing(tr._gen_transform_infos_non_cached, ["src_spec", "dst_spec"])


_TRANSFORM_INFOS_OK = _INTERNALS.probe(
    "torch.distributed.tensor._redistribute._gen_transform_infos",
    _probe_transform_infos,
    instead="the test pool plans every redistribution again after each task",
)
_PLANS_BY_TASK: dict = {}


def keep_redistribution_plans_across_meshes() -> bool:
    """Test-pool helper: remember torch's redistribution plans by mesh layout.

    torch caches a plan (the steps from one placement list to another) by its specs,
    which hold the mesh: the pool must forget those between tasks, whose meshes it
    destroys, and a later task on a mesh of the same shape then searches the same plans
    again (up to a tenth of a second each on a 2-D mesh with a ``_StridedShard``).
    Installed in the pool's workers, this keeps each plan under the mesh's layout
    (shape, ranks, this rank's coordinate), which holds no mesh, in a cache that lives
    as long as the worker; the per-spec cache is cleared with DTensor's other caches.

    Returns:
        Whether it was installed (torch's planner found where expected).
    """
    if not _TRANSFORM_INFOS_OK:
        return False
    import torch.distributed.tensor._redistribute as tr

    if getattr(tr._gen_transform_infos, "_vescale_by_layout", False):
        return True
    compute = tr._gen_transform_infos_non_cached
    by_layout: dict = {}

    def plans(src_spec: Any, dst_spec: Any, use_graph_based_transform: bool | None = None):
        key = (src_spec, dst_spec, use_graph_based_transform)
        found = _PLANS_BY_TASK.get(key)
        if found is None:
            layout = (_mesh_layout(src_spec), _mesh_layout(dst_spec), use_graph_based_transform)
            found = by_layout.get(layout)
            if found is None:
                found = by_layout[layout] = compute(src_spec, dst_spec, use_graph_based_transform)
            _PLANS_BY_TASK[key] = found
        return found

    def cache_clear() -> None:
        # torch's own idiom for a changed plan choice (``_gen_transform_infos.cache_clear()``)
        # forgets every plan, those kept by layout included
        _PLANS_BY_TASK.clear()
        by_layout.clear()

    plans.cache_clear = cache_clear  # type: ignore[attr-defined]
    plans._vescale_by_layout = True  # type: ignore[attr-defined]
    tr._gen_transform_infos = plans
    return True


_RESOLVE_GROUP = getattr(dist.distributed_c10d, "_resolve_process_group", None)
_RESOLVE_OK = _INTERNALS.probe(
    "torch.distributed.distributed_c10d._resolve_process_group",
    lambda: _params_missing(_RESOLVE_GROUP, ["group_name"]),
    instead="CommDebugMode files bytes of named groups under no group",
)


def resolve_group_name(name: str) -> dist.ProcessGroup | None:
    """The process group registered under ``name`` (``None`` if torch cannot say)."""
    return _RESOLVE_GROUP(name) if _RESOLVE_OK else None


# ------------------------------------------------------------------ CommDebugMode
#: torch's map from native collective ops to the functional ones CommDebugMode counts.
COMM_OP_ALIASES = _INTERNALS.pick(
    "torch.distributed.tensor.debug._comm_mode.NATIVE_TO_PY_MAPPING",
    lambda m: None if isinstance(m, dict) else "is no longer a dict",
    stand_in={},
    instead="collectives are counted under their native op names",
)


# ------------------------------------------------------------------ subclass dispatch
def _subclass_dispatch_honored() -> bool | None:
    """Whether torch runs a DTensor subclass's own ``__torch_dispatch__`` (None: unknown).

    Where torch dispatches every DTensor, subclasses included, on its C++ fast path, its
    Python ``DTensor.__torch_dispatch__`` is a stub that raises ``NotImplementedError``;
    where it honours subclasses, it unwraps them and runs the op.
    """
    try:
        DTensor.__torch_dispatch__(torch.ops.aten.alias.default, (DTensor,), (torch.zeros(1),), {})
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001
        return None
    return True


def _leaves(obj: Any) -> list:
    if isinstance(obj, (list, tuple)):
        return [leaf for o in obj for leaf in _leaves(o)]
    if isinstance(obj, dict):
        return [leaf for o in obj.values() for leaf in _leaves(o)]
    return [obj]


def route_subclass_dispatch(cls: type[DTensor]) -> None:
    """Make ops on ``cls`` instances run ``cls.__torch_dispatch__`` on every torch.

    Where torch's C++ fast path takes DTensor subclasses too, it asks the Python
    ``OpDispatcher._propagate_op_sharding_dispatch_slow_path`` for every new op schema;
    an op result returned from there (as torch does for decomposed ops) is used as is
    and never cached, so routing ``cls``'s ops from there to ``cls.__torch_dispatch__``
    gives them the subclass's own dispatch, forward and backward.
    """
    name = "DTensor subclass __torch_dispatch__ (plugin-placement DTensors)"
    honored = _subclass_dispatch_honored()
    if honored:
        _INTERNALS.native(name)
        return
    disp = getattr(DTensor, "_op_dispatcher", None)
    orig = getattr(disp, "_propagate_op_sharding_dispatch_slow_path", None)
    if not callable(orig):
        _INTERNALS.missing(
            name,
            "torch ignores the subclass's __torch_dispatch__ and has no "
            "OpDispatcher._propagate_op_sharding_dispatch_slow_path to route from",
            "ops on plugin placements fail in torch's sharding propagation",
        )
        return
    if getattr(orig, "_vescale_routes", None) is cls:
        return

    def slow_path(op_call, args, kwargs, *rest, **kw):
        if any(isinstance(a, cls) for a in _leaves((args, kwargs))):
            return cls.__torch_dispatch__(op_call, (cls,), args, kwargs)
        return orig(op_call, args, kwargs, *rest, **kw)

    slow_path._vescale_routes = cls  # type: ignore[attr-defined]
    slow_path.__wrapped__ = orig  # type: ignore[attr-defined]
    disp._propagate_op_sharding_dispatch_slow_path = slow_path
    _INTERNALS.native(name, "routed from OpDispatcher._propagate_op_sharding_dispatch_slow_path")


# ------------------------------------------------------------------ foreach kernels
def _foreach_type_lists() -> list[list]:
    import torch.optim.optimizer as _optim
    import torch.utils._foreach_utils as _fe

    return [_optim._foreach_supported_types, _fe._foreach_supported_types]


def _foreach_problem() -> str | None:
    lists = _foreach_type_lists()
    if not all(isinstance(lst, list) and DTensor in lst for lst in lists):
        return "no longer a list naming DTensor"
    return None


_FOREACH_OK = _INTERNALS.probe(
    "torch.optim.optimizer._foreach_supported_types",
    _foreach_problem,
    instead="optimizers run per-tensor loops on plugin-placement DTensors",
)


def register_foreach_type(cls: type) -> None:
    """Let torch's optimizers and grad clipping pick foreach/fused kernels for ``cls``.

    torch checks ``type(p) in _foreach_supported_types`` (exact type), and registers
    only ``DTensor`` itself; a DTensor subclass must be added the same way, or torch
    silently falls back to its per-tensor loops on devices with foreach kernels.
    """
    if not _FOREACH_OK:
        return
    for lst in _foreach_type_lists():
        if cls not in lst:
            lst.append(cls)


# ------------------------------------------------------------------ fused projections
# A fused projection (QKV, gate+up) is column-parallel as ``_StridedShard(d, k)``: each
# rank holds the same slice of every one of the ``k`` fused parts. torch propagates
# that layout through linear layers and views but gathers it for ``split``/``chunk``
# into the parts, and ``cat`` (the backward of ``split``) of ``Shard(d)`` parts gathers
# too. Two extra zero-communication strategies fix both:
#   split/chunk of ``_StridedShard(d, k)`` into ``k`` equal parts  -> each ``Shard(d)``
#   cat of ``k`` equal ``Shard(d)`` parts along ``d``              -> ``_StridedShard(d, k)``
# (rank r's local tensor is ``[part_0 slice r, ..., part_k-1 slice r]`` in both).
# torch keeps its split/cat rules either as whole-mesh strategy functions
# (``op_strategy_funcs``) or as single-mesh-dim rules (``op_single_dim_strategy_funcs``);
# the local split size is rewritten by ``op_to_scalar_shape_adjuster`` or, where torch has
# no such table, by a wrapper around the propagator's (cached) propagation function.
_STRIDED_RULES_INSTALLED = False


def _split_ops() -> tuple:
    aten = torch.ops.aten
    return (aten.split.Tensor, aten.split_with_sizes.default)


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def _strided_parts(spec, dim: int, k: int, part_len: int) -> int | None:
    """The one mesh dim where ``spec`` is ``_StridedShard(dim, k)`` (evenly), else None."""
    found = None
    for i, p in enumerate(spec.placements):
        if isinstance(p, StridedShard):
            if p.dim != dim:
                continue
            if p.split_factor != k or found is not None:
                return None
            found = i
        elif isinstance(p, Shard) and p.dim == dim:
            return None
    if found is None or part_len % spec.mesh.size(found):
        return None
    return found


def _split_sizes(size: int, arg) -> list[int]:
    if isinstance(arg, int):
        return [arg] * (size // arg) + ([size % arg] if size % arg else [])
    return [int(a) for a in arg]


def _split_args(args: Sequence, ndim: int, size_of: Callable[[int], int]) -> tuple[int, list[int]]:
    dim = args[2] if len(args) > 2 else 0
    dim = dim % ndim if ndim else 0
    return dim, _split_sizes(size_of(dim), args[1])


def _wrap_split(orig):
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    def gather_strided(out, inp, dim: int):
        """torch rules that keep ``_StridedShard`` on the split dim are wrong (the parts
        are not strided): gather that mesh dim instead, as torch does for ``Shard``."""
        fixed = []
        for st in out.strategies:
            spec = st.input_specs[0]
            if not any(isinstance(p, StridedShard) and p.dim == dim for p in spec.placements):
                fixed.append(st)
                continue
            placements = tuple(
                Replicate() if isinstance(p, StridedShard) and p.dim == dim else p
                for p in spec.placements
            )
            in_spec = DTensorSpec(spec.mesh, placements, spec.tensor_meta)
            n_out = len(st.output_specs) if isinstance(st.output_specs, tuple) else 1
            fixed.append(
                OpSpec(
                    output_specs=tuple(DTensorSpec(spec.mesh, placements) for _ in range(n_out)),
                    input_specs=(in_spec,),
                    redistribute_cost=[generate_redistribute_costs(inp, in_spec)],
                )
            )
        return OpStrategy(fixed)

    def strategy(op_schema):
        out = orig(op_schema)
        inp = op_schema.args_schema[0]
        if not isinstance(inp, OpStrategy) or len(op_schema.args_schema) < 2:
            return out
        dim, sizes = _split_args(op_schema.args_schema, inp.ndim, lambda d: inp.shape[d])
        out = gather_strided(out, inp, dim)
        if len(sizes) < 2 or len(set(sizes)) != 1:
            return out
        extra = []
        for st in inp.strategies:
            spec = st.output_spec
            i = _strided_parts(spec, dim, len(sizes), sizes[0])
            if i is None:
                continue
            placements = list(spec.placements)
            placements[i] = Shard(dim)
            outs = tuple(DTensorSpec(spec.mesh, tuple(placements)) for _ in sizes)
            in_spec = DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta)
            extra.append(
                OpSpec(
                    output_specs=outs,
                    input_specs=(in_spec,),
                    redistribute_cost=[generate_redistribute_costs(inp, in_spec)],
                )
            )
        return OpStrategy(extra + list(out.strategies)) if extra else out

    strategy.__wrapped__ = orig  # type: ignore[attr-defined]
    return strategy


def _wrap_cat(orig):
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy, TupleStrategy
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs

    def legacy_empty(op_schema, children, specs):
        """``cat`` skips 1-D empty tensors (e.g. an empty KV cache being appended to):
        keep them replicated and the others as they are, instead of redistributing an
        empty tensor to a placement it has no dims for."""
        empties = {i for i, sp in enumerate(specs) if tuple(sp.shape) == (0,)}
        rest = [sp for i, sp in enumerate(specs) if i not in empties]
        ref = rest[0]
        ndim = len(ref.shape)
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dim = dim % ndim if ndim else 0
        if any(sp.placements != ref.placements for sp in rest) or any(
            isinstance(p, (Shard, StridedShard)) and p.dim % max(ndim, 1) == dim
            for p in ref.placements
        ):
            return None
        replicate = (Replicate(),) * ref.mesh.ndim
        in_specs = tuple(
            DTensorSpec(sp.mesh, replicate if i in empties else sp.placements, sp.tensor_meta)
            for i, sp in enumerate(specs)
        )
        return OpStrategy(
            [
                OpSpec(
                    output_specs=DTensorSpec(ref.mesh, ref.placements),
                    input_specs=in_specs,
                    redistribute_cost=[
                        generate_redistribute_costs(c, sp) for c, sp in zip(children, in_specs)
                    ],
                )
            ]
        )

    def strategy(op_schema):
        tup = op_schema.args_schema[0]
        if isinstance(tup, TupleStrategy) and all(
            isinstance(c, OpStrategy) and len(c.strategies) == 1 for c in tup.children
        ):
            specs = [c.strategies[0].output_spec for c in tup.children]
            n_empty = sum(tuple(sp.shape) == (0,) for sp in specs)
            if 0 < n_empty < len(specs):
                legacy = legacy_empty(op_schema, tup.children, specs)
                if legacy is not None:
                    return legacy
        out = orig(op_schema)
        if not isinstance(tup, TupleStrategy) or len(tup.children) < 2:
            return out
        children = tup.children
        if not all(isinstance(c, OpStrategy) and len(c.strategies) == 1 for c in children):
            return out
        specs = [c.strategies[0].output_spec for c in children]
        first = specs[0]
        ndim = len(first.shape)
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dim = dim % ndim if ndim else 0
        if any(s.placements != first.placements or s.shape != first.shape for s in specs):
            return out
        shard_dims = [
            i
            for i, p in enumerate(first.placements)
            if isinstance(p, Shard) and not isinstance(p, StridedShard) and p.dim == dim
        ]
        strided = [p for p in first.placements if isinstance(p, StridedShard) and p.dim == dim]
        if len(shard_dims) != 1 or strided or first.shape[dim] % first.mesh.size(shard_dims[0]):
            return out
        placements = list(first.placements)
        placements[shard_dims[0]] = StridedShard(dim, split_factor=len(specs))
        in_specs = tuple(DTensorSpec(s.mesh, s.placements, s.tensor_meta) for s in specs)
        extra = OpSpec(
            output_specs=DTensorSpec(first.mesh, tuple(placements)),
            input_specs=in_specs,
            redistribute_cost=[
                generate_redistribute_costs(c, sp) for c, sp in zip(children, in_specs)
            ],
        )
        return OpStrategy([extra, *out.strategies])

    strategy.__wrapped__ = orig  # type: ignore[attr-defined]
    return strategy


def _shards_dim(placements: Sequence, dim: int, skip: int) -> bool:
    """Whether a mesh dim other than ``skip`` shards tensor dim ``dim``."""
    return any(
        i != skip and isinstance(p, (Shard, StridedShard)) and p.dim == dim
        for i, p in enumerate(placements)
    )


def _single_dim_split(orig):
    """Add ``_StridedShard(d, k) -> k x Shard(d)`` to torch's single-mesh-dim split rules."""

    def rules(op, args_schema, kwargs_schema):
        out = list(orig(op, args_schema, kwargs_schema))
        meta = args_schema[0]
        if len(args_schema) < 2 or not hasattr(meta, "shape"):
            return out
        dim, sizes = _split_args(args_schema, len(meta.shape), lambda d: int(meta.shape[d]))
        if len(sizes) >= 2 and len(set(sizes)) == 1:
            k = len(sizes)
            out.append([Shard(dim)] * k + [StridedShard(dim, split_factor=k)])
        return out

    def keep(mesh, op_schema, input_specs, output_specs) -> bool:
        """Only even parts, and ``dim`` sharded by no other mesh dim."""
        spec = input_specs[0]
        if spec.tensor_meta is None:
            return True
        dim, sizes = _split_args(
            op_schema.args_schema, len(spec.shape), lambda d: int(spec.shape[d])
        )
        for i, p in enumerate(spec.placements):
            if isinstance(p, StridedShard) and p.dim == dim:
                outs = output_specs if isinstance(output_specs, tuple) else (output_specs,)
                if all(o is not None and o.placements[i] == Shard(dim) for o in outs) and (
                    sizes[0] % mesh.size(i) or _shards_dim(spec.placements, dim, i)
                ):
                    return False
        return True

    return rules, keep


def _single_dim_cat(orig):
    """Add ``k x Shard(d) -> _StridedShard(d, k)`` (equal parts) to torch's single-dim cat rules."""

    def rules(op, args_schema, kwargs_schema):
        out = list(orig(op, args_schema, kwargs_schema))
        metas = args_schema[0]
        if not isinstance(metas, (list, tuple)) or len(metas) < 2:
            return out
        shapes = {tuple(int(s) for s in m.shape) for m in metas}
        if len(shapes) != 1 or not (shape := next(iter(shapes))) or shape == (0,):
            return out
        ndim = len(shape)
        dim = args_schema[1] if len(args_schema) > 1 else 0
        dim = dim % ndim
        out.append([StridedShard(dim, split_factor=len(metas))] + [Shard(dim)] * len(metas))
        return out

    def keep(mesh, op_schema, input_specs, output_specs) -> bool:
        """Only parts divisible by the mesh dim, and ``dim`` sharded by no other mesh dim."""
        out = output_specs[0] if isinstance(output_specs, tuple) else output_specs
        if out is None or not input_specs or input_specs[0].tensor_meta is None:
            return True
        spec = input_specs[0]
        for i, p in enumerate(out.placements):
            if isinstance(p, StridedShard) and spec.placements[i] == Shard(p.dim):
                if spec.shape[p.dim] % mesh.size(i) or _shards_dim(spec.placements, p.dim, i):
                    return False
        return True

    return rules, keep


def _with_filter(old, new):
    if old is None:
        return new
    return lambda *a: old(*a) and new(*a)


def _install_single_dim(prop, op, make) -> None:
    info = prop.op_single_dim_strategy_funcs[op]
    rules, keep = make(info.func)
    prop.op_single_dim_strategy_funcs[op] = dataclasses.replace(
        info,
        func=rules,
        full_mesh_strategy_filter=_with_filter(info.full_mesh_strategy_filter, keep),
    )


def _adjust_split_sizes(input_specs, schema):
    """Local split sizes for a split of ``_StridedShard(dim, k)`` into ``k`` parts."""
    from torch.distributed.tensor._op_schema import OpSchema

    spec = input_specs[0]
    args = list(schema.args_schema)
    if len(args) < 2 or spec.tensor_meta is None:
        return schema
    dim, sizes = _split_args(args, len(spec.shape), lambda d: spec.shape[d])
    if len(sizes) < 2 or len(set(sizes)) != 1:
        return schema
    i = _strided_parts(spec, dim, len(sizes), sizes[0])
    if i is None:
        return schema
    m = spec.mesh.size(i)
    args[1] = args[1] // m if isinstance(args[1], int) else [int(a) // m for a in args[1]]
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def _split_size_fix(op_schema, out) -> None:
    """Rewrite the split size after torch's propagation chose the strided rule."""
    if not isinstance(out.output_spec, tuple):
        return
    schema = out.redistribute_schema or op_schema
    spec = schema.args_schema[0]
    if not isinstance(spec, DTensorSpec) or len(schema.args_schema) < 2:
        return
    dim, sizes = _split_args(schema.args_schema, len(spec.shape), lambda d: spec.shape[d])
    i = _strided_parts(spec, dim, len(sizes), sizes[0]) if len(set(sizes)) == 1 else None
    if i is None or any(o is None or o.placements[i] != Shard(dim) for o in out.output_spec):
        return
    out.redistribute_schema = _adjust_split_sizes([spec], schema)
    out.needs_redistribute = True
    out.use_val_from_redistribute_schema = True


def _wrap_propagation(prop) -> None:
    """Rewrite split sizes after torch's propagation (torch without a scalar-arg adjuster).

    The propagator's cached and uncached entry points are replaced by one wrapper
    (the cached one: a fresh cache of torch's own class around the wrapper).
    """
    split_ops = set(_split_ops())
    orig = prop.propagate_op_sharding_non_cached

    def propagate(op_schema):
        out = orig(op_schema)
        if op_schema.op in split_ops:
            _split_size_fix(op_schema, out)
        return out

    propagate.__wrapped__ = orig  # type: ignore[attr-defined]
    prop.propagate_op_sharding_non_cached = propagate
    prop.propagate_op_sharding = type(prop.propagate_op_sharding)(propagate)


def _install_undecodable_strided_fallback() -> None:
    """Redistribute a ``_StridedShard`` that encodes no shard order with the greedy planner.

    torch reads every ``_StridedShard`` as an encoded shard order by default; a fused
    projection's ``_StridedShard(d, k)`` on a 1-D mesh is none, and torch's graph-based
    planner then raises. Newer torch catches that (``_StridedShardNotDecodableError``)
    and plans greedily; this does the same where torch does not.
    """
    name = "DTensor redistribute of a _StridedShard that encodes no shard order"
    import torch.distributed.tensor._redistribute as tr

    if isinstance(getattr(tr, "_StridedShardNotDecodableError", None), type):
        _INTERNALS.native(name)
        return
    orig = getattr(tr, "_gen_transform_infos_non_cached", None)
    planner = getattr(tr, "get_redistribute_planner", None)
    if not (callable(orig) and callable(planner)):
        _INTERNALS.missing(
            name,
            "no _gen_transform_infos_non_cached/get_redistribute_planner to wrap",
            "redistributing such a tensor raises torch's ValueError",
        )
        return

    def gen(src_spec, dst_spec, *args, **kwargs):
        try:
            return orig(src_spec, dst_spec, *args, **kwargs)
        except ValueError as exc:
            if "unable to be interpreted into a corresponding shard_order" not in str(exc):
                raise
            drp = planner(src_spec.device_mesh, src_spec.tensor_meta)
            return drp.generate_greedy_transform_infos(src_spec, dst_spec)

    gen.__wrapped__ = orig  # type: ignore[attr-defined]
    tr._gen_transform_infos_non_cached = gen
    _INTERNALS.native(
        name, "torch.distributed.tensor._redistribute._gen_transform_infos_non_cached wrapped"
    )


def _strided_rule_plan(prop) -> tuple[str | None, str | None, str | None]:
    """(where the split/cat rules live, how split sizes are adjusted, problem)."""
    aten = torch.ops.aten
    ops = (*_split_ops(), aten.cat.default)
    if not _STRIDED_OK or DTensorSpec is None:
        return None, None, "_StridedShard or DTensorSpec is unavailable"
    tables = {
        "op_strategy_funcs": getattr(prop, "op_strategy_funcs", None),
        "op_single_dim_strategy_funcs": getattr(prop, "op_single_dim_strategy_funcs", None),
    }
    where = None
    for name, table in tables.items():
        if isinstance(table, dict) and all(op in table for op in ops):
            where = name
            break
    if where is None:
        return (
            None,
            None,
            "no split/cat strategy in op_strategy_funcs or op_single_dim_strategy_funcs",
        )
    if where == "op_single_dim_strategy_funcs":
        info = tables[where][aten.split.Tensor]
        fields = getattr(info, "__dataclass_fields__", {})
        if not {"func", "full_mesh_strategy_filter"} <= set(fields):
            return None, None, "single-dim strategy info has no func/full_mesh_strategy_filter"
    adjusters = getattr(prop, "op_to_scalar_shape_adjuster", None)
    if isinstance(adjusters, dict):
        if any(op in adjusters for op in _split_ops()):
            return None, None, "torch now adjusts split sizes itself"
        return where, "op_to_scalar_shape_adjuster", None
    cache = getattr(prop, "propagate_op_sharding", None)
    if callable(getattr(prop, "propagate_op_sharding_non_cached", None)) and callable(
        getattr(cache, "cache_clear", None)
    ):
        return where, "propagate_op_sharding", None
    return None, None, "no way to rewrite the local split size"


def install_strided_split_rules() -> None:
    """Add the two fused-projection strategies to torch's DTensor propagator (once).

    Never raises: where torch's propagator does not look as expected, nothing is
    installed and torch's own rules (an all-gather) stay in place.
    """
    global _STRIDED_RULES_INSTALLED
    if _STRIDED_RULES_INSTALLED:
        return
    _STRIDED_RULES_INSTALLED = True
    try:
        _install_undecodable_strided_fallback()
    except Exception as exc:  # noqa: BLE001
        _INTERNALS.missing(
            "DTensor redistribute of a _StridedShard that encodes no shard order",
            f"wrapping failed: {exc!r}",
            "redistributing such a tensor raises torch's ValueError",
        )
    name = "ShardingPropagator split/cat strategies (fused projections)"
    instead = "torch's own rules: split/cat of fused parts all-gather"
    try:
        prop = _propagator()
        where, adjust, problem = _strided_rule_plan(prop)
        if problem is not None:
            _INTERNALS.fallback(name, problem, instead)
            return
        aten = torch.ops.aten
        if where == "op_strategy_funcs":
            funcs = prop.op_strategy_funcs
            for op in _split_ops():
                funcs[op] = _wrap_split(funcs[op])
            funcs[aten.cat.default] = _wrap_cat(funcs[aten.cat.default])
        else:
            for op in _split_ops():
                _install_single_dim(prop, op, _single_dim_split)
            _install_single_dim(prop, aten.cat.default, _single_dim_cat)
        if adjust == "op_to_scalar_shape_adjuster":
            for op in _split_ops():
                prop.op_to_scalar_shape_adjuster[op] = _adjust_split_sizes
        if adjust == "propagate_op_sharding":
            _wrap_propagation(prop)
        prop.propagate_op_sharding.cache_clear()
        _INTERNALS.native(name, f"{where} + {adjust}")
    except Exception as exc:  # noqa: BLE001 - never break import over an optimisation
        _INTERNALS.fallback(name, f"installing failed: {exc!r}", instead)


# ------------------------------------------------------------------ flattening views
# A batched matmul of 4-D DTensors (``q @ k.transpose(-2, -1)`` with the heads sharded)
# flattens ``(batch, heads)`` with ``_unsafe_view``. Newer torch expresses that as a
# ``_StridedShard``; torch whose strict view rule refuses it raises. ``_unsafe_view`` only
# ever views a temporary (nothing aliases it), so its non-strict reshape rule is correct
# there: it gathers the sharded dim first (slower, one all-gather).
def _strict_flatten_problem() -> str | None:
    from torch.distributed.tensor._ops import _view_ops as vo

    rule = vo.view_groups([2, 4, 8, 8], [8, 8, 8])
    try:
        vo.propagate_shape_and_sharding((Shard(1),), (2, 4, 8, 8), rule, (2,), True)
    except RuntimeError as exc:
        return f"torch's strict view rule refuses it ({str(exc.args[0]).strip()})"
    return None


def install_unsafe_view_rule() -> None:
    """Let ``_unsafe_view`` flatten a sharded inner dim where torch's view rule refuses (once)."""
    name = "DTensor _unsafe_view flattening a sharded inner dim (4-D matmuls)"
    aten = torch.ops.aten
    try:
        problem = _strict_flatten_problem()
    except Exception:  # noqa: BLE001 - torch's view rules look different: nothing to adapt
        problem = None
    if problem is None:
        _INTERNALS.native(name)
        _INTERNALS.native("DTensor view flattening a sharded inner dim (sequence-parallel logits)")
        return
    prop = _propagator()
    funcs = getattr(prop, "op_strategy_funcs", {})
    if aten.reshape.default not in funcs or aten._unsafe_view.default not in funcs:
        _INTERNALS.missing(name, problem, "such matmuls raise torch's error")
        return
    if funcs[aten._unsafe_view.default] is not funcs[aten.reshape.default]:
        funcs[aten._unsafe_view.default] = funcs[aten.reshape.default]
        prop.propagate_op_sharding.cache_clear()
    _INTERNALS.fallback(name, problem, "its reshape rule (one all-gather of that dim)")
    # ``x.view(-1, vocab)`` of sequence-sharded logits, or a head reshape of head-sharded
    # activations, flattens a sharded inner dim with ``view`` itself. Where torch refuses
    # that, the reshape rule gathers the dim: the values are right, but the result is a
    # copy, not an alias of ``x`` (an in-place change of one is not seen in the other).
    view_name = "DTensor view flattening a sharded inner dim (sequence-parallel logits)"
    if aten.view.default not in funcs:
        _INTERNALS.missing(view_name, problem, "such views raise torch's error")
        return
    if funcs[aten.view.default] is not funcs[aten.reshape.default]:
        funcs[aten.view.default] = funcs[aten.reshape.default]
        prop.propagate_op_sharding.cache_clear()
    _INTERNALS.fallback(
        view_name, problem, "its reshape rule (one all-gather of that dim; a copy, not a view)"
    )


# ------------------------------------------------------------------ torch.compile
# dynamo turns a ``DeviceMesh`` into a constant only if its type is exactly torch's on
# some releases (2.11: ``istype`` in ``DeviceMeshVariable.is_device_mesh``); a vescale
# ``DeviceMesh`` (a subclass adding nothing dynamo needs) then fails tracing with
# "UserDefinedObjectVariable(DeviceMesh) is not a constant". Widened to subclasses.
DYNAMO_MESH = "torch._dynamo DeviceMeshVariable.is_device_mesh (DeviceMesh subclasses)"


def install_dynamo_mesh_rule(mesh_cls: type) -> None:
    """Let dynamo trace a ``mesh_cls`` (a torch ``DeviceMesh`` subclass) like torch's own."""
    effect = "torch.compile of a model on a vescale DeviceMesh fails while tracing"
    try:
        import torch._dynamo.variables.distributed as dyn
    except Exception as exc:  # noqa: BLE001 - no dynamo: nothing to adapt
        _INTERNALS.missing(DYNAMO_MESH, f"cannot be imported: {exc!r}", effect)
        return
    DeviceMeshVariable = getattr(dyn, "DeviceMeshVariable", None)
    orig = getattr(DeviceMeshVariable, "is_device_mesh", None)
    if not callable(orig):
        # newer dynamo traces meshes as opaque objects, subclasses included
        _INTERNALS.native(DYNAMO_MESH, "dynamo has no exact-type DeviceMesh check")
        return
    try:
        accepted = bool(orig(object.__new__(mesh_cls)))
    except Exception as exc:  # noqa: BLE001
        _INTERNALS.missing(DYNAMO_MESH, f"probing failed: {exc!r}", effect)
        return
    if accepted:
        _INTERNALS.native(DYNAMO_MESH)
        return

    def is_device_mesh(value: object) -> bool:
        return isinstance(value, mesh_cls) or orig(value)

    DeviceMeshVariable.is_device_mesh = staticmethod(is_device_mesh)
    _INTERNALS.native(DYNAMO_MESH, "widened from torch's exact type to vescale's subclass")


# ------------------------------------------------------------------ CPU attention
# torch has DTensor strategies for the CUDA flash/efficient/cuDNN attention ops but
# none for the CPU flash kernel that ``F.scaled_dot_product_attention`` picks on CPU.
# The same rules as torch's CUDA flash op: all replicated, heads sharded (dim 1,
# tensor parallelism) or batch sharded (dim 0), for query/key/value, the output and
# the logsumexp alike; forward and backward. Masks are not covered (no rule then).
# Registered through torch's public (experimental) ``register_sharding``.
_CPU_ATTENTION_INSTALLED = False


def _attention_rules(n_out: int, n_in: int):
    def rules(*args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            raise NotImplementedError(
                "vescale: no DTensor rule for CPU flash attention with an attn_mask; pass "
                "is_causal=True instead of a causal mask, or use eager attention"
            )
        return [([p] * n_out, [p] * n_in) for p in (Replicate(), Shard(1), Shard(0))]

    return rules


def _has_strategy(op) -> bool:
    prop = _propagator()
    return any(
        op in (getattr(prop, t, None) or {})
        for t in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    )


def install_cpu_attention_rules() -> None:
    """Register DTensor strategies for ``_scaled_dot_product_flash_attention_for_cpu``.

    Never raises; where it cannot register, sharded CPU attention raises torch's
    "no sharding strategy" error as before.
    """
    global _CPU_ATTENTION_INSTALLED
    if _CPU_ATTENTION_INSTALLED:
        return
    _CPU_ATTENTION_INSTALLED = True
    name = "DTensor rules for aten._scaled_dot_product_flash_attention_for_cpu"
    try:
        aten = torch.ops.aten
        fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        if _has_strategy(fwd):
            _INTERNALS.native(name, "torch's own")
            return
        from torch.distributed.tensor.experimental import register_sharding

        for op, n_out, n_in in ((fwd, 2, 3), (bwd, 3, 6)):
            register_sharding(op)(_attention_rules(n_out, n_in))
        _propagator().propagate_op_sharding.cache_clear()
        _INTERNALS.native(name, "torch.distributed.tensor.experimental.register_sharding")
    except Exception as exc:  # noqa: BLE001
        _INTERNALS.missing(
            name, f"registering failed: {exc!r}", "sharded CPU flash attention raises"
        )


# ------------------------------------------------------------------ full state dicts
# ``torch.distributed.checkpoint.state_dict.set_state_dict(..., full_state_dict=True)``
# cuts each full tensor for its DTensor inside torch's private
# ``torch.distributed._state_dict_utils``: with ``distribute_tensor`` (a name bound in that
# module at import) when every rank holds the full state dict, and with rectangular slices
# (``_distribute_tensors``) after ``broadcast_from_rank0``. Neither knows plugin placements
# (a ragged shard is no box of the tensor), so both are wrapped for them.
STATE_DICT_RULES = "torch.distributed._state_dict_utils (full state dicts into plugin placements)"
_STATE_DICT_RULES_INSTALLED = False


def _state_dict_utils_problem(sdu: Any) -> str | None:
    if not callable(getattr(sdu, "distribute_tensor", None)):
        return "has no distribute_tensor"
    return _params_missing(
        getattr(sdu, "_distribute_tensors", None), ["local_state_dict", "keys", "device", "pg"]
    )


def install_state_dict_rules(
    handles: Callable[[Sequence[Any]], bool],
    distribute: Callable[..., DTensor],
    fill_local: Callable[[str, DTensor, torch.Tensor], DTensor],
) -> None:
    """Let torch's full-state-dict loading place tensors into plugin-placed DTensors (once).

    DTensors whose placements ``handles`` accepts go to
    ``distribute(tensor, mesh, placements, src_data_rank=...)`` (every rank holds the
    full tensor) or ``fill_local(key, local_dtensor, full_tensor)`` (after torch's broadcast
    from rank 0); everything else takes torch's own path. Never raises: where the
    internals look different, nothing is wrapped and such loads raise torch's error.
    """
    global _STATE_DICT_RULES_INSTALLED
    if _STATE_DICT_RULES_INSTALLED:
        return
    _STATE_DICT_RULES_INSTALLED = True
    effect = (
        "set_state_dict(full_state_dict=True) into plugin-placed DTensors raises "
        "(sharded state dicts and torch.distributed.checkpoint.load still work)"
    )
    try:
        import torch.distributed._state_dict_utils as sdu
    except ImportError as exc:
        _INTERNALS.missing(STATE_DICT_RULES, f"cannot be imported: {exc}", effect)
        return
    if not _INTERNALS.probe(
        STATE_DICT_RULES, lambda: _state_dict_utils_problem(sdu), instead=effect, required=True
    ):
        return
    orig_distribute = sdu.distribute_tensor
    orig_tensors = sdu._distribute_tensors

    @functools.wraps(orig_distribute)
    def distribute_tensor(tensor, device_mesh=None, placements=None, **kwargs):
        if placements is not None and handles(placements):
            return distribute(tensor, device_mesh, placements, **kwargs)
        return orig_distribute(tensor, device_mesh, placements, **kwargs)

    @functools.wraps(orig_tensors)
    def _distribute_tensors(local_state_dict, keys, device, pg=None):
        rest = []
        for key in keys:
            value = local_state_dict.get(key)
            if (
                isinstance(value, tuple)
                and isinstance(value[0], DTensor)
                and handles(value[0].placements)
            ):
                local_state_dict[key] = fill_local(key, value[0], value[1])
            else:
                rest.append(key)
        return orig_tensors(local_state_dict, rest, device, pg)

    sdu.distribute_tensor = distribute_tensor
    sdu._distribute_tensors = _distribute_tensors


def check_torch_internals() -> dict[str, str]:
    """What vescale-dtensor found of the torch internals it relies on.

    Returns:
        ``{internal: status}``; a status is ``"native"`` (possibly ``"native: <how>"``),
        ``"fallback: <problem>; <slower path>"`` or ``"missing: <problem>; <what
        raises>"``. The rules installed by ``import vescale.dtensor`` are included.
    """
    return _INTERNALS.report()


def root_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh ``mesh`` was sliced from (``mesh`` itself for a root), or ``None``.

    ``None`` when this torch has no way to tell (the private ``_get_root_mesh``); callers
    then rebuild the joint mesh from ranks.
    """
    get = getattr(mesh, "_get_root_mesh", None)
    if not callable(get):
        return None
    try:
        root = get()
    except Exception:  # noqa: BLE001 (an internal that changed: fall back)
        return None
    return root if isinstance(root, DeviceMesh) else None


def seed_dtensor_rng(seed: int, mesh: DeviceMesh) -> bool:
    """Seed torch's DTensor random-number tracker on meshes it supports.

    Returns:
        ``True`` if torch's tracker was seeded, ``False`` if this mesh's device type has
        no tracker (random ops then use the device's default generator, seeded by
        ``torch.manual_seed``) or this torch lacks the private module.
    """
    try:
        from torch.distributed.tensor import _random
    except ImportError:
        return False
    supported = getattr(_random, "is_rng_supported_mesh", None)
    seed_fn = getattr(_random, "manual_seed", None)
    if not (callable(supported) and callable(seed_fn)) or not supported(mesh):
        return False
    seed_fn(seed, mesh)
    return True


# ------------------------------------------------------------------ random ops
RANDOM_OP_HANDLERS = "DTensor OpDispatcher._custom_op_handlers (random ops drawn as on one device)"
_RANDOM_HANDLERS_OK = _INTERNALS.probe(
    RANDOM_OP_HANDLERS,
    lambda: (
        None
        if isinstance(
            getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None), dict
        )
        else "is missing"
    ),
    instead="random ops on sharded DTensors draw torch's per-shard values, not the one-device ones",
)


def set_random_op_handler(ops: Sequence[Any], handler: Callable | None) -> bool:
    """Route torch's DTensor dispatch of ``ops`` to ``handler(op, args, kwargs)``.

    ``handler=None`` removes the routes (torch's own random-op path again).

    Returns:
        Whether this torch offers the hook (``False``: nothing changed).
    """
    if not _RANDOM_HANDLERS_OK:
        return False
    table = DTensor._op_dispatcher._custom_op_handlers
    for op in ops:
        if handler is None:
            if getattr(table.get(op), "_vescale_rng", False):
                del table[op]
        else:
            table[op] = handler
    return True


TorchDispatchMode = _INTERNALS.pick(
    "torch.utils._python_dispatch.TorchDispatchMode",
    lambda mode: None if callable(getattr(mode, "__enter__", None)) else "has no __enter__",
    instead="vescale.dtensor.random.data_parallel_rng raises NotImplementedError",
    required=True,
)
DISPATCH_MODE_OK = TorchDispatchMode is not None
