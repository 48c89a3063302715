"""Whole-tensor ownership (issue 12, first part): which group rank owns which (virtual) parameter
when a matrix-wise optimizer (Muon, Adafactor) needs whole tensors. Pure arithmetic: no
torch.distributed here, the same result on every rank from the same inputs.

[Note: ownership plan]
Each (virtual) parameter has a cost: the optimizer's work on it per step. For an elementwise
optimizer that is its number of elements; for Muon it is dominated by the Newton-Schulz
iteration on the (m x n) matrix, m <= n: per step a Gram matrix (2 m^2 n flops), its update
(2 m^3) and the product with the iterate (2 m^2 n), ``ns_steps`` times, plus the elementwise
momentum (a few flops per element). Owners are assigned greedily, largest cost first, each to
the rank with the least load so far (LPT scheduling: at most 4/3 of the optimal maximum load);
ties are broken by the lower index, then the lower rank, so the plan is a function of the costs
and the group size alone and is part of the contract (it is recorded in checkpoints, and a
reshard re-plans with the same function).

[Note: whole-tensor layout (plan for partition="tensors", not built yet)]
The chunk layout (layout.py) gives every virtual parameter N equal pieces, one per rank row at
the same row offset. Whole-tensor ownership gives it one piece: row ``owner`` at an offset of
that row. Both are "pieces": (rank, row offset, flat start, length) per virtual parameter,
so the bucket machinery (fill, zero-fill at launch, one reduce-scatter per bucket, the
all-gather back) stays as it is once row views are built from pieces; a bucket's row length
becomes the largest per-rank sum of owned elements in it, so the plan should balance each
bucket's rows too (elements) while balancing the optimizer's work (cost) overall, or the
reduce-scatter carries padding. The segment of an owned tensor is the whole (virtual) tensor in
its own shape (a view of the fp32 parameter, or a master), so Muon sees a matrix; presence and
the absent-expert rule are unchanged (grad None on the owner).
Measured with the global plan on the issue's model (64 experts x 3 matrices, N = 3, Muon cost):
buckets of 3, 6, 12 and 48 tensors carry 61%, 38%, 15% and 3% padding in their buffers
(``TensorBucket.padding``). ``plan_owners_by_bucket`` (largest first within each bucket, by
elements, to the rank whose row is shortest, ties to the least optimizer load so far) keeps the
cost balance (1.004) and cuts the padding to 17%, 17%, 4% and 1% (17% is the floor with three
tensors of 64Ki, 64Ki and 36Ki elements on three rows): the engine should use that one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["elementwise_cost", "newton_schulz_cost", "plan_owners", "loads", "balance",
           "OwnedSlot", "TensorBucket", "plan_rows", "plan_owners_by_bucket"]

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


@dataclass(frozen=True)
class OwnedSlot:
    """A whole (virtual) parameter in its owner's row of a bucket buffer."""

    virtual: int
    owner: int
    row_offset: int  # in row ``owner``
    numel: int


@dataclass(frozen=True)
class TensorBucket:
    """Rows of one bucket under whole-tensor ownership: row r holds the tensors rank r owns, one
    after another; every row is ``row_numel`` long (the longest), the rest is padding."""

    index: int
    slots: tuple[OwnedSlot, ...]  # in bucket order
    row_numel: int

    def padding(self, world: int) -> float:
        """Padding elements per real element of the bucket's buffer."""
        real = sum(s.numel for s in self.slots)
        return (world * self.row_numel - real) / real if real else 0.0


def plan_rows(buckets: Sequence[Sequence[int]], numels: Sequence[int], owners: Sequence[int],
              world: int) -> tuple[TensorBucket, ...]:
    """The rows of each bucket (``buckets``: virtual indices per bucket, in bucket order) for
    the given owners ([Note: whole-tensor layout])."""
    out = []
    for b, members in enumerate(buckets):
        fill = [0] * world
        slots = []
        for v in members:
            r = owners[v]
            slots.append(OwnedSlot(v, r, fill[r], int(numels[v])))
            fill[r] += int(numels[v])
        out.append(TensorBucket(b, tuple(slots), max(fill, default=0)))
    return tuple(out)


def plan_owners_by_bucket(buckets: Sequence[Sequence[int]], costs: Sequence[float],
                          numels: Sequence[int], world: int) -> list[int]:
    """Owners planned bucket by bucket ([Note: whole-tensor layout]): within a bucket, largest
    tensor first (elements, then cost, then index), to the rank with the shortest row so far,
    ties to the rank with the least optimizer cost so far, then the lowest rank. Balances each
    bucket's rows (the reduce-scatter's padding) and, through the tie-break, the work."""
    if world < 1:
        raise ValueError(f"plan_owners_by_bucket: world={world}; expected at least 1")
    owners = [0] * len(costs)
    work = [0.0] * world
    for members in buckets:
        fill = [0] * world
        for v in sorted(members, key=lambda v: (-int(numels[v]), -float(costs[v]), v)):
            r = min(range(world), key=lambda r: (fill[r], work[r], r))
            owners[v] = r
            fill[r] += int(numels[v])
            work[r] += float(costs[v])
    return owners
