"""One rank of a fault-injection run; ``test_rank_faults.py`` starts one process per rank.

Every rank trains a tiny FSDP model one step and saves a committed checkpoint
(``ckpt_1``); rank 0 writes the full values of everything it holds to
``reference.pt``. In step 2 the victim rank is killed (``SIGKILL``) or stalled
(``SIGSTOP``: alive, sockets open, silent) in the given phase, after writing the time
to ``fault_time``. The other ranks must then fail on their own, with a clear error,
within twice the collective timeout (``VESCALE_COLLECTIVE_TIMEOUT``, set by the test).
"""

from __future__ import annotations

import atexit
import time

# Registered before torch is imported, so it runs last: after the interpreter joined every
# non-daemon thread (an async save's thread included) and ran every other exit handler.
# What is left after it is the native teardown of the interpreter.
atexit.register(lambda: print(f"EXIT_WORK_DONE {time.time()!r}", flush=True))

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: E402

import vescale.checkpoint as vckpt  # noqa: E402
from vescale.checkpoint import VescaleFileSystemReader, VescaleFileSystemWriter  # noqa: E402
from vescale.dmodule import DModule  # noqa: E402
from vescale.dtensor import DTensor, init_device_mesh  # noqa: E402

PHASES = ("forward", "backward", "step", "save", "async_save", "load")


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def reference(model, opt) -> dict[str, torch.Tensor]:
    """The full value of every tensor the checkpoint holds, keyed as it flattens them."""
    ref = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    for fqn, st in get_optimizer_state_dict(model, opt)["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                ref[f"optim.state.{fqn}.{name}"] = _full(v)
    return ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--phase", choices=PHASES, required=True)
    ap.add_argument("--fault", choices=("kill", "stall"), required=True)
    ap.add_argument("--victim", type=int, default=1)
    args = ap.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = DModule(net, mesh, data_parallel={"dp": "fsdp"})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    victim = rank == args.victim

    def fault(*_a, **_k):
        with open(os.path.join(args.dir, "fault_time"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)

    def train_step(backward_fault: bool = False) -> None:
        loss = model(data).square().mean()
        if backward_fault:
            loss.register_hook(fault)
        loss.backward()
        opt.step()
        opt.zero_grad()

    state = {"model": model, "optim": opt, "step": 1}
    train_step()
    committed = os.path.join(args.dir, "ckpt_1")
    vckpt.save(committed, state)
    ref = reference(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(args.dir, "reference.pt"))
    dist.barrier()
    print(f"rank {rank}: step 1 committed", flush=True)

    if victim and args.phase == "forward":
        model.register_forward_pre_hook(fault)
    if victim and args.phase == "step":
        opt.register_step_pre_hook(fault)
    if victim and args.phase in ("save", "async_save"):
        write_data = VescaleFileSystemWriter.write_data

        def faulty_write(self, plan, planner):
            fault()
            return write_data(self, plan, planner)

        VescaleFileSystemWriter.write_data = faulty_write
    if victim and args.phase == "load":
        read_data = VescaleFileSystemReader.read_data

        def faulty_read(self, plan, planner):
            fault()
            return read_data(self, plan, planner)

        VescaleFileSystemReader.read_data = faulty_read

    state["step"] = 2
    train_step(backward_fault=victim and args.phase == "backward")
    if args.phase == "save":
        vckpt.save(os.path.join(args.dir, "ckpt_2"), state)
    elif args.phase == "async_save":
        vckpt.save(os.path.join(args.dir, "ckpt_2"), state, async_op=True)
        train_step()  # training goes on while the background thread saves
    elif args.phase == "load":
        vckpt.load(committed, state)
    train_step()
    vckpt.wait_pending()
    print(f"rank {rank}: UNEXPECTED_SUCCESS", flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # when the error reached the top (the rest of the exit is teardown)
        print(f"RAISED_AT {time.time()!r}", flush=True)
        raise
