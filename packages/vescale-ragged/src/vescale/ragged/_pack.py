"""Pack kernels: copy many tensors into one contiguous buffer and back.

A `PackKernels` object is chosen per device type through the
``vescale_pack_kernels`` hook (see `vescale.ragged.hookspecs`): the torch
implementation (`TorchPackKernels`, any device) answers ``trylast``; the
Triton implementation (`vescale.ragged._triton_pack`, CUDA) answers above it
when Triton is installed. `get_pack_kernels` asks once per device type and
caches the answer.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence

import torch

# The torch privates the kernels use are probed in _compat (public fallbacks there).
from vescale.ragged._compat import check_torch_internals  # noqa: F401  (the name is kept)
from vescale.ragged._compat import flatten_dense as _flatten_dense
from vescale.ragged._compat import foreach_copy as _foreach_copy
from vescale.ragged._compat import unflatten_dense as _unflatten_dense

__all__ = ["PackKernels", "TorchPackKernels", "get_pack_kernels", "packed_numel"]


# Unbound accessors: mapping them over a list skips a Python frame per tensor.
_numel = torch.Tensor.numel
_dim = torch.Tensor.dim
_dtype = operator.attrgetter("dtype")


def packed_numel(tensors: Sequence[torch.Tensor]) -> int:
    """Total number of elements of ``tensors`` (the packed buffer's length)."""
    return sum(map(_numel, tensors))


class PackKernels:
    """Interface of pack/unpack kernels for one device type.

    ``pack`` writes the flattened tensors back to back into one 1-D buffer;
    ``unpack`` copies such a buffer back into the tensors. Both cast when the buffer
    and a tensor have different dtypes (with torch's ``copy_`` rounding).

    Attributes:
        name: Short name shown in benchmarks and errors.
    """

    name: str = "abstract"

    def pack(
        self,
        tensors: Sequence[torch.Tensor],
        out: torch.Tensor | None = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Copy ``tensors`` into one contiguous 1-D buffer.

        Args:
            tensors: Tensors on this device (any shapes, strides and dtypes).
            out: Destination, 1-D and contiguous, with at least
                `packed_numel` elements (the rest is left untouched). Its
                dtype is the buffer's dtype. A new buffer when ``None``.
            dtype: Dtype of a new buffer (``out=None``); default: the first
                tensor's dtype. Must match ``out.dtype`` when both are given.

        Returns:
            ``out`` (or the new buffer).
        """
        raise NotImplementedError

    def unpack(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copy consecutive pieces of the 1-D ``buffer`` into ``tensors`` (in place).

        Args:
            buffer: 1-D contiguous buffer with at least `packed_numel` elements.
            tensors: Destinations; each receives its ``numel()`` elements, cast to its
                dtype.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


# --------------------------------------------------------------------------- helpers
def _check_out(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None,
    dtype: torch.dtype | None,
    total: int | None = None,
) -> torch.Tensor:
    if total is None:
        total = packed_numel(tensors)
    if out is None:
        if dtype is None:
            if not tensors:
                raise ValueError("pack() of no tensors needs dtype= or out=")
            dtype = tensors[0].dtype
        device = tensors[0].device if tensors else None
        return torch.empty(total, dtype=dtype, device=device)
    if dtype is not None and dtype != out.dtype:
        raise ValueError(f"pack(): dtype={dtype} but out has dtype {out.dtype}")
    check_buffer(out, total, "out")
    return out


def check_buffer(buffer: torch.Tensor, total: int, what: str = "buffer") -> None:
    """Raise ``ValueError`` unless ``buffer`` is 1-D, contiguous and long enough."""
    if buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(
            f"{what} must be a 1-D contiguous tensor, got shape {tuple(buffer.shape)} "
            f"stride {buffer.stride()}"
        )
    if buffer.numel() < total:
        raise ValueError(f"{what} has {buffer.numel()} elements; the tensors need {total}")


def _views(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer``'s consecutive pieces, shaped like ``tensors`` (one C++ call)."""
    return _unflatten_dense(buffer, tensors)


#: Pack stages tensors through one C++ flatten (a temporary) and one ``copy_`` when their
#: mean size is below these many elements: 1 us of Python per view costs more than the
#: extra pass over the data. ``_STAGE_SAME``: tensors already of the buffer's dtype (else
#: ``torch.cat(out=)`` of flat views); ``_STAGE_CAST``: casts or mixed dtypes (else
#: ``torch._foreach_copy_`` into views of the buffer).
_STAGE_SAME = 1024
_STAGE_CAST = 4096
#: Most elements staged by one flatten (bounds the temporary).
_STAGE_CHUNK = 1 << 20


def _stage_run(dst: torch.Tensor, tensors: Sequence[torch.Tensor], off: int, n: int) -> None:
    if n == 0:
        return
    piece = dst[off : off + n]
    if len(tensors) == 1:
        piece.view_as(tensors[0]).copy_(tensors[0])  # no temporary
    else:
        piece.copy_(_flatten_dense(tensors))


def _stage(
    dst: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    sizes: list[int],
    dtypes: list[torch.dtype],
    total: int,
) -> None:
    """Copy ``tensors`` into ``dst`` (exactly ``total`` elements) through staged flattens.

    Each flatten takes consecutive tensors of one dtype (so it never promotes), at most
    ``_STAGE_CHUNK`` elements (or one larger tensor); ``copy_`` then casts as it would
    tensor by tensor. Dtypes that alternate every few tensors go through
    ``torch._foreach_copy_`` instead.
    """
    count = len(tensors)
    if total <= _STAGE_CHUNK and dtypes.count(dtypes[0]) == count:
        _stage_run(dst, tensors, 0, total)
        return
    runs = []
    start = off = run = 0
    for i, n in enumerate(sizes):
        if i != start and (run + n > _STAGE_CHUNK or dtypes[i] != dtypes[start]):
            runs.append((start, i, off, run))
            start, off, run = i, off + run, 0
        run += n
    runs.append((start, count, off, run))
    if len(runs) * 4 > count:
        _foreach_copy(_views(dst, tensors), tensors)
        return
    for start, end, off, run in runs:
        _stage_run(dst, tensors[start:end], off, run)


class TorchPackKernels(PackKernels):
    """Pack kernels in plain torch (any device).

    Copies run under ``torch.no_grad()`` (tensors may be parameters that require grad).
    Per-tensor Python work is what costs for many small tensors, so the strategy
    depends on the tensors (chosen from their sizes, dtypes and dims):

    * pack, 1-D tensors (none empty), of any dtypes ``torch.cat`` casts to the buffer's:
      one ``torch.cat(out=)`` straight away (cat checks the dims and dtypes in C++ and
      casts like ``copy_``; what it refuses takes the paths below);
    * pack, small tensors (mean below ``_STAGE_SAME`` / ``_STAGE_CAST`` elements):
      ``torch._C._nn.flatten_dense_tensors`` (flattening in C++) into a temporary, then
      one ``copy_`` into the buffer (which casts);
    * pack, large tensors: ``torch.cat(out=)`` of flat views when contiguous and of the
      buffer's dtype, else ``torch._foreach_copy_`` into views of the buffer;
    * unpack, 1-D tensors of the buffer's dtype: ``torch.split_with_sizes_copy(out=)``;
      else ``torch._foreach_copy_`` from ``torch._C._nn.unflatten_dense_tensors`` views
      (one C++ call; ``Tensor.view(t.shape)`` from Python cost 3-6 us a tensor here).

    Measured on CPU (``OMP_NUM_THREADS=1``, fp32, best of several runs of
    ``benchmarks/ragged_bench.py`` and of old/new side by side on a noisy 2-core
    machine), 1000 tensors of 100 elements: pack 0.19 ms against 0.18 ms for one
    ``torch.cat(out=)`` (was 0.27 ms, 2.2x, with Python passes over dtypes and dims;
    the one pass left reads the sizes); unpack 1.3-1.9 ms, 1.15-1.3x one
    ``torch.split_with_sizes_copy`` (whose per-piece views and copies dominate); pack
    fp32->bf16 1.1-1.5 ms and unpack bf16->fp32 1.7-2.5 ms (were 6-9 ms through
    per-tensor views). 1000 tensors of 10x10: pack 1.2 ms (2.3 ms with ``torch.cat`` of
    ``view(-1)``s), unpack 2.9 ms. 20 tensors of 500k elements: every path within 10%
    of ``torch.cat(out=)``.
    """

    name = "torch"

    def pack(self, tensors, out=None, *, dtype=None):
        if not isinstance(tensors, (list, tuple)):
            tensors = list(tensors)
        sizes = list(map(_numel, tensors))
        total = sum(sizes)
        out = _check_out(tensors, out, dtype, total)
        if not tensors:
            return out
        if tensors[0].dim() == 1 and 0 not in sizes:
            # Fast path: torch.cat checks dims and dtypes itself (no Python pass over the
            # tensors). Without empty tensors (which cat would skip) it refuses any tensor
            # that is not 1-D, and casts like copy_ where it accepts the dtype; what it
            # refuses takes the general path below.
            try:
                with torch.no_grad():
                    torch.cat(tensors, out=out.view(-1)[:total])
                return out
            except (RuntimeError, TypeError):
                pass
        count = len(tensors)
        dtypes = list(map(_dtype, tensors))
        same = dtypes.count(out.dtype) == count
        with torch.no_grad():
            dst = out if total == out.numel() else out[:total]
            if same and set(map(_dim, tensors)) == {1}:
                torch.cat(tensors, out=dst)
            elif total < count * (_STAGE_SAME if same else _STAGE_CAST):
                _stage(dst, tensors, sizes, dtypes, total)
            elif same and all(t.is_contiguous() for t in tensors):
                torch.cat([t if t.dim() == 1 else t.view(-1) for t in tensors], out=dst)
            else:
                _foreach_copy(_views(dst, tensors), tensors)
        return out

    def unpack(self, buffer, tensors):
        if not isinstance(tensors, (list, tuple)):
            tensors = list(tensors)
        sizes = list(map(_numel, tensors))
        total = sum(sizes)
        check_buffer(buffer, total)
        if not tensors:
            return
        with torch.no_grad():
            src = buffer if total == buffer.numel() else buffer[:total]
            if set(map(_dim, tensors)) != {1}:
                _foreach_copy(tensors, _views(src, tensors))
            elif list(map(_dtype, tensors)).count(buffer.dtype) == len(tensors):
                torch.split_with_sizes_copy(src, sizes, out=tensors)
            else:  # 1-D: flat pieces need no reshaping
                _foreach_copy(tensors, src.split_with_sizes(sizes))


# --------------------------------------------------------------------------- selection
_cache: dict[str, PackKernels] = {}
_lock = threading.Lock()
_callback_added = False


def _clear_cache() -> None:
    _cache.clear()


def _ensure_registered(pm) -> None:
    """Register this package's pack hooks if nothing provides them yet.

    The ``vescale`` entry point (``vescale.ragged._plugin``) normally brings them in;
    this keeps `get_pack_kernels` working when it does not (yet) re-export them.
    """
    hook = getattr(pm.hook, "vescale_pack_kernels", None)
    if hook is not None and hook.get_hookimpls():
        return
    from vescale.dtensor import register_plugin
    from vescale.ragged import _pack_plugin

    if not pm.is_registered(_pack_plugin):
        register_plugin(_pack_plugin, name="vescale.ragged.pack")


def get_pack_kernels(device_type: str | torch.device) -> PackKernels:
    """The pack kernels for ``device_type`` (the ``vescale_pack_kernels`` hook's answer, cached).

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ... or a ``torch.device``.

    Raises:
        RuntimeError: No plugin answers for this device type.
    """
    global _callback_added
    key = device_type.type if isinstance(device_type, torch.device) else str(device_type)
    kernels = _cache.get(key)
    if kernels is not None:
        return kernels
    from vescale.dtensor import get_plugin_manager
    from vescale.dtensor.plugin.manager import add_cache_invalidation_callback

    with _lock:
        if not _callback_added:
            add_cache_invalidation_callback(_clear_cache)
            _callback_added = True
        pm = get_plugin_manager()
        _ensure_registered(pm)
        kernels = pm.hook.vescale_pack_kernels(device_type=key)
        if kernels is None:
            raise RuntimeError(f"no vescale_pack_kernels implementation for device type {key!r}")
        _cache[key] = kernels
    return kernels
