"""vescale.ragged: the ``RaggedShard`` placement, flat buffers and pack kernels.

``RaggedShard(dims, local_units)`` shards the flattened storage of a tensor in
arbitrary proportions, so that many parameters can live as views of one buffer
and be gathered with no padding and no extra copies. It joins ``vescale.dtensor``
only through the ``vescale`` entry point (``vescale.ragged._plugin``).
"""

from vescale.ragged.__about__ import __version__
from vescale.ragged._placement import RaggedShard

__all__ = ["__version__", "RaggedShard"]
