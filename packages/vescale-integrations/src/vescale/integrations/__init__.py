"""vescale.integrations: vescale inside other trainers.

- `vescale.integrations.lightning.VescaleStrategy`: a PyTorch Lightning strategy
  (``pip install vescale-integrations[lightning]``).

Importing this package needs no trainer; each integration imports its trainer when it
is imported itself.
"""

from vescale.integrations.__about__ import __version__

__all__ = ["__version__"]
