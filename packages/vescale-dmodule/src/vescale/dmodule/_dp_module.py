"""Methods that `fully_shard` and `replicate` add.

As FSDP2's ``fully_shard`` does, both swap the wrapped module's class for a cached
subclass of a mixin and the module's own class, so the object keeps its identity,
attributes and code while gaining FSDP2's per-module controls. The swap composes with
`DModule`'s (a ``DModule`` wrapped again by ``fully_shard``
becomes ``FSDPDModule<Name>``, an instance of both mixins and of the original class).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from vescale.dmodule._module_state import dp_engine

__all__ = ["FullyShardedModule", "ReplicatedModule", "swap_class"]

_CLASS_CACHE: dict[tuple[type, type], type] = {}


def swap_class(module: nn.Module, mixin: type, prefix: str) -> None:
    """Make ``module`` an instance of ``mixin`` too (a cached ``<prefix><Name>`` subclass)."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    new = _CLASS_CACHE.get((mixin, cls))
    if new is None:
        new = type(f"{prefix}{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
        new.__qualname__ = f"{prefix}{cls.__qualname__}"
        _CLASS_CACHE[(mixin, cls)] = new
    module.__class__ = new


def _engine(module: nn.Module, kind: str) -> Any:
    engine = dp_engine(module)
    if engine is None:
        raise RuntimeError(f"{type(module).__qualname__} has no {kind} engine")
    return engine


class FullyShardedModule:
    """Per-module controls of a module wrapped by `fully_shard`.

    The names and meanings are FSDP2's (``torch.distributed.fsdp.FSDPModule``). With the
    per-layer-then-root idiom every wrapped module has them and acts on its own group
    (``recurse=True``: and on the groups inside it) of the one engine that runs them.
    """

    def unshard(self, async_op: bool = False) -> Any:
        """All-gather this module's own parameters (not its sub-groups').

        Afterwards the module's parameters are the unsharded compute tensors until
        `reshard` or the end of the next forward. With ``async_op=True`` the
        all-gather is only started; the returned handle's ``wait()`` finishes it and
        registers the unsharded parameters.

        Args:
            async_op: Return before the all-gather completes.

        Returns:
            A handle with ``wait()`` (already waited when ``async_op`` is ``False``).
        """
        return _engine(self, "FSDP").unshard_module(self, async_op=async_op)  # type: ignore[arg-type]

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded ones (this module's own)."""
        _engine(self, "FSDP").reshard_module(self)  # type: ignore[arg-type]

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduces the gradients (``False``: they accumulate locally).

        FSDP2's form of ``no_sync()``: set it to ``False`` for the micro-batches of a
        gradient-accumulation step and back to ``True`` before the last backward.

        Args:
            requires_gradient_sync: Reduce-scatter gradients in backward.
            recurse: Also for every fully-sharded group inside this module.
        """
        engine = _engine(self, "FSDP")
        for g in engine.groups_under(self, recurse):
            g.sync = bool(requires_gradient_sync)

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Whether this module's groups free their unsharded parameters after forward.

        Args:
            reshard_after_forward: ``True``: gather again in backward; ``False``:
                keep them until the end of backward.
            recurse: Also for every fully-sharded group inside this module.
        """
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(
                f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}"
            )
        engine = _engine(self, "FSDP")
        for g in engine.groups_under(self, recurse):
            g.reshard_after_forward = reshard_after_forward

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally (every group of the engine)."""
        with _engine(self, "FSDP").no_sync():
            yield


class ReplicatedModule:
    """Per-module controls of a module wrapped by `replicate` (DDP)."""

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward all-reduces the gradients (``False``: they accumulate locally).

        Args:
            requires_gradient_sync: All-reduce gradients in backward.
            recurse: Accepted for FSDP2 compatibility; one DDP engine covers the module.
        """
        _engine(self, "DDP").set_gradient_sync(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally."""
        with _engine(self, "DDP").no_sync():
            yield
