"""``parallelize_module`` / ``DModule``: shard an unmodified module by a plan."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from vescale.dmodule import _plan
from vescale.dmodule._auto_plan import resolve_tp_dim
from vescale.dmodule._compat import StridedShard as _StridedShard
from vescale.dmodule._grad_sync import PartialGradSync
from vescale.dmodule._hooks import (
    ImplicitReplicationHooks,
    make_input_hook,
    make_output_hook,
    make_tensor_hooks,
    refuse_compile_hook,
)
from vescale.dmodule._module_state import module_state
from vescale.dmodule._replica import ReplicaCompute, replica_dims
from vescale.dmodule._torch_styles import has_torch_styles, translate_torch_plan
from vescale.dtensor import distribute_tensor, get_plugin_manager, register_plugin

__all__ = ["DModule", "parallelize_module", "dump_plan", "is_dmodule"]

_OPTIONS = {
    "tp_dim": "tp",
    "sequence_parallel": False,
    "auto_plan": None,
    "grad_sync": True,
    "implicit_replication": True,
    "allow_uneven_shards": False,
    "src_data_rank": 0,
    "param_init_fn": None,
    "data_parallel": None,
    "activation_checkpointing": None,
    "factory": False,
    "unmatched_plan_keys": "error",
}
_DP_KINDS = ("ddp", "fsdp")


@dataclasses.dataclass
class _State:
    mesh: DeviceMesh
    plan: dict[str, dict[str, Any]]
    resolved: _plan.ResolvedPlan
    options: dict[str, Any]
    grad_sync: PartialGradSync
    handles: list = dataclasses.field(default_factory=list)
    implicit: ImplicitReplicationHooks | None = None
    checkpointed: list[str] = dataclasses.field(default_factory=list)
    # where the tensor-parallel computation runs: ``mesh``, or under data parallelism
    # ``mesh`` without the data-parallel dims
    compute_mesh: DeviceMesh | None = None
    # without data parallelism: the hooks presenting the parameters (on ``mesh``) on
    # ``compute_mesh``, ``mesh`` without its replica dims (see ``_replica``)
    replica: ReplicaCompute | None = None


class DModule:
    """A module parallelized in place by `parallelize_module`.

    ``DModule(model, device_mesh, sharding_plan=None, **options)`` is the same call as
    ``parallelize_module(...)``: it shards ``model``'s parameters **in place** and
    returns ``model`` itself. The object keeps its identity, its attributes and its
    class's code; its class is swapped for a cached subclass of both ``DModule`` and
    the original class (as FSDP2's ``fully_shard`` does), so
    ``isinstance(model, MyModel)`` and ``isinstance(model, DModule)`` both hold and
    the methods below are available.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        if cls is DModule:
            if "strategy" in kwargs:  # DModule(model, strategy="auto", global_batch=...)
                from vescale.dmodule._strategy import parallelize_auto

                return parallelize_auto(*args, **kwargs)
            return parallelize_module(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and args[0] is self:  # DModule(model, ...) returned `model` itself
            return
        super().__init__(*args, **kwargs)

    def dump_plan(self) -> str:
        """Applied placements per parameter/buffer and per module input/output."""
        return dump_plan(self)  # type: ignore[arg-type]

    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients locally.

        The same as ``torch.nn.parallel.DistributedDataParallel.no_sync()`` and
        `vescale.dmodule.no_sync`; a no-op without data parallelism.
        """
        from vescale.dmodule._fsdp import no_sync

        return no_sync(self)  # type: ignore[arg-type]

    def finish_grad_sync(self) -> int:
        """Reduce ``Partial`` gradients now (bucketed); returns collectives issued.

        Runs automatically at the end of each backward unless the module was
        parallelized with ``grad_sync=False``; calling it again is a no-op.
        """
        return module_state(self).dmodule.grad_sync.sync()  # type: ignore[union-attr]


_CLASS_CACHE: dict[type, type] = {}


def _grad_like_param(placements: tuple) -> Any:
    """A gradient hook giving a sharded parameter's gradient the parameter's placements.

    torch's sharding propagation picks the placements of a gradient by cost, and some
    releases (2.11) give a column-parallel weight a replicated gradient; the optimizer,
    the clipping and the data-parallel engines expect the parameter's own layout. A
    ``Replicate`` -> ``Shard`` step is a local slice; a pending ``Partial`` is reduced.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            return grad.redistribute(grad.device_mesh, placements)
        return grad

    return hook


def _aliases(model: nn.Module, t: torch.Tensor) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if p is t] + [
        n for n, b in model.named_buffers(remove_duplicate=False) if b is t
    ]


def _own_meta(module: nn.Module) -> list[str]:
    names = [n for n, t in module.named_parameters(recurse=False) if t.device.type == "meta"]
    names += [n for n, t in module.named_buffers(recurse=False) if t.device.type == "meta"]
    return names


def _has_meta(model: nn.Module) -> bool:
    return any(_own_meta(m) for m in model.modules())


def _check_meta_init(model: nn.Module, init_fn: Any) -> None:
    """Before any communication: every meta tensor must have a way to be initialised."""
    if init_fn is not None:
        if not callable(init_fn):
            raise TypeError(f"param_init_fn must be callable, got {type(init_fn).__name__}")
        return
    for name, mod in model.named_modules():
        meta = _own_meta(mod)
        if meta and not callable(getattr(mod, "reset_parameters", None)):
            where = f"{name}." if name else ""
            raise ValueError(
                f"{', '.join(where + n for n in meta)} on the meta device: "
                f"{type(mod).__name__} has no reset_parameters(); pass "
                "param_init_fn=fn(module) to initialise it"
            )


def _materialize_meta(
    model: nn.Module, resolved: Any, mesh: DeviceMesh, init_fn: Any, *, local: bool = True
) -> None:
    """Initialise meta tensors module by module and cut them to local shards at once."""
    placements = {}
    for entry in resolved.params:
        for name in entry.names:
            placements[name] = entry.placements
    device = torch.device(mesh.device_type)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    for mod_name, mod in model.named_modules():
        if not _own_meta(mod):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        # names under which each of this module's tensors is reachable (tied weights)
        aliases = {
            (table, attr): _aliases(model, t)
            for table in ("_parameters", "_buffers")
            for attr, t in getattr(mod, table).items()
            if t is not None
        }
        mod.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if init_fn is not None:
                init_fn(mod)
            else:
                mod.reset_parameters()
        for (table, attr), names in aliases.items():
            full = getattr(mod, table)[attr]
            pl = placements.get(prefix + attr)
            if full is None or isinstance(full, DTensor):
                continue
            if local and pl is not None:
                with torch.no_grad():
                    # every rank initialised the same values: cut locally, no communication
                    shard = distribute_tensor(full.detach(), mesh, pl, src_data_rank=None)
                new = (
                    nn.Parameter(shard, requires_grad=full.requires_grad)
                    if table == "_parameters"
                    else shard
                )
            else:
                new = full  # kept whole (pure data parallelism shards it later)
            for name in names or [prefix + attr]:  # tied weights: every alias
                owner_name, _, a = name.rpartition(".")
                owner = model.get_submodule(owner_name) if owner_name else model
                getattr(owner, table)[a] = new


def _dmodule_class(cls: type) -> type:
    if issubclass(cls, DModule):
        return cls
    new = _CLASS_CACHE.get(cls)
    if new is None:
        new = type(f"DModule{cls.__name__}", (DModule, cls), {"__module__": cls.__module__})
        new.__qualname__ = f"DModule{cls.__qualname__}"
        _CLASS_CACHE[cls] = new
    return new


def is_dmodule(model: nn.Module) -> bool:
    """True if ``model`` was parallelized by `parallelize_module`."""
    state = module_state(model)
    return state is not None and state.dmodule is not None


def _ensure_plugin() -> None:
    from vescale.dmodule import _plugin

    pm = get_plugin_manager()
    if not pm.is_registered(_plugin):
        register_plugin(_plugin, name="dmodule")


def parallelize_module(
    model: nn.Module,
    device_mesh: DeviceMesh,
    sharding_plan: dict[str, Any] | None = None,
    **options: Any,
) -> nn.Module:
    """Shard ``model`` over ``device_mesh`` by ``sharding_plan``, in place.

    Parameters become DTensor parameters with the planned placements (unplanned
    parameters and buffers: ``Replicate()`` on every mesh dim); forward pre/post
    hooks move the planned module inputs and outputs to their placements. The
    model's class and code are untouched (see `DModule`). Build the
    optimizer **after** this call: parameters are new objects.

    Plan format:

    ```python
    {
        "parameter": {r"blocks\\.\\d+\\.attn\\.q_proj\\.weight": [Shard(0)]},
        "forward": {
            "fc1.input": [[Replicate()]],            # per positional arg; None skips
            r"blocks\\.\\d+\\.attn.input": {"x": [Shard(1)]},  # by argument name
            "fc2.output": [[Replicate()]],           # per output; a dict for dict outputs
        },
    }
    ```

    Keys are regexes that full-match ``named_modules()`` names plus a suffix: a
    parameter or buffer name for the parameter section, ``.input``/``.output`` for
    the forward section (``input``/``output`` alone is the root module). The first
    matching key wins. A flat dict of parameter keys is the parameter section. A
    forward key naming a parameter or buffer (``"fc1.weight": [Replicate()]``)
    redistributes it (differentiably) right before that module's forward; the
    parameter itself keeps its placements and gets the gradient. A dict input plan
    may name ``*args`` (a list, one entry per extra positional value) and, when
    ``forward`` takes ``**kwargs``, any keyword.
    Plain tensors given to a planned input are taken as the same full value on
    every rank (``Replicate()``) and redistributed.

    A mesh dim on which the plan (parameters, buffers, forward entries, ``factory``)
    places only ``Replicate()`` while another dim is tensor parallel is a *replica*
    dim. Without ``data_parallel=``, the parameters live on ``device_mesh``
    (``Replicate()`` on it) but the forward computes on the mesh without the replica
    dims: each rank of such a dim may feed its own samples (data parallelism by
    ``vescale.optim.DistributedOptimizer`` or by the program), its gradients are then
    those of its own samples, and module outputs are DTensors on that sub-mesh.

    Args:
        model: The module to parallelize (parameters as plain tensors).
        device_mesh: The device mesh.
        sharding_plan: The plan; ``None`` derives one through the
            ``vescale_sharding_plan`` hook (Megatron TP/SP for transformer-style
            models).
        **options: ``tp_dim`` (name or index of the tensor-parallel mesh dim for
            automatic plans; default ``"tp"``, or the last dim if no dim has that
            name), ``sequence_parallel`` (automatic plans; default ``False``),
            ``auto_plan`` (``True`` merges the automatic plan under a user plan,
            user keys winning; default: only when ``sharding_plan`` is ``None``),
            ``grad_sync`` (reduce ``Partial`` gradients after each backward; default
            ``True``), ``implicit_replication`` (plain tensors made inside forward
            act as replicated; default ``True``), ``allow_uneven_shards`` (default
            ``False``), ``src_data_rank`` (rank whose parameter values are
            distributed; ``None``: each rank's own; default ``0``),
            ``param_init_fn`` (``fn(module)`` that initialises a module's own
            parameters and buffers in place; used for models built on the ``meta``
            device, default: the module's ``reset_parameters()``),
            ``data_parallel`` (mesh dim name or index -> ``"ddp"`` | ``"fsdp"``, or
            ``{"mode": ..., **engine options}``: DDP or FSDP on one dim, or HSDP with
            one ``"ddp"`` dim and one ``"fsdp"`` dim, e.g.
            ``{"rep": "ddp", "shard": "fsdp"}``: parameters sharded over the fsdp
            dim, replicated over the ddp dim; see ``docs/data_parallel.md``),
            ``factory`` (veScale's: ``True`` makes ``torch.zeros``/``ones``/
            ``empty``/``full``/``rand``/``randn``/``arange`` called in the model's
            ``forward`` return replicated DTensors; a dict of factory function ->
            placements, or of module class -> ``True``/``False``/such a dict, the
            innermost class applying; default ``False``),
            ``unmatched_plan_keys`` (``"error"``, the default: a plan key that
            matches nothing raises, suggesting the nearest names; ``"warn"``: warn and
            skip it, as veScale does),
            ``activation_checkpointing`` (``True``: the FSDP groups, or every
            ``nn.ModuleList`` element; regex(es) full-matching ``named_modules()``
            names; or a predicate ``(name, module) -> bool``: those submodules'
            forwards run under non-reentrant ``torch.utils.checkpoint``; default
            ``None``, off).

    A model built on the ``meta`` device is materialised module by module: each
    module's own tensors are allocated at full size on the mesh's device,
    initialised by ``param_init_fn``/``reset_parameters()`` (consuming the RNG in
    module order, so a model whose initialisation lives in ``reset_parameters``
    gets the same values as eager construction with the same seed), and
    immediately cut to this rank's local shards. Peak memory is one module's
    full tensors, not the model's. Before that, every rank's default generators
    (CPU; CUDA's current device on a CUDA mesh) take the states of the
    ``src_data_rank`` rank (one small broadcast per mesh dim), so every rank
    initialises the same values however the ranks were seeded, and they equal
    that rank's eager construction, as without ``meta``; with ``src_data_rank=None``
    each rank initialises from its own generators.

    Returns:
        ``model`` itself, now also an instance of `DModule`.

    Raises:
        PlanSectionError: The plan has an unknown section (both a ``KeyError`` and a
            ``ValueError``; the nearest section is suggested).
        ValueError: The plan has a key that matches nothing
            (the nearest names are suggested), a placement list whose length is not
            the mesh's ndim, a shard dim out of range or not dividing the tensor.
            All checks run before any communication.
        TypeError: Unknown option, or malformed plan entries.
    """
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown parallelize_module option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}"
        )
    opts = {**_OPTIONS, **options}
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    if is_dmodule(model):
        warnings.warn(
            f"{type(model).__qualname__} is already parallelized; parallelize_module does nothing",
            stacklevel=2,
        )
        return model
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"expected a DeviceMesh, got {type(device_mesh).__name__}")

    if has_torch_styles(sharding_plan):
        sharding_plan = translate_torch_plan(
            model,
            device_mesh,
            sharding_plan,
            tp_dim=resolve_tp_dim(device_mesh, opts["tp_dim"]),
            unmatched=opts["unmatched_plan_keys"],
        )
        if "implicit_replication" not in options:
            # torch's styles hand plain local tensors between layers; saving those as
            # replicated DTensors would break their backward
            opts["implicit_replication"] = False
    plan = _plan.normalize_plan(sharding_plan)
    dp_specs = _parse_data_parallel(opts["data_parallel"], device_mesh)
    dp_dims = {d for d, _, _ in dp_specs}
    use_auto = opts["auto_plan"] if opts["auto_plan"] is not None else sharding_plan is None
    if use_auto and resolve_tp_dim(device_mesh, opts["tp_dim"]) in dp_dims:
        use_auto = False  # every mesh dim is data parallel: no tensor parallelism to derive
    if use_auto:
        _ensure_plugin()
        tp = resolve_tp_dim(device_mesh, opts["tp_dim"])
        auto = get_plugin_manager().hook.vescale_sharding_plan(
            model=model,
            device_mesh=device_mesh,
            tp_dim=tp,
            sequence_parallel=bool(opts["sequence_parallel"]),
        )
        if auto and any(mode == "fsdp" for _, mode, _ in dp_specs):
            auto = _without_strided_shards(auto)
        if auto:
            plan = _plan.merge_plans(plan, _plan.normalize_plan(auto))
    resolved = _plan.resolve_plan(
        model,
        device_mesh,
        plan,
        allow_uneven=bool(opts["allow_uneven_shards"]),
        unmatched=opts["unmatched_plan_keys"],
    )

    _check_meta_init(model, opts["param_init_fn"])
    _check_dp_against_plan(dp_specs, resolved, device_mesh)
    if dp_specs:
        from vescale.dmodule._dp_common import check_src_rank

        check_src_rank(
            opts["src_data_rank"], device_mesh, [d for d, _, _ in dp_specs], "parallelize_module"
        )
    # Tensor parallelism under data parallelism computes on the mesh without the
    # data-parallel dims: the ranks of a dp dim hold different samples, so activations
    # (and the compute parameters) must not claim Replicate() over them, or DTensor's
    # sharding propagation may cut them there (a local slice) and reduce the Partial
    # results back over dp, mixing the ranks' samples into the gradients.
    mesh = device_mesh
    tp_resolved = resolved
    if dp_specs and _has_tensor_parallelism(resolved):
        tp_resolved = _drop_dims_from_plan(resolved, dp_dims, device_mesh)
    if opts["factory"] not in (False, None):
        from vescale.dmodule._factory import parse_factory

        parse_factory(opts["factory"], device_mesh)  # bad options fail before any communication
    # Without data parallelism, a mesh dim the plan only replicates over is a replica dim:
    # its ranks may hold other samples (e.g. data parallelism by DistributedOptimizer),
    # so the model computes on the mesh without it, for the same reason as above; the
    # parameters stay on the whole mesh (see _replica).
    replica: set[int] = set()
    if not dp_specs and _has_tensor_parallelism(resolved):
        replica = replica_dims(resolved, device_mesh, opts["factory"])
        if replica:
            tp_resolved = _drop_dims_from_plan(resolved, replica, device_mesh)
    ac = opts["activation_checkpointing"]
    fsdp_groups = any(m == "fsdp" and "groups" in kw for _, m, kw in dp_specs)
    if ac is not None and ac is not False and not (ac is True and fsdp_groups):
        from vescale.dmodule._activation_checkpoint import resolve_checkpoint_modules

        resolve_checkpoint_modules(model, ac)  # bad selections fail before any communication
    # the data-parallel engines take the src rank's values (DDP: a broadcast, FSDP: a
    # scatter of each flat buffer); a meta model's ranks initialise the same values
    has_meta = _has_meta(model)
    dp_src = None if has_meta else opts["src_data_rank"]
    if opts["src_data_rank"] is not None and has_meta:
        # Meta tensors are initialised in full on every rank, which keeps its own shards:
        # every rank draws from the src rank's generators, so replicas agree (and equal
        # that rank's eager construction) however the ranks were seeded.
        from vescale.dmodule._rng_sync import sync_default_rng

        sync_default_rng(device_mesh, opts["src_data_rank"])
    if dp_specs and not _has_tensor_parallelism(resolved):
        # Pure data parallelism: the DP engine owns the parameters (no TP wrapping).
        _materialize_meta(model, resolved, device_mesh, opts["param_init_fn"], local=False)
        state = _State(
            device_mesh, plan, resolved, opts, PartialGradSync([], device_mesh, auto=False)
        )
        module_state(model, create=True).dmodule = state
        model.__class__ = _dmodule_class(type(model))
        _apply_data_parallel(model, device_mesh, dp_specs, dp_src)
        _apply_checkpointing(model, state, ac)
        return model

    # ---- from here on: communication (parameter distribution), no more validation.
    if tp_resolved is not resolved:
        mesh = _mesh_without(device_mesh, dp_dims | replica)
    # where the parameters live: the compute mesh, or the whole mesh with replica dims
    param_mesh, param_plan = (device_mesh, resolved) if replica else (mesh, tp_resolved)
    _materialize_meta(model, param_plan, param_mesh, opts["param_init_fn"])
    new_params = _place_params(model, param_mesh, param_plan, opts["src_data_rank"], dp_dims)
    factory = opts["factory"]
    if mesh is not device_mesh and factory not in (False, None):
        factory = _drop_factory_dims(factory, dp_dims | replica, device_mesh)
    handles, ir = _install_hooks(model, mesh, tp_resolved, opts, factory)
    rc = None
    if replica and mesh is not device_mesh:
        rc = ReplicaCompute(device_mesh, mesh, replica)
        handles += rc.install(model)  # last: its pre-hooks run first, post-hooks last
    sync = PartialGradSync(new_params, param_mesh, auto=bool(opts["grad_sync"]))
    state = _State(device_mesh, plan, resolved, opts, sync, handles, implicit=ir)
    state.compute_mesh = mesh
    state.replica = rc
    module_state(model, create=True).dmodule = state
    model.__class__ = _dmodule_class(type(model))
    _apply_data_parallel(model, device_mesh, dp_specs, dp_src)
    _apply_checkpointing(model, state, ac)
    return model


