"""Hook specifications owned by vescale-checkpoint.

They join the ``vescale`` plugin manager through the core ``vescale_addhooks`` hook,
from :mod:`vescale.checkpoint._plugin`.
"""

from __future__ import annotations

from typing import Any

from vescale.dtensor import hookspec


@hookspec(firstresult=True)
def vescale_checkpoint_storage(uri: str) -> tuple[Any, Any] | None:
    """Return ``(writer, reader)`` for a checkpoint location, or ``None`` if not handled.

    ``writer`` is a ``torch.distributed.checkpoint.StorageWriter`` and ``reader`` a
    ``StorageReader``, both pointed at ``uri``. The built-in filesystem storage answers
    ``trylast`` for local paths and ``file://`` URIs; a plugin adds object stores by
    answering for its own schemes (``s3://...``). Asked once per ``save``/``load`` call.

    Writers that subclass :class:`vescale.checkpoint.VescaleFileSystemWriter` get atomic
    commit, checksums and rotation; any other DCP writer is used as is.

    Args:
        uri: The ``path`` given to ``save``/``load``/``export``.

    Returns:
        ``(writer, reader)`` or ``None``.
    """
