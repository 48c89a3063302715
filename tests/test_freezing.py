"""Freezing and unfreezing selected parameters during training (progressive unfreezing), with the
README's setup: a host optimizer over ``model.parameters()`` and ``wrap_ddp``.

- A selected parameter frozen when SelectedZero2 was built has no slot: unfreezing it later is
  refused on every rank at the start of that step's backward, before anything changed (the
  host stepped each rank's own, un-averaged gradient of it: replicas drifted apart, silently).
- The documented way: build while it trains, freeze it right after, unfreeze it at step k:
  equal to plain torch doing the same (a frozen parameter gets no gradient, so no update).
- Freezing a trained selected parameter at step k: equal to plain torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, UsageError, wrap_ddp

from ._blocks import BlockMoE, block_loss
from ._state import cached_outcomes, capture, model_state, value_of

pytestmark = pytest.mark.multiproc

LAYERS, STEPS, SWITCH = 2, 4, 2
TARGET = "blocks.1.experts.0"  # the expert whose parameters are (un)frozen
OPT = {"lr": 1e-2, "weight_decay": 0.1}


def _build() -> BlockMoE:
    torch.manual_seed(0)
    return BlockMoE(layers=LAYERS)


def _target(model: BlockMoE) -> torch.nn.Module:
    return model.get_submodule(TARGET)


def _trainable_at(schedule: str, step: int) -> bool:
    return (step >= SWITCH) == (schedule == "unfreeze")


def run(rank: int, world: int, schedule: str, frozen_at_build: bool) -> dict[str, Any]:
    """``schedule``: "unfreeze" (frozen before step SWITCH) or "freeze" (frozen from it)."""
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    if frozen_at_build:
        _target(model).requires_grad_(_trainable_at(schedule, 0))
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]), opt)
    ddp = wrap_ddp(model, sz)
    errors = []
    for step in range(STEPS):
        _target(model).requires_grad_(_trainable_at(schedule, step))
        before = model_state(model)
        try:
            block_loss(ddp, step, rank, layers=LAYERS).backward()
        except UsageError as e:
            errors.append((step, str(e), all(torch.equal(v, before[k])
                                             for k, v in model_state(model).items())))
            break
        opt.step()
        sz.step()
        opt.zero_grad(set_to_none=True)
    return {"state": model_state(model), "errors": errors}


def _reference(schedule: str) -> dict[str, torch.Tensor]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    for step in range(STEPS):
        _target(model).requires_grad_(_trainable_at(schedule, step))
        torch.stack([block_loss(model, step, r, layers=LAYERS) for r in range(2)]).mean() \
            .backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


CASES = {"refused": ("unfreeze", True), "unfreeze": ("unfreeze", False),
         "freeze": ("freeze", False)}


def _all(rank: int, world: int) -> dict[str, Any]:
    return {k: capture(lambda c=c: run(rank, world, *c)) for k, c in CASES.items()}


_outcomes = cached_outcomes(_all, 2, timeout=180)


def test_cannot_unfreeze_a_parameter_frozen_when_selzero_was_built():
    for run_ in value_of(_outcomes(), "refused"):
        (step, message, unchanged), = run_["errors"]
        assert step == SWITCH and unchanged
        assert f"{TARGET}.w1.weight" in message and "requires_grad_(False)" in message


@pytest.mark.parametrize("case", ["unfreeze", "freeze"])
def test_freezing_and_unfreezing_after_construction_equals_torch(case):
    runs = value_of(_outcomes(), case)
    ref = _reference(CASES[case][0])
    for run_ in runs:
        assert run_["errors"] == []
        for k, v in ref.items():
            assert torch.allclose(run_["state"][k], v, atol=1e-6, rtol=0), \
                (k, float((run_["state"][k] - v).abs().max()))
