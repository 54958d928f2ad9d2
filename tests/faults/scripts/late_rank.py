"""Rank 1 starts ``LATE_S`` seconds late; then it is silent for ``LATE_S`` in a collective.

Joining the process group must wait for a late rank even when the collective timeout
(``VESCALE_COLLECTIVE_TIMEOUT``) is shorter than the delay; the collective must not.
"""

import os
import time

late = float(os.environ["LATE_S"])
if os.environ["RANK"] == "1":
    time.sleep(late)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from vescale.dtensor import init_device_mesh  # noqa: E402

mesh = init_device_mesh("cpu", (2,))
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: JOINED {t.item():g}", flush=True)
if dist.get_rank() == 1:
    time.sleep(late)
start = time.time()
try:
    dist.all_reduce(t)
except RuntimeError as e:
    print(f"rank {dist.get_rank()}: TIMED_OUT after {time.time() - start:.2f} s: {e}", flush=True)
