"""Two ranks train a BlockMoE under selzero on gloo; at step 2 rank 0's backward raises (or is
interrupted) and the program ends with that exception, while rank 1 reaches the same point of its
backward ``DELAY`` seconds later: rank 0's reductions are still in flight when its interpreter
exits ([Note: p2p reduce-scatter], ``Driver``). Run by tests/test_p2p_reduce.py under env
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE; FAIL=raise|interrupt."""

import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from selzero_plugin import SelectedZero2, SelZeroConfig  # noqa: E402
from tests._blocks import BlockMoE, block_batch, block_routes  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)
model = BlockMoE(layers=3, d=7, h=13)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=0.0015,
                                        timeout_s=10.0), opt)
assert len(sz.layout.buckets) > 2 and sz.comm.p2p


class Fault(torch.autograd.Function):
    step = -1

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        if Fault.step == 2:
            if rank == 0:
                raise KeyboardInterrupt if os.environ["FAIL"] == "interrupt" else \
                    RuntimeError("a user's error in backward on rank 0")
            time.sleep(float(os.environ["DELAY"]))
        return g


inner = model.blocks[1].forward
model.blocks[1].forward = lambda h, r: inner(Fault.apply(h), r)
for step in range(4):
    Fault.step = step
    x, y = block_batch(step, rank)
    (model(x, block_routes(step, rank, layers=3)) - y).pow(2).mean().backward()
    opt.step()
    sz.step()
    opt.zero_grad()
