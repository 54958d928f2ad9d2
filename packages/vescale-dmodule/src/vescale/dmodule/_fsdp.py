"""``fully_shard``: zero-copy fully sharded data parallelism on ``RaggedShard`` flat buffers.

This module is the entry point: it checks and resolves `fully_shard`'s arguments
(mesh dims, FSDP2's ``reshard_after_forward``/offload/mixed-precision forms, the
groups, the FSDP2 per-layer-then-root idiom) before any collective, then hands the
module to an `FSDPEngine`. The engine and its per-step algorithm are described in
`vescale.dmodule._fsdp_engine`; the groups and their flat buffers (one
`vescale.ragged.FlatBuffer` per group and dtype) in `vescale.dmodule._fsdp_groups`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from vescale.dmodule._dp_common import (
    MixedPrecision,
    check_dp_replicated,
    check_one_device,
    check_src_rank,
    resolve_mixed_precision,
    select_submodules,
)
from vescale.dmodule._fsdp_engine import FSDPEngine
from vescale.dmodule._fsdp_groups import SHARDED, default_groups
from vescale.dmodule._module_state import dp_engine, module_state
from vescale.dtensor import resolve_mesh_dim

__all__ = ["fully_shard", "FSDPEngine", "get_dp_engine", "no_sync"]


def get_dp_engine(module: nn.Module):
    """The DDP/FSDP engine of ``module`` (``None`` if it has none)."""
    return dp_engine(module)


@contextlib.contextmanager
def no_sync(module: nn.Module):
    """Accumulate gradients locally (no communication) in backward passes inside the block.

    A module without a data-parallel engine (tensor parallelism only, or a
    ``DistributedOptimizer`` that reduces gradients in ``step()``) has no gradient
    synchronisation to skip: the block then changes nothing, so one training loop
    runs under every engine.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_sync expects an nn.Module, got {type(module).__name__}")
    engine = get_dp_engine(module)
    if engine is None:
        yield
        return
    with engine.no_sync():
        yield


def _resolve_reshard(value: Any, world: int, what: str) -> bool | None:
    """``reshard_after_forward`` as FSDP2 takes it: a bool, ``None``, or a world size."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"{what}: reshard_after_forward must be a bool, None or an int, got {value!r}"
        )
    if value < 1 or value > world or world % value:
        raise ValueError(
            f"{what}: reshard_after_forward={value} must divide the data-parallel world "
            f"size {world} (an int is the number of ranks to reshard to after forward)"
        )
    if value == 1:
        return False
    if value == world:
        return True
    raise NotImplementedError(
        f"{what}: reshard_after_forward={value} (resharding to {value} of {world} ranks after "
        "forward) is not supported; use True (reshard to all ranks) or False (keep the "
        "unsharded parameters until backward)"
    )


def _resolve_offload(
    policy: Any, device: torch.device, what: str
) -> tuple[torch.device | None, bool]:
    """``(offload device, pin memory)`` from torch's ``OffloadPolicy`` / ``CPUOffloadPolicy``."""
    if policy is None:
        return None, False
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if isinstance(policy, CPUOffloadPolicy):
        # pinned host memory makes the copies to and from the GPU asynchronous; it needs CUDA
        pin = bool(policy.pin_memory) and device.type == "cuda" and torch.cuda.is_available()
        return torch.device("cpu"), pin
    if isinstance(policy, OffloadPolicy):  # the base class: no offload
        return None, False
    raise TypeError(
        f"{what}: offload_policy must be a torch.distributed.fsdp.CPUOffloadPolicy or "
        f"OffloadPolicy, got {type(policy).__name__}"
    )


