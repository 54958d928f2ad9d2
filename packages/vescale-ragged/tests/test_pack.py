"""Pack kernels: exactness for many dtypes, the hook, and the Triton kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from vescale.dtensor import get_plugin_manager
from vescale.ragged import _compat, _pack
from vescale.ragged._pack import PackKernels, TorchPackKernels, get_pack_kernels

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]
SHAPES = [(3, 5), (0,), (), (1030,), (2, 3, 4), (7, 1)]


def _tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in SHAPES:
        x = torch.randn(shape, generator=g) * 20
        if dtype == torch.complex64:
            out.append(torch.complex(x, -x))
        else:
            out.append(x.to(dtype))
    out.append(out[0].t())  # non-contiguous
    return out


def _reference(tensors, dtype):
    return (
        torch.cat([t.reshape(-1).to(dtype) for t in tensors])
        if tensors
        else torch.empty(0, dtype=dtype)
    )


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (floats: equal values, NaN matching NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point() and a.element_size() > 1:
        return bool(((a == b) | (a != a) & (b != b)).all())
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_pack_unpack_roundtrip_exact(dtype):
    k = TorchPackKernels()
    ts = _tensors(dtype)
    buf = k.pack(ts)
    assert buf.dtype == dtype and buf.dim() == 1
    assert _bits_equal(buf, _reference(ts, dtype))
    back = [torch.empty_like(t) for t in ts]
    k.unpack(buf, back)
    for a, b in zip(back, ts):
        assert _bits_equal(a, b)


@pytest.mark.parametrize(
    "src, dst",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float32),
        (torch.int32, torch.float32),
    ],
    ids=str,
)
def test_torch_pack_casts_like_copy(src, dst):
    k = TorchPackKernels()
    ts = _tensors(src)
    out = torch.full((sum(t.numel() for t in ts) + 3,), 7, dtype=dst)
    assert k.pack(ts, out) is out
    n = out.numel() - 3
    assert _bits_equal(out[:n], _reference(ts, dst))
    assert torch.all(out[n:] == 7)  # the tail is untouched
    back = [torch.empty_like(t) for t in ts]
    k.unpack(out, back)
    for a, t in zip(back, ts):
        assert _bits_equal(a, t.to(dst).to(src))


def test_pack_validation():
    k = TorchPackKernels()
    ts = [torch.ones(4), torch.ones(2)]
    with pytest.raises(ValueError, match="6"):
        k.pack(ts, torch.empty(5))
    with pytest.raises(ValueError, match="1-D contiguous"):
        k.pack(ts, torch.empty(4, 2))
    with pytest.raises(ValueError, match="dtype"):
        k.pack(ts, torch.empty(6), dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype= or out="):
        k.pack([])
    assert k.pack([], dtype=torch.float32).numel() == 0


# --------------------------------------------------------------------------- strategies
# TorchPackKernels picks a strategy from the tensors' sizes, dtypes and dims; every one
# must give exactly what per-tensor ``copy_`` gives. The thresholds are patched to force
# each strategy on small inputs, and the torch privates to their public fallbacks.

_PATHS = {
    # name: (_STAGE_SAME, _STAGE_CAST, _STAGE_CHUNK)
    "staged": (1 << 40, 1 << 40, 1 << 20),
    "staged-chunked": (1 << 40, 1 << 40, 40),
    "direct": (0, 0, 1 << 20),
}


@pytest.fixture(params=list(_PATHS))
def path(request, monkeypatch):
    same, cast, chunk = _PATHS[request.param]
    monkeypatch.setattr(_pack, "_STAGE_SAME", same)
    monkeypatch.setattr(_pack, "_STAGE_CAST", cast)
    monkeypatch.setattr(_pack, "_STAGE_CHUNK", chunk)
    return request.param


@pytest.fixture(params=["torch-privates", "public-fallbacks"])
def privates(request, monkeypatch):
    if request.param == "public-fallbacks":
        monkeypatch.setattr(_pack, "_flatten_dense", _compat._flatten_public)
        monkeypatch.setattr(_pack, "_unflatten_dense", _compat._unflatten_public)
        monkeypatch.setattr(_pack, "_foreach_copy", _compat._foreach_copy_public)
    return request.param


def _varied(dtypes, seed=0):
    """Tensors of the given dtypes (cycled): N-D, 1-D, 0-d, zero-numel, non-contiguous."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (4,), (), (2, 0), (0,), (9,), (2, 3, 4), (6, 4), (1,), (5, 1)]
    out = []
    for i, shape in enumerate(shapes * 2):
        x = torch.randn(shape, generator=g) * 50
        if i % 4 == 3 and x.dim() == 2:
            x = x.t()  # non-contiguous
        elif i % 5 == 4 and x.dim() == 1 and x.numel() > 1:
            x = torch.randn(2 * x.numel(), generator=g)[::2] * 50  # strided 1-D
        dtype = dtypes[i % len(dtypes)]
        if not dtype.is_floating_point:
            x = x * 211  # integers that float16 cannot hold exactly
        out.append(x.to(dtype))
    return out


