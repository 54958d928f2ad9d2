"""The one record of what vescale attached to a module: `ModuleState`.

Every feature of vescale-dmodule that has to find another one on a module (the
``DModule`` plan state, the DDP/FSDP engine, activation checkpointing) reads and
writes it through `module_state`, the only accessor; nothing else is stored in a
module's ``__dict__``. The features talk to each other through methods of what is
stored here (`DataParallelEngine`), never by attribute names or duck typing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from vescale.dmodule._activation_checkpoint import _ACState
    from vescale.dmodule._api import _State

__all__ = ["ModuleState", "module_state", "dp_engine", "DataParallelEngine"]

_ATTR = "_vescale_state"


class DataParallelEngine:
    """What the other features may ask of a data-parallel engine (DDP or FSDP).

    `vescale.dmodule._ddp.DDPEngine` and `vescale.dmodule._fsdp.FSDPEngine` derive
    from it. The gradient-synchronisation switch (`no_sync`) is shared.
    """

    _sync: bool = True

    def __init__(self, module: nn.Module, mesh: DeviceMesh, dp_dim: int) -> None:
        """Bind the engine to ``module`` and the data-parallel mesh dim ``dp_dim``.

        Sets ``module``, ``mesh``, ``dp_dim``, ``pg`` (the dp dim's process group) and
        ``world`` (its size); gradients are synchronised (`no_sync` off) and no
        end-of-backward callback is queued yet (``_cb_queued``).
        """
        self.module = module
        self.mesh = mesh
        self.dp_dim = dp_dim
        self.pg = mesh.get_group(dp_dim)
        self.world = mesh.size(dp_dim)
        self._sync = True
        self._cb_queued = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; no communication."""
        prev = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = prev

    def set_gradient_sync(self, enabled: bool) -> None:
        """Reduce gradients in backward (``True``) or accumulate them locally."""
        self._sync = bool(enabled)

    def recompute_context(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Context of an activation-checkpoint recomputation of ``module`` (default: none)."""
        return contextlib.nullcontext()

    def checkpoint_candidates(self, root: nn.Module) -> list[str]:
        """Submodule names that ``activation_checkpointing=True`` picks (default: none)."""
        return []

    def engine_tensors(self) -> list:
        """Buffers the engine holds besides parameters and gradients (memory accounting)."""
        return []


@dataclasses.dataclass
class ModuleState:
    """What vescale attached to one module.

    Attributes:
        dmodule: The ``DModule`` state (plan, hooks, ``PartialGradSync``) when the
            module was given to `parallelize_module`.
        dp_engine: The data-parallel engine running the module (`replicate` or
            `fully_shard`; with FSDP2's per-layer-then-root calls, every wrapped module
            points at the one engine that runs them).
        checkpoint: The activation-checkpointing record when the module's forward
            was wrapped by `apply_activation_checkpointing`.
    """

    dmodule: _State | None = None
    dp_engine: DataParallelEngine | None = None
    checkpoint: _ACState | None = None


def module_state(module: nn.Module, create: bool = False) -> ModuleState | None:
    """The `ModuleState` of ``module`` (``None`` when it has none and not ``create``)."""
    d = getattr(module, "__dict__", None)
    if d is None:
        return None
    state = d.get(_ATTR)
    if state is None and create:
        state = d[_ATTR] = ModuleState()
    return state


def dp_engine(module: nn.Module) -> Any:
    """The data-parallel engine of ``module`` (``None`` if it has none)."""
    state = module_state(module)
    return None if state is None else state.dp_engine
