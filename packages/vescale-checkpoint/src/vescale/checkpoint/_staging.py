"""Staging for asynchronous saves: copying tensors to reused CPU (pinned) buffers, with
several threads for big tensors, and detecting tensors written while a save is pending.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from vescale.checkpoint._storage import check_storage

__all__ = ["Stager", "auto_copy_threads", "raw_copy"]


_PARALLEL_MIN_BYTES = 16 << 20  # tensors at least this big are copied by several threads
_PIECE_MIN_BYTES = 4 << 20


def auto_copy_threads() -> int:
    """Threads for staging copies: the CPUs this process may use over the local ranks (<= 8).

    The local rank count is ``LOCAL_WORLD_SIZE`` (set by ``torchrun``), else the size of
    the default process group (an upper bound on one host). On a host with no spare
    cores per rank this is 1: copies then run on the caller's thread only.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local <= 0:
        import torch.distributed as dist

        local = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return max(1, min(8, cpus // max(local, 1)))


def raw_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a plain ``memmove`` when both are dense CPU tensors of one dtype.

    glibc's ``memmove`` uses non-temporal stores for large copies: about twice the
    bandwidth of ``Tensor.copy_`` here. ``ctypes`` releases the GIL during the call.
    """
    if (
        src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.shape == dst.shape
        and src.layout == torch.strided
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
        and type(src) is torch.Tensor
        and type(dst) is torch.Tensor
    ):
        n = src.numel() * src.element_size()
        if n:
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
        return
    dst.copy_(src)


class Stager:
    """Copies tensors to CPU for an asynchronous save, reusing buffers across saves.

    A buffer is kept per flattened key and reused by the next staging of the same key
    when shape and dtype match (no allocation, no page faults: staging is a plain
    memory copy). CUDA tensors go to pinned buffers with non-blocking copies and one
    synchronisation in `finish`. Buffers of keys absent from a save are dropped
    then, so at most one CPU copy of the last staged state is kept.

    Dense CPU tensors are copied with `raw_copy` (``memmove``). CPU tensors of at
    least 16 MiB are copied in `finish` by ``copy_threads`` threads in slices (the
    copies release the GIL); smaller ones, and all of them when ``copy_threads`` is 1,
    are copied at once. Every copy is complete when `finish` returns. A tensor
    whose storage is smaller than its view (freed) raises ``ValueError`` naming it.

    A buffer may only be reused once the save that wrote from it has finished;
    `vescale.checkpoint.save` waits for the previous async save before staging.

    Args:
        copy_threads: Threads for big copies (``None``: `auto_copy_threads`).

    Attributes:
        bytes_copied: Bytes copied by the last staging.
        bytes_allocated: Bytes of new buffers allocated by the last staging.
        threads_used: Threads that copied in the last staging (1: the caller's only).
    """

    def __init__(self, copy_threads: int | None = None) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._used: dict[str, torch.Tensor] = {}
        self._big: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._background = False
        # (key, buffer, source, source version) of copies left to `complete`
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        self._sync_cuda = False
        self._threads = 1
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0
        self.copy_threads = copy_threads
        self.bytes_copied = 0
        self.bytes_allocated = 0
        self.threads_used = 1

    def begin(self, background: bool = False) -> None:
        """Start a staging; with ``background``, CPU copies wait for `complete`."""
        self._used = {}
        self._big = []
        self._background = background
        self._deferred = []
        self._sync_cuda = False
        self._threads = (
            auto_copy_threads() if self.copy_threads is None else max(1, int(self.copy_threads))
        )
        self.bytes_copied = self.bytes_allocated = 0
        self.threads_used = 1

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A CPU buffer that holds ``t``'s values once `finish` returned."""
        t = t.detach()
        pin = t.device.type == "cuda"
        buf = self._buffers.get(key)
        if (
            buf is None
            or buf.shape != t.shape
            or buf.dtype != t.dtype
            or (pin and not buf.is_pinned())
        ):
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self.bytes_allocated += buf.numel() * buf.element_size()
        nbytes = buf.numel() * buf.element_size()
        if t.device.type == "cpu":
            check_storage(t, key)
        version = _version_or_none(t) if self._background and t.device.type == "cpu" else None
        if pin:
            buf.copy_(t, non_blocking=True)
        elif version is not None:
            self._deferred.append((key, buf, t, version))
        elif self._threads > 1 and t.device.type == "cpu" and nbytes >= _PARALLEL_MIN_BYTES:
            self._big.append((buf, t))
        else:
            raw_copy(buf, t)
        self._sync_cuda |= pin
        self.bytes_copied += nbytes
        self._used[key] = buf
        return buf

    def _copy_big(self) -> None:
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        total = sum(b.numel() * b.element_size() for b, _ in self._big)
        target = max(_PIECE_MIN_BYTES, -(-total // self._threads))
        for buf, src in self._big:
            if not src.is_contiguous():
                pieces.append((buf, src))
                continue
            d, s = buf.view(-1), src.view(-1)
            step = max(1, target // buf.element_size())
            pieces.extend((d[i : i + step], s[i : i + step]) for i in range(0, d.numel(), step))
        self._big = []
        if len(pieces) == 1:
            raw_copy(*pieces[0])
            return
        if self._pool is None or self._pool_threads != self._threads:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="vescale-ckpt-stage")
            self._pool_threads = self._threads
        for f in [self._pool.submit(raw_copy, d, s) for d, s in pieces]:
            f.result()
        self.threads_used = min(self._threads, len(pieces))

    def finish(self) -> None:
        """End the caller's part: every copy is done, except the deferred background ones."""
        if self._big:
            self._copy_big()
        if self._sync_cuda:
            torch.cuda.synchronize()
        self._buffers, self._used = self._used, {}

    @contextlib.contextmanager
    def blocking(self) -> Iterator[None]:
        """Copies requested inside happen now, even in a background staging."""
        prev, self._background = self._background, False
        try:
            yield
        finally:
            self._background = prev

    @property
    def deferred_bytes(self) -> int:
        """Bytes whose copy waits for `complete` (background staging)."""
        return sum(b.numel() * b.element_size() for _, b, _, _ in self._deferred)

    def complete(self) -> list[str]:
        """Run the deferred copies (any thread); return the keys modified meanwhile.

        A source whose version counter moved between `copy` and the end of its
        copy was written to while being staged: its staged values may be torn.
        """
        pending, self._deferred = self._deferred, []
        if not pending:
            return []
        self._big = [(b, t) for _, b, t, _ in pending]
        if self._threads > 1 and sum(b.numel() * b.element_size() for b, _ in self._big) >= (
            _PARALLEL_MIN_BYTES
        ):
            self._copy_big()
        else:
            for b, t in self._big:
                raw_copy(b, t)
            self._big = []
        return [key for key, _, t, v in pending if t._version != v]

    def clear(self) -> None:
        """Drop every kept buffer."""
        self._buffers = {}
        self._used = {}
        self._big = []


def _version_or_none(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), or ``None`` if untracked."""
    if t.is_inference():
        return None
    try:
        return t._version
    except RuntimeError:
        return None
