"""Rank functions and single-process references for the reduction modes (issue #2, rule 4).

[Note: why these runs select every parameter]
Under ``weighted`` and ``sum`` each rank's loss is a SUM over its tokens. DDP would *average* the
host parameters' gradients over the ranks, i.e. divide by the world size, which is not what a
loss-sum objective wants (the exact denominator is the global token count). Rather than scale the
host's loss to undo DDP's averaging, these runs select every parameter of the toy model into
selzero (``params=["*"]``) and use the model directly (no DDP): then selzero alone decides the
normalization, and the single-process reference is plain ``torch.optim`` on
``sum of all ranks' token losses / total tokens`` (weighted) or on the plain sum of the active
contributions (sum). SGD with momentum is used because it is scale-sensitive (AdamW would hide a
wrong denominator), with weight decay so that a parameter wrongly treated as present moves.

Expert parallelism (``normalize_over="world"``) is simulated with world 4: selzero instances on
groups {0, 1} and {2, 3}, each group holding different expert values (a different seed) and
seeing different data; the non-expert parameters are frozen, so the experts are the whole
trainable model of each group and the reference for group g is one process on the losses of
g's ranks divided by the world's denominator.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._state import capture, differences, model_state, snapshot
from .models import ToyMoE, loss_fn, make_batch
from .parity import routes_for

__all__ = ["group_modes_rank", "expert_parallel_rank", "weighted_reference", "sum_reference",
           "ep_reference", "build_ep", "tokens_of", "token_sum_loss", "E", "GROUPS", "SUM_STEPS"]

E = 4
SGD_KW: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.01}
SUM_DENOMINATOR = 20.0  # the "global denominator" a sum-mode caller already put into its loss


def tokens_of(step: int, rank: int) -> int:
    """Different token counts per rank and per step."""
    return 3 + 2 * rank + step


def token_sum_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                   routes: torch.Tensor) -> torch.Tensor:
    """Loss-sum objective: summed over tokens (and outputs), not averaged."""
    return (model(x, routes) - y).pow(2).sum()


def build(seed: int = 0) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(E)


def _sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, **SGD_KW)


# ---- weighted and sum on one group ---------------------------------------------------------


def _weighted_run(rank: int, steps: int) -> dict[str, Any]:
    model = build()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], reduction="weighted"), torch.optim.SGD,
                       SGD_KW)
    weights = []
    for step in range(steps):
        n = tokens_of(step, rank)
        x, y = make_batch(step, rank, tokens=n)
        token_sum_loss(model, x, y, routes_for(step, rank, n, E, "uneven")).backward()
        # a tensor weight (as a token count usually is) on odd steps, an int on even ones
        result = sz.step(weight=n if step % 2 == 0 else torch.tensor(n))
        weights.append(result.global_weight)
    return {"state": model_state(model), "global_weights": weights}


def weighted_reference(world: int, steps: int) -> dict[str, Any]:
    model = build()
    opt = _sgd(model.parameters())
    totals = []
    for step in range(steps):
        total = sum(tokens_of(step, r) for r in range(world))
        losses = []
        for r in range(world):
            n = tokens_of(step, r)
            x, y = make_batch(step, r, tokens=n)
            losses.append(token_sum_loss(model, x, y, routes_for(step, r, n, E, "uneven")))
        (torch.stack(losses).sum() / total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        totals.append(total)
    return {"state": model_state(model), "global_weights": totals}


def _weighted_zero(rank: int) -> dict[str, Any]:
    """One real step (so optimizer state exists), then a window whose global weight is 0."""
    model = build()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], reduction="weighted"), torch.optim.SGD,
                       SGD_KW)
    x, y = make_batch(0, rank, tokens=4)
    token_sum_loss(model, x, y, routes_for(0, rank, 4, E, "same")).backward()
    sz.step(weight=4)
    before = snapshot(model, sz)
    x, y = make_batch(1, rank, tokens=4)
    token_sum_loss(model, x, y, routes_for(1, rank, 4, E, "same")).backward()
    result = sz.step(weight=0)
    return {"changed": differences(before, snapshot(model, sz)), "result": result,
            "optim_keys": sum(k.startswith("optim/") for k in before)}


# Sum mode. Step 0: everyone active. Step 1: the last rank is inactive (step(active=False)) and
# routes every token to expert 3, which no active rank uses. Step 2: two micro-steps; rank 0's
# first one is inactive (end_microstep(active=False)) and routes to expert 3 only.
SUM_STEPS = 3


def _sum_routes(step: int, micro: int, rank: int, world: int, n: int) -> torch.Tensor:
    if (step, micro, rank) in ((1, 0, world - 1), (2, 0, 0)):
        return torch.full((n,), E - 1)
    return torch.arange(n) % (E - 1)  # experts 0..2


def _sum_active(step: int, micro: int, rank: int, world: int) -> bool:
    return (step, micro, rank) not in ((1, 0, world - 1), (2, 0, 0))


def _micros(step: int) -> int:
    return 2 if step == 2 else 1


def _sum_run(rank: int, world: int) -> dict[str, Any]:
    model = build()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], reduction="sum"), torch.optim.SGD, SGD_KW)
    results = []
    for step in range(SUM_STEPS):
        for micro in range(_micros(step)):
            n = tokens_of(step, rank)
            x, y = make_batch(10 * step + micro, rank, tokens=n)
            loss = token_sum_loss(model, x, y, _sum_routes(step, micro, rank, world, n))
            (loss / SUM_DENOMINATOR).backward()
            active = _sum_active(step, micro, rank, world)
            if micro < _micros(step) - 1:
                sz.end_microstep(active=active)
            else:
                results.append(sz.step(active=active))
    return {"state": model_state(model), "results": results}


def sum_reference(world: int) -> dict[str, torch.Tensor]:
    """Plain SGD on the sum of the active contributions only (no division)."""
    model = build()
    opt = _sgd(model.parameters())
    for step in range(SUM_STEPS):
        losses = []
        for micro in range(_micros(step)):
            for r in range(world):
                if not _sum_active(step, micro, r, world):
                    continue
                n = tokens_of(step, r)
                x, y = make_batch(10 * step + micro, r, tokens=n)
                losses.append(token_sum_loss(model, x, y, _sum_routes(step, micro, r, world, n)))
        (torch.stack(losses).sum() / SUM_DENOMINATOR).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


def _sum_all_inactive(rank: int) -> dict[str, Any]:
    """After a real step: a one-micro-step and a two-micro-step window, every rank inactive."""
    model = build()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], reduction="sum"), torch.optim.SGD, SGD_KW)

    def backward(seed: int) -> None:
        x, y = make_batch(seed, rank, tokens=5)
        token_sum_loss(model, x, y, routes_for(seed, rank, 5, E, "same")).backward()

    backward(0)
    sz.step(active=True)
    before = snapshot(model, sz)
    backward(1)
    one = sz.step(active=False)
    backward(2)
    sz.end_microstep(active=False)
    backward(3)
    two = sz.step(active=False)
    after = snapshot(model, sz)
    backward(4)
    sz.step(active=True)
    return {"changed": differences(before, after), "results": [one, two],
            "optim_keys": sum(k.startswith("optim/") for k in before),
            "moved_after": bool(differences(after, snapshot(model, sz)))}


def _sum_skip_presence(rank: int, world: int) -> dict[str, Any]:
    """missing_grad="skip" under sum: only active ranks' presence counts, only they are expected.

    Active ranks route to experts 0..2 only; the inactive last rank routes to expert 3 only.
    Experts 0..2 are present on every *active* rank (updated); expert 3 is absent on every active
    rank (not updated, bit-identical). Counting the inactive rank's presence, or expecting it,
    would flip one of the two.
    """
    model = build()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], reduction="sum", missing_grad="skip"),
                       torch.optim.SGD, SGD_KW)
    inactive = rank == world - 1
    n = 6
    x, y = make_batch(0, rank, tokens=n)
    routes = torch.full((n,), E - 1) if inactive else torch.arange(n) % (E - 1)
    before = model_state(model)
    token_sum_loss(model, x, y, routes).backward()
    result = sz.step(active=not inactive)
    return {"before": before, "after": model_state(model), "result": result}


def group_modes_rank(rank: int, world: int) -> dict[str, Any]:
    """Every group-normalized scenario of rule 4, each captured on its own."""
    return {
        "weighted": capture(lambda: _weighted_run(rank, 3)),
        "weighted_zero": capture(lambda: _weighted_zero(rank)),
        "sum": capture(lambda: _sum_run(rank, world)),
        "sum_all_inactive": capture(lambda: _sum_all_inactive(rank)),
        "sum_skip_presence": capture(lambda: _sum_skip_presence(rank, world)),
    }


# ---- normalize_over="world": two expert groups in a world of 4 -----------------------------

GROUPS = ([0, 1], [2, 3])
EP_STEPS = 2


def _group_of(rank: int) -> int:
    return 0 if rank in GROUPS[0] else 1


def build_ep(g: int) -> ToyMoE:
    """Group g's model: its own expert values (seed), non-expert parameters frozen."""
    model = build(seed=100 + g)
    for name, p in model.named_parameters():
        if not name.startswith("experts."):
            p.requires_grad_(False)
    return model


