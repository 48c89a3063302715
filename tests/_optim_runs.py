"""Optimizer parity runs: param groups, lr schedulers, host optimizer instances, step(lr=).

A `Recipe` says how the optimizer is set up; `reference` runs it on one process (plain
torch.optim on every parameter, loss = mean of the ranks' losses) and `sharded` runs it with
selzero on the experts and DDP + a host optimizer on the rest. Both return the final state dict,
plus (sharded) the lr of every selzero group after every step.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from .models import loss_fn, make_batch
from .parity import OPTIMIZERS, build_model, routes_for

__all__ = ["Recipe", "NO_DECAY", "reference", "sharded", "sharded_many", "optimizer_spec",
           "scheduled_lrs"]

TOKENS = 6
NO_DECAY = ["*.bias", "*.gain"]  # selzero config globs for the no-decay group
DECAY_WD = 0.1


@dataclass(frozen=True)
class Recipe:
    opt: str
    """A key of parity.OPTIMIZERS, or a qualified class name (then `kwargs` gives its settings)."""
    kwargs: tuple[tuple[str, Any], ...] = ()
    """Overrides of the optimizer's keyword arguments."""
    groups: bool = False
    """Two groups: decay (weight_decay=0.1) and no decay (biases and `gain`, weight_decay=0)."""
    schedule: str | None = None
    """"lambda" (a different LambdaLR factor per group) or "step" (StepLR) on the host optimizer."""
    host_instance: bool = False
    """selzero mirrors the host optimizer instance; else it gets a class, kwargs, param_groups."""
    lrs: tuple[float, ...] | None = None
    """Per step: `sz.step(lr=x)`, and the same lr set by hand on the host / reference groups."""
    steps: int = 5
    pattern: str = "uneven"
    config: tuple[tuple[str, Any], ...] = field(default=())
    """Extra selzero config entries."""


def optimizer_spec(recipe: Recipe) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    if recipe.opt in OPTIMIZERS:
        cls, kwargs = OPTIMIZERS[recipe.opt]
    else:
        module, _, name = recipe.opt.rpartition(".")
        cls, kwargs = getattr(importlib.import_module(module), name), {}
    return cls, {**kwargs, **dict(recipe.kwargs)}


def _no_decay(name: str) -> bool:
    return name.endswith(".bias") or name.endswith(".gain")


def _groups(named: list[tuple[str, nn.Parameter]], recipe: Recipe) -> list[dict[str, Any]]:
    if not recipe.groups:
        return [{"params": [p for _, p in named]}]
    return [{"params": [p for n, p in named if not _no_decay(n)], "weight_decay": DECAY_WD},
            {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0}]


def _lambda_decay(step: int) -> float:
    return 1.0 / (1.0 + step)


def _lambda_no_decay(step: int) -> float:
    return 0.5 ** step


def _scheduler(opt: torch.optim.Optimizer, recipe: Recipe) -> Any:
    if recipe.schedule is None:
        return None
    if recipe.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
    lambdas = [_lambda_decay, _lambda_no_decay] if recipe.groups else [_lambda_decay]
    return torch.optim.lr_scheduler.LambdaLR(opt, lambdas)


def scheduled_lrs(recipe: Recipe) -> list[list[float]]:
    """The lr of each group at each step, as the reference's scheduler sets it."""
    model = build_model()
    cls, kwargs = optimizer_spec(recipe)
    opt = cls(_groups(list(model.named_parameters()), recipe), **kwargs)
    sched = _scheduler(opt, recipe)
    out = []
    for step in range(recipe.steps):
        if recipe.lrs is not None:
            for g in opt.param_groups:
                g["lr"] = recipe.lrs[step]
        out.append([float(g["lr"]) for g in opt.param_groups])
        if sched is not None:
            opt.step()  # silences the "scheduler before optimizer" warning; no grads, no change
            sched.step()
    return out


def reference(world: int, recipe: Recipe) -> dict[str, torch.Tensor]:
    """One process: plain torch.optim with the same groups / scheduler on the mean of the losses."""
    model = build_model()
    cls, kwargs = optimizer_spec(recipe)
    opt = cls(_groups(list(model.named_parameters()), recipe), **kwargs)
    sched = _scheduler(opt, recipe)
    for step in range(recipe.steps):
        losses = [loss_fn(model, *make_batch(step, r), routes_for(step, r, TOKENS, 4, recipe.pattern))
                  for r in range(world)]
        torch.stack(losses).mean().backward()
        if recipe.lrs is not None:
            for g in opt.param_groups:
                g["lr"] = recipe.lrs[step]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sharded(rank: int, world: int, recipe: Recipe) -> dict[str, Any]:
    """selzero on the experts, DDP + the host optimizer on the rest."""
    model = build_model()
    cls, kwargs = optimizer_spec(recipe)
    config: dict[str, Any] = {"params": ["experts.*"], **dict(recipe.config)}
    named = list(model.named_parameters())
    if recipe.host_instance:
        host = cls(_groups(named, recipe), **kwargs)
        sz = SelectedZero2(model, SelZeroConfig.from_dict(config), host)
    else:
        if recipe.groups:
            config["param_groups"] = [{"params": NO_DECAY, "weight_decay": 0.0}]
            kwargs = {**kwargs, "weight_decay": DECAY_WD}
        sz = SelectedZero2(model, SelZeroConfig.from_dict(config), cls, kwargs)
        selected = {id(e.param) for e in sz.entries}
        host = cls(_groups([(n, p) for n, p in named if id(p) not in selected], recipe),
                   **optimizer_spec(recipe)[1])
    sched = _scheduler(host, recipe)
    ddp = wrap_ddp(model, sz)
    lrs: list[list[float]] = []
    for step in range(recipe.steps):
        x, y = make_batch(step, rank)
        loss_fn(ddp, x, y, routes_for(step, rank, TOKENS, 4, recipe.pattern)).backward()
        lr = None
        if recipe.lrs is not None:
            lr = recipe.lrs[step]
            for g in host.param_groups:
                g["lr"] = lr
        host.step()
        sz.step(lr=lr)
        host.zero_grad(set_to_none=True)
        lrs.append([float(g["lr"]) for g in sz.optimizer.param_groups])
        if sched is not None:
            sched.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "lrs": lrs,
            "selected": [n for e in sz.entries for n in e.names],
            "group_sizes": [len(g["params"]) for g in sz.optimizer.param_groups]}


def sharded_many(rank: int, world: int, recipes: list[Recipe]) -> list[dict[str, Any]]:
    """Several recipes in one set of processes (spawning ranks costs more than training here)."""
    return [sharded(rank, world, r) for r in recipes]
