"""Gradients that arrive after their bucket was launched are trained right ([Note: late
gradients] in core/window.py).

Three models of three blocks, each block the launch unit of its experts, ranks routing to
different experts:

- ``shared``: block 2's expert 0 is applied a second time, outside its unit, before block 0 (a
  module applied twice): its gradient is complete only after block 2's post-backward;
- ``checkpointed``: every block runs under a *reentrant* activation checkpoint, and block i's
  expert 0 first weight is also used outside the checkpoint, before the block: the checkpoint's
  inner backward fires the unit, the outer use's gradient comes after it;
- ``twice``: block 1 itself runs twice in the forward: its unit passes after its second
  post-backward (the forward counted two runs), so nothing is late.

Every model trains equal to plain torch. Late gradients cost one more reduction per late bucket
in the step they were first seen, never again (those buckets launch at the end of backward from
then on); ``twice`` costs nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import BlockMoE, block_loss, reference_blocks
from ._state import cached_outcomes, capture, value_of

pytestmark = pytest.mark.multiproc

LAYERS, STEPS = 3, 3
OPT = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


class SharedExpertMoE(BlockMoE):
    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = h + 0.1 * self.blocks[2].experts[0](h)  # outside its unit (blocks.2), earlier
        for block, r in zip(self.blocks, routes):
            h = block(h, r)
        return self.out(h)


class CheckpointedMoE(BlockMoE):
    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block, r in zip(self.blocks, routes):
            w = block.experts[0].w1.weight  # also used outside the checkpointed unit
            h = h + 0.1 * torch.tanh(h @ w.T).sum(-1, keepdim=True)
            h = checkpoint(block, h, r, use_reentrant=True)
        return self.out(h)


class TwiceMoE(BlockMoE):
    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, (block, r) in enumerate(zip(self.blocks, routes)):
            h = block(block(h, r), r) if i == 1 else block(h, r)
        return self.out(h)


MODELS = {"shared": SharedExpertMoE, "checkpointed": CheckpointedMoE, "twice": TwiceMoE}


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[kind](layers=LAYERS)


def late_run(rank: int, world: int, kind: str) -> dict[str, Any]:
    model = _build(kind)
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], bucket_mb=1e-3), OPT[0], OPT[1])
    sz.comm.trace = []
    reductions, late_elements = [], []
    for step in range(STEPS):
        start = len(sz.comm.trace)
        block_loss(model, step, rank, layers=LAYERS).backward()
        sz.step()
        calls = [c for c in sz.comm.trace[start:] if c[0] == "reduce_scatter"]
        reductions.append(len(calls))
        late_elements.append(sum(c[1] for c in calls[len(sz.layout.buckets):]))
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "reductions": reductions, "late_elements": late_elements,
            "buckets": len(sz.layout.buckets), "deferred": sorted(sz.window.deferred)}


def _all(rank: int, world: int) -> dict[str, Any]:
    return {kind: capture(lambda kind=kind: late_run(rank, world, kind)) for kind in MODELS}


_outcomes = cached_outcomes(_all, 2, timeout=180)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_model_with_late_gradients_trains_like_torch(kind):
    runs = value_of(_outcomes(), kind)
    ref = reference_blocks(2, list(range(STEPS)), lambda: _build(kind), OPT, layers=LAYERS)
    for run in runs:
        for k, v in ref.items():
            assert torch.allclose(run["state"][k], v, atol=1e-6, rtol=0), \
                (k, float((run["state"][k] - v).abs().max()))
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in ref)


@pytest.mark.parametrize("kind", ["shared", "checkpointed"])
def test_late_gradients_cost_one_more_reduction_per_bucket_once(kind):
    for run in value_of(_outcomes(), kind):
        late = len(run["deferred"])
        assert late > 0
        assert run["reductions"] == [run["buckets"] + late] + [run["buckets"]] * (STEPS - 1)
        assert run["late_elements"][0] > 0 and run["late_elements"][1:] == [0] * (STEPS - 1)


def test_a_unit_run_twice_in_the_forward_waits_for_both_runs():
    for run in value_of(_outcomes(), "twice"):
        assert run["deferred"] == []
        assert run["reductions"] == [run["buckets"]] * STEPS
