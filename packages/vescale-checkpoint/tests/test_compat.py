"""Fails loudly when torch changes an internal that vescale-checkpoint relies on."""

import torch

from vescale.checkpoint import _compat
from vescale.dtensor.testing import expected_torch_internals

NATIVE = [
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.distributed_c10d._get_default_group",
    "DTensor._local_tensor",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch._utils._element_size",
]
RECORDED = {(2, 11): {}, (2, 13): {}, (2, 15): {}}


def test_torch_internals_report_is_the_recorded_one():
    report = _compat.check_torch_internals()
    assert report == expected_torch_internals(report, NATIVE, RECORDED)


def test_element_size_fallback_matches_torch(monkeypatch):
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64]
    native = [_compat.element_size(d) for d in dtypes]
    monkeypatch.setattr(_compat, "_ELEMENT_SIZE_OK", False)
    assert [_compat.element_size(d) for d in dtypes] == native == [4, 2, 8, 1, 1, 8]
