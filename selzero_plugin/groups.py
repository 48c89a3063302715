"""Expert-parallel process groups.

[Note: expert-parallel layout]
DeepSpeed's layout (deepspeed/utils/groups.py), which Megatron's default order matches for
pure data x expert parallelism: expert-parallel groups are blocks of ``E`` consecutive ranks
({0..E-1}, {E..2E-1}, ...), so rank r holds the experts of *position* r % E, and the ranks that
hold the same experts form the expert-data-parallel group {r % E, r % E + E, r % E + 2E, ...}.
selzero shards each position's experts over that group; the mean over the data-parallel world
divides by the world size, since expert gradients arrive summed over the expert-parallel ranks
(``normalize_over="world"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import ConfigError, UsageError

__all__ = ["ExpertGroups", "expert_data_parallel", "expert_data_parallel_groups"]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel (EP) and expert-data-parallel (EDP) process groups."""

    expert_parallel: Any
    """The ranks that together hold every expert once: ``[k*E, ..., k*E + E - 1]``."""
    expert_data_parallel: Any
    """The ranks that hold the same experts as this one: ``[r % E, r % E + E, ...]``."""
    ep_rank: int
    """Position in the expert-parallel group (which slice of the experts): rank % E."""
    edp_rank: int
    """Position in the expert-data-parallel group: rank // E."""
    ep_size: int
    edp_size: int
    all_ranks: list[list[int]]
    """Global ranks of every expert-data-parallel group, by expert-parallel position."""

    @property
    def position(self) -> int:  # the DeepSpeed adapter's name for ep_rank
        return self.ep_rank

    @property
    def group(self) -> Any:  # the DeepSpeed adapter's name for expert_data_parallel
        return self.expert_data_parallel


def expert_data_parallel(ep_size: int) -> ExpertGroups:
    """Create every expert-parallel and expert-data-parallel group and return this rank's.

    A collective of the world: every rank calls it with the same ``ep_size`` (checked: a
    different value on some rank raises on every rank), and every rank creates every group in
    the same order, as torch requires of ``new_group`` without local synchronization.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError("expert_data_parallel(ep_size): torch.distributed is not initialized; "
                         "call dist.init_process_group(...) first.")
    world, rank = dist.get_world_size(), dist.get_rank()
    valid = not isinstance(ep_size, bool) and isinstance(ep_size, int) and ep_size >= 1
    seen = _min_max(ep_size if valid else -1)
    if seen[0] != seen[1]:
        raise ConfigError(f"expert_data_parallel(ep_size): the ranks passed different values "
                          f"(from {seen[0]} to {seen[1]}; -1: not a positive integer); pass the "
                          "same ep_size on every rank.")
    if not valid or world % ep_size:
        raise ConfigError(f"expert_data_parallel(ep_size={ep_size!r}): expected a positive "
                          f"divisor of the world size {world} (e.g. "
                          f"{[d for d in range(1, world + 1) if world % d == 0]}).")
    e = ep_size
    ep_ranks = [list(range(k * e, (k + 1) * e)) for k in range(world // e)]
    edp_ranks = [list(range(k, world, e)) for k in range(e)]
    ep_groups = [dist.new_group(r) for r in ep_ranks]
    edp_groups = [dist.new_group(r) for r in edp_ranks]
    return ExpertGroups(expert_parallel=ep_groups[rank // e],
                        expert_data_parallel=edp_groups[rank % e], ep_rank=rank % e,
                        edp_rank=rank // e, ep_size=e, edp_size=world // e, all_ranks=edp_ranks)


def expert_data_parallel_groups(expert_parallel_size: int) -> ExpertGroups:
    """The DeepSpeed adapter's entry point (``{"expert_parallel_size": E}``)."""
    return expert_data_parallel(expert_parallel_size)


def _min_max(value: int) -> tuple[int, int]:
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return -int(t[1]), int(t[0])
