"""Rank functions for tests/reliability/test_misuse_deepspeed.py (the misuse cases of
test_misuse.py, through the DeepSpeed entry)."""

from __future__ import annotations

import os
from typing import Any

import torch

from selzero_plugin import SelectedZero2, SelZeroConfig

from .. import _deepspeed as dsh
from .._state import capture

__all__ = ["misuse_deepspeed_run"]


def _engine(rank: int, world: int, *, client: Any = None, model: Any = None,
            changes: dict[str, Any] | None = None) -> Any:
    import deepspeed

    model = model if model is not None else dsh.build_model()
    config = dsh.ds_config(2, False, optimizer=client is None, world=world)
    config.update(gradient_accumulation_steps=1, train_batch_size=6 * world)
    config.update(changes or {})
    config["selected_zero2"]["timeout_s"] = 30.0
    if client is not None:
        config["zero_allow_untested_optimizer"] = True
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           **({"optimizer": client} if client else {}))
    return engine


def _selected(engine: Any) -> dict[str, torch.Tensor]:
    return {e.name: e.param.detach().clone() for e in engine.selzero.entries}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _step_without_backward(rank: int, world: int) -> dict[str, Any]:
    engine = _engine(rank, world)
    before = _selected(engine)
    engine.step()
    return {"updated": engine.selzero_step_result.updated,
            "unchanged": _same(before, _selected(engine))}


def _second_step(rank: int, world: int) -> dict[str, Any]:
    engine = _engine(rank, world)
    engine.backward(dsh.ds_loss(engine, 0, rank, None))
    engine.step()
    first = engine.selzero_step_result.updated
    after = _selected(engine)
    engine.step()
    return {"first": first, "second": engine.selzero_step_result.updated,
            "unchanged": _same(after, _selected(engine))}


def _client_with_state(rank: int, world: int) -> dict[str, Any]:
    model = dsh.build_model()
    client = torch.optim.AdamW(model.parameters(), lr=dsh.LR)
    dsh.block_loss(model, 0, rank, layers=dsh.LAYERS).backward()
    client.step()
    client.zero_grad()
    _engine(rank, world, client=client, model=model)
    return {}


def _cast_after(rank: int, world: int) -> dict[str, Any]:
    engine = _engine(rank, world)
    if rank == world - 1:  # one rank only
        engine.module.double()
    loss = dsh.ds_loss(engine, 0, rank, torch.float64 if rank == world - 1 else None)
    engine.backward(loss)
    engine.step()
    return {}


def _second_instance(rank: int, world: int) -> dict[str, Any]:
    model = dsh.build_model()
    SelectedZero2(model, SelZeroConfig(name="dense", params=["inp.*"]), torch.optim.SGD,
                  {"lr": 0.1})
    _engine(rank, world, model=model)
    return {}


def _offload(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-Offload keeps no averaged_gradients: the step check must not fire (second review)."""
    engine = _engine(rank, world, changes={
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False})
    engine.backward(dsh.ds_loss(engine, 0, rank, None))
    engine.step()
    return {"updated": engine.selzero_step_result.updated}


def _unmanaged_accumulation(rank: int, world: int) -> dict[str, Any]:
    _engine(rank, world, changes={"managed_gradient_accumulation": False})
    return {}


def misuse_deepspeed_run(rank: int, world: int) -> dict[str, Any]:
    dsh._quiet()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401 - registers the entry

    cases = {"step_without_backward": _step_without_backward, "second_step": _second_step,
             "client_with_state": _client_with_state, "cast_after": _cast_after,
             "second_instance": _second_instance, "offload": _offload,
             "unmanaged_accumulation": _unmanaged_accumulation}
    return {name: capture(lambda fn=fn: fn(rank, world)) for name, fn in cases.items()}
