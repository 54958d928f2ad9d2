"""Pack kernels: exactness for many dtypes, the hook, and the Triton kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from vescale.dtensor import get_plugin_manager
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
