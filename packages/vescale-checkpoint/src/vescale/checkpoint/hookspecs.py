"""Hook specifications owned by vescale-checkpoint.

They join the ``vescale`` plugin manager through the core ``vescale_addhooks`` hook,
from `vescale.checkpoint._plugin`.
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

    A writer/reader pair that subclasses `vescale.checkpoint.VescaleFileSystemWriter`
    / `VescaleFileSystemReader` gets atomic commit (local
    filesystem renames), stale staging-dir cleanup, ``keep_last`` rotation, per-chunk
    CRC32 and the JSON manifest (plain values). Any other DCP writer/reader is used as
    is: tensors only, no commit, no checksums, no plain values.

    Args:
        uri: The ``path`` given to ``save``/``load``/``export``.

    Returns:
        ``(writer, reader)`` or ``None``.
    """
