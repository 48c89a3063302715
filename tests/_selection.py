"""Rank functions and references for selection semantics (issue #2, rule 6).

Runs use selzero on ``experts.*`` and ``wrap_ddp`` for the rest, ``reduction="mean"``, SGD with
momentum on both sides; the reference is one process running plain SGD on the mean of the ranks'
losses, with the same ties / frozen flags applied to its model.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelectionError, SelZeroConfig, wrap_ddp

from ._state import capture, model_state
from .models import ToyMoE, loss_fn, make_batch
from .parity import routes_for

__all__ = ["selection_rank", "reference", "tie", "freeze", "FROZEN"]

E = 4
STEPS = 3
SGD_KW: dict[str, Any] = {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}
FROZEN = ("experts.0.gain", "experts.1.w2.bias")


def tie(model: ToyMoE) -> ToyMoE:
    """Two ties: a shared module (w1 of experts 0 and 1) and a Parameter registered twice (gain)."""
    model.experts[1].w1 = model.experts[0].w1
    model.experts[3].gain = model.experts[2].gain
    return model


def freeze(model: ToyMoE) -> ToyMoE:
    params = dict(model.named_parameters())
    for name in FROZEN:
        params[name].requires_grad_(False)
    return model


def build(prepare: Callable[[ToyMoE], ToyMoE]) -> ToyMoE:
    torch.manual_seed(0)
    return prepare(ToyMoE(E))


def reference(world: int, prepare: Callable[[ToyMoE], ToyMoE]) -> dict[str, torch.Tensor]:
    model = build(prepare)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **SGD_KW)
    for step in range(STEPS):
        losses = [loss_fn(model, *make_batch(step, r), routes_for(step, r, 6, E, "random"))
                  for r in range(world)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


def _train(rank: int, model: nn.Module) -> SelectedZero2:
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"]), torch.optim.SGD, SGD_KW)
    host = torch.optim.SGD([p for n, p in model.named_parameters()
                            if p.requires_grad and not n.startswith("experts.")], **SGD_KW)
    ddp = wrap_ddp(model, sz)
    for step in range(STEPS):
        loss_fn(ddp, *make_batch(step, rank), routes_for(step, rank, 6, E, "random")).backward()
        host.step()
        sz.step()
        host.zero_grad(set_to_none=True)
    return sz


def _tied(rank: int) -> dict[str, Any]:
    model = build(tie)
    sz = _train(rank, model)
    return {"state": model_state(model),
            "still_tied": [model.experts[1].w1 is model.experts[0].w1,
                           model.experts[3].gain is model.experts[2].gain],
            "aliases": {e.name: list(e.aliases) for e in sz.entries if e.aliases},
            "selected": sz.selected_names, "trainable": sz.trainable_names}


def _crossing(rank: int) -> None:
    model = build(tie)
    SelectedZero2(model, SelZeroConfig(params=["experts.0.*"]), torch.optim.SGD, SGD_KW)


def _frozen(rank: int) -> dict[str, Any]:
    model = build(freeze)
    before = model_state(model)
    sz = _train(rank, model)
    params = dict(model.named_parameters())
    frozen_storages = {params[n].untyped_storage().data_ptr() for n in FROZEN}
    segment_storages = {s.untyped_storage().data_ptr() for s in sz.segments}
    return {"before": before, "state": model_state(model), "selected": sz.selected_names,
            "trainable": sz.trainable_names,
            "virtual_entries": sorted({sz.trainable[v.entry].name for v in sz.layout.virtuals}),
            "segments_on_frozen": sorted(frozen_storages & segment_storages),
            "state_tensors": len(sz.optimizer.state), "segments": len(sz.segments),
            "state_parameter_count": sz.state_parameter_count}


def _empty(rank: int, world: int) -> dict[str, Any]:
    """A selection that takes nothing: every rank raises (an instance owning nothing would let
    wrap_ddp hand everything to DDP, silently); the model is untouched."""
    torch.manual_seed(0)
    model = ToyMoE(E)
    before = model_state(model)
    try:
        SelectedZero2(model, SelZeroConfig(params=["expert.*.w1.*"]), torch.optim.AdamW,
                      {"lr": 1e-2})
    except SelectionError as e:
        return {"error": str(e), "unchanged": all(
            torch.equal(v, before[k]) for k, v in model_state(model).items())}
    return {"error": None}


def selection_rank(rank: int, world: int) -> dict[str, Any]:
    return {
        "tied": capture(lambda: _tied(rank)),
        "crossing": capture(lambda: _crossing(rank)),
        "frozen": capture(lambda: _frozen(rank)),
        "empty": capture(lambda: _empty(rank, world)),
    }
