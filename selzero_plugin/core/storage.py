"""This rank's share of the subset: gradient shard, FP32 masters, segment parameters.

[Note: shard storage]
For each slot (a virtual parameter with a non-empty chunk on this rank, in bucket order; see
[Note: layout]) the storage holds

- its real chunk of the reduced gradient, packed without padding in ``grad_shard`` (FP32, 1D);
- a *segment parameter*: the FP32 tensor the optimizer updates. For an fp32 parameter it is a
  view of the parameter's own storage (the update writes the parameter directly); for a bf16 or
  fp16 parameter it is a view of ``master_flat``, the FP32 masters (1D).

Under whole-tensor ownership a slot is a whole (virtual) parameter and its segment and
gradient view have the virtual parameter's own shape (an expert's ``(out, in)`` matrix), so a
matrix-wise optimizer sees the matrix; the gradient shard and the masters stay flat.

All of it lives on the selected parameters' device. ``grad_shard`` accumulates the reduced rows
of successive micro-steps; ``stale`` marks that it still holds a finished window's values, so the
first reduced row of the next window overwrites instead of adding.

[Note: cached views]
A step makes thousands of small copies between rows of bucket buffers, parameters and
segments; on a model of many small experts building their views (a slice costs ~4 us in
Python) took as long as the copies. The CPU buffer pool reuses the same blocks every step
([Note: buffer pool]), so the views into those blocks are built once and kept, per bucket and
block; views into parameters are kept with the data pointers of the parameters and segments
they were built from and rebuilt when any of them changed. Buffers that are not reused (a GPU's,
a third block) get fresh views each time; views of the segments are dropped when ``rebind``
moves one. The copies themselves then run as one ``torch._foreach_copy_`` per bucket, a fused
tensor's chunks merged into one strided copy (``rowcopy.coalesce_copies``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from .layout import Layout, ShardSlot
from .report import MemoryReport
from .rowcopy import coalesce_copies, entry_buffer_views, entry_flat_views
from .selection import SelectedEntry

__all__ = ["ShardStorage", "holds_nonfinite", "may_hold_nonfinite"]

_FP32 = torch.float32


def holds_nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``flat``'s device: does it hold an inf or NaN? Its min and max are both
    finite exactly when every value is (both propagate NaN, and neither can overflow like a
    sum). One pass: 3 ms on 8.4M floats on one CPU thread, where the infinity norm took 32 ms."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=flat.device)
    low, high = torch.aminmax(flat)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def may_hold_nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """0-dim bool on ``flat``'s device: False proves every value finite; True may also mean
    finite values whose sum overflows ([Note: non-finite check] in window.py). Its sum: an inf
    or NaN makes every partial sum it enters inf or NaN, and nothing makes those finite again."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=flat.device)
    return ~torch.isfinite(flat.sum())


