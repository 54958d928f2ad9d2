"""The flat-buffer engine: `FlatBuffer` (one storage per dtype) and its collectives.

A `FlatLayout` (from `plan_flat_buffers`) says where many parameters live in one
flat buffer per dtype and which ``[start, stop)`` slice of it each rank of a mesh dim
owns. Given a layout and a mesh dim, a ``FlatBuffer`` owns the rank's slice: every
parameter's local tensor is a view of it, and `FlatBuffer.dtensor` wraps it as a
DTensor whose placement on the mesh dim is the parameter's ``RaggedShard``
(``Replicate()`` on the other dims). Its collectives move a whole buffer at once,
straight between flat buffers, with no copy-in or copy-out; each one runs
synchronously or, with ``async_op=True``, returns a `FlatWork` whose ``wait()``
finishes it:

* `FlatBuffer.all_gather` gathers every rank's slice into an unsharded buffer
  whose per-parameter views (`FlatBuffer.full_views`) are the full parameters
  (FSDP's unshard, ZeRO's parameter gather);
* `FlatBuffer.reduce_scatter` reduces an unsharded buffer (e.g. gradients) into
  the rank's slice (FSDP's and ZeRO's gradient reduction);
* `FlatBuffer.all_reduce` reduces a whole buffer, unsharded or a slice, over the
  mesh dim or another one (DDP's gradient buckets, HSDP's replicate dim).

The buffers a collective takes may have any dtype (a bf16 compute copy of an fp32
shard, a gradient buffer in the reduce dtype): the layout fixes element counts and
offsets, not the element type.

With an *even* layout (the planner's default) each is one even collective. With a
weighted layout (uneven slices) the gather and the reduce-scatter are
`vescale.dtensor.collectives.all_gather_uneven` / ``reduce_scatter_uneven`` (gloo
has no uneven all-gather) plus one copy into the destination, which
`FlatBuffer.extra_copy_bytes` counts.

`bucket_specs` groups parameters into size-capped, one-dtype buckets (DDP's and
ZeRO's gradient buckets), each then planned as one `FlatLayout`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from vescale.dtensor import resolve_mesh_dim
from vescale.dtensor.collectives import all_gather_uneven, reduce_scatter_uneven
from vescale.ragged import _compat
from vescale.ragged._planner import FlatLayout, ParamSpec

__all__ = ["FlatBuffer", "FlatWork", "bucket_specs"]

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class FlatWork:
    """A `FlatBuffer` collective in flight (``async_op=True``).

    ``wait()`` blocks until it finished and returns its result (the destination
    buffer); it is idempotent. A ``FlatWork`` of a collective that needed no
    communication (one rank) is already complete.
    """

    def __init__(self, works: Sequence[Any], finish: Callable[[], torch.Tensor]) -> None:
        self._works = list(works)
        self._finish = finish
        self._result: torch.Tensor | None = None
        self._done = False

    def wait(self) -> torch.Tensor:
        """Wait for the collective; return the destination buffer."""
        if not self._done:
            for w in self._works:
                w.wait()
            self._works = []
            self._result = self._finish()
            self._done = True
        return self._result  # type: ignore[return-value]

    def is_completed(self) -> bool:
        """Whether `wait` has already returned."""
        return self._done


def _finished(value: torch.Tensor, async_op: bool) -> Any:
    return FlatWork([], lambda: value) if async_op else value


def _reduce_op(op: str) -> dist.ReduceOp:
    if op not in _REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    return _REDUCE_OPS[op]


def bucket_specs(
    params: Iterable[ParamSpec | tuple], cap_bytes: float | None = None
) -> list[list[ParamSpec]]:
    """Group parameters into one-dtype buckets of at most ``cap_bytes`` each.

    Parameters are taken in order; each dtype has one open bucket, which is closed
    when the next parameter of its dtype would take it over ``cap_bytes`` (a larger
    parameter gets a bucket of its own). ``None``: one bucket per dtype. Plan each
    bucket with `plan_flat_buffers` (one `FlatLayout` each).

    Args:
        params: `ParamSpec` objects or ``(name, shape, dtype[, granularity])`` tuples.
        cap_bytes: Largest bucket in bytes, or ``None``.

    Returns:
        The buckets in the order they were opened, each a list of specs in the
        given order.
    """
    buckets: list[list[ParamSpec]] = []
    open_: dict[torch.dtype, tuple[list[ParamSpec], int]] = {}
    for item in params:
        spec = item if isinstance(item, ParamSpec) else ParamSpec(*item)
        nbytes = spec.dtype.itemsize
        for s in spec.shape:
            nbytes *= s
        cur = open_.get(spec.dtype)
        if cur is None or (cap_bytes is not None and cur[0] and cur[1] + nbytes > cap_bytes):
            cur = ([], 0)
            buckets.append(cur[0])
        cur[0].append(spec)
        open_[spec.dtype] = (cur[0], cur[1] + nbytes)
    return buckets


class FlatBuffer:
    """The rank's shard of one dtype's flat buffer, on one mesh dim.

    Args:
        layout: The plan (from `plan_flat_buffers`).
        mesh: Device mesh; the buffer is sharded over ``mesh_dim`` and replicated
            over the other dims.
        mesh_dim: Index or name of the sharded mesh dim (see
            `vescale.dtensor.resolve_mesh_dim`).
        device: Device of the storage; default: the mesh's device type (current
            device index for CUDA).
        local: Optional existing storage for the slice (1-D, contiguous, the
            rank's slice length; any dtype, e.g. fp32 masters of a bf16 layout, or a
            view of an unsharded buffer); zeros of the layout's dtype are allocated
            when ``None``.

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
        mesh_dim = resolve_mesh_dim(mesh, mesh_dim, "mesh_dim")
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
        self.local = local
        self.extra_copy_bytes = 0
        self._global_ranks: list[int] | None = None
        self._slice_sizes = [b - a for a, b in layout.rank_ranges]
        # the end of the last parameter: trailing padding is never sent by all_reduce
        self._data_stop = max((p.stop for p in layout.params), default=0)
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

    def load_full_from(self, tensors: Mapping[str, torch.Tensor] | None, src: int) -> None:
        """Fill every rank's shard with the full parameters of the rank at ``src``.

        The rank at coordinate ``src`` of the mesh dim lays ``tensors`` out in one
        unsharded buffer and scatters it (one ``scatter``; uneven slices padded to the
        longest): it sends the buffer's bytes once and every rank receives only its
        slice, where a broadcast of the full parameters would send ``N`` times as much.
        A collective over the mesh dim: every rank calls it.

        Args:
            tensors: ``name -> full tensor`` (plain tensors) on the source rank, every
                name of the layout; ignored on the others (may be ``None``).
            src: The source's coordinate on the mesh dim.

        Raises:
            ValueError: ``src`` is not a coordinate of the mesh dim (before any
                communication).
            KeyError: The source lacks a parameter of the layout.
        """
        sizes = self._slice_sizes
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < len(sizes):
            raise ValueError(f"load_full_from: src={src!r} is not in [0, {len(sizes)})")
        if len(sizes) == 1:
            self.load_full(tensors)
            return
        longest = max(sizes)
        recv = torch.empty(longest, dtype=self.layout.dtype, device=self.local.device)
        chunks = None
        if self.rank == src:
            missing = [n for n in self.layout.names if tensors is None or n not in tensors]
            if missing:
                raise KeyError(f"load_full_from: missing parameter {missing[0]!r}")
            full = self.new_full_buffer(zero=True)
            for name, view in self.full_views(full).items():
                view.copy_(tensors[name].detach().reshape(view.shape))
            if all(n == longest for n in sizes) and full.numel() == longest * len(sizes):
                staged = full  # the slices are the buffer's consecutive pieces
            else:
                staged = full.new_zeros(longest * len(sizes))
                for q, (a, b) in enumerate(self.layout.rank_ranges):
                    staged[q * longest : q * longest + b - a].copy_(full[a:b])
            chunks = list(staged.split(longest))  # the slices, in rank order (views)
        dist.scatter(recv, chunks, src=self._src_rank(src), group=self._group)
        self.local.copy_(recv[: sizes[self.rank]])

    # ------------------------------------------------------------------ unsharded
    def new_full_buffer(
        self,
        *,
        zero: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """A new unsharded (global) buffer of `FlatLayout.numel` elements.

        Args:
            zero: Zero it (padding included).
            dtype: Element type; default: the layout's.
            device: Device; default: that of `local`.
        """
        make = torch.zeros if zero else torch.empty
        return make(
            self.layout.numel,
            dtype=self.layout.dtype if dtype is None else dtype,
            device=self.local.device if device is None else device,
        )

    def new_slice(self, *, dtype: torch.dtype | None = None, zero: bool = False) -> torch.Tensor:
        """A new buffer shaped like the rank's slice (`local`), e.g. a gradient shard."""
        make = torch.zeros if zero else torch.empty
        return make(
            self.local.numel(),
            dtype=self.layout.dtype if dtype is None else dtype,
            device=self.local.device,
        )

    def padding_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every run of padding in the unsharded buffer."""
        out, pos = [], 0
        for p in sorted(self.layout.params, key=lambda q: q.offset):
            if p.offset > pos:
                out.append((pos, p.offset))
            pos = max(pos, p.stop)
        if pos < self.layout.numel:
            out.append((pos, self.layout.numel))
        return out

    def full_views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every parameter's full tensor as a view of an unsharded ``buffer``."""
        self._check_full(buffer, "buffer")
        return {p.name: buffer[p.offset : p.stop].view(p.shape) for p in self.layout.params}

    def _check_full(self, buffer: torch.Tensor, what: str) -> None:
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != self.layout.numel:
            raise ValueError(
                f"{what} must be a 1-D contiguous tensor of {self.layout.numel} elements (the "
                f"unsharded buffer), got {buffer.dtype} shape {tuple(buffer.shape)}"
            )

    def _check_slice(self, t: torch.Tensor, what: str, dtype: torch.dtype | None = None) -> None:
        n = self.local.numel()
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != n:
            raise ValueError(
                f"{what} must be a 1-D contiguous tensor of {n} elements (the rank's slice), "
                f"got {t.dtype} shape {tuple(t.shape)}"
            )
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{what} has dtype {t.dtype}, expected {dtype}")

    # ------------------------------------------------------------------ collectives
    def all_gather(
        self,
        out: torch.Tensor | None = None,
        *,
        src: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | FlatWork:
        """Gather every rank's slice into an unsharded buffer (no copy-in/copy-out).

        Args:
            out: Destination unsharded buffer (see `new_full_buffer`), of ``src``'s
                dtype; a new one when ``None`` (on one rank: ``src`` itself).
            src: What this rank sends: `local` (default) or another slice-shaped
                buffer, e.g. a compute-dtype cast of it or a copy on the compute
                device.
            async_op: Return a `FlatWork` at once.

        Returns:
            The unsharded buffer (or a `FlatWork` whose ``wait()`` returns it);
            `full_views` gives the full parameters.
        """
        src = self.local if src is None else src
        self._check_slice(src, "src")
        if self.layout.num_ranks == 1 and out is None:
            return _finished(src, async_op)  # one rank: the shard is the whole buffer
        if out is None:
            out = self.new_full_buffer(dtype=src.dtype, device=src.device)
        self._check_full(out, "out")
        if out.dtype != src.dtype:
            raise ValueError(f"out has dtype {out.dtype} but src has {src.dtype}")
        if self.layout.num_ranks == 1:
            if out.data_ptr() != src.data_ptr():
                out.copy_(src)
                self.extra_copy_bytes += src.numel() * src.element_size()
            return _finished(out, async_op)
        if self.layout.even:
            work = _compat.all_gather_single(out, src, group=self._group, async_op=async_op)
            return FlatWork([work], lambda: out) if async_op else out
        handle = all_gather_uneven(
            src, (self.mesh, self.mesh_dim), 0, True, sizes=self._slice_sizes, method="pad"
        )
        return self._copy_when_done(handle, out, async_op)

    def _src_rank(self, q: int) -> int:
        """The global rank of coordinate ``q`` on the mesh dim (a broadcast's source)."""
        if self._global_ranks is None:
            self._global_ranks = [
                dist.get_global_rank(self._group, i) for i in range(self.layout.num_ranks)
            ]
        return self._global_ranks[q]

    def broadcast_slices(
        self, out: torch.Tensor, *, src: torch.Tensor | None = None, async_op: bool = False
    ) -> torch.Tensor | FlatWork:
        """`all_gather` as one broadcast per rank, from its slice into ``out``.

        The same bytes as an all-gather, for backends whose all-gather is slower than
        their broadcast: on gloo, ``all_gather_into_tensor`` stages its output through
        a second buffer and measured 2-6x slower than ``N`` broadcasts of the slices.
        Works for even and weighted layouts alike (no padding is sent).

        Args:
            out: Destination unsharded buffer (see `new_full_buffer`).
            src: This rank's slice (default `local`); copied into ``out`` unless it
                already is ``out``'s slice of this rank (then nothing is copied).
            async_op: Return a `FlatWork` at once.

        Returns:
            ``out`` (or a `FlatWork` whose ``wait()`` returns it).
        """
        src = self.local if src is None else src
        self._check_slice(src, "src")
        self._check_full(out, "out")
        if out.dtype != src.dtype:
            raise ValueError(f"out has dtype {out.dtype} but src has {src.dtype}")
        a, b = self.layout.rank_ranges[self.rank]
        if src.data_ptr() != out[a:b].data_ptr() or b == a:
            out[a:b].copy_(src)
            self.extra_copy_bytes += src.numel() * src.element_size()
        works = []
        if self.layout.num_ranks > 1:
            for q, (a, b) in enumerate(self.layout.rank_ranges):
                if b > a:
                    works.append(
                        dist.broadcast(
                            out[a:b], src=self._src_rank(q), group=self._group, async_op=True
                        )
                    )
        work = FlatWork(works, lambda: out)
        return work if async_op else work.wait()

    def broadcast_pieces(
        self, dst: Mapping[str, torch.Tensor], *, async_op: bool = False
    ) -> FlatWork | None:
        """Gather every parameter in place: one broadcast per non-empty piece.

        Each rank's piece of each parameter is broadcast by its owner straight into
        ``dst[name]``, the flattened full (dense, per-rank local) tensor of that
        parameter, on every rank; the owner's own piece must already be in place. No
        flat buffer and no copy at all, at the price of one collective per piece (at
        most ``len(params) + N - 1``), so it suits few large parameters on backends
        with a slow all-gather (gloo); `all_gather` or `broadcast_slices` suit many
        small ones.

        Args:
            dst: ``name -> 1-D contiguous tensor`` of the parameter's ``numel``, for
                every name of the layout.
            async_op: Return a `FlatWork` (``wait()`` returns ``None``) at once.

        Returns:
            ``None``, or a `FlatWork` with ``async_op=True``.
        """
        works = []
        multi = self.layout.num_ranks > 1
        for slot in self.layout.params:
            t = dst[slot.name]
            if t.dim() != 1 or not t.is_contiguous() or t.numel() != slot.stop - slot.offset:
                raise ValueError(
                    f"dst[{slot.name!r}] must be a 1-D contiguous tensor of "
                    f"{slot.stop - slot.offset} elements, got shape {tuple(t.shape)}"
                )
            if not multi:
                continue
            for q, a, b in self._pieces(slot):
                works.append(
                    dist.broadcast(t[a:b], src=self._src_rank(q), group=self._group, async_op=True)
                )
        work = FlatWork(works, lambda: None)  # type: ignore[arg-type,return-value]
        if async_op:
            return work
        work.wait()
        return None

    def num_pieces(self) -> int:
        """Non-empty (parameter, rank) pieces: the broadcasts of `broadcast_pieces`."""
        return sum(len(self._pieces(slot)) for slot in self.layout.params)

    def _pieces(self, slot: Any) -> list[tuple[int, int, int]]:
        """``(rank, start, stop)`` of ``slot``'s non-empty pieces, inside the parameter."""
        out = []
        for q in range(slot.first_rank, slot.last_rank + 1):
            a, b = self.layout.piece(slot.name, q)
            if b > a:
                out.append((q, a - slot.offset, b - slot.offset))
        return out

    def reduce_scatter(
        self,
        grad_flat: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        op: str = "sum",
        async_op: bool = False,
    ) -> torch.Tensor | FlatWork:
        """Reduce an unsharded buffer over the mesh dim into the rank's slice.

        Args:
            grad_flat: Unsharded buffer with this layout (e.g. a buffer from
                `new_full_buffer` whose `full_views` were the ``.grad`` of
                the full parameters), any dtype.
            out: Destination slice (1-D, the rank's slice length, ``grad_flat``'s
                dtype); new when ``None`` (on one rank: ``grad_flat`` itself).
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
            async_op: Return a `FlatWork` at once.

        Returns:
            The reduced slice (or a `FlatWork` whose ``wait()`` returns it);
            `local_views` with it as ``storage`` gives the per-parameter shards.
        """
        self._check_full(grad_flat, "grad_flat")
        rop = _reduce_op(op)
        if self.layout.num_ranks == 1 and out is None:
            return _finished(grad_flat, async_op)  # one rank: nothing to reduce
        if out is None:
            out = torch.empty(self.local.numel(), dtype=grad_flat.dtype, device=grad_flat.device)
        else:
            self._check_slice(out, "out", grad_flat.dtype)
        if self.layout.num_ranks == 1:
            a, b = self.layout.rank_ranges[0]
            out.copy_(grad_flat[a:b])
            self.extra_copy_bytes += (b - a) * out.element_size()
            return _finished(out, async_op)
        if self.layout.even:
            work = _compat.reduce_scatter_single(
                out, grad_flat, op=rop, group=self._group, async_op=async_op
            )
            return FlatWork([work], lambda: out) if async_op else out
        handle = reduce_scatter_uneven(
            grad_flat, self._slice_sizes, (self.mesh, self.mesh_dim), 0, op, True
        )
        return self._copy_when_done(handle, out, async_op)

    def _copy_when_done(self, handle: Any, out: torch.Tensor, async_op: bool) -> Any:
        """Uneven path: the collective's result (a new tensor) copied into ``out``."""

        def finish() -> torch.Tensor:
            out.copy_(handle.wait())
            self.extra_copy_bytes += out.numel() * out.element_size()
            return out

        work = FlatWork([], finish)
        return work if async_op else work.wait()

    def all_reduce(
        self,
        buffer: torch.Tensor,
        *,
        op: str = "sum",
        mesh_dim: int | str | None = None,
        async_op: bool = False,
    ) -> torch.Tensor | FlatWork:
        """Reduce a whole buffer in place over a mesh dim (every rank gets the result).

        Args:
            buffer: An unsharded buffer of this layout (trailing padding is not
                sent) or a slice-shaped one (e.g. a gradient shard), any dtype.
            op: ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``.
            mesh_dim: The mesh dim to reduce over: the buffer's own (default) or
                another one, e.g. HSDP's replicate dim.
            async_op: Return a `FlatWork` at once.

        Returns:
            ``buffer`` (or a `FlatWork` whose ``wait()`` returns it).
        """
        rop = _reduce_op(op)
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"buffer must be 1-D and contiguous, got shape {tuple(buffer.shape)}")
        if buffer.numel() == self.layout.numel:
            sent = buffer[: self._data_stop]
        elif buffer.numel() == self.local.numel():
            sent = buffer
        else:
            raise ValueError(
                f"buffer has {buffer.numel()} elements; expected the unsharded buffer "
                f"({self.layout.numel}) or the rank's slice ({self.local.numel()})"
            )
        dim = self.mesh_dim if mesh_dim is None else resolve_mesh_dim(self.mesh, mesh_dim)
        if self.mesh.size(dim) == 1 or sent.numel() == 0:
            return _finished(buffer, async_op)
        group = self._group if dim == self.mesh_dim else self.mesh.get_group(dim)
        work = dist.all_reduce(sent, op=rop, group=group, async_op=async_op)
        return FlatWork([work], lambda: buffer) if async_op else buffer

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
