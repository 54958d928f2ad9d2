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
    "torch.distributed.distributed_c10d._world.group_count",
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


def test_member_group_fallback_is_none(monkeypatch):
    # without torch's group count, a subgroup's async save has no group of its own:
    # save() then saves synchronously (tests/test_async.py covers the native path)
    from datetime import timedelta

    monkeypatch.setattr(_compat, "_GROUP_COUNT_OK", False)
    assert _compat.new_member_group([0, 1], timedelta(seconds=5)) is None
