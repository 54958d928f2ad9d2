"""vescale-ragged's plugin module, loaded only through the ``vescale`` entry point.

``vescale.dtensor`` never imports vescale-ragged: pluggy's
``load_setuptools_entrypoints("vescale")`` finds this module.
"""

from __future__ import annotations

from vescale.dtensor import hookimpl
from vescale.ragged._pack_plugin import (  # noqa: F401  (hook implementations)
    vescale_addhooks,
    vescale_pack_kernels,
    vescale_pack_kernels_triton,
)
from vescale.ragged._placement import RaggedShard
from vescale.ragged._steps import step_for


@hookimpl
def vescale_register_placements():
    return RaggedShard


@hookimpl
def vescale_redistribute_step(src, dst):
    return step_for(src, dst)
