"""The one place where vescale-optim touches torch internals.

Probed by feature when imported (see ``vescale.dtensor.compat.TorchInternals``):
``torch._foreach_mul_`` (gradient clipping scales every gradient with one kernel per
device and dtype); DTensor's local tensor is vescale-dtensor's probe, shared. An
internal that is missing or behaves differently is replaced by a public (slower)
equivalent, with one ``TorchInternalsWarning`` naming it. `check_torch_internals`
reports what was found; the test suite compares it with the report recorded for the
torch under test.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vescale.dtensor.compat import local_tensor, sibling_internals

__all__ = ["check_torch_internals", "foreach_mul_", "local_tensor"]

_INTERNALS = sibling_internals("vescale-optim", shared=("DTensor._local_tensor",))


# ------------------------------------------------------------------ foreach multiply
_FOREACH_MUL = getattr(torch, "_foreach_mul_", None)


def _foreach_mul_problem() -> str | None:
    if not callable(_FOREACH_MUL):
        return "is missing"
    ts = [torch.tensor([1.0, -2.0]), torch.tensor([[3.0]], dtype=torch.float64)]
    _FOREACH_MUL(ts, torch.tensor(0.5))
    if ts[0].tolist() != [0.5, -1.0] or ts[1].tolist() != [[1.5]]:
        return f"scales differently: {ts}"
    return None


_FOREACH_OK = _INTERNALS.probe(
    "torch._foreach_mul_", _foreach_mul_problem, instead="one mul_ per tensor"
)


def foreach_mul_(tensors: Sequence[torch.Tensor], scalar: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``scalar`` (a 0-d tensor or a number)."""
    if _FOREACH_OK:
        _FOREACH_MUL(list(tensors), scalar)
        return
    for t in tensors:
        t.mul_(scalar)


def check_torch_internals() -> dict[str, str]:
    """What vescale-optim found of the torch internals it relies on.

    Returns:
        ``{internal: status}``, statuses as in ``vescale.dtensor.compat.check_torch_internals``.
    """
    return _INTERNALS.report()
