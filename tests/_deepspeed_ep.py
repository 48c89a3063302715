"""Expert parallelism under DeepSpeed with ``"group": {"expert_parallel_size": 2}``, 4 ranks.

Rank r holds the experts of expert-parallel position r % 2 (DeepSpeed's layout: expert-parallel
groups {0, 1} and {2, 3}; expert-data-parallel groups {0, 2} and {1, 3}). Tokens are dispatched
inside the expert-parallel group with differentiable all-reduces (gloo has no reduce-scatter),
so an expert's gradient arrives summed over the expert-parallel ranks; selzero reduces it over
its expert-data-parallel group and divides by the world (DeepSpeed's mean). The reference is one
process holding every expert, on the mean of the 4 ranks' losses.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

from ._deepspeed import GAS, LR, WD, _quiet
from .models import Expert

EP, LOCAL, WORLD, D, H, T = 2, 2, 4, 7, 13, 6
CLIP = 0.05


def _seeded_expert(global_id: int) -> Expert:
    torch.manual_seed(100 + global_id)
    return Expert(D, H)


class Dispatch(nn.Module):
    """Router (dense) and this rank's LOCAL experts; tokens of every expert-parallel peer."""

    def __init__(self, position: int, group: Any) -> None:
        super().__init__()
        self.position, self.group = position, group
        torch.manual_seed(1)
        self.router = nn.Linear(D, EP * LOCAL)
        self.experts = nn.ModuleList(_seeded_expert(position * LOCAL + e) for e in range(LOCAL))
        self.experts.expert_offset = position * LOCAL  # checkpoint keys by global expert

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        slots = torch.zeros((EP,) + t.shape, dtype=t.dtype)
        slots = slots.index_copy(0, torch.tensor([self.position]), t.unsqueeze(0))
        return dist_nn.all_reduce(slots, group=self.group)

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(h), dim=-1)
        hs, gs = self._gather(h), self._gather(gates)
        rs = torch.zeros(EP, T, dtype=torch.long)
        rs[self.position] = routes
        dist.all_reduce(rs, group=self.group)
        ys = []
        for p in range(EP):
            y = torch.zeros(T, D)
            for e, expert in enumerate(self.experts):
                g = self.position * LOCAL + e
                idx = (rs[p] == g).nonzero().flatten()
                if idx.numel():
                    y = y.index_add(0, idx, expert(hs[p][idx]) * gs[p][idx, g:g + 1])
            ys.append(y)
        mine = dist_nn.all_reduce(torch.stack(ys), group=self.group)[self.position]
        return h + mine + 0.01 * gates.pow(2).sum(-1, keepdim=True)


class EPModel(nn.Module):
    def __init__(self, position: int, group: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.block = Dispatch(position, group)
        torch.manual_seed(2)
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(torch.tanh(self.inp(x)), routes))


class FullModel(nn.Module):
    """The reference: every expert in one process."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        torch.manual_seed(1)
        self.router = nn.Linear(D, EP * LOCAL)
        self.experts = nn.ModuleList(_seeded_expert(g) for g in range(EP * LOCAL))
        torch.manual_seed(2)
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        gates = torch.softmax(self.router(h), dim=-1)
        y = torch.zeros_like(h)
        for g, expert in enumerate(self.experts):
            idx = (routes == g).nonzero().flatten()
            if idx.numel():
                y = y.index_add(0, idx, expert(h[idx]) * gates[idx, g:g + 1])
        return self.out(h + y + 0.01 * gates.pow(2).sum(-1, keepdim=True))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank r routes to global experts (r + t) % 3: ranks differ, expert 3 gets no token."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(T, D, generator=g), torch.randn(T, 3, generator=g)
    routes = (torch.arange(T) + rank + step) % (EP * LOCAL - 1)
    return x, y, routes


def ep_run(rank: int, world: int, steps: int, save_dir: str | None = None) -> dict[str, Any]:
    _quiet()
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401
    import deepspeed

    ep_groups = [dist.new_group(list(range(b * EP, b * EP + EP))) for b in range(world // EP)]
    model = EPModel(rank % EP, ep_groups[rank // EP])
    config = {
        "train_micro_batch_size_per_gpu": T, "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP, "zero_optimization": {"stage": 2},
        "steps_per_print": 10 ** 9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD,
                                                  "torch_adam": True}},
        "selected_zero2": {"params": ["block.experts.*"], "bucket_mb": 1e-4,
                           "group": {"expert_parallel_size": EP}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    norms = []
    for step in range(steps):
        for micro in range(GAS):
            x, y, routes = batch(step * GAS + micro, rank)
            loss = (engine(x, routes) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    if save_dir is not None:
        engine.save_checkpoint(save_dir, tag="ep")
    sz = engine.selzero
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "norms": norms, "name": sz.config.name, "group": list(sz.comm.global_ranks),
            "normalize_over": sz.config.normalize_over}


def ep_reference(steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = FullModel()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        loss = sum((model(*batch(step * GAS + m, r)[::2]) - batch(step * GAS + m, r)[1])
                   .pow(2).mean() for m in range(GAS) for r in range(WORLD)) / (GAS * WORLD)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def local_name(full_name: str, rank: int) -> str | None:
    """The reference's name -> this rank's parameter name (None: held elsewhere)."""
    if full_name.startswith("experts."):
        g = int(full_name.split(".")[1])
        if g // LOCAL != rank % EP:
            return None
        return "block.experts." + str(g % LOCAL) + full_name[len(f"experts.{g}"):]
    if full_name.startswith("router."):
        return "block." + full_name
    return full_name
