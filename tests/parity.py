"""Shared parity harness: selzero (+ DDP for the rest) vs one process on the mean of the losses."""

from __future__ import annotations

from typing import Any, Callable

import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from .models import ToyMoE, loss_fn, make_batch

OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 5e-2}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
}


def routes_for(step: int, rank: int, tokens: int, num_experts: int,
               pattern: str = "uneven") -> torch.Tensor:
    """Token -> expert. "uneven": rank r uses experts {r, r+1} (mod E-1); expert E-1 never used."""
    if pattern == "same":
        return torch.arange(tokens) % num_experts
    if pattern == "random":
        g = torch.Generator().manual_seed(7919 * step + rank)
        k = int(torch.randint(0, num_experts + 1, (1,), generator=g))
        pool = torch.randperm(num_experts, generator=g)[:max(k, 0)]
        if pool.numel() == 0:
            return torch.full((tokens,), -1)  # no expert gets a token on this rank
        return pool[torch.randint(0, pool.numel(), (tokens,), generator=g)]
    allowed = torch.tensor([rank % (num_experts - 1), (rank + 1) % (num_experts - 1)])
    return allowed[torch.arange(tokens) % 2]


def build_model(seed: int = 0, num_experts: int = 4, dtype: torch.dtype = torch.float32) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(num_experts).to(dtype)


def reference_run(world: int, steps: int, opt_name: str | None, *, pattern: str = "uneven",
                  num_experts: int = 4, accumulate: int = 1, clip: float | None = None,
                  optimizers: Callable[[ToyMoE], list[Any]] | None = None
                  ) -> dict[str, torch.Tensor]:
    """One process, plain torch.optim, loss = mean over ranks (and micro-steps); the optimizer
    of ``OPTIMIZERS[opt_name]`` over every parameter, or those ``optimizers(model)`` builds."""
    model = build_model(num_experts=num_experts)
    if optimizers is not None:
        opts = optimizers(model)
    else:
        cls, kwargs = OPTIMIZERS[opt_name]
        opts = [cls(model.parameters(), **kwargs)]
    for step in range(steps):
        for micro in range(accumulate):
            s = step * accumulate + micro
            losses = [loss_fn(model, *make_batch(s, r), routes_for(s, r, 6, num_experts, pattern))
                      for r in range(world)]
            (torch.stack(losses).mean() / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def selzero_run(rank: int, world: int, steps: int, opt_name: str, *, pattern: str = "uneven",
                num_experts: int = 4, accumulate: int = 1, accumulate_mode: str = "end_microstep",
                clip: float | None = None, config: dict[str, Any] | None = None,
                host_instance: bool = False,
                hook: Callable[[SelectedZero2], None] | None = None) -> dict[str, torch.Tensor]:
    """selzero on the experts, DDP on the rest, AdamW/SGD/... on both."""
    from selzero_plugin import clip_grad_norm_

    model = build_model(num_experts=num_experts)
    cls, kwargs = OPTIMIZERS[opt_name]
    cfg = SelZeroConfig.from_dict({"params": ["experts.*"], **(config or {})})
    if host_instance:
        host_opt = cls(model.parameters(), **kwargs)
        sz = SelectedZero2(model, cfg, host_opt)
    else:
        sz = SelectedZero2(model, cfg, cls, kwargs)
        selected = {id(e.param) for e in sz.entries}
        host_opt = cls([p for p in model.parameters() if id(p) not in selected], **kwargs)
    if hook:
        hook(sz)
    ddp = wrap_ddp(model, sz)
    host_params = [p for p in model.parameters()]
    for step in range(steps):
        for micro in range(accumulate):
            s = step * accumulate + micro
            x, y = make_batch(s, rank)
            last = micro == accumulate - 1
            if accumulate_mode == "no_sync" and not last:
                with ddp.no_sync():
                    (loss_fn(ddp, x, y, routes_for(s, rank, 6, num_experts, pattern))
                     / accumulate).backward()
            else:
                (loss_fn(ddp, x, y, routes_for(s, rank, 6, num_experts, pattern))
                 / accumulate).backward()
                if not last:
                    sz.end_microstep()
        if clip is not None:
            clip_grad_norm_(host_params, clip, subsets=[sz])
        host_opt.step()
        sz.step()
        host_opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