def _ep_loss(model: nn.Module, mode: str, step: int, rank: int) -> torch.Tensor:
    n = tokens_of(step, rank)
    x, y = make_batch(step, rank, tokens=n)
    routes = routes_for(step, rank, n, E, "uneven")
    return loss_fn(model, x, y, routes) if mode == "mean" else token_sum_loss(model, x, y, routes)


def _experts(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model_state(model).items() if k.startswith("experts.")}


def _ep_run(rank: int, mode: str, group: dist.ProcessGroup) -> dict[str, Any]:
    model = build_ep(_group_of(rank))
    cfg = SelZeroConfig(params=["experts.*"], reduction=mode, normalize_over="world")
    sz = SelectedZero2(model, cfg, torch.optim.SGD, SGD_KW, group=group)
    weights = []
    for step in range(EP_STEPS):
        _ep_loss(model, mode, step, rank).backward()
        result = sz.step() if mode == "mean" else sz.step(weight=tokens_of(step, rank))
        weights.append(result.global_weight)
    return {"state": _experts(model), "global_weights": weights, "group_size": sz.world_size}


def _ep_zero(rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    model = build_ep(_group_of(rank))
    cfg = SelZeroConfig(params=["experts.*"], reduction="weighted", normalize_over="world")
    sz = SelectedZero2(model, cfg, torch.optim.SGD, SGD_KW, group=group)
    _ep_loss(model, "weighted", 0, rank).backward()
    sz.step(weight=tokens_of(0, rank))
    before = snapshot(model, sz)
    _ep_loss(model, "weighted", 1, rank).backward()
    result = sz.step(weight=0)
    return {"changed": differences(before, snapshot(model, sz)), "result": result}


def expert_parallel_rank(rank: int, world: int) -> dict[str, Any]:
    assert world == 4, "two groups of two"
    # Only the members create a group: use_local_synchronization makes new_group local to them.
    group = dist.new_group(GROUPS[_group_of(rank)], use_local_synchronization=True)
    return {
        "mean": capture(lambda: _ep_run(rank, "mean", group)),
        "weighted": capture(lambda: _ep_run(rank, "weighted", group)),
        "zero": capture(lambda: _ep_zero(rank, group)),
    }


def ep_reference(g: int, mode: str, world: int = 4) -> dict[str, Any]:
    """Group g's experts trained by one process on g's losses over the world's denominator."""
    model = build_ep(g)
    opt = _sgd([p for p in model.parameters() if p.requires_grad])
    denominators = []
    for step in range(EP_STEPS):
        denominator = world if mode == "mean" else sum(tokens_of(step, r) for r in range(world))
        loss = sum(_ep_loss(model, mode, step, r) for r in GROUPS[g]) / denominator
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        denominators.append(denominator)
    return {"state": _experts(model), "global_weights": denominators}
