"""``save`` and ``load``: DCP with plugin placements, atomic commit, checksums, async."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vescale.checkpoint import _compat
from vescale.checkpoint._commit import (
    SaveLock,
    clean_stale,
    commit,
    new_manifest,
    read_manifest,
    resolve_checkpoint,
    rotate,
)
from vescale.checkpoint._coverage import check_chunks
from vescale.checkpoint._format import CheckpointError
from vescale.checkpoint._staging import Stager
from vescale.checkpoint._state import decode_value, flatten_state
from vescale.checkpoint._storage import VescaleFileSystemReader, VescaleFileSystemWriter
from vescale.dtensor import get_default_timeout

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
    """The live state and the checkpoint disagree on keys, shapes or dtypes.

    Attributes:
        missing: Keys of the live state that the checkpoint lacks.
        unexpected: Keys of the checkpoint that the live state lacks.
        mismatched: ``(key, checkpoint shape, live shape)`` for shape mismatches.
        dtypes: ``(key, checkpoint dtype, live dtype, why)`` for dtype changes that
            were not allowed (``why`` is ``""`` when ``allow_dtype_cast`` would allow it).
    """

    def __init__(self, path: str, missing, unexpected, mismatched, dtypes=()) -> None:
        self.path = path
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        self.dtypes = list(dtypes)
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
        if self.dtypes:
            lines.append(
                "  dtype changes (key: checkpoint vs state): "
                + ", ".join(
                    f"{k}: {_dtype_name(a)} vs {_dtype_name(b)}" + (f" ({why})" if why else "")
                    for k, a, b, why in self.dtypes
                )
            )
        if missing or unexpected or mismatched:
            lines.append("Pass strict=False to load the matching keys only.")
        if any(not why for *_, why in self.dtypes):
            lines.append("Pass allow_dtype_cast=True (or {key regex: live dtype}) to cast on load.")
        super().__init__("\n".join(lines))

    def __reduce__(self):  # picklable (DCP gathers exceptions from every rank)
        args = (self.path, self.missing, self.unexpected, self.mismatched, self.dtypes)
        return type(self), args


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class LoadResult:
    """What `load` did.

    Attributes:
        missing: Live keys not found in the checkpoint (left unchanged).
        unexpected: Checkpoint keys with no live counterpart (ignored).
        mismatched: ``(key, checkpoint shape, live shape)`` pairs (left unchanged).
        seconds: Wall time of the load.
        loaded: Live keys that were filled (`load_hf` only; empty for `load`).
        bytes_read: Bytes this rank read from the files (`load_hf` only; 0 for `load`).
    """

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    seconds: float = 0.0
    loaded: list[str] = field(default_factory=list)
    bytes_read: int = 0


class SaveHandle:
    """The future of one `save`.

    Attributes:
        path: The checkpoint directory being written.
        blocking_seconds: Time the call blocked the caller (flattening + staging for an
            async save, flattening only with ``staging="background"``; everything for a
            synchronous one).
        total_seconds: Time from the call to the commit (``None`` until done).
        bytes_written: Bytes of data files this rank wrote (``None`` until done).
    """

    def __init__(
        self,
        path: str,
        future: Future[str],
        t0: float,
        stats: dict[str, Any] | None = None,
        staged: threading.Event | None = None,
    ) -> None:
        self.path = path
        self._future = future
        self._staged = staged
        self._t0 = t0
        # Filled by the save itself before its future completes (no callback races).
        self._stats = stats if stats is not None else {}
        self._retrieved = False
        self.blocking_seconds = 0.0

    @property
    def total_seconds(self) -> float | None:
        return self._stats.get("total_seconds")

    @property
    def staged_seconds(self) -> float | None:
        """Time from the call until every tensor was copied (``None`` until then)."""
        return self._stats.get("staged_seconds")

    @property
    def fence_wait_seconds(self) -> float:
        """Time optimizer steps waited for this save's background staging."""
        return self._stats.get("fence_wait_seconds", 0.0)

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the state is copied off the live tensors (background staging).

        Returns:
            True once staged (at once for blocking staging), False on timeout.
        """
        return True if self._staged is None else self._staged.wait(timeout)

    @property
    def bytes_written(self) -> int | None:
        return self._stats.get("bytes_written")

    def done(self) -> bool:
        """True once the checkpoint is committed (or the save failed)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> str:
        """Wait for the commit and return the checkpoint path (re-raises a failure)."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if self._future.done():
                self._retrieved = True  # the caller has seen the failure
            raise

    wait = result

    @property
    def blocking_fraction(self) -> float | None:
        """``blocking_seconds / total_seconds`` once done."""
        if not self.total_seconds:
            return None
        return self.blocking_seconds / self.total_seconds

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle({self.path!r}, {state}, blocking={self.blocking_seconds:.3f}s)"


_pending: SaveHandle | None = None
_stager = Stager()
_pending_lock = threading.Lock()
# ranks (None: the world) -> (default group, async group, its timeout in seconds)
_async_groups: dict[tuple[int, ...] | None, tuple[Any, Any, float]] = {}
_executor: ThreadPoolExecutor | None = None
_warned_sync_fallback = False


# (event set once staged, the save's stats) of an in-flight background staging
_staging: tuple[threading.Event, dict[str, Any]] | None = None
_fence_handle: Any = None


def _step_fence(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: wait for an in-flight background staging."""
    cur = _staging
    if cur is None or cur[0].is_set():
        return None
    t = time.perf_counter()
    cur[0].wait()
    cur[1]["fence_wait_seconds"] = cur[1].get("fence_wait_seconds", 0.0) + (time.perf_counter() - t)
    return None


