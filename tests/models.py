"""Tiny models for tests: explicit per-expert modules with shapes that divide by no world size."""

from __future__ import annotations

import torch
from torch import nn

D, H = 7, 13  # (13, 7) and (7, 13) weights: 91 elements, divisible by neither 2 nor 3


class Expert(nn.Module):
    def __init__(self, d: int = D, h: int = H) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, h)
        self.w2 = nn.Linear(h, d)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.tanh(self.w1(x))) * self.gain


class ToyMoE(nn.Module):
    """Dense in/out layers (host) and E experts (selzero); routing is given by the caller."""

    def __init__(self, num_experts: int = 4, d: int = D, h: int = H) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.router = nn.Linear(d, num_experts)
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(num_experts))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        gates = torch.softmax(self.router(h), dim=-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (routes == e).nonzero().flatten()
            if idx.numel():
                y = y.index_add(0, idx, expert(h[idx]) * gates[idx, e:e + 1])
        # the aux term keeps the router in the graph on ranks whose tokens reach no expert
        return self.out(h + y) + 0.01 * gates.pow(2).sum(-1, keepdim=True)


def make_batch(seed: int, rank: int, tokens: int = 6, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(tokens, d, generator=g), torch.randn(tokens, 3, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    return (model(x, routes) - y).pow(2).mean()
