"""torch's own clipping functions see the subset ([Note: torch's clipping idioms] in
torch_clip.py), at world 2 with routing that differs by rank: beside plain DDP (``wrap_ddp``),
``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and ``clip_grad_value_`` equal one
process of plain torch doing the same; given some of the subset's parameters, inside
``no_sync()``, or with an instance whose group is not the world (a rank without one would clip
locally), every rank that can tell raises instead of training wrong or hanging."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from ._blocks import BlockMoE, block_loss
from ._state import cached_outcomes, capture, model_state, value_of

pytestmark = pytest.mark.multiproc

LAYERS, STEPS = 2, 4
NORM, VALUE = 0.05, 2e-3


def _build() -> BlockMoE:
    torch.manual_seed(0)
    return BlockMoE(layers=LAYERS)


def _clip(model: torch.nn.Module, how: str) -> None:
    if how == "norm":
        torch.nn.utils.clip_grad_norm_(model.parameters(), NORM)
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), VALUE)


def trained(rank: int, world: int, how: str) -> dict[str, Any]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]), opt)
    ddp = wrap_ddp(model, sz)
    for step in range(STEPS):
        block_loss(ddp, step, rank, layers=LAYERS).backward()
        _clip(model, how)
        opt.step()
        sz.step()
        opt.zero_grad(set_to_none=True)
    return {"state": model_state(model)}


def reference(how: str, world: int = 2) -> dict[str, torch.Tensor]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        torch.stack([block_loss(model, step, r, layers=LAYERS) for r in range(world)]
                    ).mean().backward()
        _clip(model, how)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


def refused(rank: int, world: int, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    model = _build()
    if case == "subgroup":  # rank 1 alone holds an instance (a stage with experts)
        group = dist.new_group([1])
        if rank == 0:
            block_loss(model, 0, rank, layers=LAYERS).backward()
            return {"norm": float(torch.nn.utils.clip_grad_norm_(model.parameters(), NORM))}
        sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]),
                           torch.optim.SGD, {"lr": 0.1}, group=group)
    else:
        sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]),
                           torch.optim.SGD, {"lr": 0.1})
    if case == "no_sync":
        with sz.no_sync():
            block_loss(model, 0, rank, layers=LAYERS).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), NORM)
    elif case == "some":
        block_loss(model, 0, rank, layers=LAYERS).backward()
        torch.nn.utils.clip_grad_norm_(model.blocks[0].parameters(), NORM)
    else:
        block_loss(model, 0, rank, layers=LAYERS).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), NORM)
    return {}


CASES = ("no_sync", "some", "subgroup")


def _all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {how: capture(lambda h=how: trained(rank, world, h))
                           for how in ("norm", "value")}
    for case in CASES:
        out[case] = capture(lambda c=case: refused(rank, world, c))
    return out


_outcomes = cached_outcomes(_all, 2, timeout=180)


@pytest.mark.parametrize("how", ["norm", "value"])
def test_torch_clipping_over_model_parameters_equals_torch(how):
    ref = reference(how)
    for run in value_of(_outcomes(), how):
        for k, v in ref.items():
            assert torch.allclose(run["state"][k], v, atol=1e-6, rtol=0), \
                (k, float((run["state"][k] - v).abs().max()))


@pytest.mark.parametrize("case, expected", [
    ("no_sync", "inside no_sync()"), ("some", "were given"),
    ("subgroup", "whose group is not the whole world")])
def test_torch_clipping_that_would_train_wrong_or_hang_raises(case, expected):
    runs = [o.value[case] for o in _outcomes()]
    ranks = [1] if case == "subgroup" else [0, 1]  # rank 0 holds no instance there
    for rank in ranks:
        assert runs[rank].get("error") == "UsageError", (rank, runs[rank])
        assert expected in runs[rank]["message"]
    if case == "subgroup":
        assert "value" in runs[0], runs[0]  # torch's own local clipping, unchanged
