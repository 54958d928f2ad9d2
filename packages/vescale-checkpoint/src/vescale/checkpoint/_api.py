"""``save`` and ``load``: DCP with plugin placements, atomic commit, checksums, async."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vescale.checkpoint._state import Stager, decode_value, flatten_state
from vescale.checkpoint._storage import (
    CheckpointError,
    SaveLock,
    VescaleFileSystemReader,
    VescaleFileSystemWriter,
    clean_stale,
    commit,
    new_manifest,
    read_manifest,
    rotate,
)

__all__ = [
    "save",
    "load",
    "wait_pending",
    "free_staging_buffers",
    "SaveHandle",
    "LoadResult",
    "CheckpointMismatchError",
    "storage_for",
]


class CheckpointMismatchError(CheckpointError):
    """The live state and the checkpoint disagree on keys or shapes.

    Attributes:
        missing: Keys of the live state that the checkpoint lacks.
        unexpected: Keys of the checkpoint that the live state lacks.
        mismatched: ``(key, checkpoint shape, live shape)`` for shape mismatches.
    """

    def __init__(self, path: str, missing, unexpected, mismatched) -> None:
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        lines = [f"checkpoint {path} does not match the state being loaded:"]
        if missing:
            lines.append(f"  missing keys (in the state, not in the checkpoint): {missing}")
        if unexpected:
            lines.append(f"  unexpected keys (in the checkpoint, not in the state): {unexpected}")
        if mismatched:
            lines.append(
                "  mismatched shapes (key: checkpoint vs state): "
                + ", ".join(f"{k}: {a} vs {b}" for k, a, b in mismatched)
            )
        lines.append("Pass strict=False to load the matching keys only.")
        super().__init__("\n".join(lines))


@dataclass
class LoadResult:
    """What :func:`load` did.

    Attributes:
        missing: Live keys not found in the checkpoint (left unchanged).
        unexpected: Checkpoint keys with no live counterpart (ignored).
        mismatched: ``(key, checkpoint shape, live shape)`` pairs (left unchanged).
        seconds: Wall time of the load.
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    seconds: float = 0.0


