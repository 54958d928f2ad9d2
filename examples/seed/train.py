"""The program from the guide vescale's users start from, as they write it.

    torchrun --nproc-per-node 4 examples/seed/train.py          # the flat plan
    torchrun --nproc-per-node 4 examples/seed/train.py --no-plan
    torchrun --nproc-per-node 4 examples/seed/train.py --desync  # the debug tool fires

A 2x2 device mesh, an unmodified model, a flat sharding plan written with one
placement per parameter (the remaining mesh dim is padded with ``Replicate()``), a
plain training loop, and the gradient-sync debugging switch called with no arguments.
``--desync`` feeds rank 1 other data, so its replicated gradients diverge and the
debug check raises ``GradientSyncError`` naming the parameters.
"""

import argparse

import torch
from torch import nn

from vescale.debug import enable_gradient_sync_debug
from vescale.dmodule import DModule
from vescale.dtensor.device_mesh import DeviceMesh
from vescale.dtensor.placement_types import Replicate


class SimpleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--no-plan", action="store_true", help="DModule(model, mesh) without a plan"
    )
    parser.add_argument("--desync", action="store_true", help="give rank 1 different data")
    parser.add_argument(
        "--debug-late", action="store_true", help="enable the debug check after building the model"
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    if not args.debug_late:
        enable_gradient_sync_debug()
    device_mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    model = SimpleModel()
    sharding_plan = {"linear.weight": [Replicate()], "linear.bias": [Replicate()]}
    if args.no_plan:
        dmodule = DModule(model, device_mesh)
    else:
        dmodule = DModule(model, device_mesh, sharding_plan)

    if args.debug_late:
        enable_gradient_sync_debug()

    optimizer = torch.optim.SGD(dmodule.parameters(), lr=0.1)
    rank = torch.distributed.get_rank()
    for step in range(args.steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        if args.desync and rank == 1:
            x = x + 1.0
        loss = dmodule(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.full_tensor().item():.6f}")
    if rank == 0:
        print("weight checksum", f"{dmodule.linear.weight.full_tensor().sum().item():.6f}")


if __name__ == "__main__":
    main()