def _place_params(
    model: nn.Module,
    mesh: DeviceMesh,
    resolved: _plan.ResolvedPlan,
    src_data_rank: int | None,
    dropped: set[int],
) -> list[nn.Parameter]:
    """Make every planned parameter/buffer a DTensor on ``mesh`` with its placements.

    ``dropped``: data-parallel dims of the tensors' mesh that ``mesh`` leaves out.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    new_params: list[nn.Parameter] = []
    for entry in resolved.params:
        mod_name, _, attr = entry.names[0].rpartition(".")
        table = "_parameters" if entry.kind == "parameter" else "_buffers"
        old = getattr(modules[mod_name], table)[attr]
        if isinstance(old, DTensor):
            new = (
                old
                if old.device_mesh is mesh and tuple(old.placements) == entry.placements
                else _to_mesh(old, mesh, entry.placements, dropped)
            )
        else:
            with torch.no_grad():
                new = distribute_tensor(
                    old.detach(), mesh, entry.placements, src_data_rank=src_data_rank
                )
        if entry.kind == "parameter":
            new = nn.Parameter(new, requires_grad=old.requires_grad)
            new_params.append(new)
            if new.requires_grad and any(p.is_shard() for p in new.placements):
                new.register_hook(_grad_like_param(new.placements))
        for name in entry.names:
            mod_name, _, attr = name.rpartition(".")
            getattr(modules[mod_name], table)[attr] = new
    return new_params


def _install_hooks(
    model: nn.Module,
    mesh: DeviceMesh,
    resolved: _plan.ResolvedPlan,
    opts: dict[str, Any],
    factory: Any,
) -> tuple[list, ImplicitReplicationHooks | None]:
    """The forward hooks of a plan on ``mesh``: ``(handles, implicit replication)``."""
    modules = dict(model.named_modules(remove_duplicate=False))
    handles = []
    done: set[tuple[int, str]] = set()
    for name, (_key, spec) in resolved.inputs.items():
        mod = modules[name]
        if (id(mod), "in") in done:
            continue
        done.add((id(mod), "in"))
        handles.append(
            mod.register_forward_pre_hook(make_input_hook(mod, spec, mesh), with_kwargs=True)
        )
    for name, (_key, spec) in resolved.outputs.items():
        mod = modules[name]
        if (id(mod), "out") in done:
            continue
        done.add((id(mod), "out"))
        handles.append(mod.register_forward_hook(make_output_hook(spec, mesh)))
    for name, table in resolved.tensors.items():
        pre, post = make_tensor_hooks({a: pl for a, (_k, pl) in table.items()}, mesh)
        handles.append(modules[name].register_forward_pre_hook(pre))
        handles.append(modules[name].register_forward_hook(post, always_call=True))
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if (
            isinstance(mod, nn.Embedding)
            and isinstance(w, DTensor)
            and any(isinstance(p, Shard) and p.dim == 0 for p in w.placements)
        ):
            handles.append(mod.register_forward_pre_hook(refuse_compile_hook(name or "<root>")))
    if factory not in (False, None):
        from vescale.dmodule._factory import install_factory

        handles += install_factory(model, mesh, factory)
    ir = None
    if opts["implicit_replication"]:
        ir = ImplicitReplicationHooks(mesh)
        handles.append(model.register_forward_pre_hook(ir.pre, prepend=True))
        handles.append(model.register_forward_hook(ir.post, always_call=True))
    return handles, ir


def compute_without_dp_dims(model: nn.Module, mesh: DeviceMesh, dp_dims: tuple[int, ...]) -> None:
    """Move a tensor-parallel module's computation to the mesh without ``dp_dims``.

    Called by `fully_shard` / `replicate` on a module that `parallelize_module`
    tensor-parallelised on ``mesh`` itself (without ``data_parallel=``): each rank of a
    data-parallel dim then holds other samples, so the activations must not be DTensors
    that claim ``Replicate()`` over that dim. The parameters (``Replicate()`` there) keep
    their local tensors, re-wrapped on the sub-mesh; the forward hooks are installed
    again on it. No communication besides building the sub-mesh; a no-op for modules
    that were not parallelized on ``mesh`` or already compute on a sub-mesh. A module
    whose parameters live on ``mesh`` but compute on the mesh without its replica dims
    (see ``_replica``) moves its parameters to the mesh without ``dp_dims`` and computes
    there (replica dims other than ``dp_dims`` then stay in the compute mesh).

    Raises:
        ValueError: The plan places a module input or output other than
            ``Replicate()`` on a data-parallel dim.
    """
    ms = module_state(model)
    state: _State | None = None if ms is None else ms.dmodule
    if state is None or (state.compute_mesh is not state.mesh and state.replica is None):
        return
    same = state.mesh.device_type == mesh.device_type and torch.equal(state.mesh.mesh, mesh.mesh)
    if not same or not _has_tensor_parallelism(state.resolved):
        return
    dims = set(dp_dims)
    tp_resolved = _drop_dims_from_plan(state.resolved, dims, state.mesh)
    sub = _mesh_without(state.mesh, dims)
    if sub is state.mesh:
        return
    for h in state.handles:
        h.remove()
    state.grad_sync.release()
    new_params = _place_params(model, sub, tp_resolved, None, dims)
    factory = state.options["factory"]
    if factory not in (False, None):
        factory = _drop_factory_dims(factory, dims, state.mesh)
    state.handles, state.implicit = _install_hooks(model, sub, tp_resolved, state.options, factory)
    state.grad_sync = PartialGradSync(new_params, sub, auto=bool(state.options["grad_sync"]))
    state.compute_mesh = sub
    state.replica = None


def _mesh_without(mesh: DeviceMesh, dims: set[int]) -> DeviceMesh:
    """The sub-mesh of ``mesh`` without mesh dims ``dims`` (at this rank's coordinate)."""
    keep = [i for i in range(mesh.ndim) if i not in dims]
    if not dims or not keep:
        return mesh
    names = mesh.mesh_dim_names
    if not names:
        # a named copy of the same ranks (building it is a collective, as slicing is not)
        from vescale.dtensor import DeviceMesh as _VDeviceMesh

        cache = mesh.__dict__.setdefault("_vescale_named_copy", [])
        if not cache:
            cache.append(
                _VDeviceMesh(
                    mesh.device_type,
                    mesh.mesh,
                    mesh_dim_names=tuple(f"dim{i}" for i in range(mesh.ndim)),
                )
            )
        mesh, names = cache[0], cache[0].mesh_dim_names
    kept = tuple(names[i] for i in keep)
    return mesh[kept[0]] if len(kept) == 1 else mesh[kept]


def _drop_factory_dims(factory: Any, dims: set[int], mesh: DeviceMesh) -> Any:
    """A checked ``factory=`` option read on the mesh without the data-parallel ``dims``."""
    from vescale.dtensor import normalize_placements

    if isinstance(factory, dict):
        return {
            k: (
                _drop_factory_dims(v, dims, mesh)
                if isinstance(k, type)
                else tuple(
                    p for i, p in enumerate(normalize_placements(v, mesh.ndim)) if i not in dims
                )
            )
            for k, v in factory.items()
        }
    return factory


def _drop_dims_from_plan(
    resolved: _plan.ResolvedPlan, dims: set[int], mesh: DeviceMesh
) -> _plan.ResolvedPlan:
    """``resolved`` read on the mesh without the data-parallel ``dims``.

    Raises:
        ValueError: A forward entry places a tensor other than ``Replicate()`` on a
            data-parallel dim (the data-parallel engines own those dims).
    """

    def drop(spec: Any, where: str) -> Any:
        if spec is None:
            return None
        if isinstance(spec, _plan.LocalLayout):
            return _plan.LocalLayout(drop(spec.src, where), drop(spec.dst, where), spec.to_local)
        if isinstance(spec, dict):
            return {k: drop(v, f"{where}[{k!r}]") for k, v in spec.items()}
        if _plan._is_placement_list(spec) and spec:
            for d in dims:
                if not spec[d].is_replicate():
                    raise ValueError(
                        f"{where}: {spec[d]} on mesh dim {_dim_name(mesh, d)!r}, which is "
                        "data parallel; the data-parallel engine owns that dim (plan "
                        "Replicate() there)"
                    )
            return tuple(p for i, p in enumerate(spec) if i not in dims)
        if isinstance(spec, (list, tuple)):
            return tuple(drop(v, f"{where}[{i}]") for i, v in enumerate(spec))
        return spec

    params = [
        dataclasses.replace(e, placements=drop(e.placements, repr(e.names[0])))
        for e in resolved.params
    ]

    def io(table: dict, suffix: str) -> dict:
        return {
            name: (key, drop(spec, f"{name or '<root>'}.{suffix} (plan key {key!r})"))
            for name, (key, spec) in table.items()
        }

    tensors = {
        name: {a: (k, drop(pl, f"{name}.{a} (plan key {k!r})")) for a, (k, pl) in table.items()}
        for name, table in resolved.tensors.items()
    }
    return _plan.ResolvedPlan(
        params, io(resolved.inputs, "input"), io(resolved.outputs, "output"), tensors
    )


def _to_mesh(t: DTensor, mesh: DeviceMesh, placements: tuple, dropped: set[int]) -> DTensor:
    """``t`` (a DTensor on ``mesh``, or on the mesh ``mesh`` is without ``dropped``) on ``mesh``."""
    if t.device_mesh == mesh:
        return t.redistribute(mesh, placements)
    # t lives on the whole mesh: replicated over the dropped (data-parallel) dims, its
    # local tensor is the same on the sub-mesh
    full = list(t.placements)
    if any(not full[d].is_replicate() for d in dropped):
        full = [Replicate() if i in dropped else p for i, p in enumerate(full)]
        t = t.redistribute(t.device_mesh, full)
    kept = [p for i, p in enumerate(full) if i not in dropped]
    with torch.no_grad():
        out = DTensor.from_local(
            t.to_local(), mesh, kept, run_check=False, shape=t.shape, stride=t.stride()
        )
        if tuple(kept) != tuple(placements):
            out = out.redistribute(mesh, placements)
    return out


def _without_strided_shards(auto: dict[str, Any]) -> dict[str, Any]:
    """The automatic plan with fused (``_StridedShard``) parameters replicated instead.

    FSDP shards the tensor-parallel local tensor with ``RaggedShard``, which composes
    with plain ``Shard`` only; a fused projection then stays replicated over tp.
    """
    params = {
        k: [Replicate() if isinstance(p, _StridedShard) else p for p in v]
        if isinstance(v, (list, tuple))
        else v
        for k, v in auto.get("parameter", {}).items()
    }
    return {**auto, "parameter": params}


def _apply_checkpointing(model: nn.Module, state: _State, which: Any) -> None:
    if which is None or which is False:
        return
    from vescale.dmodule._activation_checkpoint import apply_activation_checkpointing

    state.checkpointed = apply_activation_checkpointing(model, which)


def _dim_name(mesh: DeviceMesh, dim: int) -> Any:
    return mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else dim


def _parse_data_parallel(spec: Any, mesh: DeviceMesh) -> list[tuple[int, str, dict]]:
    """``{"dp": "fsdp"}`` / ``{"dp": {"mode": "ddp", "bucket_cap_mb": 10}}`` -> checked list.

    One dim (DDP or FSDP), or two (HSDP: one ``"ddp"`` dim that replicates, one
    ``"fsdp"`` dim that shards; returned ddp first).
    """
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise TypeError(
            f"data_parallel must be a dict of mesh dim -> 'ddp' | 'fsdp', got {type(spec).__name__}"
        )
    names = list(mesh.mesh_dim_names or ())
    out = []
    seen: dict[int, Any] = {}
    for key, value in spec.items():
        if isinstance(key, int) and not isinstance(key, bool):
            if not -mesh.ndim <= key < mesh.ndim:
                raise ValueError(
                    f"data_parallel: mesh dim {key} is out of range for a {mesh.ndim}-dim mesh"
                )
            dim = key % mesh.ndim
        elif key in names:
            dim = names.index(key)
        else:
            raise ValueError(
                f"data_parallel: {key!r} is not a mesh dim; the mesh dims are {names or list(range(mesh.ndim))}"
            )
        if dim in seen:
            raise ValueError(
                f"data_parallel: {seen[dim]!r} and {key!r} are the same mesh dim "
                f"{_dim_name(mesh, dim)!r}"
            )
        seen[dim] = key
        kwargs = dict(value) if isinstance(value, dict) else {"mode": value}
        mode = kwargs.pop("mode", None)
        if mode not in _DP_KINDS:
            raise ValueError(
                f"data_parallel[{key!r}]: mode must be one of {_DP_KINDS}, got {mode!r}"
            )
        out.append((dim, mode, kwargs))
    if len(out) <= 1:
        return out
    dims = [repr(_dim_name(mesh, d)) for d, _, _ in out]
    hint = (
        "HSDP is one 'ddp' dim (replicas) and one 'fsdp' dim (shards), e.g. "
        "{'rep': 'ddp', 'shard': 'fsdp'}"
    )
    if len(out) > 2:
        raise ValueError(
            f"data_parallel on {len(out)} mesh dims ({', '.join(dims)}) is not supported; {hint}"
        )
    modes = [m for _, m, _ in out]
    if modes[0] == modes[1]:
        extra = (
            "; to shard over both, make them one mesh dim"
            if modes[0] == "fsdp"
            else "; to replicate over both, make them one mesh dim"
        )
        raise ValueError(
            f"data_parallel: {modes[0]!r} on two mesh dims ({dims[0]} and {dims[1]}); {hint}{extra}"
        )
    out.sort(key=lambda s: s[1] != "ddp")  # ddp (replicate) first, then fsdp (shard)
    rep_dim, _, rep_kwargs = out[0]
    if rep_kwargs:
        raise ValueError(
            f"data_parallel: HSDP's replicate dim {_dim_name(mesh, rep_dim)!r} takes no DDP "
            f"options (got {sorted(rep_kwargs)}); put FSDP options on the 'fsdp' dim"
        )
    return out


def _has_tensor_parallelism(resolved: Any) -> bool:
    if resolved.inputs or resolved.outputs:
        return True
    return any(not all(p.is_replicate() for p in e.placements) for e in resolved.params)


def _check_dp_against_plan(dp_specs: list, resolved: Any, mesh: DeviceMesh) -> None:
    """A data-parallel mesh dim must not also carry the plan's tensor parallelism."""
    for dim, mode, _ in dp_specs:
        for e in resolved.params:
            if not e.placements[dim].is_replicate():
                name = _dim_name(mesh, dim)
                raise ValueError(
                    f"data_parallel: {mode} on mesh dim {name!r}, but the sharding plan already "
                    f"places {e.names[0]!r} as {e.placements[dim]} on that dim"
                )
            if mode == "fsdp" and any(isinstance(p, _StridedShard) for p in e.placements):
                raise ValueError(
                    f"data_parallel: fsdp on mesh dim {_dim_name(mesh, dim)!r} cannot shard "
                    f"{e.names[0]!r}, placed {list(e.placements)}: FSDP composes with plain "
                    "Shard only; plan the fused projection Replicate() on tp instead"
                )


def _apply_data_parallel(
    model: nn.Module, mesh: DeviceMesh, dp_specs: list, src: int | None
) -> None:
    """Wrap ``model`` in the DDP/FSDP engines of ``dp_specs``.

    ``src``: the rank (coordinate on every data-parallel dim) whose parameter and
    buffer values every rank takes; ``None``: each rank keeps its own (no
    communication). An engine option given in ``data_parallel=`` wins.
    """
    from vescale.dmodule._ddp import replicate
    from vescale.dmodule._dp_common import broadcast_buffers
    from vescale.dmodule._fsdp import fully_shard

    if not dp_specs:
        return
    if len(dp_specs) == 2:  # HSDP: (ddp dim, fsdp dim)
        (rep_dim, _, _), (shard_dim, _, kwargs) = dp_specs
        kwargs = {"src_data_rank": src, **kwargs}
        fully_shard(model, mesh, shard_dim, replicate_dim=rep_dim, **kwargs)
    else:
        for dim, mode, kwargs in dp_specs:
            if mode == "ddp":
                replicate(model, mesh, dim, **{"broadcast_from": src, **kwargs})
            else:
                fully_shard(model, mesh, dim, **{"src_data_rank": src, **kwargs})
    if src is not None:
        broadcast_buffers(model, mesh, [d for d, _, _ in dp_specs], src)


def _fmt(placements) -> str:
    if placements is None:
        return "None"
    if isinstance(placements, _plan.LocalLayout):
        return str(placements)
    return "[" + ", ".join(str(p) for p in placements) + "]"


def _fmt_spec(spec) -> str:
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in spec.items()) + "}"
    return "[" + ", ".join(_fmt(v) for v in spec) + "]"