def _install_step_fence() -> None:
    global _fence_handle
    if _fence_handle is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _fence_handle = register_optimizer_step_pre_hook(_step_fence)


def _check_staged_everywhere(modified: list[str], group: Any, collective: bool) -> None:
    """Fail the save on every rank if any rank's staging saw a tensor written meanwhile."""
    bad = 1 if modified else 0
    if collective:
        flag = torch.tensor([bad], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        bad = int(flag.item())
    if bad:
        where = f"{', '.join(modified[:5])}" if modified else "on another rank"
        raise CheckpointError(
            "checkpoint save with staging='background' failed: tensors were written in "
            f"place while being staged ({where}); nothing was committed. Write saved "
            "tensors outside an optimizer step only after handle.wait_staged(), or use "
            "staging='blocking'"
        )


def wait_pending() -> None:
    """Wait for the previous asynchronous `save` of this process.

    Re-raises its error, unless the caller already got it from `SaveHandle.result`.
    """
    global _pending
    with _pending_lock:
        handle, _pending = _pending, None
    if handle is not None:
        if handle._retrieved:
            handle._future.exception()  # wait only
        else:
            handle.result()


def free_staging_buffers() -> None:
    """Release the CPU (pinned) buffers kept for the next asynchronous `save`.

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


def _async_group(process_group: Any) -> Any:
    """A gloo group of the saving ranks used only by background saves (``None``: unavailable).

    Background saves never issue a collective on a group the training thread may use:
    two threads issuing collectives on one group interleave them differently on
    different ranks. The group is created once per set of ranks and timeout (a
    collective of those ranks, on the caller's thread) and cached. Its collectives
    time out after ``vescale.dtensor.get_default_timeout()`` seconds.
    """
    default = _compat.default_group()
    if process_group is None or dist.get_world_size(process_group) == dist.get_world_size():
        ranks = None
    else:
        ranks = tuple(dist.get_process_group_ranks(process_group))
    seconds = get_default_timeout()
    hit = _async_groups.get(ranks)
    if hit is not None and hit[0] is default and hit[2] == seconds:
        try:
            dist.get_process_group_ranks(hit[1])  # KeyError once destroyed
            return hit[1]
        except (KeyError, ValueError, RuntimeError):
            pass
    # The configured collective timeout (torch's default for a new gloo group is 30 min,
    # and the interpreter waits for this thread at exit).
    timeout = timedelta(seconds=seconds)
    if ranks is None:
        group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        try:
            # Only the members call save(); the group's name is derived from its ranks.
            group = _compat.new_member_group(list(ranks), timeout)
        except (ValueError, RuntimeError):
            return None  # a group of the same ranks already holds that name
        if group is None:
            return None
    _async_groups[ranks] = (default, group, seconds)
    return group


def _broadcast_int(value: int, group: Any) -> int:
    """Broadcast an int64 from the group's rank 0 (one collective)."""
    backend = dist.get_backend(group)
    if "gloo" in str(backend).lower() or "cpu" in str(backend).lower():
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, group=group, group_src=0)
        return int(t.item())
    box = [value]  # other backends: let torch pick the device
    dist.broadcast_object_list(box, group=group, group_src=0)
    return int(box[0])


def _agree_save_id(group: Any, collective: bool) -> str:
    """A 12-hex-digit id that every rank of ``group`` agrees on (rank 0 draws it)."""
    value = int.from_bytes(os.urandom(6), "big")
    if collective:
        value = _broadcast_int(value, group)
    return f"{value:012x}"


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _as_checkpoint_error(exc: BaseException, doing: str) -> BaseException:
    """The error a public call raises for ``exc`` raised inside DCP or a collective.

    DCP reports failures as ``CheckpointException``, which derives only from
    ``BaseException``, wrapping each failing rank's exception; every rank gets the same
    one. It becomes the first failing rank's ``CheckpointError`` (which names its file
    and tensor), or a ``CheckpointError`` carrying every failing rank's root cause. A
    ``KeyboardInterrupt`` / ``SystemExit`` of this rank stays what it is. Other
    exceptions (a collective's timeout) become a ``CheckpointError`` too.
    """
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, CheckpointException):
        failures = [(rank, inner) for rank, (inner, _tb) in sorted(exc.failures.items())]
    elif isinstance(exc, Exception):
        failures = [(_rank(), exc)]
    else:
        return exc
    me = _rank()
    for rank, inner in failures:
        if rank == me and not isinstance(inner, Exception):
            return inner
    multi = _dist_on() and dist.get_world_size() > 1
    where = f" on rank {failures[0][0]}" if multi else ""
    for rank, inner in failures:
        if isinstance(inner, CheckpointError):
            msg = f"{doing} failed{f' on rank {rank}' if multi else ''}: {inner}"
            try:
                err = type(inner)(msg)
            except TypeError:  # a subclass with its own constructor
                err = CheckpointError(msg)
            err.__cause__ = inner
            return err
    if len(failures) > 1:
        where = " on ranks " + ", ".join(str(r) for r, _ in failures)
    detail = "; ".join(
        (f"rank {r}: " if len(failures) > 1 else "") + f"{type(e).__name__}: {e}"
        for r, e in failures
    )
    err = CheckpointError(f"{doing} failed{where}: {detail}")
    err.__cause__ = failures[0][1]
    return err