def _child_engines(
    module: nn.Module, mesh: DeviceMesh, dim: int, rep_dim: int | None, what: str
) -> list[FSDPEngine]:
    """FSDP engines of submodules already passed to ``fully_shard`` (the FSDP2 idiom).

    Raises (before any collective) if the module itself is wrapped, a submodule is DDP,
    or a submodule's engine is on another mesh or dims.
    """
    own = dp_engine(module)
    if own is not None:
        raise ValueError(
            f"{what}: the module is already data-parallel ({type(own).__name__}); a module "
            "can be wrapped by replicate()/fully_shard() only once"
        )
    inside = {id(m) for m in module.modules()}
    found: list[FSDPEngine] = []
    for name, sub in module.named_modules():
        state = dp_engine(sub)
        if state is None or any(state is e for e in found):
            continue
        if not isinstance(state, FSDPEngine):
            raise ValueError(
                f"{what}: submodule {name!r} is already data-parallel ({type(state).__name__}); "
                "fully_shard() can only take over submodules that fully_shard() wrapped"
            )
        if id(state.module) not in inside:
            raise ValueError(
                f"{what}: submodule {name!r} is already sharded by fully_shard() on an "
                "enclosing module; call fully_shard() on submodules first, then on the root"
            )
        same_mesh = state.mesh.device_type == mesh.device_type and torch.equal(
            state.mesh.mesh, mesh.mesh
        )
        if not same_mesh or state.dp_dim != dim or state.replicate_dim != rep_dim:
            raise ValueError(
                f"{what}: submodule {name!r} was sharded on mesh {state.mesh.mesh.tolist()} "
                f"(dp dim {state.dp_dim}, replicate dim {state.replicate_dim}) but this call "
                f"uses mesh {mesh.mesh.tolist()} (dp dim {dim}, replicate dim {rep_dim}); every "
                "fully_shard() of one model must use the same mesh and dims"
            )
        found.append(state)
    return found


