"""Pack kernels in Triton: one launch per source dtype, however many tensors.

Imported only when Triton is installed (the optional ``triton`` extra). Each
program copies one ``BLOCK``-element block of one tensor: a small table maps
program ids to ``(tensor, block)`` and holds every tensor's address, length and
offset in the buffer, so thousands of parameters cost one launch. The cast, when
the buffer and a tensor differ in dtype, happens in registers.

On a machine without a GPU the kernels run on CPU tensors under
``TRITON_INTERPRET=1`` (how the tests exercise them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from vescale.ragged._pack import PackKernels, _check_out, check_buffer, packed_numel

__all__ = ["TritonPackKernels"]

_BLOCK = 1024

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
    torch.int8: tl.int8,
    torch.int16: tl.int16,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
    torch.uint8: tl.uint8,
}


@triton.jit
def _cast(x, dst: tl.constexpr):
    """``x.to(dst)`` rounding to nearest even like torch's ``copy_``.

    Casts to bfloat16 go through float32 and an explicit round-to-nearest-even on
    the bits (torch also rounds through float32); the Triton interpreter would
    otherwise truncate.
    """
    if dst == tl.bfloat16 and x.dtype != tl.bfloat16:
        f = x.to(tl.float32)
        bits = f.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x40
        out = tl.where(f != f, quiet_nan, rounded)
        return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if x.dtype.is_floating() and dst.is_floating():
        if x.dtype.primitive_bitwidth > dst.primitive_bitwidth:
            return x.to(dst, fp_downcast_rounding="rtne")
    return x.to(dst)


@triton.jit
def _pack_kernel(
    addrs,  # int64 [T]: address of every tensor
    offsets,  # int64 [T]: its first element in the buffer
    numels,  # int64 [T]
    prog_tensor,  # int32 [programs]: tensor of each program
    prog_block,  # int32 [programs]: block of that tensor
    buffer,
    SRC: tl.constexpr,
    BLOCK: tl.constexpr,
    TO_BUFFER: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(prog_tensor + pid)
    b = tl.load(prog_block + pid).to(tl.int64)
    n = tl.load(numels + t)
    off = tl.load(offsets + t)
    ptr = tl.load(addrs + t).to(tl.pointer_type(SRC), bitcast=True)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    if TO_BUFFER:
        x = tl.load(ptr + idx, mask=mask)
        tl.store(buffer + off + idx, _cast(x, buffer.dtype.element_ty), mask=mask)
    else:
        x = tl.load(buffer + off + idx, mask=mask)
        tl.store(ptr + idx, _cast(x, SRC), mask=mask)


def _launch(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], to_buffer: bool) -> None:
    device = buffer.device
    groups: dict[torch.dtype, list[tuple[torch.Tensor, int]]] = {}
    off = 0
    fallback: list[tuple[torch.Tensor, int]] = []
    for t in tensors:
        n = t.numel()
        if n:
            if t.is_contiguous() and t.dtype in _TL_DTYPES and t.device == device:
                groups.setdefault(t.dtype, []).append((t, off))
            else:
                fallback.append((t, off))
        off += n
    for dtype, items in groups.items():
        prog_tensor: list[int] = []
        prog_block: list[int] = []
        for i, (t, _) in enumerate(items):
            blocks = triton.cdiv(t.numel(), _BLOCK)
            prog_tensor.extend([i] * blocks)
            prog_block.extend(range(blocks))
        meta = torch.tensor([[t.data_ptr(), o, t.numel()] for t, o in items], dtype=torch.int64).to(
            device
        )
        pt = torch.tensor(prog_tensor, dtype=torch.int32, device=device)
        pb = torch.tensor(prog_block, dtype=torch.int32, device=device)
        _pack_kernel[(len(prog_tensor),)](
            meta[:, 0].contiguous(),
            meta[:, 1].contiguous(),
            meta[:, 2].contiguous(),
            pt,
            pb,
            buffer,
            SRC=_TL_DTYPES[dtype],
            BLOCK=_BLOCK,
            TO_BUFFER=to_buffer,
        )
    for t, o in fallback:  # non-contiguous or exotic dtypes: torch copy
        piece = buffer[o : o + t.numel()].view(t.shape)
        if to_buffer:
            piece.copy_(t)
        else:
            t.copy_(piece)


class TritonPackKernels(PackKernels):
    """Triton pack kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

    Contiguous tensors of the dtypes in ``_TL_DTYPES`` go through one launch per
    source dtype; other tensors (non-contiguous, complex, fp8, bool) fall back to
    torch's ``copy_``.
    """

    name = "triton"

    def pack(self, tensors, out=None, *, dtype=None):
        out = _check_out(tensors, out, dtype)
        if out.dtype not in _TL_DTYPES:
            from vescale.ragged._pack import TorchPackKernels

            return TorchPackKernels().pack(tensors, out)
        _launch(out, tensors, to_buffer=True)
        return out

    def unpack(self, buffer, tensors):
        check_buffer(buffer, packed_numel(tensors))
        if buffer.dtype not in _TL_DTYPES:
            from vescale.ragged._pack import TorchPackKernels

            TorchPackKernels().unpack(buffer, tensors)
            return
        _launch(buffer, tensors, to_buffer=False)
