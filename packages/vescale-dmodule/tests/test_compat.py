"""Fails loudly when torch changes an internal that vescale-dmodule relies on."""

import collections

import torch

from vescale.dmodule import _compat
from vescale.dtensor.testing import expected_torch_internals

NATIVE = [
    "torch.distributed.tensor.placement_types._StridedShard",
    "DTensor._local_tensor",
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._C._get/_set_dtensor_allow_implicit_replication",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch.autograd._unsafe_preserve_version_counter / _unsafe_set_version_counter",
    "torch._C._current_graph_task_id",
    "torch.utils._pytree.tree_flatten / tree_unflatten",
]
RECORDED = {(2, 11): {}, (2, 13): {}, (2, 15): {}}


def test_torch_internals_report_is_the_recorded_one():
    report = _compat.check_torch_internals()
    assert report == expected_torch_internals(report, NATIVE, RECORDED)


Pair = collections.namedtuple("Pair", "a b")


def test_pytree_fallback_round_trips_like_torch():
    x = torch.ones(2)
    tree = ((x, [1, {"k": x * 2, "j": None}]), {"kw": Pair(x * 3, "s")})
    leaves, spec = _compat.tree_flatten(tree)
    public_leaves, public_spec = _compat._flatten_public(tree)
    assert len(leaves) == len(public_leaves) and all(a is b for a, b in zip(leaves, public_leaves))
    new = [v * 10 if isinstance(v, torch.Tensor) else v for v in public_leaves]
    a, b = _compat.tree_unflatten(new, spec), _compat._unflatten_public(new, public_spec)
    assert type(a[1]["kw"]) is type(b[1]["kw"]) is Pair
    assert repr(a) == repr(b)


def test_in_backward_and_queue_callback():
    seen = []
    x = torch.ones(3, requires_grad=True)

    def hook(grad):
        seen.append(_compat.in_backward())
        _compat.queue_callback(lambda: seen.append("done"))
        return grad

    x.register_hook(hook)
    assert not _compat.in_backward()
    (x * 2).sum().backward()
    assert seen == [True, "done"]


def test_version_counters():
    t = torch.zeros(2)
    v = t._version
    with _compat.preserve_version_counter(t):
        t.add_(1)
    assert t._version == v
    t.add_(1)
    _compat.set_version_counters((t,), (v,))
    assert t._version == v and t.tolist() == [2.0, 2.0]
