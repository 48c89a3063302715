"""The collectives selzero issues, behind one small class so tests can record or fake them.

selzero never communicates on the host's process group: ``Communicator.create`` makes a group
of its own with ``dist.new_group(ranks, use_local_synchronization=True)``, so expert groups
that exist on only some ranks can be created independently, and the host's collectives can
never interleave with selzero's.
"""

from __future__ import annotations

import datetime
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .errors import UsageError

__all__ = ["Communicator", "Work", "group_ranks"]


class Work(Protocol):
    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


# torch 2.13 names these *_single (the *_tensor names warn as deprecated); older torch has only
# the *_tensor names, with the same signature.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` (None: the default group), sorted."""
    if group is None:
        return list(range(dist.get_world_size()))
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        ranks: list[int] = []
    else:
        ranks = sorted(dist.get_process_group_ranks(group))
    if dist.get_rank() not in ranks:
        raise UsageError(f"global rank {dist.get_rank()} is not a member of the process group passed "
                         f"as group= (its ranks: {ranks}); build SelectedZero2 only on the ranks of "
                         "that group (each expert group on its own ranks).")
    return ranks


class Communicator:
    """Collectives over one process group; ``trace`` (a list) records every call when set."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 global_ranks: list[int], device: torch.device = torch.device("cpu")) -> None:
        self.group = group
        self.device = device  # where control tensors live (the parameters' device)
        self.rank = rank
        self.size = size
        self.global_ranks = global_ranks
        self.trace: list[tuple[str, int, str]] | None = None

    @classmethod
    def create(cls, ranks: list[int], *, timeout_s: float, device: torch.device) -> "Communicator":
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s),
                               use_local_synchronization=True)
        return cls(group, dist.get_rank(group), len(ranks), list(ranks), device)

    @classmethod
    def single(cls, device: torch.device) -> "Communicator":
        """A group of one process, for use without torch.distributed (every collective is local)."""
        return cls(None, 0, 1, [0], device)

    def _record(self, op: str, t: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((op, t.numel(), str(t.dtype)))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *,
                       async_op: bool = False) -> Work:
        """SUM-reduce ``input`` (N rank-major rows) and hand row ``rank`` to ``output``."""
        self._record("reduce_scatter", input)
        if self.size == 1:
            output.copy_(input)
            return _Done()
        return _REDUCE_SCATTER(output, input, op=dist.ReduceOp.SUM, group=self.group,
                               async_op=async_op) or _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *,
                   async_op: bool = False) -> Work:
        self._record("all_gather", output)
        if self.size == 1:
            output.copy_(input)
            return _Done()
        return _ALL_GATHER(output, input, group=self.group, async_op=async_op) or _Done()

    def all_reduce(self, tensor: torch.Tensor, *, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        self._record("all_reduce", tensor)
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0) -> None:
        """Broadcast from group rank ``src``."""
        self._record("broadcast", tensor)
        if self.size > 1:
            dist.broadcast(tensor, group=self.group, group_src=src)

    # ---- byte messages (no pickle): a fixed-size length, then the payload -------------------

    def broadcast_bytes(self, data: bytes | None, *, src: int = 0) -> bytes:
        length = torch.tensor([len(data) if self.rank == src and data is not None else 0],
                              dtype=torch.int64, device=self.device)
        self.broadcast(length, src=src)
        buf = torch.zeros(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == src and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src=src)
        return bytes(buf.cpu().tolist())

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        lengths = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        self.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=self.device))
        longest = int(lengths.max().item())
        mine = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        if data:
            mine[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        out = torch.zeros(longest * self.size, dtype=torch.uint8, device=self.device)
        self.all_gather(out, mine)
        rows = out.view(self.size, longest).cpu()
        return [bytes(rows[r, :int(lengths[r])].tolist()) for r in range(self.size)]
