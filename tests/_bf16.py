"""bf16 parameters with FP32 masters: selzero runs and the single-process FP32-master reference.

The model is the ToyMoE cast to bf16 with its host (non-selected) parameters frozen: the experts'
gradients then depend only on the experts' bf16 weights and the rank's batch, so the reference can
recompute every rank's bf16 gradient bit for bit (both sides single-threaded) and the comparison
isolates what selzero does with them — FP32 cast, sum over ranks, division, update of FP32 masters,
cast back to bf16. A trainable host in bf16 or fp32 would add its own rounding to the comparison
(DDP averages in the parameter dtype) without testing anything of selzero.

The reference keeps an FP32 master per expert parameter, steps plain ``torch.optim`` on the masters
with the mean of the ranks' gradients (each computed in the bf16 model, cast to FP32, summed in
rank order, divided by N; ``None`` when no rank reached the parameter) and writes the masters back
cast to bf16 after every step. ``keep_masters=False`` gives a reference that throws the masters
away every step (re-reads them from the bf16 weights): what an engine without masters would do,
used to show the comparison can fail.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._presence import toy_routes
from ._shard import shard_snapshot
from .models import loss_fn, make_batch
from .parity import build_model

__all__ = ["OPTIMIZERS", "E", "bf16_model", "bf16_selzero", "bf16_reference"]

E = 4
# small steps: most updates are below one bf16 ulp of the weights, so masters matter
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 2e-2, "momentum": 0.9, "weight_decay": 0.01}),
}


def bf16_model() -> nn.Module:
    model = build_model(num_experts=E, dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("experts."))
    return model


def _expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.startswith("experts.")}


def _loss(model: nn.Module, step: int, rank: int, pattern: str) -> torch.Tensor:
    x, y = make_batch(step, rank)
    return loss_fn(model, x.bfloat16(), y.bfloat16(), toy_routes(step, rank, E, pattern))


def bf16_selzero(rank: int, world: int, steps: int, pattern: str) -> dict[str, Any]:
    """One bf16 model per optimizer, selzero on its experts; snapshots after every step."""
    out: dict[str, Any] = {}
    for opt_name, (cls, kwargs) in OPTIMIZERS.items():
        model = bf16_model()
        sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], name=f"bf16_{opt_name}"),
                           cls, kwargs)
        master_storage = sz.master_flat.untyped_storage().data_ptr()
        snaps = []
        for step in range(steps):
            _loss(model, step, rank, pattern).backward()
            result = sz.step()
            params = {n: p.detach().clone() for n, p in _expert_params(model).items()}
            snaps.append({"params": params,
                          "shard": shard_snapshot(sz), "result": result})
        out[opt_name] = {
            "snaps": snaps,
            "master_dtype": sz.master_flat.dtype,
            "segments_in_master_flat": all(
                seg.dtype == torch.float32
                and seg.untyped_storage().data_ptr() == master_storage for seg in sz.segments),
        }
    return out


def bf16_reference(world: int, steps: int, pattern: str, opt_name: str, *,
                   keep_masters: bool = True) -> list[dict[str, Any]]:
    """One process, FP32 masters, plain torch.optim on the mean of the ranks' bf16 gradients."""
    cls, kwargs = OPTIMIZERS[opt_name]
    model = bf16_model()
    params = _expert_params(model)
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in params.items()}
    opt = cls(list(masters.values()), **kwargs)
    snaps = []
    for step in range(steps):
        sums: dict[str, torch.Tensor | None] = dict.fromkeys(params)
        for r in range(world):
            model.zero_grad(set_to_none=True)
            _loss(model, step, r, pattern).backward()
            for n, p in params.items():
                if p.grad is not None:
                    g = p.grad.float()
                    sums[n] = g if sums[n] is None else sums[n] + g
        for n, m in masters.items():
            m.grad = None if sums[n] is None else sums[n] / world
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n].to(torch.bfloat16))
                if not keep_masters:
                    masters[n].copy_(p.float())
        snaps.append({"params": {n: p.detach().clone() for n, p in params.items()},
                      "masters": {n: m.detach().clone() for n, m in masters.items()},
                      "state": {n: {k: v.clone() for k, v in opt.state[m].items()}
                                for n, m in masters.items() if m in opt.state}})
    return snaps
