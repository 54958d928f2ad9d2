"""FSDP parameter groups and their flat buffers (the data side of `._fsdp_engine`).

A *group* is the parameters of one module that FSDP gathers together; each group has
one `Buf` per dtype (and per trainable/frozen subset): a `vescale.ragged.FlatBuffer`
holding the rank's shard, the unsharded parameter and gradient buffers whose views
autograd sees, and the sharded parameters and gradients the optimizer sees.
`build_buffers` lays a group out and makes all of them; `assign_groups` decides
which group owns a parameter used by several modules.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from vescale.dmodule._dp_common import MixedPrecision, local_tensor, placements_on
from vescale.dtensor import from_local

__all__ = [
    "Buf",
    "Group",
    "Placing",
    "SHARDED",
    "alloc_storage",
    "assign_groups",
    "build_buffers",
    "scatter_from_source",
    "default_groups",
    "free_storage",
]

# every sharded parameter an engine made, by id (weak: an id counts while its tensor lives)
SHARDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def alloc_storage(t: torch.Tensor) -> int:
    """Give ``t``'s freed storage its bytes back; returns the bytes allocated (0 if live)."""
    s = t.untyped_storage()
    need = t.numel() * t.element_size()
    if s.nbytes() >= need:
        return 0
    s.resize_(need)
    return need


def free_storage(t: torch.Tensor) -> int:
    """Free ``t``'s storage (views keep pointing at it); returns the bytes freed."""
    s = t.untyped_storage()
    n = s.nbytes()
    if n:
        s.resize_(0)
    return n


@dataclasses.dataclass
class Buf:
    """One dtype of one group."""

    fb: Any  # FlatBuffer (master dtype, sharded)
    names: list[str]
    master_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    full: torch.Tensor  # unsharded params, compute dtype (storage freed when resharded)
    gfull: torch.Tensor  # unsharded grads, compute dtype (storage freed when reduced)
    gshard: torch.Tensor  # sharded grads, master dtype (persistent)
    cshard: torch.Tensor | None  # compute-dtype copy of the shard (mixed precision)
    sharded: dict[str, nn.Parameter]
    leaves: dict[str, torch.Tensor]
    grad_dts: dict[str, DTensor]
    trainable: list[str]
    # CPU offload: the shard (fb.local) and gshard live on the offload device; dshard
    # is the compute-device copy of the shard for the all-gather (storage freed after)
    dshard: torch.Tensor | None
    offloaded: bool


@dataclasses.dataclass
class Group:
    index: int
    name: str
    module: nn.Module
    bufs: list[Buf]
    paths: dict[str, list]  # param name -> module paths
    mp: MixedPrecision = dataclasses.field(default_factory=MixedPrecision)
    # None: FSDP2's default (False for the engine's root group, True for the others)
    reshard_after_forward: bool | None = True
    # set_requires_gradient_sync(False): this group's gradients accumulate locally
    sync: bool = True
    unsharded: bool = False
    swapped_in: bool = False
    gather_works: list = dataclasses.field(default_factory=list)
    gather_versions: list = dataclasses.field(default_factory=list)
    pre_bwd_done: bool = False
    post_bwd_done: bool = False
    # grad-enabled forwards whose backward has not reached the group's inputs yet
    # (several forwards before one backward: the group reduces after the last)
    fwd_pending: int = 0
    grads_live: bool = False
    used: dict[str, bool] = dataclasses.field(default_factory=dict)
    # whether a parameter's sharded gradient existed before this backward's reduction
    had_grad: dict[str, bool] = dataclasses.field(default_factory=dict)
    handles: list = dataclasses.field(default_factory=list)

    @property
    def param_names(self) -> list[str]:
        return [n for b in self.bufs for n in b.names]

    def unsharded_bytes(self) -> int:
        return sum(b.full.numel() * b.full.element_size() for b in self.bufs)