class ShardStorage:
    def __init__(self, layout: Layout, trainable: list[SelectedEntry], rank: int,
                 device: torch.device) -> None:
        self.layout = layout
        self.trainable = trainable
        self.rank = rank
        self.slots: tuple[ShardSlot, ...] = layout.shard_slots(rank)
        # a segment's shape: its chunk (1-D), or under whole-tensor ownership the virtual shape
        self.shapes: list[tuple[int, ...]] = [self._shape(s) for s in self.slots]
        self.grad_shard = torch.zeros(sum(s.numel for s in self.slots), dtype=_FP32,
                                      device=device)  # 1D, real chunks only
        self.master_offset: list[int | None] = []
        masters = 0
        for s in self.slots:
            if self.entry_of(s).param.dtype != _FP32:
                self.master_offset.append(masters)
                masters += s.numel
            else:
                self.master_offset.append(None)
        self.master_flat = torch.zeros(masters, dtype=_FP32, device=device)  # 1D
        self.segments = [nn.Parameter(self._segment_data(i)) for i in range(len(self.slots))]
        self.load_masters()
        self.slots_of_bucket: list[list[int]] = [[] for _ in layout.buckets]
        for i, s in enumerate(self.slots):
            self.slots_of_bucket[s.bucket].append(i)
        self.runs = [_runs([self.slots[i] for i in ids]) for ids in self.slots_of_bucket]
        self._bucket_segments = [[self.segments[i] for i in ids] for ids in self.slots_of_bucket]
        self._slots_of_entry: dict[int, list[int]] = {}
        for i, s in enumerate(self.slots):
            self._slots_of_entry.setdefault(layout.virtuals[s.virtual].entry, []).append(i)
        self.grad_views = [self.grad_view(i) for i in range(len(self.slots))]
        self._views: dict[tuple[Any, ...], Any] = {}  # [Note: cached views]
        self.generation = 0  # counts rebinds that moved a segment (views of it are stale)
        self.written: set[int] = set()  # buckets accumulated since the window began
        self.stale = True

    # ---- slots and segments ----------------------------------------------------------------

    def entry_of(self, slot: ShardSlot) -> SelectedEntry:
        return self.trainable[self.layout.virtuals[slot.virtual].entry]

    def _shape(self, slot: ShardSlot) -> tuple[int, ...]:
        virtual = self.layout.virtuals[slot.virtual]
        if virtual.owner is None:
            return (slot.numel,)
        return self.entry_of(slot).virtual_shape

    def param_chunk(self, i: int) -> torch.Tensor:
        """This rank's real chunk of slot i, as a view of the parameter's storage (1-D, or the
        virtual parameter's shape under whole-tensor ownership)."""
        s = self.slots[i]
        start = self.layout.virtuals[s.virtual].chunk_start(self.rank)
        return self.entry_of(s).param.data.view(-1)[start:start + s.numel].view(self.shapes[i])

    def _segment_data(self, i: int) -> torch.Tensor:
        offset = self.master_offset[i]
        if offset is None:
            return self.param_chunk(i)
        return self.master_flat[offset:offset + self.slots[i].numel].view(self.shapes[i])

    def grad_view(self, i: int) -> torch.Tensor:
        s = self.slots[i]
        return self.grad_shard[s.shard_offset:s.shard_offset + s.numel].view(self.shapes[i])

    def load_masters(self, values: dict[str, torch.Tensor] | None = None) -> None:
        """Re-read the FP32 masters from the (bf16/fp16) parameters, or from full FP32
        ``values`` by canonical name."""
        with torch.no_grad():
            for i, seg in enumerate(self.segments):
                if self.master_offset[i] is None:
                    continue
                if values is None:
                    seg.data.copy_(self.param_chunk(i))
                    continue
                s = self.slots[i]
                start = self.layout.virtuals[s.virtual].chunk_start(self.rank)
                seg.data.view(-1).copy_(
                    values[self.entry_of(s).name].reshape(-1)[start:start + s.numel])

    def rebind(self) -> None:
        """Point fp32 segments at the parameters' storage again (the host may have replaced it).
        Views kept of the old storage are dropped (``generation`` tells the flat step's)."""
        for i, seg in enumerate(self.segments):
            if self.master_offset[i] is None:
                view = self.param_chunk(i)
                if view.data_ptr() != seg.data.data_ptr():
                    seg.data = view
                    self._views.clear()
                    self.generation += 1

    # ---- reduced rows in, updated rows out -------------------------------------------------

    def own_row(self, bucket: int) -> torch.Tensor | None:
        """[Note: own row in the shard] (collectives.py): ``bucket``'s range of the gradient
        shard, where this rank's row of the bucket is exactly that range (every chunk of the
        row full, no padding; chunked layout) and the window has not accumulated the bucket
        yet; else None."""
        if not self.stale and bucket in self.written:
            return None
        runs = self.runs[bucket]
        if self.layout.owned or len(runs) != 1 or runs[0][0] != 0 or \
                runs[0][2] != self.layout.buckets[bucket].row_numel:
            return None
        start = runs[0][1]
        return self.grad_shard[start:start + runs[0][2]]

    def accumulate(self, bucket: int, row: torch.Tensor) -> None:
        """Add this rank's reduced row of ``bucket`` into the gradient shard (a row that is
        the shard's own range, ``own_row``, was reduced in place: nothing to copy)."""
        if self.stale:  # a new window: each bucket's first row is copied, not added to zeros
            self.written.clear()
            self.stale = False
        first = bucket not in self.written
        self.written.add(bucket)
        if self.grad_shard.numel() and \
                row.untyped_storage().data_ptr() == self.grad_shard.untyped_storage().data_ptr():
            assert first, "a row reduced in the shard is the window's first of its bucket"
            return
        for row_offset, shard_offset, numel in self.runs[bucket]:
            target = self.grad_shard[shard_offset:shard_offset + numel]
            if first:
                target.copy_(row[row_offset:row_offset + numel])
            else:
                target.add_(row[row_offset:row_offset + numel])

    def pack_row(self, bucket: int, row: torch.Tensor, *, persistent: bool = False) -> None:
        """Write this rank's updated chunks of ``bucket``, cast to the parameter dtype, into
        ``row`` (its padding is left as is: it is never read back). ``persistent``: ``row``
        lies in a buffer reused every step, whose views may be kept ([Note: cached views])."""
        ids = self.slots_of_bucket[bucket]
        if not ids:
            return
        key = ("pack", bucket, row.data_ptr(), row.dtype)
        dsts = self._views.get(key)
        if dsts is None:  # in the segments' shapes (whole-tensor ownership: the tensor's);
            # a fused tensor's chunks as one strided copy (rowcopy.coalesce_copies)
            dsts = coalesce_copies(
                [row[self.slots[i].row_offset:self.slots[i].row_offset + self.slots[i].numel]
                 .view(self.shapes[i]) for i in ids],
                [s.detach() for s in self._bucket_segments[bucket]])
            if persistent:
                self._views[key] = dsts
        with torch.no_grad():
            torch._foreach_copy_(dsts[0], dsts[1])

    def unpack_rows(self, bucket: int, rows: torch.Tensor, *, persistent: bool = False) -> None:
        """Rebuild the full parameters of ``bucket`` from its gathered buffer (1-D, the rows
        one after another).
        This rank's own row is not copied back into an fp32 parameter whose segments are
        views of it: the update already wrote those elements there."""
        entries = self.layout.buckets[bucket].entries
        params = [self.trainable[t].param for t in entries]
        bound = (tuple(p.data_ptr() for p in params),
                 tuple(seg.data_ptr() for seg in self._bucket_segments[bucket]))
        key = ("unpack", bucket, rows.data_ptr(), rows.dtype)
        cached = self._views.get(key)
        if cached is None or cached[0] != bound:
            cached = (bound, *self._unpack_views(bucket, rows))
            if persistent:
                self._views[key] = cached
        if cached[1]:
            with torch.no_grad():
                torch._foreach_copy_(cached[1], cached[2])

    def _unpack_views(self, bucket: int, rows: torch.Tensor
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for t in self.layout.buckets[bucket].entries:
            skip = self.rank if self._written_in_place(t) else None
            srcs += entry_buffer_views(self.layout, rows, t, skip=skip)
            dsts += entry_flat_views(self.layout, self.trainable[t].param.data, t, skip=skip)
        return dsts, srcs

    def _written_in_place(self, t: int) -> bool:
        """Are entry t's chunks on this rank all segments that view the parameter itself?"""
        return all(self.master_offset[i] is None and
                   self.segments[i].data_ptr() == self.param_chunk(i).data_ptr()
                   for i in self._slots_of_entry.get(t, []))

    # ---- checks and accounting -------------------------------------------------------------

    def nonfinite(self) -> torch.Tensor:
        """0-dim bool on the device: does the reduced shard hold an inf or NaN?"""
        return holds_nonfinite(self.grad_shard)

    def maybe_nonfinite(self) -> torch.Tensor:
        """0-dim bool on the device: False proves the reduced shard finite (``nonfinite``
        decides a True)."""
        return may_hold_nonfinite(self.grad_shard)

    def nonfinite_virtuals(self) -> list[int]:
        """Virtual indices whose reduced chunk holds an inf or NaN (error path: reads)."""
        return [s.virtual for i, s in enumerate(self.slots)
                if not bool(torch.isfinite(self.grad_view(i)).all())]

    def memory_report(self, optimizer: torch.optim.Optimizer,
                      flat: Iterable[torch.Tensor] = ()) -> MemoryReport:
        """Per-rank bytes of gradient shard, optimizer state and masters, from live storages.
        ``flat``: state buffers of the flat step ([Note: flat step]), each a group's real
        lengths packed; state viewing one counts it whole, once."""
        grad = _storage_bytes([self.grad_shard])
        master = _storage_bytes([self.master_flat])
        state = _storage_bytes([v for st in optimizer.state.values() for v in st.values()
                                if isinstance(v, torch.Tensor)])
        ideal = 0
        in_flat = {b.untyped_storage().data_ptr(): b for b in flat}
        counted: set[int] = set()
        for i, (s, seg) in enumerate(zip(self.slots, self.segments)):
            ideal += s.numel * 4 * (1 + (self.master_offset[i] is not None))
            for v in optimizer.state.get(seg, {}).values():
                if not isinstance(v, torch.Tensor):
                    continue
                ptr = v.untyped_storage().data_ptr()
                if ptr in in_flat:
                    if ptr not in counted:
                        counted.add(ptr)
                        ideal += in_flat[ptr].numel() * in_flat[ptr].element_size()
                    continue
                ideal += (s.numel if v.numel() == seg.numel() else v.numel()) * v.element_size()
        return MemoryReport(grad, state, master, grad + state + master, ideal)


def _runs(slots: list[ShardSlot]) -> list[tuple[int, int, int]]:
    """Merge a bucket's slots into contiguous (row_offset, shard_offset, numel) runs."""
    runs: list[list[int]] = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][2] == s.row_offset and \
                runs[-1][1] + runs[-1][2] == s.shard_offset:
            runs[-1][2] += s.numel
        else:
            runs.append([s.row_offset, s.shard_offset, s.numel])
    return [(r[0], r[1], r[2]) for r in runs]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
