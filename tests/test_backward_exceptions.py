"""An exception inside backward does not leave selzero stuck (DESIGN.md "Micro-steps and
reduction points"): after what a plain-torch user does when skipping a batch, the window of the
failed backward is dropped on every rank and training equals training without that batch.

Every rank fails the same batch, but at a different point of its backward (rank 0 in a later
block than rank 1, so the ranks launched different numbers of buckets before failing). All of
the model is selected, so no host needs repairing; the reference skips the failed batch.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import Block, BlockMoE, block_loss, reference_blocks
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

LAYERS, STEPS, FAILED = 3, 4, 1
OPT = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


class SimulatedOOM(RuntimeError):
    pass


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, armed: bool) -> torch.Tensor:
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.armed:
            raise SimulatedOOM("CUDA out of memory (simulated)")
        return grad, None


class FailingBlock(Block):
    armed = False

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return super().forward(_FailInBackward.apply(h, self.armed), routes)


def _build() -> BlockMoE:
    torch.manual_seed(0)
    return BlockMoE(layers=LAYERS, block=FailingBlock)


def failing_run(rank: int, world: int, recovery: str, reduction: str, overlap: bool
                ) -> dict[str, Any]:
    model = _build()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], bucket_mb=1e-4, reduction=reduction,
                                            overlap=overlap), OPT[0], OPT[1])
    kwargs = {"weight": 6} if reduction == "weighted" else {}
    results = []
    for step in range(STEPS):
        failing = step == FAILED
        model.blocks[2 - rank].armed = failing  # rank 0 fails in block 2, rank 1 in block 1
        loss = block_loss(model, step, rank, layers=LAYERS)
        if reduction == "weighted":  # loss-sum over 6 tokens, divided by the 12 of both ranks
            loss = loss * 6
        try:
            loss.backward()
        except SimulatedOOM:
            assert failing
            model.zero_grad(set_to_none=True)
            if recovery == "zero_grad":
                sz.zero_grad()
            elif recovery == "step":  # the loop steps anyway: nothing is updated
                results.append(sz.step(**kwargs).updated)
            continue
        finally:
            model.blocks[2 - rank].armed = False
        results.append(sz.step(**kwargs).updated)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "updated": results}


@pytest.mark.parametrize("recovery", ["next_batch", "zero_grad", "step"])
@pytest.mark.parametrize("reduction,overlap", [("mean", True), ("weighted", True),
                                               ("mean", False)],
                         ids=["mean", "weighted", "mean_no_overlap"])
def test_a_failed_backward_is_dropped_and_training_goes_on(recovery, reduction, overlap):
    runs = all_values(run_ranks(failing_run, 2, recovery, reduction, overlap, timeout=90))
    steps = [s for s in range(STEPS) if s != FAILED]
    ref = reference_blocks(2, steps, _build, OPT, layers=LAYERS)
    for run in runs:
        for k in ref:
            assert torch.allclose(run["state"][k], ref[k], atol=1e-6, rtol=0), k
        expected = len(steps) + (recovery == "step")
        assert len(run["updated"]) == expected
        if recovery == "step":
            assert run["updated"][FAILED] == 0
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in ref)
