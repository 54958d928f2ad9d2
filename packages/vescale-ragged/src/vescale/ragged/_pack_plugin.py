"""vescale-ragged's pack-kernel hook implementations.

Re-exported by ``vescale.ragged._plugin`` (the entry-point module), or registered
directly by `vescale.ragged.get_pack_kernels` when they are not.
"""

from __future__ import annotations

import importlib.util

from vescale.dtensor import hookimpl

__all__ = ["vescale_addhooks", "vescale_pack_kernels", "vescale_pack_kernels_triton"]


@hookimpl
def vescale_addhooks(pluginmanager) -> None:
    from vescale.ragged import hookspecs

    if (
        not hasattr(pluginmanager.hook, "vescale_pack_kernels")
        or not pluginmanager.hook.vescale_pack_kernels.has_spec()
    ):
        pluginmanager.add_hookspecs(hookspecs)


@hookimpl(trylast=True)
def vescale_pack_kernels(device_type: str):
    """Torch kernels for every device type (the fallback)."""
    from vescale.ragged._pack import TorchPackKernels

    return TorchPackKernels()


@hookimpl(specname="vescale_pack_kernels")
def vescale_pack_kernels_triton(device_type: str):
    """Triton kernels for CUDA tensors, when Triton is installed."""
    if device_type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from vescale.ragged._triton_pack import TritonPackKernels

    return TritonPackKernels()
