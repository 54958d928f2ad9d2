"""torchrun smoke test: meshes work with no process-group set-up (run on 4 ranks).

Usage: ``torchrun --nproc-per-node 4 device_mesh_smoke.py``; prints
``DEVICE_MESH_SMOKE_OK rank=N`` on every rank that passed.
"""

import torch
import torch.distributed as dist

from vescale.dtensor.device_mesh import DeviceMesh, init_device_mesh


def main() -> None:
    assert not dist.is_initialized()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    assert dist.is_initialized() and dist.get_backend() == "gloo"
    rank = dist.get_rank()
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert named.mesh.tolist() == mesh.mesh.tolist() == [[0, 1], [2, 3]]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=named.get_group("tp"))
    assert t.item() == {0: 1.0, 1: 5.0}[rank // 2], t
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mesh.get_group(0))
    assert t.item() == {0: 2.0, 1: 4.0}[rank % 2], t
    dist.barrier()
    print(f"DEVICE_MESH_SMOKE_OK rank={rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
