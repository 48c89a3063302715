"""A second backward into a reduced micro-step that was not closed (DESIGN.md "Micro-steps and
reduction points"): every rank raises the same UsageError at the reduction point, in every
reduction mode, also the rank whose second backward touched none of the selected parameters;
nobody hangs, and the next step trains normally."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, UsageError

from ._blocks import BlockMoE, block_loss
from ._state import cached_outcomes, capture, value_of
from .dist_utils import all_errors, run_ranks

pytestmark = pytest.mark.multiproc

LAYERS = 2
KWARGS = {"mean": {}, "weighted": {"weight": 6}, "sum": {"active": True}}


def two_backwards_run(rank: int, world: int, reduction: str, overlap: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], reduction=reduction,
                                            overlap=overlap, bucket_mb=1e-4),
                       torch.optim.SGD, {"lr": 0.1})
    block_loss(model, 0, rank, layers=LAYERS).backward()
    # rank 1's second batch reaches no expert: its hooks see nothing of this backward
    second = "uneven" if rank == 0 else "none"
    block_loss(model, 1, rank, layers=LAYERS, pattern=second).backward()
    message = None
    try:
        sz.step(**KWARGS[reduction])
    except UsageError as e:
        message = str(e)
    block_loss(model, 2, rank, layers=LAYERS).backward()
    result = sz.step(**KWARGS[reduction])
    return {"message": message, "updated_after": result.updated}


CASES = [(reduction, overlap) for reduction in KWARGS for overlap in (True, False)]


def _all_cases(rank: int, world: int) -> dict[Any, Any]:
    out = {case: capture(lambda: two_backwards_run(rank, world, *case)) for case in CASES}
    out["no_sync"] = capture(lambda: _second_backward_inside_no_sync_is_fine(rank, world))
    return out


_outcomes = cached_outcomes(_all_cases, 2, timeout=120)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("reduction", ["mean", "weighted", "sum"])
def test_every_rank_raises_the_same_error_for_a_second_backward(reduction, overlap):
    runs = value_of(_outcomes(), (reduction, overlap))
    messages = [r["message"] for r in runs]
    assert all(m is not None for m in messages), messages
    assert "second backward" in messages[0] and "end_microstep" in messages[0]
    assert [m.split("] ", 1)[1] for m in messages] == [messages[0].split("] ", 1)[1]] * 2
    assert all(r["updated_after"] > 0 for r in runs)


def _second_backward_inside_no_sync_is_fine(rank: int, world: int) -> int:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]),
                       torch.optim.SGD, {"lr": 0.1})
    with sz.no_sync():
        block_loss(model, 0, rank, layers=LAYERS).backward()
        block_loss(model, 1, rank, layers=LAYERS).backward()
    block_loss(model, 2, rank, layers=LAYERS).backward()
    return sz.step().updated


def test_local_micro_steps_may_run_several_backwards():
    assert all(n > 0 for n in value_of(_outcomes(), "no_sync"))


def _backward_after_reduce(rank: int, world: int) -> None:
    model = BlockMoE(layers=LAYERS)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]),
                       torch.optim.SGD, {"lr": 0.1})
    block_loss(model, 0, rank, layers=LAYERS).backward()
    sz.reduce_gradients()
    block_loss(model, 1, rank, layers=LAYERS).backward()


def test_cannot_run_a_backward_between_reduce_gradients_and_step():
    messages = all_errors(run_ranks(_backward_after_reduce, 2, timeout=60), "UsageError")
    assert all("step()" in m for m in messages)
