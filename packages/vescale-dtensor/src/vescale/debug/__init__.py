"""Debugging aids for distributed training (import path kept from the seed project).

``enable_gradient_sync_debug()`` checks after each backward that gradients of
replicated parameters agree across ranks, and names the parameters and ranks that
diverge.
"""

from vescale.dtensor._grad_sync_debug import (
    GradientSyncDebugHandle,
    GradientSyncError,
    enable_gradient_sync_debug,
)

__all__ = ["enable_gradient_sync_debug", "GradientSyncError", "GradientSyncDebugHandle"]
