"""[Note: checked buckets]: on gloo the reduction checks its sums for inf/NaN as it writes them
into the shard, and the reduction point uses those checks instead of a pass over the shard only
while they describe it. A sum that overflows though each rank's gradient is finite, a NaN on one
rank, an overflow across micro-steps (the second micro-step's addition is not checked: the whole
shard is) and a write through ``sz.grad_shard`` after the backward are each found, on every
rank, and the step is skipped; so is one written through ``.data`` or ``.numpy()`` of
``sz.grad_shard`` (no version counter moves: handing the shard out turns the checks off);
finite steps update and need no pass over the shard until then."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig
from selzero_plugin.core import storage as storage_module

from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

SHAPE = (37, 29)  # 1,073 elements: rows that do not divide by 2 or 3
EXPERTS = 3


def _grad(fill: float | str) -> torch.Tensor:
    """The gradient a weight gets: ``fill`` everywhere, or 1 with a NaN at element 0."""
    if fill == "nan at 0":
        grad = torch.ones(SHAPE)
        grad[0, 0] = float("nan")
        return grad
    return torch.full(SHAPE, float(fill))


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Module()
    model.experts = nn.ModuleList(nn.Linear(SHAPE[1], SHAPE[0], bias=False)
                                  for _ in range(EXPERTS))
    # a bucket per expert: each reduction is checked on its own
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], nonfinite="skip",
                                            bucket_mb=0.004), torch.optim.SGD, {"lr": 0.1})
    whole = []  # passes over the whole shard at the reduction point
    check = storage_module.holds_nonfinite

    def counted(flat: torch.Tensor) -> torch.Tensor:
        whole.append(flat.numel())
        return check(flat)

    storage_module.holds_nonfinite = counted

    def step(microsteps: list[list[float]], write: Any = None) -> dict[str, Any]:
        whole.clear()
        before = [e.weight.detach().clone() for e in model.experts]
        for m, fills in enumerate(microsteps):
            loss = sum((e.weight * _grad(c)).sum() for e, c in zip(model.experts, fills))
            loss.backward()
            if m < len(microsteps) - 1:
                sz.end_microstep()
        if write is not None:
            write(sz)
        result = sz.step()
        return {"updated": result.updated, "skipped_nonfinite": result.skipped_nonfinite,
                "changed": [not torch.equal(b, e.weight) for b, e in zip(before, model.experts)],
                "whole": len(whole), "buckets": len(sz.storage.runs)}

    last = world - 1
    out = {
        "finite": step([[1.0, 2.0, 3.0]]),
        # each rank's 3e38 is finite; their sum is not
        "sum_overflows": step([[1.0, 3e38, 1.0]]),
        # one NaN, in rank 0's chunk, from the last rank: its peer summed last at world 3
        "nan_on_one_rank": step([[1.0, 1.0, "nan at 0" if rank == last else 1.0]]),
        # 1e38 per rank and micro-step: finite after the first, inf after the second
        "accumulation_overflows": step([[1e38, 1.0, 1.0], [1e38, 1.0, 1.0]]),
        "accumulation_finite": step([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]),
        "finite_again": step([[1.0, 2.0, 3.0]]),
        # writes after the backward, through the public shard: from then on, whole-shard passes
        # (review finding: .data and .numpy() writes move no version counter)
        "user_write": step([[1.0, 1.0, 1.0]],
                           write=lambda sz: sz.grad_shard.__setitem__(3, float("inf"))),
        "user_write_data": step([[1.0, 1.0, 1.0]],
                                write=lambda sz: sz.grad_shard.data.__setitem__(3, float("inf"))),
        "user_write_numpy": step([[1.0, 1.0, 1.0]], write=lambda sz: sz.grad_shard.numpy()
                                 .__setitem__(3, float("inf"))),
        "after_exposure": step([[1.0, 2.0, 3.0]]),
    }
    sz.remove_hooks()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_sums_are_found_by_the_checks_or_the_whole_shard(world: int) -> None:
    for value in all_values(run_ranks(_scenarios, world, timeout=120)):
        assert value["finite"]["buckets"] == EXPERTS, value
        for case in ("finite", "accumulation_finite", "finite_again", "after_exposure"):
            assert value[case]["updated"] == EXPERTS and all(value[case]["changed"]), \
                (case, value[case])
        for case in ("sum_overflows", "nan_on_one_rank", "accumulation_overflows",
                     "user_write", "user_write_data", "user_write_numpy"):
            assert value[case]["updated"] == 0 and value[case]["skipped_nonfinite"] == EXPERTS \
                and not any(value[case]["changed"]), (case, value[case])
        # the checks made on the reduction's thread serve a window of one micro-step
        for case in ("finite", "sum_overflows", "nan_on_one_rank", "finite_again"):
            assert value[case]["whole"] == 0, (case, value[case])
        # a second micro-step's addition, or the shard handed out: the whole shard
        for case in ("accumulation_overflows", "accumulation_finite", "user_write",
                     "user_write_data", "user_write_numpy", "after_exposure"):
            assert value[case]["whole"] == 1, (case, value[case])