class SaveHandle:
    """The future of one :func:`save`.

    Attributes:
        path: The checkpoint directory being written.
        blocking_seconds: Time the call blocked the caller (planning + staging for an
            async save; everything for a synchronous one).
        total_seconds: Time from the call to the commit (``None`` until done).
        bytes_written: Bytes of data files this rank wrote (``None`` until done).
    """

    def __init__(self, path: str, future: Future[str], t0: float) -> None:
        self.path = path
        self._future = future
        self._t0 = t0
        self.blocking_seconds = 0.0
        self.total_seconds: float | None = None
        self.bytes_written: int | None = None
        future.add_done_callback(self._done)

    def _done(self, _fut: Future[str]) -> None:
        self.total_seconds = time.perf_counter() - self._t0

    def done(self) -> bool:
        """True once the checkpoint is committed (or the save failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        """Wait for the commit and return the checkpoint path (re-raises a failure)."""
        return self._future.result(timeout)

    wait = result

    @property
    def blocking_fraction(self) -> float | None:
        """``blocking_seconds / total_seconds`` once done."""
        if self.total_seconds is None or self.total_seconds == 0:
            return None
        return self.blocking_seconds / self.total_seconds

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle({self.path!r}, {state}, blocking={self.blocking_seconds:.3f}s)"


_pending: SaveHandle | None = None
_stager = Stager()
_pending_lock = threading.Lock()
_async_groups: dict[int, Any] = {}


def wait_pending() -> None:
    """Wait for the previous asynchronous :func:`save` of this process (re-raises its error)."""
    global _pending
    with _pending_lock:
        handle, _pending = _pending, None
    if handle is not None:
        handle.result()


def free_staging_buffers() -> None:
    """Release the CPU (pinned) buffers kept for the next asynchronous :func:`save`.

    Async saves reuse the staging buffers of the previous async save when shapes match,
    so staging is one memory copy; this keeps one CPU copy of the last staged state.
    Waits for a pending async save first.
    """
    wait_pending()
    _stager.clear()


def storage_for(path: str | os.PathLike) -> tuple[Any, Any]:
    """``(writer, reader)`` for ``path`` from the ``vescale_checkpoint_storage`` hook."""
    from vescale.checkpoint import _plugin
    from vescale.dtensor import get_plugin_manager, register_plugin

    pm = get_plugin_manager()
    if not pm.is_registered(_plugin):
        # Before the entry point is installed (or in a bare environment).
        register_plugin(_plugin, name="vescale.checkpoint")
    answer = pm.hook.vescale_checkpoint_storage(uri=os.fspath(path))
    if answer is None:
        raise ValueError(f"no vescale_checkpoint_storage plugin handles {path!r}")
    return answer


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _async_group() -> Any:
    """A gloo group for background saves, so they never interleave with training collectives."""
    key = id(dist.distributed_c10d._get_default_group())
    group = _async_groups.get(key)
    if group is not None:
        try:
            dist.get_world_size(group)
            return group
        except (ValueError, RuntimeError):
            pass
    group = dist.new_group(backend="gloo")
    _async_groups[key] = group
    return group


def _unwrap(exc: BaseException) -> BaseException:
    if isinstance(exc, CheckpointException):
        for _rank, (inner, _tb) in sorted(exc.failures.items()):
            if isinstance(inner, CheckpointError):
                return inner
    return exc


def save(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    async_op: bool = False,
    keep_last: int | None = None,
    process_group: Any = None,
) -> SaveHandle:
    """Save ``state`` to the directory ``path`` (a collective over all ranks).

    ``state`` maps names to ``nn.Module``s, optimizers (state keyed by parameter
    name), tensors, DTensors with any placements (plugin placements included), objects
    with ``state_dict``/``load_state_dict`` and plain values (JSON).

    The checkpoint is written to ``<path>.tmp-<id>`` and renamed to ``path`` once every
    rank has finished, with a ``COMPLETE`` marker; a crash leaves any previous
    checkpoint at ``path`` intact. After the commit, staging directories that crashed
    saves of the same ``path`` left behind are deleted (never one that a live save
    still holds the lock of).

    Args:
        path: Checkpoint directory (or a URI a storage plugin handles).
        state: The state to save.
        async_op: Return once the state is staged in CPU memory; the write and commit run
            in the background. The next ``save`` (or :func:`wait_pending`) waits for it.
            Staging buffers are kept and reused by the next async save when shapes
            match (:func:`free_staging_buffers` releases them).
        keep_last: After committing, delete the oldest complete checkpoints of the same
            series so that at most ``keep_last`` remain (never ``path``). The series is
            the checkpoints in the same parent directory whose name is ``path``'s name
            with its trailing number replaced by another (``step_100``: ``step_<n>``);
            a name without a trailing number rotates nothing.
        process_group: Group of the ranks that save (default: the world).

    Returns:
        A :class:`SaveHandle`; already done unless ``async_op``.
    """
    global _pending
    wait_pending()
    t0 = time.perf_counter()
    path = os.fspath(path)
    writer, _reader = storage_for(path)
    on = _dist_on()
    rank = dist.get_rank(process_group) if on else 0
    world = dist.get_world_size(process_group) if on else 1
    box = [uuid.uuid4().hex[:12] if rank == 0 else None]
    if on and world > 1:
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=process_group)
    save_id = box[0]
    flat = flatten_state(state, for_load=False, stage=_stager if async_op else None)
    manifest = new_manifest(save_id, world)
    manifest["values"] = flat.values
    manifest["tensors"] = flat.tensor_info
    group = process_group
    if async_op and on:
        group = _async_group() if process_group is None else process_group

    def work() -> str:
        return _write(path, writer, flat.tensors, manifest, save_id, group, keep_last, on, rank)

    fut: Future[str] = Future()
    handle = SaveHandle(path, fut, t0)
    if not async_op:
        try:
            fut.set_result(work())
        except BaseException as e:  # noqa: BLE001 - re-raised below with DCP's wrapper removed
            fut.set_exception(_unwrap(e))
            raise _unwrap(e) from None
        handle.blocking_seconds = time.perf_counter() - t0
        handle.bytes_written = getattr(writer, "bytes_written", None)
        return handle

    def run() -> None:
        try:
            fut.set_result(work())
            handle.bytes_written = getattr(writer, "bytes_written", None)
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(_unwrap(e))

    threading.Thread(target=run, name=f"vescale-ckpt-save-{save_id}", daemon=True).start()
    handle.blocking_seconds = time.perf_counter() - t0
    with _pending_lock:
        _pending = handle
    return handle


def _write(path, writer, tensors, manifest, save_id, group, keep_last, on, rank) -> str:
    fs = isinstance(writer, VescaleFileSystemWriter)
    if fs:
        path = os.fspath(writer.path)  # the location the storage plugin resolved
    target = f"{path}.tmp-{save_id}" if fs else path
    lock = SaveLock(target, save_id) if fs and rank == 0 else None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                tensors,
                checkpoint_id=target,
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                process_group=group,
                no_dist=not on,
            )
        if on:
            dist.barrier(group=group)
        if rank == 0 and fs:
            manifest["chunks"] = writer.chunk_records
            commit(target, path, manifest)
            clean_stale(path, save_id)
            if keep_last is not None:
                rotate(path, keep_last)
        if on:
            dist.barrier(group=group)
    except BaseException:
        if fs and rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()
    return path


def load(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    process_group: Any = None,
) -> LoadResult:
    """Load a checkpoint into the live objects of ``state``, in place (a collective).

    Tensors are resharded to whatever mesh and placements the live objects have now;
    plain values are replaced in their containers; optimizers get their state and
    param groups back (keyed by parameter name).

    Args:
        path: A checkpoint directory written by :func:`save`.
        state: Same structure as at save time (different placements are fine).
        strict: Raise :class:`CheckpointMismatchError` on missing, unexpected or
            mismatched keys. With ``strict=False`` only the matching keys are loaded.
        process_group: Group of the ranks that load (default: the world).

    Returns:
        A :class:`LoadResult` listing missing, unexpected and mismatched keys.

    Raises:
        IncompleteCheckpointError: ``path`` is missing or was never committed.
        CheckpointCorruptError: A checksum does not match (names file and tensor).
        CheckpointMismatchError: Keys or shapes differ and ``strict`` is true.
    """
    wait_pending()
    t0 = time.perf_counter()
    path = os.fspath(path)
    _writer, reader = storage_for(path)
    on = _dist_on()
    if isinstance(reader, VescaleFileSystemReader):
        reader.manifest = read_manifest(reader.path)
        values = reader.manifest["values"]
    else:
        values = {}
    metadata = reader.read_metadata()
    ckpt_tensors = {
        k: list(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    flat = flatten_state(state, for_load=True)
    live = {k: list(t.shape) for k, t in flat.tensors.items()}
    missing = sorted((set(live) - set(ckpt_tensors)) | (set(flat.values) - set(values)))
    unexpected = sorted((set(ckpt_tensors) - set(live)) | (set(values) - set(flat.values)))
    mismatched = sorted(
        (k, ckpt_tensors[k], live[k])
        for k in set(live) & set(ckpt_tensors)
        if live[k] != ckpt_tensors[k]
    )
    if strict and (missing or unexpected or mismatched):
        raise CheckpointMismatchError(path, missing, unexpected, mismatched)
    bad = {k for k, _, _ in mismatched}
    to_load = {k: t for k, t in flat.tensors.items() if k in ckpt_tensors and k not in bad}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                to_load,
                storage_reader=reader,
                planner=DefaultLoadPlanner(allow_partial_load=False),
                process_group=process_group,
                no_dist=not on,
            )
    except BaseException as e:
        raise _unwrap(e) from None
    for k, setter in flat.value_setters.items():
        if k in values:
            setter(decode_value(values[k]))
    for fn in flat.finishers:
        fn()
    return LoadResult(missing, unexpected, mismatched, time.perf_counter() - t0)
