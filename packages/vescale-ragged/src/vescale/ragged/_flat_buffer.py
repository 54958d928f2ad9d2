"""``FlatBuffer``: one contiguous storage per dtype for a rank's shard of many parameters.

Given a `FlatLayout` and a mesh dim, a ``FlatBuffer`` owns the
rank's slice of the layout's global buffer. Every parameter's local tensor is a view
of that slice, and `FlatBuffer.dtensor` wraps it as a DTensor whose placement
on the mesh dim is the parameter's ``RaggedShard`` (``Replicate()`` on the other
dims). Collectives move the whole buffer at once, straight between the flat
buffers, with no copy-in or copy-out:

* `FlatBuffer.all_gather` gathers every rank's slice into an unsharded buffer
  whose per-parameter views (`FlatBuffer.full_views`) are the full parameters;
* `FlatBuffer.reduce_scatter` reduces a flat gradient buffer (same layout)
  into the rank's gradient slice.

With an *even* layout (the planner's default) each is one even collective. With a
weighted layout (uneven slices; gloo has no uneven all-gather) the gather is one
broadcast per rank straight into the destination's views and the reduce-scatter
is one uneven ``reduce_scatter`` over views; only the rank's own slice is copied
locally in the gather, and `FlatBuffer.extra_copy_bytes` counts it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from vescale.ragged import _compat
from vescale.ragged._planner import FlatLayout

__all__ = ["FlatBuffer"]

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


class FlatBuffer:
    """The rank's shard of one dtype's flat buffer, on one mesh dim.

    Args:
        layout: The plan (from `plan_flat_buffers`).
        mesh: Device mesh; the buffer is sharded over ``mesh_dim`` and replicated
            over the other dims.
        mesh_dim: Index or name of the sharded mesh dim.
        device: Device of the storage; default: the mesh's device type (current
            device index for CUDA).
        local: Optional existing storage for the slice (1-D, contiguous, the
            layout's dtype and the rank's slice length); zeros are allocated when
            ``None``.

    Attributes:
        layout: The layout.
        mesh: The mesh.
        mesh_dim: Index of the sharded mesh dim.
        rank: This rank's coordinate on ``mesh_dim``.
        local: The rank's slice, a 1-D tensor (padding included).
        extra_copy_bytes: Bytes copied by this object's collectives besides the
            collectives themselves (zero for even layouts). Reset it freely.
    """

    def __init__(
        self,
        layout: FlatLayout,
        mesh: DeviceMesh,
        mesh_dim: int | str = 0,
        *,
        device: torch.device | str | None = None,
        local: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(layout, FlatLayout):
            raise TypeError(f"layout must be a FlatLayout, got {type(layout).__name__}")
        if isinstance(mesh_dim, str):
            names = mesh.mesh_dim_names or ()
            if mesh_dim not in names:
                raise ValueError(f"mesh has no dim named {mesh_dim!r} (dims: {names})")
            mesh_dim = names.index(mesh_dim)
        if not 0 <= mesh_dim < mesh.ndim:
            raise ValueError(f"mesh_dim {mesh_dim} out of range for a {mesh.ndim}-dim mesh")
        if mesh.size(mesh_dim) != layout.num_ranks:
            raise ValueError(
                f"layout planned for {layout.num_ranks} ranks but mesh dim {mesh_dim} has "
                f"{mesh.size(mesh_dim)}"
            )
        self.layout = layout
        self.mesh = mesh
        self.mesh_dim = mesh_dim
        self.rank = mesh.get_local_rank(mesh_dim)
        self._group = mesh.get_group(mesh_dim)
        self._group_ranks = dist.get_process_group_ranks(self._group)
        start, stop = layout.rank_ranges[self.rank]
        n = stop - start
        if local is None:
            if device is None:
                device = _mesh_device(mesh)
            local = torch.zeros(n, dtype=layout.dtype, device=device)
        elif local.dim() != 1 or not local.is_contiguous() or local.numel() != n:
            raise ValueError(
                f"local storage must be 1-D and contiguous with {n} elements, got shape "
                f"{tuple(local.shape)}"
            )
        elif local.dtype != layout.dtype:
            raise ValueError(f"local storage has dtype {local.dtype}, layout {layout.dtype}")
        self.local = local
        self.extra_copy_bytes = 0
        placements = []
        for slot in layout.params:
            p: list[Placement] = [Replicate()] * mesh.ndim
            p[mesh_dim] = slot.placement
            placements.append(tuple(p))
        self._placements = dict(zip(layout.names, placements))

    # ------------------------------------------------------------------ shards
    def placements(self, name: str) -> tuple[Placement, ...]:
        """The DTensor placements of ``name`` (one per mesh dim)."""
        self.layout[name]  # KeyError naming the parameter
        return self._placements[name]

    def local_view(self, name: str, storage: torch.Tensor | None = None) -> torch.Tensor:
        """``name``'s local tensor: a view of ``storage`` (default: `local`).

        ``storage`` may be any slice-shaped tensor with this layout, e.g. a gradient
        shard from `reduce_scatter`.
        """
        storage = self.local if storage is None else storage
        a, b = self.layout.local_range(name, self.rank)
        return storage[a:b].view(self.layout.local_shape(name, self.rank))

    def local_views(self, storage: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`local_view` of every parameter, in buffer order."""
        return {name: self.local_view(name, storage) for name in self.layout.names}

    def dtensor(self, name: str, *, requires_grad: bool = False) -> DTensor:
        """``name`` as a DTensor whose local tensor is a view of `local`.

        The result is a leaf; with ``requires_grad=True`` it can be wrapped in
        ``torch.nn.Parameter``.
        """
        from vescale.dtensor import from_local

        slot = self.layout[name]
        dt = from_local(
            self.local_view(name).detach(), self.mesh, self._placements[name], shape=slot.shape
        )
        if requires_grad:
            dt.requires_grad_(True)
        return dt

    def dtensors(self, *, requires_grad: bool = False) -> dict[str, DTensor]:
        """`dtensor` of every parameter, in buffer order."""
        return {n: self.dtensor(n, requires_grad=requires_grad) for n in self.layout.names}

    @torch.no_grad()
    def load_full(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy the rank's pieces of full (dense) parameters into the shard.

        Args:
            tensors: ``name -> full tensor``; every name of the layout is required.
        """
        for name in self.layout.names:
            if name not in tensors:
                raise KeyError(f"load_full: missing parameter {name!r}")
            full = tensors[name].detach()
            if isinstance(full, DTensor):
                full = full.full_tensor()
            self.local_view(name).copy_(self.layout.shard_of(name, full, self.rank))

    # ------------------------------------------------------------------ unsharded
    def new_full_buffer(self, *, zero: bool = False) -> torch.Tensor:
        """A new unsharded (global) buffer of `FlatLayout.numel` elements."""
        make = torch.zeros if zero else torch.empty
        return make(self.layout.numel, dtype=self.layout.dtype, device=self.local.device)

    def full_views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter's full tensor as a view of an unsharded ``buffer``."""
        self._check_full(buffer, "buffer")
        return {p.name: buffer[p.offset : p.stop].view(p.shape) for p in self.layout.params}

    def _check_full(self, buffer: torch.Tensor, what: str) -> None:
        if (
            buffer.dim() != 1
            or not buffer.is_contiguous()
            or buffer.numel() != self.layout.numel
            or buffer.dtype != self.layout.dtype
        ):
            raise ValueError(
                f"{what} must be a 1-D contiguous {self.layout.dtype} tensor of "
                f"{self.layout.numel} elements, got {buffer.dtype} shape {tuple(buffer.shape)}"
            )

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather every rank's slice into an unsharded buffer (no copy-in/copy-out).

        Args:
            out: Destination unsharded buffer (see `new_full_buffer`); a new
                one when ``None`` (on one rank: `local` itself).

        Returns:
            The unsharded buffer; `full_views` gives the full parameters.
        """
        if self.layout.num_ranks == 1 and out is None:
            return self.local  # one rank: the shard is the whole buffer
        out = self.new_full_buffer() if out is None else out
        self._check_full(out, "out")
        if self.layout.num_ranks == 1:
            if out.data_ptr() != self.local.data_ptr():
                out.copy_(self.local)
                self.extra_copy_bytes += self.local.numel() * self.local.element_size()
            return out
        if self.layout.even:
            _compat.all_gather_single(out, self.local, group=self._group)
            return out
        for q, (a, b) in enumerate(self.layout.rank_ranges):
            if a == b:
                continue
            if q == self.rank:
                out[a:b].copy_(self.local)
                self.extra_copy_bytes += (b - a) * self.local.element_size()
            dist.broadcast(out[a:b], src=self._group_ranks[q], group=self._group)
        return out

    def reduce_scatter(
        self,
        grad_flat: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        op: str = "sum",
    ) -> torch.Tensor:
        """Reduce a flat gradient buffer over the mesh dim into the rank's slice.

        Args:
            grad_flat: Unsharded gradient buffer with this layout (e.g. a buffer from
                `new_full_buffer` whose `full_views` were the ``.grad`` of
                the full parameters).
            out: Destination slice (1-D, the rank's slice length); new when ``None``
                (on one rank: ``grad_flat`` itself).
            op: ``"sum"`` or ``"avg"``.

        Returns:
            The reduced slice; `local_views` with it as ``storage`` gives the
            per-parameter gradient shards.
        """
        self._check_full(grad_flat, "grad_flat")
        if op not in _REDUCE_OPS:
            raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        if self.layout.num_ranks == 1 and out is None:
            return grad_flat  # one rank: nothing to reduce
        if out is None:
            out = torch.empty_like(self.local)
        elif (
            out.shape != self.local.shape
            or not out.is_contiguous()
            or out.dtype != self.local.dtype
        ):
            raise ValueError(
                f"out must be a contiguous {self.local.dtype} tensor of shape "
                f"{tuple(self.local.shape)}, got {out.dtype} {tuple(out.shape)}"
            )
        if self.layout.num_ranks == 1:
            a, b = self.layout.rank_ranges[0]
            out.copy_(grad_flat[a:b])
            self.extra_copy_bytes += (b - a) * out.element_size()
            return out
        if self.layout.even:
            _compat.reduce_scatter_single(out, grad_flat, op=_REDUCE_OPS[op], group=self._group)
            return out
        pieces = [grad_flat[a:b] for a, b in self.layout.rank_ranges]
        dist.reduce_scatter(out, pieces, op=_REDUCE_OPS[op], group=self._group)
        return out

    def __repr__(self) -> str:
        return (
            f"FlatBuffer({self.layout.dtype}, {len(self.layout.params)} params, "
            f"rank {self.rank}/{self.layout.num_ranks}, slice {self.local.numel()} of "
            f"{self.layout.numel})"
        )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)
