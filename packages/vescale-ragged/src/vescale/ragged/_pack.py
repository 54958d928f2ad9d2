"""Pack kernels: copy many tensors into one contiguous buffer and back.

A :class:`PackKernels` object is chosen per device type through the
``vescale_pack_kernels`` hook (see :mod:`vescale.ragged.hookspecs`): the torch
implementation (:class:`TorchPackKernels`, any device) answers ``trylast``; the
Triton implementation (:mod:`vescale.ragged._triton_pack`, CUDA) answers above it
when Triton is installed. :func:`get_pack_kernels` asks once per device type and
caches the answer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

__all__ = ["PackKernels", "TorchPackKernels", "get_pack_kernels", "packed_numel"]


def packed_numel(tensors: Sequence[torch.Tensor]) -> int:
    """Total number of elements of ``tensors`` (the packed buffer's length)."""
    return sum(t.numel() for t in tensors)


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
                :func:`packed_numel` elements (the rest is left untouched). Its
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
            buffer: 1-D contiguous buffer with at least :func:`packed_numel` elements.
            tensors: Destinations; each receives its ``numel()`` elements, cast to its
                dtype.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def _check_out(
    tensors: Sequence[torch.Tensor], out: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor:
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
    sizes = [t.numel() for t in tensors]
    total = sum(sizes)
    pieces = buffer[:total].split(sizes) if total < buffer.numel() else buffer.split(sizes)
    return [p.view(t.shape) for p, t in zip(pieces, tensors)]


class TorchPackKernels(PackKernels):
    """Pack kernels in plain torch (any device).

    Measured on CPU (``OMP_NUM_THREADS=1``, fp32; ``benchmarks/ragged_bench.py``):
    for contiguous tensors of the buffer's dtype, ``torch.cat(out=)`` packs and
    ``torch.split_with_sizes_copy(out=)`` unpacks fastest (1000 tensors of 100
    elements: 1.7 ms and 2.6 ms, against 9.5 ms and 10.4 ms for
    ``torch._foreach_copy_`` into per-tensor views, whose Python-side view creation
    dominates). Casts and non-contiguous tensors go through ``torch._foreach_copy_``
    (``torch.cat`` with a cast is 2x slower). Flattening a tensor that is not 1-D
    costs about 1 us of Python per tensor (``Tensor.view``).
    """

    name = "torch"

    def pack(self, tensors, out=None, *, dtype=None):
        out = _check_out(tensors, out, dtype)
        if not tensors:
            return out
        total = packed_numel(tensors)
        if all(t.dtype == out.dtype and t.is_contiguous() for t in tensors):
            torch.cat([t if t.dim() == 1 else t.view(-1) for t in tensors], out=out[:total])
        else:
            torch._foreach_copy_(_views(out, tensors), list(tensors))
        return out

    def unpack(self, buffer, tensors):
        total = packed_numel(tensors)
        check_buffer(buffer, total)
        if not tensors:
            return
        if all(t.dtype == buffer.dtype and t.is_contiguous() for t in tensors):
            torch.split_with_sizes_copy(
                buffer[:total],
                [t.numel() for t in tensors],
                out=[t if t.dim() == 1 else t.view(-1) for t in tensors],
            )
        else:
            torch._foreach_copy_(list(tensors), _views(buffer, tensors))


# --------------------------------------------------------------------------- selection
_cache: dict[str, PackKernels] = {}
_lock = threading.Lock()
_callback_added = False


def _clear_cache() -> None:
    _cache.clear()


def _ensure_registered(pm) -> None:
    """Register this package's pack hooks if nothing provides them yet.

    The ``vescale`` entry point (``vescale.ragged._plugin``) normally brings them in;
    this keeps :func:`get_pack_kernels` working when it does not (yet) re-export them.
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
