"""Random ops on DTensors draw exactly what one device draws for the whole tensor.

Every check compares with plain torch on one device after the same
``torch.manual_seed``: the values of the op's result (dropout masks included) and the
generator's state afterwards (a later ``torch.rand`` matches).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vescale.dtensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from vescale.dtensor import random as vrandom
from vescale.dtensor.testing import distributed

PLACEMENTS = [
    [Shard(0), Shard(1)],
    [Shard(1), Replicate()],
    [Replicate(), Shard(2)],
    [Shard(0), Shard(0)],  # one tensor dim split over both mesh dims (FSDP x TP params)
    [Replicate(), Replicate()],
]


OPS = {
    "dropout": lambda t: F.dropout(t, 0.3),
    "native_dropout": lambda t: torch.ops.aten.native_dropout(t, 0.4, True),
    "rand_like": torch.rand_like,
    "randn_like": torch.randn_like,
    "randint_like": lambda t: torch.randint_like(t, 0, 10),
    "uniform_": lambda t: t.clone().uniform_(),
    "normal_": lambda t: t.clone().normal_(1, 2),
    "bernoulli_": lambda t: t.clone().bernoulli_(0.4),
    "bernoulli(p)": lambda t: torch.bernoulli(t.clamp(0, 1)),
    "exponential_": lambda t: t.clone().exponential_(),
}


def _single(seed, fn):
    """``fn()`` on one device after ``manual_seed(seed)``, and the next draw."""
    torch.manual_seed(seed)
    out = fn()
    return out, torch.rand(3)


def _dist(seed, fn):
    torch.manual_seed(seed)
    out = fn()
    return out, torch.rand(3)


def _same(got, want, what):
    """``got`` (DTensors: this rank's part) equals one device's ``want``; no collectives."""
    if isinstance(got, tuple):
        for x, y in zip(got, want, strict=True):
            _same(x, y, what)
        return
    if isinstance(got, DTensor):
        if any(p.is_partial() for p in got.placements):
            got = got.full_tensor()
        else:
            cut = distribute_tensor(want, got.device_mesh, got.placements, src_data_rank=None)
            assert got.shape == want.shape, what
            got, want = got.to_local(), cut.to_local()
    assert torch.equal(got, want), f"{what}: differs from one device\n{got}\n{want}"


@distributed(4)
def test_random_ops_equal_one_device_for_every_placement():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert vrandom.is_single_device_rng()
    for i, pl in enumerate(PLACEMENTS):
        shape = [(5, 6, 7), (4, 6, 8)][i % 2]  # uneven and even shards
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape) / 300 + 0.01
        x = distribute_tensor(full, mesh, pl)
        ops = OPS if i == 0 else {k: OPS[k] for k in ("dropout", "rand_like")}
        for name, op in ops.items():
            _same(_dist(7, lambda: op(x)), _single(7, lambda: op(full)), f"{name} {shape} {pl}")  # noqa: B023

    # a transposed (non-contiguous) DTensor, a user generator, autograd through dropout
    full = torch.randn(6, 4, 8, generator=torch.Generator().manual_seed(0))
    x = distribute_tensor(full, mesh, [Shard(0), Shard(2)])
    _same(
        _dist(3, lambda: F.dropout(x.transpose(0, 2), 0.5)),
        _single(3, lambda: F.dropout(full.transpose(0, 2), 0.5)),
        "dropout of a transposed DTensor",
    )
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    a = x.clone().uniform_(generator=g1).full_tensor()
    b = full.clone().uniform_(generator=g2)
    assert torch.equal(a, b) and torch.equal(g1.get_state(), g2.get_state())
    xr = distribute_tensor(full, mesh, [Shard(1), Shard(0)]).requires_grad_()
    fr = full.clone().requires_grad_()
    torch.manual_seed(5)
    (F.dropout(xr, 0.3) * 2).sum().backward()
    torch.manual_seed(5)
    (F.dropout(fr, 0.3) * 2).sum().backward()
    assert torch.equal(xr.grad.full_tensor(), fr.grad)

    # Partial: dropout is linear, so the mask applies to the pending sum
    part = DTensor.from_local(full / 2, mesh, [Partial(), Replicate()], run_check=False)
    _same(_dist(9, lambda: F.dropout(part, 0.5)), _single(9, lambda: F.dropout(full, 0.5)), "P")
    # an in-place fill of a Partial DTensor: its pending sum is the one-device value
    _same(
        _dist(9, lambda: part.clone().uniform_()), _single(9, lambda: full.clone().uniform_()), "P_"
    )

    # off: torch's own behaviour (on CPU every rank draws its local shape)
    before = vrandom.set_single_device_rng(False)
    try:
        assert before is True and not vrandom.is_single_device_rng()
        torch.manual_seed(7)
        local = torch.rand_like(distribute_tensor(full, mesh, [Shard(0), Replicate()])).to_local()
        torch.manual_seed(7)
        assert torch.equal(local, torch.rand(local.shape))
    finally:
        vrandom.set_single_device_rng(True)
    with pytest.raises(TypeError, match="bool"):
        vrandom.set_single_device_rng(1)


@distributed(4)
def test_data_parallel_rng_draws_the_global_batch():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_coordinate()
    full = torch.randn(8, 4, 6, generator=torch.Generator().manual_seed(0))
    for layout, rows in [("block", slice(dp_rank * 4, dp_rank * 4 + 4)), ("interleaved", None)]:
        mine = full[rows] if rows is not None else full[dp_rank::2]
        torch.manual_seed(4)
        ref = F.dropout(full, 0.5)
        ref_next = torch.rand(2)
        want = ref[rows] if rows is not None else ref[dp_rank::2]
        # plain tensors (DDP/FSDP activations)
        torch.manual_seed(4)
        with vrandom.data_parallel_rng(mesh, "dp", layout=layout):
            got = F.dropout(mine, 0.5)
        assert torch.equal(got, want) and torch.equal(torch.rand(2), ref_next), layout
        # DTensors replicated over dp, sharded over tp (FSDP x TP activations)
        x = DTensor.from_local(
            mine.chunk(2, dim=2)[tp_rank], mesh, [Replicate(), Shard(2)], run_check=False
        )
        torch.manual_seed(4)
        with vrandom.data_parallel_rng(mesh, ["dp"], layout=layout):
            got = F.dropout(x, 0.5).full_tensor()
        assert torch.equal(got, want) and torch.equal(torch.rand(2), ref_next), layout
        # activation checkpointing: with the backward inside the context, the
        # recomputation draws the forward's masks again (gradients of one device)
        w, w_ref = mine.clone().requires_grad_(), full.clone().requires_grad_()
        torch.manual_seed(4)
        with vrandom.data_parallel_rng(mesh, "dp", layout=layout):
            out = checkpoint(lambda t: F.dropout(t, 0.5) * 3, w, use_reentrant=False)
            out.sum().backward()
        torch.manual_seed(4)
        (F.dropout(w_ref, 0.5) * 3).sum().backward()
        want = w_ref.grad[rows] if rows is not None else w_ref.grad[dp_rank::2]
        assert torch.equal(w.grad, want), layout
    with pytest.raises(ValueError, match="'pp' is not a mesh dim"):
        with vrandom.data_parallel_rng(mesh, "pp"):
            pass
    with pytest.raises(ValueError, match="layout"):
        with vrandom.data_parallel_rng(mesh, "dp", layout="strided"):
            pass


def test_microbatch_rng_draws_the_whole_batch_mask():
    """Each micro-batch, restarted from one generator state, gets its rows of the whole
    batch's dropout mask; the generator ends where the whole-batch draw leaves it."""
    x = torch.randn(6, 5, 4) + 3.0  # no zeros: the mask is visible in the output
    torch.manual_seed(7)
    start = torch.get_rng_state()
    whole = F.dropout(x, 0.5)
    torch.rand(3)  # a later draw continues from the same state
    after = torch.rand(3)
    parts = []
    for i, mb in enumerate(x.chunk(3)):
        torch.set_rng_state(start)
        with vrandom.microbatch_rng(i, 3) as seen:
            parts.append(F.dropout(mb, 0.5))
        assert seen.random_ops >= 1
    torch.rand(3)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(3), after, rtol=0, atol=0)
    # without the region each micro-batch draws its own (different) mask
    torch.set_rng_state(start)
    assert not torch.equal(F.dropout(x[2:4], 0.5), whole[2:4])
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 3\)"):
        with vrandom.microbatch_rng(3, 3):
            pass
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        with vrandom.microbatch_rng(0, 0):
            pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@distributed(4)
