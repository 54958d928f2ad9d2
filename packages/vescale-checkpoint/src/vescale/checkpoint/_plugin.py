"""vescale-checkpoint's plugin module, loaded through the ``vescale`` entry point.

It adds `vescale.checkpoint.hookspecs` to the plugin manager and answers
``vescale_checkpoint_storage`` for local paths (``trylast``, so third-party storages
registered through the same hook take precedence).
"""

from __future__ import annotations

import os

from vescale.checkpoint import hookspecs
from vescale.dtensor import hookimpl


@hookimpl
def vescale_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(hookspecs)


@hookimpl(trylast=True)
def vescale_checkpoint_storage(uri):
    from vescale.checkpoint._storage import VescaleFileSystemReader, VescaleFileSystemWriter

    path = str(uri)
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        return None
    path = os.fspath(path)
    return VescaleFileSystemWriter(path), VescaleFileSystemReader(path)
