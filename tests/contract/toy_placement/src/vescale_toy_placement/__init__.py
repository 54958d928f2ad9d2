"""A toy third-party placement: block-cyclic distribution of rows."""

from vescale_toy_placement.placement import BlockCyclic

__all__ = ["BlockCyclic"]
