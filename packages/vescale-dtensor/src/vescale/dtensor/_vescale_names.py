"""Module ``__getattr__`` for veScale module paths: names we resolve late or refuse.

veScale programs import names from module paths that vescale mirrors (see
``docs/migrating.md``). A name vescale deliberately does not provide raises
``UnsupportedVeScaleName``, an ``ImportError`` whose message says why and what to
use instead, so ``from vescale.x import Name`` fails with that message (an
``AttributeError`` would be replaced by Python's generic "cannot import name").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["UnsupportedVeScaleName", "refusing_getattr"]


class UnsupportedVeScaleName(ImportError):
    """A veScale name that vescale does not provide; the message says why and what instead."""


def refusing_getattr(
    module: str,
    refused: Mapping[str, str],
    resolve: Callable[[str], Any] | None = None,
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves names late and refuses others clearly.

    Args:
        module: The module's ``__name__`` (for messages).
        refused: veScale names this module refuses, mapped to the reason and the
            replacement.
        resolve: Optional late resolver; returns the object or ``None`` if unknown.

    Returns:
        The ``__getattr__`` function for the module.
    """

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if resolve is not None:
            value = resolve(name)
            if value is not None:
                return value
        why = refused.get(name)
        if why is not None:
            raise UnsupportedVeScaleName(f"{module}.{name} is not provided by vescale: {why}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
