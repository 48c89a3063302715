"""Expert-parallel process groups.

[Note: expert-parallel layout]
DeepSpeed's layout (deepspeed/utils/groups.py), which Megatron's default order matches for
pure data x expert parallelism: expert-parallel groups are blocks of ``E`` consecutive ranks
({0..E-1}, {E..2E-1}, ...), so rank r holds the experts of *position* r % E, and the ranks that
hold the same experts form the expert-data-parallel group {r % E, r % E + E, r % E + 2E, ...}.
selzero shards each position's experts over that group; the mean over the data-parallel world
divides by the world size, since expert gradients arrive summed over the expert-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .errors import ConfigError

__all__ = ["ExpertGroups", "expert_data_parallel_groups"]


@dataclass(frozen=True)
class ExpertGroups:
    position: int
    """This rank's expert-parallel position (which experts it holds): rank % E."""
    group: Any
    """This rank's expert-data-parallel process group."""
    all_ranks: list[list[int]]
    """Global ranks of every position's expert-data-parallel group, by position."""


def expert_data_parallel_groups(expert_parallel_size: int) -> ExpertGroups:
    """Create every expert-data-parallel group (a collective of the world: every rank calls it,
    in the same order) and return this rank's (see [Note: expert-parallel layout])."""
    ep = expert_parallel_size
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world % ep:
        raise ConfigError(f"expert_parallel_size={ep!r}: expected a positive divisor of the "
                          f"world size {world}.")
    all_ranks = [list(range(k, world, ep)) for k in range(ep)]
    groups = [dist.new_group(ranks) for ranks in all_ranks]
    return ExpertGroups(position=rank % ep, group=groups[rank % ep], all_ranks=all_ranks)
