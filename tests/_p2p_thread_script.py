"""selzero's gloo point-to-point reductions launched where a driver thread that ends on its own
would miss them (review findings). MODE=thread: the main thread starts a training thread and
ends, the training thread keeps reducing; MODE=atexit: the program's atexit hook reduces, with
pauses between the reductions. Run by tests/test_p2p_reduce.py under
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; prints "ok" when every reduction was right."""

import atexit
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from selzero_plugin.core.comm import Communicator  # noqa: E402

dist.init_process_group("gloo")
world = dist.get_world_size()
comm = Communicator.create(list(range(world)), timeout_s=20, device=torch.device("cpu"))


def train() -> None:
    time.sleep(0.25)  # the main thread has ended by now (MODE=thread)
    good = True
    for step in range(4):
        time.sleep(0.15)  # the driver idles between reductions
        row = comm.reduce_scatter_rows(torch.full((world * 10,), float(step))).wait()
        good &= bool(torch.equal(row, torch.full((10,), float(step * world))))
    print("ok" if good else "wrong", flush=True)


comm.reduce_scatter_rows(torch.zeros(world * 10)).wait()  # the driver exists already
if os.environ.get("MODE", "thread") == "thread":
    threading.Thread(target=train).start()
else:
    atexit.register(train)
