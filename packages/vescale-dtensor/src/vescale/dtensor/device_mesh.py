"""``DeviceMesh``: torch's device mesh with input validation and self-initialisation.

`DeviceMesh` subclasses `torch.distributed.device_mesh.DeviceMesh`,
so it is accepted wherever torch expects a mesh (DTensor, FSDP2,
``parallelize_module``, DCP). On top of torch it

* validates its input and raises `ValueError` saying what was expected;
* initialises the default process group from the environment when none
  exists: gloo for ``"cpu"``, NCCL for ``"cuda"``, configured by the
  ``torchrun`` variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``); without any of them, a single-process group (world size 1)
  is created so that scripts also run as plain ``python``;
* applies a collective timeout (`set_default_timeout`, environment
  variable ``VESCALE_COLLECTIVE_TIMEOUT``, default 300 s) to the process
  groups it creates (and, when the timeout is configured, to a default
  group the caller created); joining the default group it creates waits for
  the last rank to start for at least 300 s, whatever the collective timeout;
* checks that every rank builds the same mesh: one all-gather of a small
  fingerprint (device type, shape, ranks, dimension names) over the default
  group, under the timeout, before any group is created. Ranks that disagree
  raise `MeshMismatchError` on every rank, naming both versions,
  instead of hanging in torch's group creation.

Sub-meshes obtained by slicing (``mesh["tp"]``) are torch's own
``DeviceMesh`` objects, as torch builds them internally.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as _TorchDeviceMesh

__all__ = [
    "DeviceMesh",
    "MeshMismatchError",
    "get_default_timeout",
    "init_device_mesh",
    "set_default_timeout",
]

TIMEOUT_ENV = "VESCALE_COLLECTIVE_TIMEOUT"
_DEFAULT_TIMEOUT_S = 300.0
#: Joining the default group waits at least this long for the last rank to start.
_JOIN_TIMEOUT_MIN_S = 300.0
_timeout_override: float | None = None
_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def set_default_timeout(seconds: float | None) -> None:
    """Set the collective timeout used for process groups vescale creates.

    Args:
        seconds: Positive number of seconds, or ``None`` to fall back to the
            ``VESCALE_COLLECTIVE_TIMEOUT`` environment variable (or 300 s).

    Raises:
        ValueError: If ``seconds`` is not a positive finite number.
    """
    global _timeout_override
    if seconds is not None:
        seconds = _check_timeout(seconds, "set_default_timeout")
    _timeout_override = seconds


def _check_timeout(value: Any, where: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected a positive number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{where}: expected a positive number of seconds, got {value!r}")
    return seconds


def _timeout_configured() -> bool:
    return _timeout_override is not None or bool(os.environ.get(TIMEOUT_ENV))


def get_default_timeout() -> float:
    """Return the collective timeout in seconds.

    Order: the value given to `set_default_timeout`, else the
    ``VESCALE_COLLECTIVE_TIMEOUT`` environment variable, else 300.

    Raises:
        ValueError: If the environment variable is not a positive number.
    """
    if _timeout_override is not None:
        return _timeout_override
    env = os.environ.get(TIMEOUT_ENV)
    if env:
        return _check_timeout(env, f"environment variable {TIMEOUT_ENV}")
    return _DEFAULT_TIMEOUT_S


class MeshMismatchError(ValueError):
    """Ranks constructed different device meshes (shape, ranks, names or device type).

    Raised on every rank by `DeviceMesh` and `init_device_mesh` before any process
    group is created.

    Attributes:
        versions: ``{description: [global ranks that built it]}``.
    """

    def __init__(self, versions: dict[str, list[int]]) -> None:
        self.versions = versions
        parts = "; ".join(f"ranks {ranks} built {desc}" for desc, ranks in versions.items())
        super().__init__(
            f"ranks disagree on the device mesh: {parts}. Every rank must construct the "
            "same DeviceMesh (same shape, ranks, dimension names and device type)"
        )


def _describe_mesh(device_type: str, tensor: torch.Tensor, names: tuple[str, ...] | None) -> str:
    ranks = tensor.tolist() if tensor.numel() <= 64 else f"<{tensor.numel()} ranks>"
    return f"a {device_type!r} mesh of shape {tuple(tensor.shape)} with ranks {ranks}" + (
        f" and dim names {names}" if names else ""
    )


def _fingerprint(
    device_type: str, tensor: torch.Tensor, names: tuple[str, ...] | None
) -> list[int]:
    def crc(text: str) -> int:
        return zlib.crc32(text.encode())

    return [
        tensor.ndim,
        tensor.numel(),
        crc(repr(tuple(tensor.shape))),
        zlib.crc32(tensor.contiguous().numpy().tobytes()),
        crc(repr(names)),
        crc(device_type),
    ]


def _exchange_device() -> torch.device:
    """A device the default group can run a collective on."""
    backend = str(dist.get_backend()).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _check_same_mesh(device_type: str, tensor: torch.Tensor, names: tuple[str, ...] | None) -> None:
    """Raise `MeshMismatchError` on every rank unless all ranks build this mesh.

    One all-gather of a fixed-size fingerprint over the default group; only when the
    fingerprints differ, a second one (every rank sees the same fingerprints, so all
    take it) exchanges the descriptions for the error message.
    """
    world = dist.get_world_size()
    if world == 1:
        return
    device = _exchange_device()
    mine = torch.tensor(_fingerprint(device_type, tensor, names), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    rows = [tuple(g.tolist()) for g in gathered]
    if len(set(rows)) == 1:
        return
    descriptions: list[Any] = [None] * world
    dist.all_gather_object(descriptions, _describe_mesh(device_type, tensor, names))
    versions: dict[str, list[int]] = {}
    for rank, desc in enumerate(descriptions):
        versions.setdefault(str(desc), []).append(rank)
    raise MeshMismatchError(versions)


def _check_device_type(device_type: Any) -> str:
    if not isinstance(device_type, str):
        raise ValueError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    try:
        dev = torch.device(device_type)
    except RuntimeError:
        raise ValueError(
            f"unknown device type {device_type!r}; expected 'cpu', 'cuda' or another torch device type"
        ) from None
    if dev.index is not None:
        raise ValueError(
            f"device_type must name a device type without an index (e.g. 'cuda'), got {device_type!r}"
        )
    if dev.type == "meta":
        raise ValueError(
            "device_type 'meta' cannot run collectives; expected 'cpu', 'cuda' or another device type"
        )
    return dev.type


def _check_dim_names(mesh_dim_names: Any, ndim: int) -> tuple[str, ...] | None:
    if mesh_dim_names is None:
        return None
    if isinstance(mesh_dim_names, str):
        raise ValueError(
            f"mesh_dim_names must be a tuple of str, got the str {mesh_dim_names!r}; write ({mesh_dim_names!r},)"
        )
    names = tuple(mesh_dim_names)
    if len(names) != ndim:
        raise ValueError(
            f"mesh_dim_names {names} has {len(names)} name(s) but the mesh has {ndim} dimension(s)"
        )
    if not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"mesh_dim_names must be non-empty str, got {names}")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"mesh_dim_names must be unique, got {names} (duplicates: {dups})")
    return names


def _mesh_tensor(mesh: Any) -> torch.Tensor:
    if isinstance(mesh, torch.Tensor):
        tensor = mesh.detach().cpu()
    else:
        try:
            tensor = torch.tensor(mesh)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(
                f"mesh must be a (nested) list or tensor of integer ranks, got {mesh!r} ({exc})"
            ) from None
    if tensor.ndim == 0:
        raise ValueError("mesh must have at least one dimension, got a scalar")
    if tensor.numel() == 0:
        raise ValueError(f"mesh must contain at least one rank, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"mesh must hold integer ranks, got dtype {tensor.dtype}")
    tensor = tensor.to(torch.int64)
    flat = tensor.flatten().tolist()
    if min(flat) < 0:
        raise ValueError(f"mesh ranks must be non-negative, got {sorted(r for r in flat if r < 0)}")
    if len(set(flat)) != len(flat):
        dups = sorted({r for r in flat if flat.count(r) > 1})
        raise ValueError(f"mesh ranks must be unique, got duplicates {dups} in {tensor.tolist()}")
    return tensor


def _ensure_process_group(device_type: str) -> None:
    """Initialise the default process group from the environment if needed."""
    if dist.is_initialized():
        return
    backend = _BACKENDS.get(device_type)
    if backend is None:
        raise ValueError(
            f"no default backend for device type {device_type!r}; expected 'cpu' (gloo) or 'cuda' (nccl), "
            "or initialise the process group yourself"
        )
    timeout = timedelta(seconds=get_default_timeout())
    present = [v for v in _TORCHRUN_VARS if os.environ.get(v)]
    if not present:
        # Plain `python script.py`: a world of one process.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return
    missing = [v for v in _TORCHRUN_VARS if not os.environ.get(v)]
    if missing:
        raise ValueError(
            f"cannot initialise the process group from the environment: {present} are set but {missing} are not "
            "(launch with torchrun, or initialise the process group yourself)"
        )
    # Joining waits for the slowest rank to start, which may take longer than a short
    # collective timeout; the group's collectives then get the timeout itself.
    join = max(timeout, timedelta(seconds=_JOIN_TIMEOUT_MIN_S))
    dist.init_process_group(backend, init_method="env://", timeout=join)
    if join != timeout:
        _set_timeout(None)


def _set_timeout(group: Any) -> None:
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 (not a group of this rank)
        return
    if "gloo" not in backend and "nccl" not in backend:
        return  # e.g. torch's threaded test group: no timeout to set
    from vescale.dtensor import _compat

    try:
        _compat.set_pg_timeout(timedelta(seconds=get_default_timeout()), group)
    except Exception:  # noqa: BLE001 (backend without timeout support)
        pass


def _apply_timeout(mesh: _TorchDeviceMesh, default_group_too: bool) -> None:
    """The collective timeout on the groups of ``mesh``'s dims (torch gives them 30 min).

    A dim over the whole world uses the default group: that one only with
    ``default_group_too`` (vescale created it, or the timeout is configured).
    """
    default = dist.group.WORLD
    for dim in range(mesh.ndim):
        try:
            group = mesh.get_group(dim)
        except Exception:  # noqa: BLE001 (rank outside the mesh: no group)
            continue
        if group is default and not default_group_too:
            continue
        _set_timeout(group)


class DeviceMesh(_TorchDeviceMesh):
    """A validated `torch.distributed.device_mesh.DeviceMesh`.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or another torch device type (no index).
        mesh: Nested list or integer tensor of unique global ranks; its shape is
            the mesh shape. Ranks must lie in ``range(world_size)``; a mesh may
            cover only part of the world.
        mesh_dim_names: One unique name per mesh dimension.
        **kwargs: Passed to torch's constructor (e.g. ``backend_override``).

    Raises:
        ValueError: On an unknown device type, a malformed mesh, duplicate or
            out-of-range ranks, or mismatched/duplicate dimension names.
        MeshMismatchError: (a ``ValueError``, on every rank) Ranks passed different
            meshes.

    Example:
        ```python
        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        ```
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence[Any] | None = None,
        *,
        mesh_dim_names: tuple[str, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        if mesh is None or any(k.startswith("_") for k in kwargs):
            # torch-internal construction path (layouts, rank maps): no checks.
            super().__init__(device_type, mesh, mesh_dim_names=mesh_dim_names, **kwargs)
            return
        device_type = _check_device_type(device_type)
        tensor = _mesh_tensor(mesh)
        names = _check_dim_names(mesh_dim_names, tensor.ndim)
        created = not dist.is_initialized()
        _ensure_process_group(device_type)
        world = dist.get_world_size()
        outside = sorted(r for r in tensor.flatten().tolist() if r >= world)
        if outside:
            raise ValueError(
                f"mesh ranks must lie in range(world_size={world}); got {outside} in {tensor.tolist()}"
            )
        if _timeout_configured() and not created:
            _set_timeout(None)  # the fingerprint exchange runs on the default group
        _check_same_mesh(device_type, tensor, names)
        super().__init__(device_type, tensor, mesh_dim_names=names, **kwargs)
        _apply_timeout(self, default_group_too=created or _timeout_configured())


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
) -> DeviceMesh:
    """Create a `DeviceMesh` over the whole world, ranks laid out row-major.

    Initialises the default process group from the environment if needed.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or another torch device type.
        mesh_shape: Positive sizes whose product equals the world size.
        mesh_dim_names: One unique name per mesh dimension.

    Returns:
        The mesh ``torch.arange(world_size).view(mesh_shape)``.

    Raises:
        ValueError: On a malformed shape, a shape whose size differs from the
            world size, or invalid names or device type.
        MeshMismatchError: (a ``ValueError``, on every rank) Ranks passed different
            shapes or names.
    """
    device_type = _check_device_type(device_type)
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    shape = tuple(mesh_shape)
    if not shape or not all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape
    ):
        raise ValueError(
            f"mesh_shape must be a non-empty tuple of positive ints, got {mesh_shape!r}"
        )
    names = _check_dim_names(mesh_dim_names, len(shape))
    _ensure_process_group(device_type)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"mesh_shape {shape} has {math.prod(shape)} rank(s) but the world size is {world}; "
            "expected a shape whose product equals the world size"
        )
    return DeviceMesh(device_type, torch.arange(world).view(shape), mesh_dim_names=names)


def _install_dynamo_rule() -> None:
    from vescale.dtensor import _compat

    _compat.install_dynamo_mesh_rule(DeviceMesh)


_install_dynamo_rule()