def _default_mesh() -> DeviceMesh:
    """FSDP2's default: a 1-D mesh over every rank of the default process group."""
    from vescale.dtensor import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard: mesh=None needs an initialised default process group "
            "(torch.distributed.init_process_group, or torchrun)"
        )
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(kind, (dist.get_world_size(),))


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    dp_dim: int | str = 0,
    *,
    replicate_dim: int | str | None = None,
    groups: Sequence[str | nn.Module] | Callable[[str, nn.Module], bool] | None = None,
    reshard_after_forward: bool | int | None = True,
    prefetch: bool = True,
    mixed_precision: MixedPrecision | Any | None = None,
    mp_policy: Any | None = None,
    offload_policy: Any | None = None,
    granularity: Any = "element",
    find_unused_parameters: bool = True,
    ignored_params: Any | None = None,
    shard_placement_fn: Callable | None = None,
    src_data_rank: int | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the mesh dim ``dp_dim`` (FSDP), in place.

    Both call styles work: ``fully_shard(model, mesh, "dp", ...)`` wraps the whole model
    at once (every ``nn.ModuleList`` element becomes a group), and FSDP2's
    ``for layer in model.layers: fully_shard(layer, mesh=mesh)`` then
    ``fully_shard(model, mesh=mesh)``: each call shards the module's remaining
    parameters at once (build the optimizer after the last call), and a call on a
    module whose submodules were wrapped before takes their groups over unchanged into
    one engine, the submodules' groups running in module order with the outer module's
    parameters as its own group.

    Args:
        module: The module; its parameters must be on one device of the mesh's type,
            and, with ``src_data_rank=None``, hold the same values on every rank of
            the dp dims (each rank keeps its own slice of its own values; ranks
            seeded differently then hold a mixture of their models): plain tensors, or
            DTensors on ``mesh`` that are ``Replicate()`` on ``dp_dim`` (tensor
            parallelism, e.g. from ``parallelize_module``) with evenly sized local
            shards.
        mesh: Device mesh; plain parameters become ``RaggedShard`` on ``dp_dim`` and
            ``Replicate()`` on every other dim. With DTensor parameters every
            parameter lives on ``engine.shard_mesh`` (``mesh`` with ``dp_dim`` moved
            last) as ``[<other dims' placements>, RaggedShard]``: the ``RaggedShard``
            cuts the TP-local tensor. ``None`` (FSDP2's default): a 1-D mesh over
            every rank of the default process group.
        dp_dim: Name or index of the data-parallel mesh dim the parameters are
            sharded over.
        replicate_dim: HSDP: name or index of a second data-parallel mesh dim over
            which the sharded parameters are replicated (``Replicate()`` there). After
            each group's gradient reduce-scatter over ``dp_dim``, the sharded
            gradient is averaged over this dim by one asynchronous all-reduce
            (``2 (R-1)/R P/N`` more bytes per step, ``R`` its size), waited at the
            end of backward. ``None``: plain FSDP.
        groups: Submodules gathered together (one flat buffer per group and dtype):
            names from ``named_modules()`` (regexes, full match), modules, or a
            predicate ``(name, module) -> bool``. The root is always a group and
            takes the remaining parameters. Default: every element of an
            ``nn.ModuleList`` (transformer blocks); when submodules were already
            wrapped by ``fully_shard`` (FSDP2's idiom), FSDP2's default: none, the
            module's remaining parameters form one group.
        reshard_after_forward: Free each group's unsharded parameters after its
            forward and gather them again in backward (3 (N-1)/N P bytes per step
            instead of 2 (N-1)/N P, less memory). ``None``: FSDP2's default, ``True``
            for groups inside an outer ``fully_shard`` and ``False`` for the engine's
            root group. An int is FSDP2's number of ranks to reshard to: the dp size
            (``True``) or 1 (``False``); other divisors raise ``NotImplementedError``.
        prefetch: Start the next group's all-gather asynchronously, in forward and
            in backward.
        mixed_precision: `MixedPrecision` (or torch's ``MixedPrecisionPolicy``);
            e.g. ``MixedPrecision(torch.bfloat16, torch.float32)`` computes in bf16
            with fp32 sharded masters and an fp32 gradient reduce-scatter.
        mp_policy: FSDP2's name for ``mixed_precision`` (a
            ``torch.distributed.fsdp.MixedPrecisionPolicy`` or `MixedPrecision`).
        offload_policy: ``torch.distributed.fsdp.CPUOffloadPolicy()``: the sharded
            parameters, their gradients and so the optimizer state and step live in
            CPU memory (pinned where CUDA exists); each group's shard is copied to the
            compute device before its all-gather and each gradient shard back after
            its reduce-scatter (``engine.offload_copy_bytes``). On a CPU mesh the
            placement does not change but the copies still run. ``None`` or
            ``OffloadPolicy()``: no offload.
        granularity: Where the planner may cut a parameter (``"element"``,
            ``"row"`` or a block shape; see `vescale.ragged`).
        find_unused_parameters: Parameters that have no gradient on any rank (unused
            in this backward and none accumulated before) keep ``grad = None``, as in
            single-device training, at the cost of one tiny all-reduce (a flag per
            parameter) per backward. ``False`` saves it: such parameters then get zero
            gradients, which optimizers with weight decay or momentum step, unlike on
            one device.
        ignored_params: Parameters left as they are (not sharded, gradients not
            reduced), as in FSDP2.
        shard_placement_fn: FSDP2's per-parameter ``Shard`` placements; only
            ``None`` (every group is one ``RaggedShard`` flat buffer).
        src_data_rank: ``None`` (the default, as FSDP2): no communication, each
            rank's shard is cut from its own values. An int: the coordinate, on
            ``dp_dim`` (and ``replicate_dim``), of the rank whose values every rank
            takes: that rank scatters each flat buffer, every rank receiving only its
            slice (about ``P`` bytes sent by the source, ``P/N`` received by each
            rank; HSDP adds one broadcast of each slice over ``replicate_dim``).
            ``parallelize_module(..., data_parallel=...)`` passes its own
            ``src_data_rank`` (default 0).

    Returns:
        ``module`` itself, its class swapped for a subclass of
        `FullyShardedModule` and the original class (``unshard()``,
        ``reshard()``, ``set_requires_gradient_sync()``, ...); its engine is
        ``get_dp_engine(module)`` (`FSDPEngine`).

    Raises:
        ValueError: ``dp_dim`` (or ``replicate_dim``) not in the mesh, both the same
            dim, the module already data-parallel (or inside a ``fully_shard``-ed
            module, or a submodule DDP or sharded on another mesh), a parameter
            shared between an already wrapped submodule and the rest of the module,
            parameters on several devices or not on the mesh's device type, a group
            name that matches nothing, a DTensor parameter on another mesh, not
            ``Replicate()`` on ``dp_dim``, ``Partial``, or with local shards of
            different shapes on different ranks (uneven tensor-parallel sharding),
            naming the parameter, a ``src_data_rank`` that is not a coordinate of the
            dp dims. All before any collective.
        TypeError: A malformed ``mp_policy``/``offload_policy``/``reshard_after_forward``.
        NotImplementedError: ``shard_placement_fn``, or an int
            ``reshard_after_forward`` other than 1 and the dp size.
    """
    what = "fully_shard"
    if not isinstance(module, nn.Module):
        raise TypeError(f"{what}: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        # as FSDP2: the hooks that gather and reduce run around forward()
        raise ValueError(
            f"{what}: does not support containers that do not implement forward: "
            f"{type(module).__name__}; wrap its elements (or the module that calls them)"
        )
    if shard_placement_fn is not None:
        raise NotImplementedError(
            f"{what}: shard_placement_fn is not supported; vescale lays each group's "
            "parameters into one RaggedShard flat buffer (choose the cut with granularity=)"
        )
    if mesh is None:
        mesh = _default_mesh()
    dim = resolve_mesh_dim(mesh, dp_dim, "dp_dim")
    rep_dim = (
        None if replicate_dim is None else resolve_mesh_dim(mesh, replicate_dim, "replicate_dim")
    )
    if rep_dim == dim:
        raise ValueError(
            f"{what}: replicate_dim {replicate_dim!r} is the sharded dim {dp_dim!r}; HSDP "
            "needs two different mesh dims"
        )
    check_src_rank(src_data_rank, mesh, (dim,) if rep_dim is None else (rep_dim, dim), what)
    reshard = _resolve_reshard(reshard_after_forward, mesh.size(dim), what)
    mp = resolve_mixed_precision(mixed_precision, mp_policy, what)
    children = _child_engines(module, mesh, dim, rep_dim, what)
    adopted = {
        id(sp) for e in children for g in e.groups for b in g.bufs for sp in b.sharded.values()
    }
    ignored = frozenset(id(p) for p in (ignored_params or ()))
    skip = adopted | ignored
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in adopted and SHARDED.get(id(p)) is p:
            raise ValueError(
                f"{what}: parameter {name!r} is already sharded by fully_shard() on an "
                "enclosing module; call fully_shard() on submodules first, then on the root"
            )
        for e in children:
            if e.replaced.get(id(p)) is p:
                raise ValueError(
                    f"{what}: parameter {name!r} is shared with submodule "
                    f"{_module_name(module, e.module)!r}, which fully_shard() already sharded; "
                    "a shared parameter must be sharded with the module that contains all its "
                    "uses: wrap a module that contains both (or only the root)"
                )
    if children and all(id(p) in skip for p in module.parameters()):
        device = children[0].device  # the outer module has no parameters of its own
    else:
        device = check_one_device(module, mesh, what, skip=skip)
    offload_device, pin = _resolve_offload(offload_policy, device, what)
    dp_dims = (dim,) if rep_dim is None else (rep_dim, dim)
    check_dp_replicated(module, mesh, dim, what, skip=skip, dp_dims=dp_dims)
    if rep_dim is not None:
        check_dp_replicated(module, mesh, rep_dim, what, skip=skip, dp_dims=dp_dims)
    mods = dict(module.named_modules())
    if groups is None:
        chosen = [] if children else default_groups(module)
    else:
        chosen = select_submodules(module, groups, f"{what} groups")
    taken = {id(e.module) for e in children} | {id(g.module) for e in children for g in e.groups}
    order = {n: i for i, n in enumerate(mods)}
    chosen = sorted({n for n in chosen if n and id(mods[n]) not in taken}, key=order.__getitem__)
    group_modules = [("", module)] + [(n, mods[n]) for n in chosen]
    # a module tensor-parallelised on this very mesh: its computation moves to the mesh
    # without the data-parallel dims (the dp ranks hold other samples)
    from vescale.dmodule._api import compute_without_dp_dims

    compute_without_dp_dims(module, mesh, dp_dims)
    engine = FSDPEngine(
        module,
        mesh,
        dim,
        group_modules,
        replicate_dim=rep_dim,
        reshard_after_forward=reshard,
        prefetch=prefetch,
        mixed_precision=mp,
        granularity=granularity,
        find_unused_parameters=find_unused_parameters,
        device=device,
        offload_device=offload_device,
        pin_memory=pin,
        adopt=children,
        ignored=ignored,
        src_data_rank=src_data_rank,
    )
    module_state(module, create=True).dp_engine = engine
    for e in children:  # the submodules' controls now reach the engine that runs them
        for sub in module.modules():
            state = module_state(sub)
            if state is not None and state.dp_engine is e:
                state.dp_engine = engine
    # A module tensor-parallelised by parallelize_module: its PartialGradSync watches
    # the original parameters, which FSDP replaced (their tp-Partial gradients are
    # reduced while they accumulate into the unsharded gradient buffer). Release them
    # so the unsharded TP-local tensors are freed.
    state = module_state(module)
    if state is not None and state.dmodule is not None:
        state.dmodule.grad_sync.release()
    from vescale.dmodule._dp_module import FullyShardedModule, swap_class

    swap_class(module, FullyShardedModule, "FSDP")
    return module


def _module_name(root: nn.Module, sub: nn.Module) -> str:
    return next((n for n, m in root.named_modules() if m is sub), "?")
