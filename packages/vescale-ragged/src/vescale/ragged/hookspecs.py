"""Hook specifications owned by vescale-ragged.

Added to the ``vescale`` plugin manager through ``vescale_addhooks`` by
vescale-ragged's own plugin module. Answers are asked once per device type and
cached (`vescale.ragged.get_pack_kernels`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vescale.dtensor import hookspec

if TYPE_CHECKING:
    from vescale.ragged._pack import PackKernels

__all__ = ["vescale_pack_kernels"]


@hookspec(firstresult=True)
def vescale_pack_kernels(device_type: str) -> PackKernels | None:
    """Return pack/unpack kernels for tensors on ``device_type``, or ``None``.

    vescale-ragged answers ``trylast`` with torch kernels for every device type and,
    when Triton is installed, with Triton kernels for ``"cuda"``. A plugin answering
    without ``trylast`` overrides them.

    Args:
        device_type: ``torch.device.type`` of the tensors (``"cpu"``, ``"cuda"``, ...).

    Returns:
        A `vescale.ragged.PackKernels` or ``None``.
    """
