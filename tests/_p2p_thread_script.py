"""The main thread of the program starts a training thread and ends; the training thread keeps
reducing through selzero's gloo point-to-point reduce-scatter (its driver must not end with
the main thread). Run by tests/test_p2p_reduce.py under MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE;
prints "ok" when every reduction was right."""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from selzero_plugin.core import p2p  # noqa: E402
from selzero_plugin.core.comm import Communicator  # noqa: E402

dist.init_process_group("gloo")
world = dist.get_world_size()
comm = Communicator.create(list(range(world)), timeout_s=20, device=torch.device("cpu"))


def train() -> None:
    time.sleep(5 * p2p.IDLE_POLL_S)  # the main thread has ended by now
    good = True
    for step in range(3):
        time.sleep(3 * p2p.IDLE_POLL_S)  # the driver idles between reductions
        row = comm.reduce_scatter_rows(torch.full((world * 10,), float(step))).wait()
        good &= bool(torch.equal(row, torch.full((10,), float(step * world))))
    print("ok" if good else "wrong", flush=True)


threading.Thread(target=train).start()