def _submit(fn) -> Future[str]:
    """Run ``fn`` on the single background save thread.

    One long-lived worker thread (started on the first async save) runs saves one at a
    time; submitting does not wait for a thread to start. The interpreter waits for a
    running save at exit (``concurrent.futures`` joins its workers before ``atexit``).
    """
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(1, thread_name_prefix="vescale-ckpt-save")
    return _executor.submit(fn)


def save(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    async_op: bool = False,
    staging: str = "blocking",
    keep_last: int | None = None,
    process_group: Any = None,
    async_checkpoint: bool | None = None,
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
        async_op: Return once the state is staged in CPU memory; agreeing on the save
            id, planning, writing and the commit run on a background thread, whose
            collectives use a gloo group of their own. The next ``save`` (or
            `wait_pending`) waits for it. Staging buffers are kept and reused by
            the next async save when shapes match (`free_staging_buffers`
            releases them). Call `wait_pending` before
            ``dist.destroy_process_group()``.
        staging: (``async_op`` only) ``"blocking"``: return once every tensor is
            copied. ``"background"``: return once the state is flattened; the copies of
            CPU tensors run on the background thread, and every torch optimizer's
            ``step()`` (a global step pre-hook; ``DistributedOptimizer`` and ``Muon``
            included) waits until they are done, so training overlaps the copy. Each
            source tensor's version counter is checked after its copy: a tensor written
            in place meanwhile (by anything but an optimizer step) fails the save on
            every rank with a ``RuntimeError`` naming it, instead of saving torn values.
            `SaveHandle.wait_staged` waits for the copies explicitly (before
            writing saved tensors outside an optimizer). Module buffers (which
            kernels such as BatchNorm's update without a version bump) and CUDA
            tensors are staged before the call returns in both modes.
        keep_last: After committing, delete the oldest complete checkpoints of the same
            series so that at most ``keep_last`` remain (never ``path``). The series is
            the checkpoints in the same parent directory whose name is ``path``'s name
            with its trailing number replaced by another (``step_100``: ``step_<n>``);
            a name without a trailing number rotates nothing.
        process_group: Group of the ranks that save (default: the world).
        async_checkpoint: veScale's name for ``async_op``.

    Returns:
        A `SaveHandle`; already done unless ``async_op``.
    """
    if async_checkpoint is not None:
        if async_op and not async_checkpoint:
            raise ValueError("save: async_op=True and async_checkpoint=False disagree; pass one")
        async_op = bool(async_checkpoint)
    global _pending, _warned_sync_fallback, _staging
    if staging not in ("blocking", "background"):
        raise ValueError(f"staging must be 'blocking' or 'background', got {staging!r}")
    wait_pending()
    t0 = time.perf_counter()
    path = os.fspath(path)
    writer, _reader = storage_for(path)
    on = _dist_on()
    world = dist.get_world_size(process_group) if on else 1

    if async_op and on:
        group = _async_group(process_group)
        if group is None:
            if not _warned_sync_fallback:
                _warned_sync_fallback = True
                warnings.warn(
                    "vescale.checkpoint.save(async_op=True): cannot create a separate gloo group "
                    "for the ranks of process_group (a group of the same ranks already holds "
                    "its name, or torch's group count is missing: see "
                    "vescale.checkpoint._compat.check_torch_internals()); saving "
                    "synchronously instead",
                    stacklevel=2,
                )
            async_op = False

    stats: dict[str, Any] = {}

    def work(flat=None, staged_event: threading.Event | None = None) -> str:
        try:
            if staged_event is not None:
                try:
                    modified = _stager.complete()
                finally:
                    stats["staged_seconds"] = time.perf_counter() - t0
                    staged_event.set()
                _check_staged_everywhere(modified, group, on and world > 1)
            save_id = _agree_save_id(group, on and world > 1)
            if flat is None:
                flat = flatten_state(state, for_load=False)
            else:
                flat.build()
            manifest = _manifest(save_id, world, flat)
            # The rank in the group that runs DCP (its rank 0 is DCP's coordinator).
            rank = dist.get_rank(group) if on else 0
            out = _write(
                path, writer, flat.tensors, manifest, save_id, group, keep_last, on, rank, world
            )
        except (ValueError, TypeError):
            raise  # bad input (flattening), named where it was found
        except BaseException as e:  # noqa: BLE001 - re-raised with DCP's wrapper removed
            err = _as_checkpoint_error(e, f"saving {path}")
            if err is e:
                raise
            raise err from err.__cause__
        finally:
            stats["total_seconds"] = time.perf_counter() - t0
        stats["bytes_written"] = getattr(writer, "bytes_written", None)
        return out

    if not async_op:
        group = process_group
        fut: Future[str] = Future()
        handle = SaveHandle(path, fut, t0, stats)
        fut.set_result(work())
        handle.blocking_seconds = time.perf_counter() - t0
        return handle

    # The caller's thread does only what reads the live state: flattening, the
    # collectives that Partial / non-box plugin placements need, and the staging copies.
    # Agreeing on the save id, building DCP's view of the staged buffers, planning,
    # writing and committing run on the background thread, over the async gloo group.
    background = staging == "background"
    staged = flatten_state(state, for_load=False, stage=_stager, defer=True, background=background)
    if not on:
        group = None
    event: threading.Event | None = None
    if background and _stager.deferred_bytes:
        event = threading.Event()
        _install_step_fence()
        _staging = (event, stats)
    handle = SaveHandle(path, _submit(lambda: work(staged, event)), t0, stats, event)
    handle.blocking_seconds = time.perf_counter() - t0
    if event is None:
        stats["staged_seconds"] = handle.blocking_seconds
    with _pending_lock:
        _pending = handle
    return handle


def _manifest(save_id: str, world: int, flat) -> dict[str, Any]:
    manifest = new_manifest(save_id, world)
    manifest["values"] = flat.values
    manifest["tensors"] = flat.tensor_info
    return manifest


def _write(path, writer, tensors, manifest, save_id, group, keep_last, on, rank, world) -> str:
    """Write with DCP, then commit on rank 0 and tell every rank whether it succeeded.

    ``dcp.save`` returns on rank 0 only after every rank's ``write_data`` has finished
    (DCP gathers the write results to the coordinator), so rank 0 commits right away;
    the broadcast of rank 0's outcome is the one collective after DCP's.
    """
    fs = isinstance(writer, VescaleFileSystemWriter)
    if fs:
        path = os.fspath(writer.path)  # the location the storage plugin resolved
    target = f"{path}.tmp-{save_id}" if fs else path
    lock = SaveLock(target, save_id) if fs and rank == 0 else None
    try:
        kwargs: dict[str, Any] = dict(
            checkpoint_id=target, storage_writer=writer, planner=DefaultSavePlanner()
        )
        if on:
            kwargs["process_group"] = group
        else:
            kwargs["no_dist"] = True
        with contextlib.ExitStack() as stack:
            # DCP warns that it saves in one process; so we mean to. catch_warnings()
            # swaps the process-wide filter list: only on the main thread.
            if not on and threading.current_thread() is threading.main_thread():
                stack.enter_context(warnings.catch_warnings())
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, **kwargs)
        failed: BaseException | None = None
        if rank == 0 and fs:
            try:
                manifest["chunks"] = writer.chunk_records
                commit(target, path, manifest)
                clean_stale(path, save_id)
                if keep_last is not None:
                    rotate(path, keep_last)
            except Exception as e:  # noqa: BLE001 - reported to every rank below
                failed = (
                    e
                    if isinstance(e, CheckpointError)
                    else CheckpointError(
                        f"saving {path}: committing {target} failed: {type(e).__name__}: {e}"
                    )
                )
                if failed is not e:
                    failed.__cause__ = e
        if on and world > 1:
            if _broadcast_int(0 if failed is None else 1, group) and failed is None:
                raise CheckpointError(
                    f"saving {path}: rank 0 failed to commit the checkpoint (see its error)"
                )
        if failed is not None:
            raise failed
    except BaseException:
        if fs and rank == 0:
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()
    return path


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _dtype_changes(
    path: str, ckpt: dict[str, torch.dtype], live: dict[str, torch.dtype], allow: Any
) -> list[tuple[str, torch.dtype, torch.dtype, str]]:
    """The dtype changes among ``live`` keys that ``allow_dtype_cast`` does not allow."""
    rules: list[tuple[re.Pattern[str], torch.dtype]] = []
    if isinstance(allow, Mapping):
        for pattern, dtype in allow.items():
            if not isinstance(pattern, str) or not isinstance(dtype, torch.dtype):
                raise TypeError(
                    "allow_dtype_cast maps key regexes (str) to the live dtype they may be "
                    f"cast to (torch.dtype), got {pattern!r}: {dtype!r}"
                )
            rx = re.compile(pattern)
            if not any(rx.fullmatch(k) for k in ckpt):
                raise ValueError(
                    f"allow_dtype_cast: the pattern '{pattern}' matches no tensor of checkpoint "
                    f"{path} (keys look like {sorted(ckpt)[:3]})"
                )
            rules.append((rx, dtype))
    elif not isinstance(allow, bool):
        raise TypeError(f"allow_dtype_cast must be a bool or a dict, got {allow!r}")
    out = []
    for k in sorted(live):
        src, dst = ckpt[k], live[k]
        if src == dst:
            continue
        if _is_float(src) and not _is_float(dst):
            out.append((k, src, dst, "floating point to integer is never cast"))
        elif src.is_complex and not dst.is_complex:
            out.append((k, src, dst, "complex to real is never cast"))
        elif allow is True:
            continue
        else:
            target = next((d for rx, d in rules if rx.fullmatch(k)), None)
            if target == dst:
                continue
            why = "" if target is None else f"allow_dtype_cast allows {_dtype_name(target)} only"
            out.append((k, src, dst, why))
    return out


def _cover_param_groups(saved: Any, live: Any) -> Any:
    """Saved optimizer param groups, extended to this rank's parameters.

    One rank writes the param groups, listing the parameters it holds. Under pipeline
    parallelism the other ranks hold other parameters (other stages): a live group none
    of whose parameters the saved groups list takes the hyper-parameters of the saved
    group at its position (every stage builds its optimizer the same way).
    """
    if not (isinstance(saved, list) and isinstance(live, list) and len(saved) == len(live)):
        return saved
    listed = {n for g in saved if isinstance(g, dict) for n in g.get("params", ())}
    out = [dict(g) if isinstance(g, dict) else g for g in saved]
    for g, lg in zip(out, live):
        if not (isinstance(g, dict) and isinstance(lg, dict)):
            continue
        names = [n for n in lg.get("params", ()) if isinstance(n, str)]
        if names and not listed.intersection(names):
            g["params"] = list(g.get("params", [])) + names
    return out


def load(
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    strict: bool = True,
    allow_dtype_cast: bool | Mapping[str, torch.dtype] = False,
    process_group: Any = None,
    broadcast_checkpoint: bool = False,
) -> LoadResult:
    """Load a checkpoint into the live objects of ``state``, in place (a collective).

    Tensors are resharded to whatever mesh and placements the live objects have now;
    plain values are replaced in their containers; optimizers get their state and
    param groups back (keyed by parameter name).

    Before anything is read, every rank checks the checkpoint against the state (keys,
    shapes, dtypes) and the saved chunks of every tensor to load (they cover every
    element, their byte lengths fit their shapes), so a bad checkpoint raises the same
    error on every rank before any collective. A data file that is missing, not a
    regular file, truncated or fails its checksum is found by the rank that reads it
    and raised on every rank.

    Args:
        path: A checkpoint directory written by `save`.
        state: Same structure as at save time (different placements are fine).
        strict: Raise `CheckpointMismatchError` on missing, unexpected or
            mismatched keys. With ``strict=False`` only the matching keys are loaded.
        allow_dtype_cast: A tensor whose live dtype differs from its saved dtype is an
            error (``CheckpointMismatchError``, whatever ``strict``) unless allowed:
            ``True`` casts every such tensor; a dict ``{key regex: dtype}`` allows the
            tensors whose key full-matches a regex to be cast to that (live) dtype. A
            regex that matches no saved tensor is a ``ValueError``. Floating-point or
            complex values are never cast to an integer (or bool) dtype, nor complex to
            real.
        process_group: Group of the ranks that load (default: the world).
        broadcast_checkpoint: Accepted for veScale programs (there: data-parallel rank
            0 reads and broadcasts to its replicas). Here every rank reads the chunks it
            needs; the loaded values are the same.

    An optimizer's state in the checkpoint (an entry with ``param_groups``) whose name
    ``state`` does not have is skipped, not unexpected: ``{"model": model}`` loads the
    model from a full training checkpoint.

    Returns:
        A `LoadResult` listing missing, unexpected and mismatched keys.

    Raises:
        IncompleteCheckpointError: ``path`` is missing or was never committed.
        CheckpointCorruptError: A checksum does not match, a chunk is missing, a file is
            missing or not a regular file, or the metadata is malformed (names the file
            and the tensor).
        CheckpointMismatchError: Keys or shapes differ and ``strict`` is true, or a dtype
            change is not allowed.
        CheckpointError: Reading failed on some rank (names the rank and the root cause).
    """
    wait_pending()
    t0 = time.perf_counter()
    path = os.fspath(path)
    _writer, reader = storage_for(path)
    on = _dist_on()
    if isinstance(reader, VescaleFileSystemReader):
        found = resolve_checkpoint(reader.path)
        if found != Path(reader.path):  # the previous checkpoint of an interrupted commit
            reader.reset(found)
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
    # an optimizer the caller did not ask for (a model-only load of a training checkpoint)
    skipped = {
        top
        for top in {k.split(".", 1)[0] for k in unexpected}
        if top not in state and f"{top}.param_groups" in values
    }
    unexpected = [k for k in unexpected if k.split(".", 1)[0] not in skipped]
    mismatched = sorted(
        (k, ckpt_tensors[k], live[k])
        for k in set(live) & set(ckpt_tensors)
        if live[k] != ckpt_tensors[k]
    )
    if strict and (missing or unexpected or mismatched):
        raise CheckpointMismatchError(path, missing, unexpected, mismatched)
    bad = {k for k, _, _ in mismatched}
    to_load = {k: t for k, t in flat.tensors.items() if k in ckpt_tensors and k not in bad}
    md = metadata.state_dict_metadata
    changes = _dtype_changes(
        path,
        {k: m.properties.dtype for k, m in md.items() if isinstance(m, TensorStorageMetadata)},
        {k: t.dtype for k, t in to_load.items()},
        allow_dtype_cast,
    )
    if changes:
        raise CheckpointMismatchError(path, [], [], [], changes)
    if isinstance(reader, VescaleFileSystemReader):
        reader.validate(metadata, to_load)
    else:
        for k in to_load:
            check_chunks(k, md[k], path)
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
    except BaseException as e:  # noqa: BLE001 - re-raised with DCP's wrapper removed
        err = _as_checkpoint_error(e, f"loading {path}")
        if err is e:
            raise
        raise err from err.__cause__
    for k, setter in flat.value_setters.items():
        if k in values:
            value = decode_value(values[k])
            if k.endswith(".param_groups"):
                value = _cover_param_groups(value, decode_value(flat.values[k]))
            setter(value)
    for fn in flat.finishers:
        fn()
    return LoadResult(missing, unexpected, mismatched, time.perf_counter() - t0)
