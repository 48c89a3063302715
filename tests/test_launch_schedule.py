"""The launch schedule does not depend on routing (DESIGN.md "Launch points"): every rank
issues selzero's reduce-scatters at the same points of its backward *relative to the host's own
collectives*, whatever its experts received.

One timeline per rank records, in order, each collective selzero issues (its communicator's
trace) and each bucket DDP launches (a DDP communication hook). Rank 0 routes tokens to every
expert of every block, rank 1 to one expert only, so "launch a bucket once all its gradients
arrived" would launch at different moments on the two ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from ._blocks import BlockMoE, block_loss
from ._state import cached_outcomes, capture, value_of

pytestmark = pytest.mark.multiproc

LAYERS = 3


def timeline_run(rank: int, world: int, overlap: bool, bucket_mb: float,
                 pattern: str, partition: str = "chunks") -> list[Any]:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=bucket_mb,
                                            overlap=overlap, partition=partition),
                       torch.optim.SGD, {"lr": 0.1})
    selected = {id(e.param) for e in sz.entries}
    host = torch.optim.SGD([p for p in model.parameters() if id(p) not in selected], lr=0.1)
    ddp = wrap_ddp(model, sz, bucket_cap_mb=1e-6)  # about one DDP bucket per dense tensor
    names = {id(p): n for n, p in model.named_parameters()}
    timeline: list[Any] = []

    def record_ddp_bucket(state, bucket):  # noqa: ANN001 - DDP checks the annotations
        timeline.append(("ddp", tuple(sorted(names[id(p)] for p in bucket.parameters()))))
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, record_ddp_bucket)
    for step in range(3):
        sz.comm.trace = timeline
        loss = block_loss(ddp, step, rank, layers=LAYERS, pattern=pattern)
        timeline.append(("backward",))
        loss.backward()
        timeline.append(("backward returned",))
        host.step()
        sz.step()
        host.zero_grad(set_to_none=True)
    return timeline


CASES = [(overlap, bucket_mb, partition) for overlap in (True, False)
         for bucket_mb in (1e-4, 25.0) for partition in ("chunks", "tensors")]


def _all_cases(rank: int, world: int) -> dict[Any, Any]:
    return {case: capture(lambda: timeline_run(rank, world, *case[:2], "skewed", case[2]))
            for case in CASES}


_outcomes = cached_outcomes(_all_cases, 2, timeout=120)


@pytest.mark.parametrize("partition", ["chunks", "tensors"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("bucket_mb", [1e-4, 25.0], ids=["bucket_per_tensor", "one_bucket"])
def test_selzero_and_host_collectives_interleave_the_same_way_on_every_rank(overlap, bucket_mb,
                                                                           partition):
    timelines = value_of(_outcomes(), (overlap, bucket_mb, partition))
    assert timelines[0] == timelines[1]
    launched_in_backward = [
        op for t in [timelines[0]] for op in t[t.index(("backward",)):t.index(("backward returned",))]
        if op[0] == "reduce_scatter"]
    # with overlap the reduce-scatters run during backward; without, none does
    assert bool(launched_in_backward) == overlap


def test_the_instrument_records_every_ddp_bucket_and_reduce_scatter():
    """The timeline sees both schedules: several DDP buckets and reduce-scatters per step."""
    timelines = value_of(_outcomes(), (True, 1e-4, "chunks"))
    for t in timelines:
        assert sum(op[0] == "ddp" for op in t) > 3 * 3
        assert sum(op[0] == "reduce_scatter" for op in t) > 3 * 3
