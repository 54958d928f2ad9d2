"""The one place where vescale-ragged touches torch internals.

Probed by feature when imported (see ``vescale.dtensor.compat.TorchInternals``):
``torch._C._nn.flatten_dense_tensors``, ``torch._C._nn.unflatten_dense_tensors`` and
``torch._foreach_copy_``, which the torch pack kernels use. The collectives renamed
across torch releases and torch's shard-size rule come from vescale-dtensor's
``_compat`` (their entries here repeat what it found). One that is missing or
behaves differently is replaced by a public (slower) equivalent, with one
``TorchInternalsWarning``; `check_torch_internals` reports which (the test
suite compares it with the report recorded for the torch under test).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vescale.dtensor.compat import (
    all_gather_single,
    reduce_scatter_single,
    shard_size_and_offset,
    sibling_internals,
)

__all__ = [
    "check_torch_internals",
    "flatten_dense",
    "unflatten_dense",
    "foreach_copy",
    "all_gather_single",
    "reduce_scatter_single",
    "shard_size_and_offset",
]

_INTERNALS = sibling_internals(
    "vescale-ragged",
    shared=(
        "torch.distributed.all_gather_single",
        "torch.distributed.reduce_scatter_single",
        "Shard.local_shard_size_and_offset",
    ),
)


def _flatten_public(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unflatten_public(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [t.numel() for t in tensors]
    pieces = flat.narrow(0, 0, sum(sizes)).split_with_sizes(sizes)
    return [p.view_as(t) for p, t in zip(pieces, tensors)]


def _foreach_copy_public(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s)


def _probe_src() -> list[torch.Tensor]:
    # A transposed (non-contiguous) 2-D tensor, a 0-d one, a zero-numel 2-D one, a 1-D one.
    return [
        torch.arange(6, dtype=torch.float16).view(2, 3).t(),
        torch.tensor(7, dtype=torch.float16),
        torch.empty(0, 3, dtype=torch.float16),
        torch.tensor([8, 9], dtype=torch.float16),
    ]


def _flatten_problem(flatten: Callable) -> str | None:
    expect = torch.tensor([0, 3, 1, 4, 2, 5, 7, 8, 9], dtype=torch.float16)
    got = flatten(_probe_src())
    if not (got.dtype == expect.dtype and got.shape == expect.shape and got.equal(expect)):
        return f"changed: gives {got}"
    return None


def _unflatten_problem(unflatten: Callable) -> str | None:
    src = _probe_src()
    flat = torch.arange(11, dtype=torch.float16)  # longer than needed: tail ignored
    views = unflatten(flat, src)
    shapes = [tuple(v.shape) for v in views]
    if shapes != [tuple(t.shape) for t in src] or views[0].data_ptr() != flat.data_ptr():
        return f"changed: gives shapes {shapes}"
    for v in views:
        v.fill_(-1)  # views: the writes land in flat, in order
    if flat[:9].ne(-1).any() or flat[9:].eq(-1).any():
        return f"no longer gives views: {flat}"
    return None


def _foreach_copy_problem(foreach_copy: Callable) -> str | None:
    from_ = [torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 1 / 3]]), torch.tensor(-2.7)]
    dst, ref = (
        [torch.zeros(3, 2, dtype=torch.bfloat16).t(), torch.zeros((), dtype=torch.int32)]
        for _ in range(2)
    )
    foreach_copy(dst, from_)
    for d, f in zip(ref, from_):
        d.copy_(f)
    if not all(a.equal(b) for a, b in zip(dst, ref)):
        return f"differs from copy_: {dst}"
    return None


flatten_dense = _INTERNALS.pick(
    "torch._C._nn.flatten_dense_tensors",
    _flatten_problem,
    stand_in=_flatten_public,
    instead="torch.cat of reshaped tensors",
)
unflatten_dense = _INTERNALS.pick(
    "torch._C._nn.unflatten_dense_tensors",
    _unflatten_problem,
    stand_in=_unflatten_public,
    instead="split_with_sizes + view_as",
)
foreach_copy = _INTERNALS.pick(
    "torch._foreach_copy_",
    _foreach_copy_problem,
    stand_in=_foreach_copy_public,
    instead="one copy_ per tensor",
)


def check_torch_internals() -> dict[str, str]:
    """What vescale-ragged found of the torch internals it relies on.

    Returns:
        ``{internal: status}``, statuses as in ``vescale.dtensor.compat.check_torch_internals``.
    """
    return _INTERNALS.report()