def _unpack_reference(buffer, tensors):
    """Per-tensor ``copy_`` from consecutive pieces of ``buffer``."""
    out, off = [], 0
    for t in tensors:
        e = torch.empty_like(t)
        e.copy_(buffer[off : off + t.numel()].view(t.shape))
        out.append(e)
        off += t.numel()
    return out


@pytest.mark.parametrize(
    "src_dtypes, buf_dtype",
    [
        ([torch.float32], torch.float32),
        ([torch.bfloat16], torch.bfloat16),
        ([torch.int64], torch.int64),
        ([torch.float32], torch.bfloat16),
        ([torch.bfloat16], torch.float32),
        ([torch.float64], torch.float16),
        ([torch.float32, torch.bfloat16], torch.float32),  # alternating dtypes
        ([torch.float32] * 3 + [torch.float16] * 3, torch.bfloat16),  # runs of one dtype
        ([torch.int64, torch.float16], torch.float32),  # would double-round if promoted
    ],
    ids=str,
)
def test_pack_unpack_every_strategy_matches_copy(path, privates, src_dtypes, buf_dtype):
    k = TorchPackKernels()
    ts = _varied(src_dtypes)
    variants = {
        "all": ts,
        "1-D only": [t for t in ts if t.dim() == 1],
        "N-D only": [t for t in ts if t.dim() != 1],
        "contiguous": [t.contiguous() for t in ts],
    }
    for variant, sel in variants.items():
        m = sum(t.numel() for t in sel)
        out = torch.full((m + 5,), 3, dtype=buf_dtype)
        assert k.pack(tuple(sel), out) is out
        assert _bits_equal(out[:m], _reference(sel, buf_dtype)), variant
        assert torch.all(out[m:] == 3), variant  # the tail is untouched
        assert _bits_equal(k.pack(sel, dtype=buf_dtype), _reference(sel, buf_dtype)), variant
        # Unpack into fresh tensors and into non-contiguous destinations.
        buf = torch.randn(m + 5).to(buf_dtype)
        expect = _unpack_reference(buf, sel)
        for dst in (
            [torch.full_like(t, 1) for t in sel],
            [
                torch.full(t.shape[::-1], 1, dtype=t.dtype).t() if t.dim() == 2 else t.clone()
                for t in sel
            ],
        ):
            k.unpack(buf, dst)
            for a, b in zip(dst, expect):
                assert _bits_equal(a, b), variant


def test_pack_staged_chunks_with_large_tensors_among_small(monkeypatch):
    # Runs of small tensors go through one flatten each; a tensor larger than a chunk
    # (here a non-contiguous one) is copied alone, without a temporary.
    monkeypatch.setattr(_pack, "_STAGE_CHUNK", 50)
    runs = []
    stage_run = _pack._stage_run
    monkeypatch.setattr(
        _pack,
        "_stage_run",
        lambda dst, ts, off, n: runs.append(len(ts)) or stage_run(dst, ts, off, n),
    )
    k = TorchPackKernels()
    g = torch.Generator().manual_seed(1)
    small = [torch.randn(s, generator=g) for s in [(3,), (2, 2), (), (0, 4), (1, 3)] * 8]
    big = torch.randn(7, 20, generator=g).t()
    ts = small + [big] + small[::-1] + [big.t()]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        runs.clear()
        assert _bits_equal(k.pack(ts, dtype=dtype), _reference(ts, dtype)), dtype
        assert runs.count(1) == 2 and max(runs) > 10, runs


def test_pack_unpack_leaves_that_require_grad():
    # Parameters: the copies are not recorded by autograd, in grad mode too.
    k = TorchPackKernels()
    ps = [torch.nn.Parameter(torch.randn(s)) for s in [(3, 2), (4,), ()]]
    for dtype in (torch.float32, torch.bfloat16):
        buf = k.pack(ps, dtype=dtype)
        assert not buf.requires_grad and buf.grad_fn is None
        assert _bits_equal(buf, _reference([p.detach() for p in ps], dtype))
        k.unpack(torch.arange(11.0).to(dtype), ps)
        assert all(p.is_leaf and p.requires_grad and p.grad_fn is None for p in ps)
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in ps]), torch.arange(11.0))
    out = torch.zeros(7, requires_grad=True)
    k.pack([torch.ones(3, 2), torch.ones(1)], out)
    assert out.is_leaf and out.grad_fn is None and out.sum().item() == 7


def test_unpack_validation_and_empty():
    k = TorchPackKernels()
    ts = [torch.ones(4), torch.ones(2, 1)]
    with pytest.raises(ValueError, match="5 elements; the tensors need 6"):
        k.unpack(torch.empty(5), ts)
    with pytest.raises(ValueError, match="1-D contiguous"):
        k.unpack(torch.empty(12)[::2], ts)
    k.unpack(torch.empty(0), [])
    k.unpack(torch.empty(3), [])
    out = torch.full((3,), 2.0)
    assert k.pack([], out) is out and torch.all(out == 2)
    assert k.pack([torch.empty(0, 3)], dtype=torch.int8).shape == (0,)


