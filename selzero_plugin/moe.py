"""A reference expert-parallel MoE layer (tests, demo): real token exchange over the
expert-parallel group, experts sharded over it.

[Note: reference EP MoE]
Global expert ``g`` lives on expert-parallel rank ``g // local`` as its local expert
``g % local`` (``local = num_experts // ep_size``): the experts of EP rank k are
``[k * local, (k + 1) * local)``, DeepSpeed's and Megatron's contiguous split. A forward sends
each token to the rank that holds its expert (``all_to_all_single`` with uneven splits, the
differentiable one from ``torch.distributed.nn.functional``), runs the local experts on what
arrived, and sends the outputs back; the backward runs the same exchange in reverse, so each
expert's gradient is summed over every token routed to it from any rank of the expert-parallel
group. Routing is the caller's (``routes``: one global expert per token, ``-1`` for none), so
tests can make it uneven, leave experts without tokens, and differ by rank. Every rank takes
part in every exchange of the forward and the backward, also one that sends or receives no
token (its expert outputs stay connected to what it received).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Expert", "ExpertParallelMoE"]


def _all_to_all(output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable uneven all-to-all: torch's eager one, checked on gloo with uneven splits
    (research/torch-facts.md); torch 2.13 marks it deprecated in favour of functional
    collectives, so its FutureWarning is silenced here."""
    from torch.distributed.nn.functional import all_to_all_single

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return all_to_all_single(output, tensor, out_splits, in_splits, group=group)


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden)
        self.w_out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(torch.tanh(self.w_in(x)))


class ExpertParallelMoE(nn.Module):
    """``num_experts`` experts sharded over ``ep_group`` (None: one process holds them all)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, ep_group: Any = None) -> None:
        super().__init__()
        self.ep_group = ep_group
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {ep}.")
        self.ep_size, self.num_experts, self.local = ep, num_experts, num_experts // ep
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(self.local))
        # local expert i is global expert expert_offset + i: selzero's checkpoints are keyed by
        # the global experts, so they load under another expert-parallel layout
        self.experts.expert_offset = self.ep_rank * self.local

    def global_expert(self, i: int) -> int:
        """The global index of local expert ``i``."""
        return self.ep_rank * self.local + i

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        routed = (routes >= 0).nonzero().flatten()
        dest = routes[routed] // self.local
        order = torch.argsort(dest, stable=True)
        tokens = routed[order]
        send = torch.bincount(dest, minlength=self.ep_size)
        inputs, experts = x[tokens], routes[tokens] % self.local
        if self.ep_size > 1:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.ep_group)
            s, r = send.tolist(), recv.tolist()
            got_experts = torch.empty(sum(r), dtype=experts.dtype, device=x.device)
            dist.all_to_all_single(got_experts, experts, r, s, group=self.ep_group)
            got = _all_to_all(x.new_empty(sum(r), x.shape[1]), inputs, r, s, self.ep_group)
        else:
            got, got_experts = inputs, experts
        # connected to `got` even when no local expert runs: every rank's backward must reach
        # the reverse exchange, or the ranks that do wait for it forever
        out = got * 0
        for i, expert in enumerate(self.experts):
            idx = (got_experts == i).nonzero().flatten()
            if idx.numel():  # an expert without tokens here gets no gradient from this rank
                out = out.index_add(0, idx, expert(got[idx]))
        if self.ep_size > 1:
            back = _all_to_all(x.new_empty(inputs.shape), out, s, r, self.ep_group)
        else:
            back = out
        y = torch.zeros_like(x)
        y = y.index_add(0, tokens, back * gates[tokens, routes[tokens]].unsqueeze(-1))
        return x + y
