"""Debugging aids for distributed training (import path kept from the seed project).

``enable_gradient_sync_debug()`` checks after each backward that gradients of
replicated parameters agree across ranks, and names the parameters and ranks that
diverge. ``declare_replicated()`` lets an engine that keeps replicated parameters
as plain tensors (vescale DDP) have them checked too.
"""

from vescale.dtensor._grad_sync_debug import (
    GradientSyncDebugHandle,
    GradientSyncError,
    declare_replicated,
    enable_gradient_sync_debug,
)

__all__ = [
    "enable_gradient_sync_debug",
    "declare_replicated",
    "GradientSyncError",
    "GradientSyncDebugHandle",
]