def test_torch_internals_unchanged():
    # The compat probe of the pack kernels (vescale.ragged._compat; the full report is
    # checked in test_compat.py): flatten/unflatten_dense_tensors and _foreach_copy_.
    # A torch upgrade that moves or changes one lands here (the kernels then fall back
    # to public torch, correct but slower).
    report = _pack.check_torch_internals()  # the name kept from before _compat existed
    for name in (
        "torch._C._nn.flatten_dense_tensors",
        "torch._C._nn.unflatten_dense_tensors",
        "torch._foreach_copy_",
    ):
        assert report[name] == "native", report
    assert _pack._flatten_dense is torch._C._nn.flatten_dense_tensors
    assert _pack._unflatten_dense is torch._C._nn.unflatten_dense_tensors
    assert _pack._foreach_copy is torch._foreach_copy_
    # The behaviours relied on, at sizes beyond the probe's.
    ts = _varied([torch.float32, torch.float32])
    flat = torch._C._nn.flatten_dense_tensors(ts)
    assert _bits_equal(flat, _reference(ts, torch.float32))
    buf = torch.arange(flat.numel() + 4, dtype=torch.float32)
    views = torch._C._nn.unflatten_dense_tensors(buf, ts)
    assert [v.shape for v in views] == [t.shape for t in ts]
    for v, e in zip(views, _unpack_reference(buf, ts)):
        assert torch.equal(v, e)
    torch._foreach_copy_(views, ts)
    assert _bits_equal(buf[: flat.numel()], flat) and torch.equal(
        buf[-4:], torch.arange(4.0) + flat.numel()
    )


def test_hook_answers_torch_kernels_for_cpu_and_caches():
    k = get_pack_kernels("cpu")
    assert isinstance(k, PackKernels) and k.name == "torch"
    assert get_pack_kernels(torch.device("cpu")) is k
    hook = get_plugin_manager().hook.vescale_pack_kernels
    assert hook.spec is not None and hook.spec.opts.get("firstresult")


def test_hook_without_cuda_triton_answer_falls_back():
    # The Triton hookimpl answers only for "cuda"; other device types get torch kernels.
    assert get_pack_kernels("meta").name == "torch"


def test_plugin_can_override_pack_kernels():
    from vescale.dtensor import hookimpl, register_plugin, unregister_plugin

    class Mine(TorchPackKernels):
        name = "mine"

    class Plugin:
        @hookimpl
        def vescale_pack_kernels(self, device_type):
            return Mine() if device_type == "cpu" else None

    plugin = Plugin()
    get_pack_kernels("cpu")
    register_plugin(plugin, name="test-pack-override")
    try:
        assert get_pack_kernels("cpu").name == "mine"
    finally:
        unregister_plugin(name="test-pack-override")
    assert get_pack_kernels("cpu").name == "torch"


_TRITON_SCRIPT = r"""
import torch
from vescale.ragged._triton_pack import TritonPackKernels
from vescale.ragged._pack import TorchPackKernels
k, ref = TritonPackKernels(), TorchPackKernels()
g = torch.Generator().manual_seed(0)
dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
shapes = [(3, 5), (0,), (), (2100,), (2, 3, 4)]
def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())
for src in dtypes:
    ts = [(torch.randn(s, generator=g) * 300).to(src) for s in shapes]
    ts.append(ts[0].t())  # non-contiguous: torch fallback path
    for dst in [src, torch.float32, torch.bfloat16, torch.float16]:
        out = k.pack(ts, dtype=dst)
        assert same(out, ref.pack(ts, dtype=dst)), (src, dst)
        back = [torch.empty_like(t) for t in ts]
        k.unpack(out, back)
        expect = [torch.empty_like(t) for t in ts]
        ref.unpack(out, expect)
        assert all(same(a, b) for a, b in zip(back, expect)), (src, dst)
nan = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0])
assert same(k.pack([nan], dtype=torch.bfloat16), nan.to(torch.bfloat16))
print("TRITON-OK")
"""


@needs_triton
def test_triton_pack_under_interpreter():
    # TRITON_INTERPRET must be set before triton is imported: run in a fresh process.
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "TRITON-OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_pack_on_gpu():
    k = get_pack_kernels("cuda")
    assert k.name == "triton"
    ts = [torch.randn(s, device="cuda") for s in [(1000, 3), (17,), (0,), (5, 5)]]
    for dst in [torch.float32, torch.bfloat16]:
        out = k.pack(ts, dtype=dst)
        assert torch.equal(out, torch.cat([t.reshape(-1) for t in ts]).to(dst))
        back = [torch.empty_like(t) for t in ts]
        k.unpack(out, back)
        assert all(torch.equal(a, t.to(dst).to(t.dtype)) for a, t in zip(back, ts))
