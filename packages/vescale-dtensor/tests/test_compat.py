"""Fails loudly when torch changes an internal that vescale-dtensor relies on."""

import torch
from torch.distributed.tensor import DTensor

import vescale.dtensor  # noqa: F401  (installs the patches)
from vescale.dtensor import _compat, _dispatch


def test_torch_internals_unchanged():
    assert _compat.check_torch_internals() == []


def test_torch_version_in_tested_range():
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    assert (major, minor) == (2, 13), (
        f"vescale-dtensor is tested on torch 2.13, got {torch.__version__}"
    )


def test_patches_wrap_torch_originals():
    assert DTensor.redistribute is _dispatch._patched_redistribute
    assert DTensor.from_local is _dispatch._patched_from_local
    assert _compat.ORIGINAL_REDISTRIBUTE.__module__ == "torch.distributed.tensor._api"
    assert _compat.ORIGINAL_FROM_LOCAL.__module__ == "torch.distributed.tensor._api"


def test_plugin_dtensor_is_a_dtensor_subclass():
    assert issubclass(_dispatch.PluginDTensor, DTensor)
    # base DTensor keeps torch's own dispatch (no Python override installed by vescale)
    assert DTensor.__torch_dispatch__.__func__.__module__ == "torch.distributed.tensor._api"