def test_random_ops_equal_one_device_on_cuda():
    """The CUDA generator: 4 ranks on the local GPU(s) (gloo carries the few collectives),
    dropout and fills on DTensors equal one CUDA device's draw, and the generator ends in
    the same state; dropout inside ``data_parallel_rng`` draws the global batch's mask."""
    dev = torch.device("cuda", torch.distributed.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
    for pl in PLACEMENTS:
        full = torch.arange(5 * 6 * 7, dtype=torch.float32, device=dev).reshape(5, 6, 7) + 1
        x = distribute_tensor(full, mesh, pl, src_data_rank=None)
        for name in ("dropout", "rand_like", "randn_like", "bernoulli_", "normal_"):
            op = OPS[name]
            torch.manual_seed(7)
            got, got_next = op(x), torch.rand(3, device=dev)
            torch.manual_seed(7)
            want, want_next = op(full), torch.rand(3, device=dev)
            _same(got, want, f"cuda {name} {pl}")
            assert torch.equal(got_next, want_next), f"cuda generator state after {name} {pl}"
    dp_rank = mesh.get_coordinate()[0]
    full = torch.randn(8, 4, 6, device=dev, generator=torch.Generator(dev).manual_seed(0))
    torch.manual_seed(4)
    want = F.dropout(full, 0.5)[dp_rank * 4 : dp_rank * 4 + 4]
    torch.manual_seed(4)
    with vrandom.data_parallel_rng(mesh, "dp"):
        got = F.dropout(full[dp_rank * 4 : dp_rank * 4 + 4], 0.5)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_microbatch_rng_on_cuda():
    """Micro-batches restarted from one CUDA generator state get the whole batch's mask
    (what a pipeline stage does on CUDA), and the generator ends where one device's does."""
    x = torch.randn(6, 5, 4, device="cuda") + 3.0
    torch.manual_seed(7)
    start = torch.cuda.get_rng_state()
    whole = F.dropout(x, 0.5)
    after = torch.rand(3, device="cuda")
    parts = []
    for i, mb in enumerate(x.chunk(3)):
        torch.cuda.set_rng_state(start)
        with vrandom.microbatch_rng(i, 3):
            parts.append(F.dropout(mb, 0.5))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(3, device="cuda"), after, rtol=0, atol=0)
