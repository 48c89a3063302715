"""An MoE of several blocks, each a *unit* that runs on every rank whatever the routing.

``BlockMoE``: a dense input layer, ``layers`` blocks (a router and an ``experts`` ModuleList; the
block owns the container, so it is the experts' launch unit) and a dense output layer. Routes are
given per block: ``routes[l][i]`` is token i's expert in block l, or -1 for none. The helpers
build per-rank routes that differ by rank (some experts get no token on some ranks, one expert
gets none anywhere) and a single-process reference on the mean of the ranks' losses.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from .models import Expert

__all__ = ["Block", "BlockMoE", "SkippingMoE", "block_routes", "block_batch", "block_loss", "reference_blocks",
           "EXPERTS"]

EXPERTS = 3


class Block(nn.Module):
    def __init__(self, num_experts: int, d: int, h: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, num_experts)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(num_experts))

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(h), dim=-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (routes == e).nonzero().flatten()
            if idx.numel():
                y = y.index_add(0, idx, self.run_expert(expert, h[idx]) * gates[idx, e:e + 1])
        # the aux term keeps the router in the graph whatever the routing
        return h + y + 0.01 * gates.pow(2).sum(-1, keepdim=True)

    def run_expert(self, expert: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return expert(x)


class BlockMoE(nn.Module):
    def __init__(self, layers: int = 3, num_experts: int = EXPERTS, d: int = 7, h: int = 13,
                 block: type[Block] = Block) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList(block(num_experts, d, h) for _ in range(layers))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block, r in zip(self.blocks, routes):
            h = block(h, r)
        return self.out(h)


class SkippingMoE(BlockMoE):
    """A model whose second block (a launch unit) is skipped on some steps (layer drop)."""

    skip = False

    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for i, (block, r) in enumerate(zip(self.blocks, routes)):
            if not (self.skip and i == 1):
                h = block(h, r)
        return self.out(h)


def block_routes(step: int, rank: int, *, layers: int, tokens: int = 6,
                 num_experts: int = EXPERTS, pattern: str = "uneven") -> list[torch.Tensor]:
    """Per-block routes. "uneven": block l on rank r uses experts {(r + l) % (E - 1)} and
    {(r + l + 1) % (E - 1)} only, so ranks differ and expert E - 1 gets no token anywhere;
    "skewed": rank 0 reaches every expert of every block, rank r > 0 only expert r % E;
    "none": no token reaches any expert on this rank; "random": seeded by (step, rank, l)."""
    routes = []
    for layer in range(layers):
        if pattern == "none":
            routes.append(torch.full((tokens,), -1))
        elif pattern == "skewed":
            routes.append(torch.arange(tokens) % num_experts if rank == 0
                          else torch.full((tokens,), rank % num_experts))
        elif pattern == "random":
            g = torch.Generator().manual_seed(7919 * step + 31 * rank + layer)
            routes.append(torch.randint(-1, num_experts, (tokens,), generator=g))
        else:
            a = (rank + layer) % (num_experts - 1)
            b = (rank + layer + 1) % (num_experts - 1)
            routes.append(torch.tensor([a, b])[torch.arange(tokens) % 2])
    return routes


def block_batch(step: int, rank: int, tokens: int = 6, d: int = 7
                ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(tokens, d, generator=g), torch.randn(tokens, 3, generator=g)


def block_loss(model: nn.Module, step: int, rank: int, *, layers: int, pattern: str = "uneven",
               d: int = 7, tokens: int = 6, num_experts: int = EXPERTS) -> torch.Tensor:
    x, y = block_batch(step, rank, tokens, d)
    routes = block_routes(step, rank, layers=layers, tokens=tokens, num_experts=num_experts,
                          pattern=pattern)
    return (model(x, routes) - y).pow(2).mean()


def reference_blocks(world: int, steps: list[int], build: Callable[[], nn.Module],
                     opt: tuple[type, dict[str, Any]], *, layers: int,
                     patterns: Callable[[int, int], str] = lambda s, r: "uneven"
                     ) -> dict[str, torch.Tensor]:
    """One process, plain torch.optim, one update per entry of ``steps`` on the mean of the
    ranks' losses for that batch number."""
    model = build()
    cls, kwargs = opt
    optimizer = cls(model.parameters(), **kwargs)
    for s in steps:
        losses = [block_loss(model, s, r, layers=layers, pattern=patterns(s, r))
                  for r in range(world)]
        torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
