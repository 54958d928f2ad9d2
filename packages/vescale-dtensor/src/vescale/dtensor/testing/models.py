"""Small reference modules for tests whose parameters take arbitrary layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["GatheredLinear"]


class GatheredLinear(nn.Module):
    """``y = x W^T + b`` computed on the *full* weight and bias.

    Its parameters may be plain tensors or DTensors with any placements (they are
    gathered in every forward), so optimizer and checkpoint tests can shard them
    freely and still compare against single-device training. Initialised from
    ``generator``: ``W ~ N(0, 1/fan_in)``, ``b ~ N(0, 0.01)``.
    """

    def __init__(self, fan_in: int, fan_out: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5)
        self.bias = nn.Parameter(torch.randn(fan_out, generator=generator) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _full(self.weight), _full(self.bias))


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if isinstance(p, DTensor) else p
