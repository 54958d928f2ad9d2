"""Fails loudly when torch changes an internal that vescale-optim relies on."""

import torch

from vescale.dtensor.testing import expected_torch_internals
from vescale.optim import _compat

NATIVE = ["DTensor._local_tensor", "torch._foreach_mul_"]
RECORDED = {(2, 11): {}, (2, 13): {}, (2, 15): {}}


def test_torch_internals_report_is_the_recorded_one():
    report = _compat.check_torch_internals()
    assert report == expected_torch_internals(report, NATIVE, RECORDED)


def test_foreach_mul_fallback_matches_torch(monkeypatch):
    def tensors():
        g = torch.Generator().manual_seed(0)
        return [
            torch.randn(5, generator=g),
            torch.randn(2, 3, generator=g).t(),
            torch.randn((), generator=g),
        ]

    coef = torch.tensor(0.37)
    native, fallback = tensors(), tensors()
    _compat.foreach_mul_(native, coef)
    monkeypatch.setattr(_compat, "_FOREACH_OK", False)
    _compat.foreach_mul_(fallback, coef)
    assert all(torch.equal(a, b) for a, b in zip(native, fallback))
