"""Whole-tensor ownership (partition="tensors") runs: selzero with Muon on the expert matrices
and AdamW on the rest of the experts (a param group with its own optimizer), DDP + AdamW on the
host, against one process running torch.optim.Muon + AdamW on the mean of the ranks' losses."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_, wrap_ddp

from .models import loss_fn, make_batch
from .parity import build_model, routes_for

MUON = {"lr": 0.02, "weight_decay": 0.1}
ADAMW = {"lr": 1e-2, "weight_decay": 0.05}
ADAFACTOR = {"lr": 1e-2, "weight_decay": 0.01}
OWN_ADAMW = [{"params": ["*.bias", "*.gain"], "optimizer": "torch.optim.AdamW", **ADAMW}]


def _is_expert(name: str) -> bool:
    return name.startswith("experts.")


def reference_optimizers(model: nn.Module, recipe: str) -> list[torch.optim.Optimizer]:
    """One process: the same optimizers over the same parameters."""
    named = list(model.named_parameters())
    host = [p for n, p in named if not _is_expert(n)]
    if recipe == "muon":
        mats = [p for n, p in named if _is_expert(n) and p.ndim == 2]
        rest = [p for n, p in named if _is_expert(n) and p.ndim != 2]
        return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest + host, **ADAMW)]
    experts = [p for n, p in named if _is_expert(n)]
    return [torch.optim.Adafactor(experts, **ADAFACTOR), torch.optim.AdamW(host, **ADAMW)]


def reference(world: int, steps: int, recipe: str = "muon", *, pattern: str = "uneven",
              num_experts: int = 4, accumulate: int = 1, clip: float | None = None
              ) -> dict[str, torch.Tensor]:
    model = build_model(num_experts=num_experts)
    opts = reference_optimizers(model, recipe)
    for step in range(steps):
        for micro in range(accumulate):
            s = step * accumulate + micro
            losses = [loss_fn(model, *make_batch(s, r), routes_for(s, r, 6, num_experts, pattern))
                      for r in range(world)]
            (torch.stack(losses).mean() / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def selzero_config(recipe: str, **extra: Any) -> tuple[SelZeroConfig, type, dict[str, Any]]:
    if recipe == "muon":
        return (SelZeroConfig.from_dict({"params": ["experts.*"], "partition": "tensors",
                                         "param_groups": OWN_ADAMW, **extra}),
                torch.optim.Muon, dict(MUON))
    return (SelZeroConfig.from_dict({"params": ["experts.*"], "partition": "tensors", **extra}),
            torch.optim.Adafactor, dict(ADAFACTOR))


def run(rank: int, world: int, steps: int, recipe: str = "muon", *, pattern: str = "uneven",
        num_experts: int = 4, accumulate: int = 1, accumulate_mode: str = "end_microstep",
        clip: float | None = None, config: dict[str, Any] | None = None,
        trace: bool = False) -> dict[str, Any]:
    model = build_model(num_experts=num_experts)
    cfg, cls, kwargs = selzero_config(recipe, **(config or {}))
    sz = SelectedZero2(model, cfg, cls, kwargs)
    if trace:
        sz.comm.trace = []
    selected = {id(e.param) for e in sz.entries}
    host_params = [p for p in model.parameters() if id(p) not in selected]
    host_opt = torch.optim.AdamW(host_params, **ADAMW)
    ddp = wrap_ddp(model, sz)
    for step in range(steps):
        for micro in range(accumulate):
            s = step * accumulate + micro
            x, y = make_batch(s, rank)
            last = micro == accumulate - 1
            loss = loss_fn(ddp, x, y, routes_for(s, rank, 6, num_experts, pattern)) / accumulate
            if accumulate_mode == "no_sync" and not last:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
                if not last:
                    sz.end_microstep()
        if clip is not None:
            clip_grad_norm_(list(model.parameters()), clip, subsets=[sz])
        host_opt.step()
        sz.step()
        host_opt.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "owners": sz.owners, "memory": sz.memory_report(),
            "trace": sz.comm.trace, "segments": len(sz.segments)}