@dataclasses.dataclass(frozen=True)
class Placing:
    """Where an engine's parameters live.

    Attributes:
        mesh: The mesh given to ``fully_shard``.
        dp_dim: The sharded (data-parallel) mesh dim.
        shard_mesh: Mesh of the sharded parameters (``mesh``, or with tensor
            parallelism the same ranks with ``dp_dim`` moved last).
        tensor_parallel: Whether the parameters were DTensors.
        replicate_dim: HSDP's replicated data-parallel mesh dim, or ``None``.
    """

    mesh: DeviceMesh
    dp_dim: int
    shard_mesh: DeviceMesh
    tensor_parallel: bool
    replicate_dim: int | None = None

    @property
    def dp_dims(self) -> tuple[int, ...]:
        """Every data-parallel mesh dim (the sharded one, and HSDP's replicated one)."""
        return (self.dp_dim,) if self.replicate_dim is None else (self.replicate_dim, self.dp_dim)

    @property
    def world(self) -> int:
        return self.mesh.size(self.dp_dim)

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank(self.dp_dim)

    def geometry(self, orig: torch.Tensor, fb, slot) -> tuple:
        """``(mesh, placements)`` + ``shape=``/``stride=`` of a sharded parameter."""
        if not self.tensor_parallel:
            return (self.mesh, fb.placements(slot.name)), {"shape": slot.shape}
        d = self.dp_dim
        orig_pl = (
            self.placements_on_mesh(orig)
            if isinstance(orig, DTensor)
            else (Replicate(),) * self.mesh.ndim
        )
        others = [orig_pl[i] for i in range(self.mesh.ndim) if i != d]
        return (self.shard_mesh, (*others, slot.placement)), {
            "shape": tuple(orig.shape),
            "stride": tuple(orig.stride()),
        }

    def placements_on_mesh(self, orig: DTensor) -> tuple:
        """``orig``'s placements on ``mesh`` (it may live on the mesh without the dp dims)."""
        pl = placements_on(orig, self.mesh, self.dp_dims)
        assert pl is not None, "fully_shard checked every parameter's mesh"
        return pl

    def compute(self, orig: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
        """The compute form of an unsharded view: a DTensor like ``orig`` if it is one.

        It lives on ``orig``'s own mesh: ``mesh``, or the tensor-parallel sub-mesh
        without the data-parallel dims (``parallelize_module(..., data_parallel=...)``),
        so activations never claim ``Replicate()`` over ranks that hold other samples.
        """
        if not isinstance(orig, DTensor):
            return view
        return from_local(
            view,
            orig.device_mesh,
            tuple(orig.placements),
            shape=tuple(orig.shape),
            stride=tuple(orig.stride()),
        )


def build_buffers(
    named: list[tuple[str, nn.Parameter]],
    placing: Placing,
    *,
    granularity: Any,
    mp: MixedPrecision,
    device: torch.device,
    offload_device: torch.device | None,
    pin_memory: bool,
    src: int | None = None,
) -> list[Buf]:
    """Lay one group's parameters out and make its `Buf` objects.

    The rank's shard of every parameter is copied into the buffers' slices (``src``
    ``None``: cut from this rank's own values; else the values of the rank at
    coordinate ``src`` on the data-parallel dims, see `scatter_from_source`); the
    unsharded buffers are made with their storage freed.
    """
    from vescale.ragged import FlatBuffer, layouts_from_tensors

    # Frozen and trainable parameters get separate buffers: a backward then
    # reduce-scatters the trainable buffer only (LoRA: the adapters, not the
    # frozen base weights, whose buffer has no gradient to reduce).
    # order="auto": the planner may reorder a buffer (same layout as the given
    # order for "element" granularity; less padding for coarse units)
    layouts = [
        item
        for subset in (
            [(n, p) for n, p in named if p.requires_grad],
            [(n, p) for n, p in named if not p.requires_grad],
        )
        if subset
        for item in layouts_from_tensors(
            [(n, local_tensor(p)) for n, p in subset],
            placing.world,
            granularity=granularity,
            order="auto",
        ).items()
    ]
    by_name = dict(named)
    bufs = []
    for dtype, layout in layouts:
        start, stop = layout.rank_ranges[placing.rank]
        if offload_device is not None:
            # the shard (and the optimizer state made from it) on the offload device
            fb = FlatBuffer(
                layout,
                placing.mesh,
                placing.dp_dim,
                local=torch.zeros(
                    stop - start, dtype=dtype, device=offload_device, pin_memory=pin_memory
                ),
            )
        else:
            fb = FlatBuffer(layout, placing.mesh, placing.dp_dim, device=device)
        with torch.no_grad():
            own = {n: local_tensor(by_name[n]).detach() for n in layout.names}
            if src is None:
                fb.load_full(own)
            else:
                scatter_from_source(fb, own, placing, src)
        compute = (
            mp.param_dtype if (mp.param_dtype is not None and dtype.is_floating_point) else dtype
        )
        reduce = (
            mp.reduce_dtype
            if (mp.reduce_dtype is not None and dtype.is_floating_point)
            else compute
        )
        full = torch.empty(layout.numel, dtype=compute, device=device)
        gfull = torch.empty(layout.numel, dtype=compute, device=device)
        gshard = torch.zeros(
            stop - start, dtype=dtype, device=fb.local.device, pin_memory=pin_memory
        )
        cshard = (
            torch.empty(fb.local.numel(), dtype=compute, device=device)
            if compute != dtype
            else None
        )
        dshard = (
            torch.empty(fb.local.numel(), dtype=dtype, device=device)
            if offload_device is not None and cshard is None
            else None
        )
        sharded, leaves, grad_dts, trainable = {}, {}, {}, []

        for slot in layout.params:
            orig = by_name[slot.name]
            geo, geo_kw = placing.geometry(orig, fb, slot)
            sp = nn.Parameter(
                from_local(fb.local_view(slot.name).detach(), *geo, **geo_kw),
                requires_grad=orig.requires_grad,
            )
            sharded[slot.name] = sp
            SHARDED[id(sp)] = sp
            view = full[slot.offset : slot.stop].view(slot.shape)
            leaf = nn.Parameter(placing.compute(orig, view), requires_grad=orig.requires_grad)
            leaves[slot.name] = leaf
            if orig.requires_grad:
                trainable.append(slot.name)
            if dtype.is_floating_point:  # may require grad later (unfrozen)
                gview = gfull[slot.offset : slot.stop].view(slot.shape)
                leaf.grad = placing.compute(orig, gview)
                grad_dts[slot.name] = from_local(fb.local_view(slot.name, gshard), *geo, **geo_kw)
        free_storage(full)
        free_storage(gfull)
        if dshard is not None:
            free_storage(dshard)
        bufs.append(
            Buf(
                fb,
                list(layout.names),
                dtype,
                compute,
                reduce,
                full,
                gfull,
                gshard,
                cshard,
                sharded,
                leaves,
                grad_dts,
                trainable,
                dshard,
                offload_device is not None,
            )
        )
    return bufs


def scatter_from_source(
    fb: Any,
    tensors: dict[str, torch.Tensor],
    placing: Placing,
    src: int,
) -> None:
    """Fill ``fb``'s shard with the source rank's values.

    The rank at coordinate ``src`` of the sharded dim (on HSDP's replicate dim: of the
    replicas at coordinate ``src``) scatters its own ``tensors``
    (`vescale.ragged.FlatBuffer.load_full_from`), each rank receiving only its slice;
    HSDP then broadcasts each slice
    from replica ``src`` over the replicate dim. The source sends about the buffer's
    bytes once, every other rank receives its ``1/N``: a broadcast of the full model
    would send ``N`` times as much.
    """
    mesh, rep = placing.mesh, placing.replicate_dim
    if rep is None or mesh.get_local_rank(rep) == src:
        fb.load_full_from(tensors, src)  # one scatter over the sharded dim
    if rep is not None and mesh.size(rep) > 1:
        dist.broadcast(fb.local, group=mesh.get_group(rep), group_src=src)


def assign_groups(group_modules, paths, params) -> dict[int, int]:
    """Owner group of every parameter: the deepest group containing all of its uses."""
    names = [n for n, _ in group_modules]

    def chain(mod_qual: str) -> list[int]:
        out = []
        for gi, gname in enumerate(names):
            if gname == "" or mod_qual == gname or mod_qual.startswith(gname + "."):
                out.append(gi)
        return out

    owner = {}
    for pid in params:
        common: set[int] | None = None
        for _m, _a, qual in paths[pid]:
            mod_qual = qual.rpartition(".")[0]
            c = set(chain(mod_qual))
            common = c if common is None else common & c
        assert common, "the root group contains every parameter"
        owner[pid] = max(common, key=lambda gi: len(names[gi]))
    return owner


def default_groups(module: nn.Module) -> list[str]:
    """Every element of an ``nn.ModuleList`` (transformer blocks), outermost lists only."""
    out: list[str] = []
    for name, mod in module.named_modules():
        if isinstance(mod, nn.ModuleList) and not any(
            name.startswith(o + ".") or name == o for o in out
        ):
            # registered keys, not range(len): a pipeline stage holds only its own blocks
            keys = [k for k, c in mod._modules.items() if c is not None]
            out.extend(f"{name}.{k}" if name else k for k in keys)
    return out
