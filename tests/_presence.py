"""ToyMoE runs that record every step: selzero (+ DDP for the rest) on N ranks, and the reference.

The reference is one process running plain ``torch.optim`` on the mean of the ranks' losses: an
expert that no rank routes to is outside the graph, so its ``.grad`` stays ``None`` and torch skips
it (no update, no decay, no step count); an expert some ranks skip gets their zero contribution.
Both sides snapshot parameters and optimizer state after every step, so presence is checked step by
step (step counts must match exactly), not only at the end.
"""

from __future__ import annotations

from typing import Any

import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from ._shard import shard_snapshot
from .models import loss_fn, make_batch
from .parity import OPTIMIZERS, build_model, routes_for

__all__ = ["TOKENS", "toy_routes", "toy_reference", "toy_selzero", "expert_of",
           "random_accumulation"]

TOKENS = 6


def toy_routes(step: int, rank: int, num_experts: int, pattern: str) -> torch.Tensor:
    """``routes_for`` plus "warm": every expert at step 0, then "uneven" (expert E-1 never)."""
    if pattern == "warm":
        pattern = "same" if step == 0 else "uneven"
    return routes_for(step, rank, TOKENS, num_experts, pattern)


def expert_of(name: str) -> int | None:
    """``experts.2.w1.weight`` -> 2; host parameters -> None."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "experts" else None


def _snapshot_reference(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    state = {}
    for name, p in model.named_parameters():
        if p in opt.state:
            state[name] = {k: v.detach().clone() for k, v in opt.state[p].items()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": state}


def toy_reference(world: int, steps: int, pattern: str, *, opt_name: str = "AdamW",
                  num_experts: int = 4) -> list[dict[str, Any]]:
    """One process, plain torch.optim, loss = mean of the ranks' losses; a snapshot per step."""
    model = build_model(num_experts=num_experts)
    cls, kwargs = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kwargs)
    snaps = []
    for step in range(steps):
        losses = [loss_fn(model, *make_batch(step, r), toy_routes(step, r, num_experts, pattern))
                  for r in range(world)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append(_snapshot_reference(model, opt))
    return snaps


def toy_selzero(rank: int, world: int, steps: int, pattern: str, *, opt_name: str = "AdamW",
                num_experts: int = 4, bucket_mb: float = 25.0) -> list[dict[str, Any]]:
    """selzero on the experts, DDP + the same optimizer class on the rest; a snapshot per step."""
    model = build_model(num_experts=num_experts)
    cls, kwargs = OPTIMIZERS[opt_name]
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=bucket_mb), cls, kwargs)
    selected = {id(e.param) for e in sz.entries}
    host_opt = cls([p for p in model.parameters() if id(p) not in selected], **kwargs)
    ddp = wrap_ddp(model, sz)
    snaps = []
    for step in range(steps):
        x, y = make_batch(step, rank)
        loss_fn(ddp, x, y, toy_routes(step, rank, num_experts, pattern)).backward()
        host_opt.step()
        result = sz.step()
        host_opt.zero_grad(set_to_none=True)
        snaps.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "shard": shard_snapshot(sz), "result": result})
    return snaps


def random_accumulation(rank: int, world: int, steps: int, micro: int) -> dict[str, Any]:
    """Random routing with ``micro`` micro-steps per step, both accumulation modes, one spawn."""
    from .parity import selzero_run

    return {mode: selzero_run(rank, world, steps, "AdamW", pattern="random", accumulate=micro,
                              accumulate_mode=mode, config={"name": f"random_{mode}"})
            for mode in ("end_microstep", "no_sync")}
