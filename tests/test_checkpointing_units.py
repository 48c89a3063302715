"""Activation checkpointing inside a launch unit (DESIGN.md "Launch points").

The experts run under ``torch.utils.checkpoint`` (reentrant and not); expert 0's first weight is
also used *outside* the checkpointed region, in the same block. Its hook then fires twice in one
backward: once in the outer backward, once in the checkpoint's inner backward. Both land before
the block's post-backward, where its bucket is launched, so there is no "second backward" error
on any rank, whatever each rank routed, and training equals plain torch.optim.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import Block, BlockMoE, block_loss, reference_blocks
from ._state import cached_outcomes, capture, value_of

pytestmark = pytest.mark.multiproc

LAYERS, STEPS = 3, 3
OPT = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})


class CheckpointedBlock(Block):
    reentrant = True

    def run_expert(self, expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(expert, x, use_reentrant=self.reentrant)

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        shared = torch.tanh(h @ self.experts[0].w1.weight.T).sum(-1, keepdim=True)
        return super().forward(h, routes) + 0.1 * shared


class NonReentrantBlock(CheckpointedBlock):
    reentrant = False


BLOCKS = {"reentrant": CheckpointedBlock, "non_reentrant": NonReentrantBlock}


def _build(kind: str) -> BlockMoE:
    torch.manual_seed(0)
    return BlockMoE(layers=LAYERS, block=BLOCKS[kind])


def checkpointed_run(rank: int, world: int, kind: str, pattern: str,
                     bucket_mb: float) -> dict[str, torch.Tensor]:
    model = _build(kind)
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], bucket_mb=bucket_mb), OPT[0], OPT[1])
    for step in range(STEPS):
        block_loss(model, step, rank, layers=LAYERS, pattern=pattern).backward()
        sz.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


CASES = [(kind, pattern, bucket_mb) for kind in BLOCKS for pattern in ("uneven", "skewed")
         for bucket_mb in (1e-4, 25.0)]


def _all_cases(rank: int, world: int) -> dict[Any, Any]:
    return {case: capture(lambda: checkpointed_run(rank, world, *case)) for case in CASES}


_outcomes = cached_outcomes(_all_cases, 2, timeout=180)


@pytest.mark.parametrize("bucket_mb", [1e-4, 25.0], ids=["bucket_per_tensor", "one_bucket"])
@pytest.mark.parametrize("pattern", ["uneven", "skewed"])
@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_a_parameter_used_inside_and_outside_a_checkpoint_trains_like_torch(kind, pattern,
                                                                            bucket_mb):
    states = value_of(_outcomes(), (kind, pattern, bucket_mb))
    ref = reference_blocks(2, list(range(STEPS)), partial(_build, kind), OPT, layers=LAYERS,
                           patterns=lambda s, r: pattern)
    for state in states:
        for k in ref:
            assert torch.allclose(state[k], ref[k], atol=1e-6, rtol=0), k
