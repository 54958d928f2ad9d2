"""Input plans apply however the caller passes the argument; plan keys and list lengths."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from vescale.dmodule import DModule
from vescale.dtensor import DTensor, Replicate, Shard, init_device_mesh
from vescale.dtensor.testing import distributed


@dataclasses.dataclass
class Pair:
    a: torch.Tensor
    b: torch.Tensor


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict = {}

    def forward(self, x, scale=None, *, extra=None):
        self.seen = {"x": x, "scale": scale, "extra": extra}
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Inner(), Inner()])

    def forward(self, x, call: str = "positional"):
        for blk in self.blocks:
            x = blk(x) if call == "positional" else blk(x=x)
        return x


def _placements(v):
    return tuple(v.placements) if isinstance(v, DTensor) else None


SH = (Shard(0),)


@pytest.mark.parametrize(
    "key", [r"blocks\.\d+\.input", r"blocks\.\d+.input", "blocks.0.input", r"blocks\.0\.input"]
)
@pytest.mark.parametrize("spec", [[[Shard(0)]], {"x": [Shard(0)]}])
@pytest.mark.parametrize("call", ["positional", "keyword"])
@distributed(2)
def test_input_plan_applies_to_positional_and_keyword_calls(key, spec, call):
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = Outer()
    torch.manual_seed(0)
    model = DModule(Outer(), mesh, {"forward": {key: spec}})
    x = torch.randn(4, 4)
    out = model(x, call=call)
    assert _placements(model.blocks[0].seen["x"]) == SH
    if "d+" in key:
        assert _placements(model.blocks[1].seen["x"]) == SH
    full = out.full_tensor() if isinstance(out, DTensor) else out
    torch.testing.assert_close(full, ref(x), atol=1e-6, rtol=1e-6)


@distributed(2)
def test_keyword_only_and_container_arguments():
    mesh = init_device_mesh("cpu", (2,))
    model = DModule(
        Inner(), mesh, {"forward": {"input": {"x": [Shard(0)], "scale": [Shard(0)], "extra": SH}}}
    )
    x = torch.randn(4, 4)
    nested = {"p": Pair(torch.ones(2, 2), torch.zeros(4)), "t": (torch.ones(2),)}
    model(x, scale=torch.ones(4), extra=nested)
    assert _placements(model.seen["x"]) == SH
    assert _placements(model.seen["scale"]) == SH
    extra = model.seen["extra"]
    assert isinstance(extra["p"], Pair)
    assert _placements(extra["p"].a) == SH and _placements(extra["p"].b) == SH
    assert isinstance(extra["t"], tuple) and _placements(extra["t"][0]) == SH


@distributed(4)
def test_short_placement_lists_are_padded_and_long_ones_refused():
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    model = DModule(nn.Linear(4, 4), mesh, {"weight": [Shard(0)], "bias": [Replicate()]})
    assert tuple(model.weight.placements) == (Shard(0), Replicate())
    assert tuple(model.bias.placements) == (Replicate(), Replicate())
    with pytest.raises(ValueError, match="at most one placement per mesh dim"):
        DModule(nn.Linear(4, 4), mesh, {"weight": [Shard(0), Replicate(), Replicate()]})
