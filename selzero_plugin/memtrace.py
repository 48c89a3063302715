"""Allocation-level memory measurement: what the allocator handed out, not what selzero counts.

[Note: measuring memory]
``memory_report()`` sums selzero's own storages, which cannot see a buffer selzero forgot about,
a copy a collective makes, or a tensor autograd keeps. ``track_allocations()`` records every
allocation and free the c10 allocator reports to the torch profiler on the calling thread (CPU
and CUDA), in order, and gives the running balance relative to the start: its maximum
(``peak``), its final value (``net``), and the sizes of the blocks still alive at the end.
Allocations and frees made on other threads (gloo's worker threads) are not seen; selzero's own
buffers are all allocated on the training thread. A block whose last reference a worker thread
drops (a collective's work object still holds it) is freed unseen and counts as alive here, so
the buffers that can be large, the bucket buffers and the reduction point's agreement vector, are
freed on the training thread after their wait (``resize_(0)``, [Note: buffer pool]); a few
scalars and short vectors (tens of bytes, e.g. the normalization count) may still count.

Use it around a backward pass: ``peak`` is then the transient memory of that backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["AllocationTrace", "track_allocations"]


@dataclass
class AllocationTrace:
    """Allocator events between entering and leaving ``track_allocations()``."""

    events: list[tuple[int, int, int]] = field(default_factory=list)
    """(time ns, bytes (negative for a free), address), in time order."""

    @property
    def peak(self) -> int:
        """Largest balance of allocated minus freed bytes at any moment (bytes)."""
        balance = best = 0
        for _, size, _ in self.events:
            balance += size
            best = max(best, balance)
        return best

    @property
    def net(self) -> int:
        """Allocated minus freed bytes at the end (bytes)."""
        return sum(size for _, size, _ in self.events)

    def alive_blocks(self) -> list[int]:
        """Sizes of the blocks allocated inside the trace and not freed by its end."""
        alive: dict[int, int] = {}
        for _, size, address in self.events:
            if size > 0:
                alive[address] = size
            else:
                alive.pop(address, None)
        return sorted(alive.values(), reverse=True)


@contextlib.contextmanager
def track_allocations() -> Iterator[AllocationTrace]:
    """Record allocator events of the calling thread; see [Note: measuring memory]."""
    trace = AllocationTrace()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        yield trace
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        extra = event.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation":
            events.append((event.start_time_ns, int(extra.alloc_size), int(extra.ptr)))
    trace.events = sorted(events)
