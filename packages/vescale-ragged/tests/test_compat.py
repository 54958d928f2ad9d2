"""Fails loudly when torch changes an internal that vescale-ragged relies on.

The report of ``_compat.check_torch_internals()`` on the torch under test must be the
one recorded for that release. (The public fallbacks of the pack privates run against
the privates in test_pack.py.)
"""

from vescale.dtensor.testing import expected_torch_internals
from vescale.ragged import _compat

NATIVE = [
    "torch.distributed.all_gather_single",
    "torch.distributed.reduce_scatter_single",
    "Shard.local_shard_size_and_offset",
    "torch._C._nn.flatten_dense_tensors",
    "torch._C._nn.unflatten_dense_tensors",
    "torch._foreach_copy_",
]
RECORDED = {
    (2, 11): {
        "torch.distributed.all_gather_single": "native: torch.distributed.all_gather_into_tensor",
        "torch.distributed.reduce_scatter_single": "native: torch.distributed.reduce_scatter_tensor",
    },
    (2, 13): {},
    (2, 15): {},
}


def test_torch_internals_report_is_the_recorded_one():
    report = _compat.check_torch_internals()
    assert report == expected_torch_internals(report, NATIVE, RECORDED)
