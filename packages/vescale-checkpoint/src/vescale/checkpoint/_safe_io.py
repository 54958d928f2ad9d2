"""Reading a checkpoint safely: plain file names inside the checkpoint, regular files only, and
DCP's pickled ``.metadata`` through an allow-list unpickler (loading never runs arbitrary code).
"""

from __future__ import annotations

import io
import os
import pickle
import stat
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from vescale.checkpoint._format import CheckpointCorruptError


def _safe_name(name: str, root: str | os.PathLike) -> str:
    """Return ``name`` if it is a plain file name inside ``root``; raise otherwise."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or os.path.isabs(name)
    ):
        raise CheckpointCorruptError(
            f"checkpoint {root}: file name {name!r} from metadata is not a plain name inside "
            "the checkpoint directory"
        )
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if os.path.dirname(real) != real_root:
        raise CheckpointCorruptError(
            f"checkpoint {root}: file {name!r} resolves outside the checkpoint directory"
        )
    return name


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((what for test, what in _FILE_KINDS if test(mode)), "not a regular file")


def open_regular(root: str | os.PathLike, name: str, what: str = "") -> io.BufferedReader:
    """Open ``root/name`` for reading if it is a regular file inside ``root``.

    Symlinks are followed only while they stay inside ``root`` (the directory itself
    may be a symlink). A FIFO, device, socket or directory is refused before it is
    opened, and again on the opened descriptor (``O_NONBLOCK``, so opening a FIFO that
    replaced the file in between cannot block).

    Args:
        root: The checkpoint directory.
        name: A plain file name inside it.
        what: What the file holds, for the error message (e.g. ``"tensor 'w'"``).

    Raises:
        CheckpointCorruptError: Missing, unreadable, not a regular file, or outside ``root``.
    """
    _safe_name(name, root)
    where = os.path.join(os.fspath(root), name)
    about = f" ({what})" if what else ""
    real = os.path.realpath(where)
    try:
        mode = os.stat(real).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointCorruptError(
                f"checkpoint file {where}{about} is not a regular file: it is {_kind(mode)}"
            )
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(real, flags | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint file {where}{about} is missing") from None
    except OSError as e:
        raise CheckpointCorruptError(
            f"cannot open checkpoint file {where}{about}: {e.strerror or e}"
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointCorruptError(
                f"checkpoint file {where}{about} is not a regular file: it is {_kind(mode)}"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_regular(root: str | os.PathLike, name: str, what: str = "") -> bytes:
    with open_regular(root, name, what) as f:
        try:
            return f.read()
        except OSError as e:
            where = os.path.join(os.fspath(root), name)
            raise CheckpointCorruptError(f"cannot read checkpoint file {where}: {e}") from None


# --------------------------------------------------------------------------- safe metadata
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED_GLOBALS:
        return True
    if module == "torch":
        import torch

        return isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        )
    return False


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise CheckpointCorruptError(
                f"checkpoint metadata refers to {module}.{name}, which is not an allowed "
                "metadata type (refusing to unpickle arbitrary objects)"
            )
        return super().find_class(module, name)


def safe_load_metadata(data: bytes, where: str | os.PathLike = "") -> Metadata:
    """Unpickle DCP metadata allowing only DCP's metadata classes and torch value types.

    Args:
        data: The pickled ``Metadata``.
        where: The file it came from (for error messages).

    Raises:
        CheckpointCorruptError: Not a pickled ``Metadata`` or refers to another type.
    """
    name = f" in {os.fspath(where)}" if where else ""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointCorruptError as e:
        raise CheckpointCorruptError(f"{e}{name}") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointCorruptError(
            f"checkpoint metadata{name} cannot be unpickled: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(
            f"checkpoint metadata{name} is a {type(md).__name__}, not Metadata"
        )
    return md