def dump_plan(model: nn.Module) -> str:
    """Describe what `parallelize_module` applied to ``model``.

    One line per parameter/buffer (its names, placements, global and local shape,
    and the plan key that chose them) and per planned module input/output.

    Raises:
        ValueError: ``model`` was not parallelized.
    """
    ms = module_state(model)
    state: _State | None = None if ms is None else ms.dmodule
    if state is None:
        raise ValueError(f"{type(model).__qualname__} was not parallelized by parallelize_module")
    modules = dict(model.named_modules(remove_duplicate=False))
    lines = [f"mesh: {_plan._mesh_desc(state.mesh)}"]
    if state.replica is not None:
        dims = ", ".join(repr(_dim_name(state.mesh, d)) for d in sorted(state.replica.dims))
        lines.append(
            f"compute mesh: {_plan._mesh_desc(state.compute_mesh)} (replica dims {dims}: "
            "only Replicate() planned there; activations and outputs live on the compute mesh)"
        )
    lines.append("parameters and buffers:")
    for e in state.resolved.params:
        mod_name, _, attr = e.names[0].rpartition(".")
        table = "_parameters" if e.kind == "parameter" else "_buffers"
        t = getattr(modules[mod_name], table)[attr]
        local = tuple(t.to_local().shape) if isinstance(t, DTensor) else tuple(t.shape)
        alias = f" (= {', '.join(e.names[1:])})" if len(e.names) > 1 else ""
        why = f"plan key {e.key!r}" if e.key else "default"
        kind = "" if e.kind == "parameter" else " [buffer]"
        lines.append(
            f"  {e.names[0]}{alias}{kind}: {_fmt(e.placements)} global {tuple(e.shape)} "
            f"local {local}  <- {why}"
        )
    lines.append("forward:")
    for io, table in (("input", state.resolved.inputs), ("output", state.resolved.outputs)):
        for name, (key, spec) in table.items():
            label = f"{name}.{io}" if name else io
            lines.append(f"  {label}: {_fmt_spec(spec)}  <- plan key {key!r}")
    from vescale.dmodule._strategy import describe_strategy

    why = describe_strategy(model)  # DModule(..., strategy="auto"): the ranking
    return "\n".join(lines + ([why] if why else []))
