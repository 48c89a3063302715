"""Whole-tensor ownership (``partition="tensors"``): which group rank owns which (virtual)
parameter when a matrix-wise optimizer (Muon, Adafactor) needs whole tensors. Pure arithmetic:
no torch.distributed here, the same result on every rank from the same inputs.

[Note: ownership plan]
Each (virtual) parameter has a cost: the optimizer's work on it per step. For an elementwise
optimizer (and Adafactor, whose factored statistics are a few passes over the elements) that is
its number of elements; for a Muon-like optimizer it is dominated by the Newton-Schulz
iteration on the (m x n) matrix, m <= n: per step a Gram matrix (2 m^2 n flops), its update
(2 m^3) and the product with the iterate (2 m^2 n), ``ns_steps`` times, plus the elementwise
momentum (a few flops per element). Owners are assigned greedily, largest cost first, each to
the rank with the least load so far (LPT scheduling: at most 4/3 of the optimal maximum load);
ties are broken by the lower index, then the lower rank, so the plan is a function of the costs
and the group size alone and is part of the contract (it is recorded in checkpoints, and a
reshard re-plans with the same function).

The virtual parameters of one fused expert tensor have the same cost, so LPT deals them out
round-robin; ``contiguous_runs`` then hands the owners it chose for them back out in expert
order (the same multiset of owners: every rank's load is unchanged), so that each rank owns a
contiguous block of experts and a bucket copy moves one block per rank instead of one piece
per expert.

Which optimizer is "Muon-like" is decided from its class *name* (``"Muon"`` in the class
name), so that the offline tools, which read the class's qualified name from a manifest and
import nothing, plan exactly as the engine does.

[Note: whole-tensor layout]
A first layout (kept here as a measurement) put each owned tensor in its owner's row of the
usual rank-major bucket buffer, every row as long as the longest: on the issue's model (64
experts x 3 matrices, N = 3) buckets of 3, 6, 12 and 48 tensors carried 61%, 38%, 15% and 3%
padding with the global plan, and still 17%, 17%, 4% and 1% when each bucket was planned on
its own, which the reduce-scatter moves on the wire. With large experts and small buckets
(one matrix per bucket) the padding is (N - 1)x the data. So rows are *uneven* instead (layout.py, [Note: layout]):
row r holds exactly what rank r owns in the bucket, no padding; the reduction is a
reduce-scatter with uneven rows (NCCL: torch's ``reduce_scatter`` with a list of unequal
inputs, which ProcessGroupNCCL runs as one reduce per owner, coalesced; gloo: the in-place
all-reduce selzero already uses) and the gather an all-gather with uneven rows (NCCL:
broadcasts from each owner, coalesced; gloo: the per-row broadcasts already used). Bytes on the
wire are then the reduce-scatter's (N-1)/N of the subset whatever the plan, so the plan needs
no per-bucket balance and balances the optimizer's work over the whole subset.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Hashable, Sequence

__all__ = ["MUON_NS_STEPS", "elementwise_cost", "newton_schulz_cost", "is_muon_like",
           "optimizer_cost", "plan_owners", "contiguous_runs", "plan_tensor_owners", "loads", "balance"]

MUON_NS_STEPS = 5  # torch.optim.Muon's default ns_steps


def elementwise_cost(shape: Sequence[int]) -> float:
    """An elementwise optimizer's work: the number of elements."""
    return float(math.prod(shape))


def newton_schulz_cost(shape: Sequence[int], ns_steps: int = MUON_NS_STEPS) -> float:
    """Muon's work on a matrix of ``shape`` (flops of the Newton-Schulz iteration plus the
    elementwise momentum); a tensor that is not 2-D costs its elements."""
    if len(shape) != 2:
        return elementwise_cost(shape)
    m, n = sorted(int(d) for d in shape)
    return float(ns_steps * (4 * m * m * n + 2 * m ** 3) + 4 * m * n)


def is_muon_like(class_name: str) -> bool:
    """Does the optimizer of this (qualified) class name orthogonalize its updates?"""
    return "Muon" in class_name.rsplit(".", 1)[-1]


def optimizer_cost(class_name: str, hyper: dict[str, Any], shape: Sequence[int]) -> float:
    """The cost model of [Note: ownership plan] for one (virtual) parameter."""
    if is_muon_like(class_name):
        steps = hyper.get("ns_steps", MUON_NS_STEPS)
        return newton_schulz_cost(shape, int(steps) if isinstance(steps, (int, float))
                                  else MUON_NS_STEPS)
    return elementwise_cost(shape)


def plan_owners(costs: Sequence[float], world: int) -> list[int]:
    """The owning group rank of each item ([Note: ownership plan])."""
    if world < 1:
        raise ValueError(f"plan_owners: world={world}; expected a group size of at least 1")
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"plan_owners: costs must be finite and >= 0, got {list(costs)[:8]}")
    owners = [0] * len(costs)
    heap = [(0.0, r) for r in range(world)]  # (load, rank): least load, then lowest rank
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + float(costs[i]), rank))
    return owners


def contiguous_runs(owners: Sequence[int], runs: Sequence[Sequence[int]]) -> list[int]:
    """``owners`` with the owners of each run of equal items (the experts of one fused tensor)
    sorted along the run: the same owners, each rank's share of a run contiguous."""
    out = list(owners)
    for run in runs:
        for i, owner in zip(run, sorted(owners[i] for i in run)):
            out[i] = owner
    return out


def plan_tensor_owners(costs: Sequence[float], fused: Sequence[Hashable | None],
                       world: int) -> list[int]:
    """[Note: ownership plan] over virtual parameters in order, as the engine and the offline
    tools plan it: ``costs[i]`` is i's cost, ``fused[i]`` the fused tensor it is an expert of
    (its experts are consecutive) or None; LPT, then each fused tensor's owners in contiguous
    blocks."""
    runs: list[list[int]] = []
    for i, key in enumerate(fused):
        if key is not None and i and fused[i - 1] == key:
            runs[-1].append(i)
        elif key is not None:
            runs.append([i])
    return contiguous_runs(plan_owners(costs, world), runs)


def loads(costs: Sequence[float], owners: Sequence[int], world: int) -> list[float]:
    """Total cost per rank."""
    out = [0.0] * world
    for c, r in zip(costs, owners):
        out[r] += float(c)
    return out


def balance(costs: Sequence[float], owners: Sequence[int], world: int) -> float:
    """max / mean load per rank (1.0 is perfect; the figure the benchmarks report)."""
    per_rank = loads(costs, owners, world)
    mean = sum(per_rank) / world
    return max(per_rank) / mean if mean > 0 else 1.0
