"""Bucket collectives: fill, launch and finish reduce-scatters with bounded memory; the
all-gather after the update; the coalesced broadcast at construction.

[Note: bounded buckets]
A bucket's full-size FP32 buffer (N rank-major rows, see [Note: layout]) is allocated when its
first gradient arrives, launched at its launch point, and freed as soon as its reduction is
finished (its row added into the gradient shard; [Note: buffer pool]). It is not zeroed when
taken: each entry's real positions are written by its first gradient, or zeroed at launch when
none came; padding positions hold whatever the block held and are never read. At most
``max_alive`` (two) buffers exist at any moment: before a new one is allocated, the oldest
launched reduction is finished first.
Finishing waits: on NCCL the current stream waits for the collective (the host runs on, and the
caching allocator reuses the buffer in stream order); on gloo the host blocks, as long as the
communicator's timeout allows: a slower peer (a rank with hot experts) is no reason to hold
more memory. Every rank launches a bucket at the same point of its backward (a unit's
post-backward, or the end-of-backward callback, which runs before the host's own end-of-backward
wait), and only waits for buckets it launched earlier, so a wait never needs a collective
another rank issues later. The bound can be exceeded only by a unit that holds more than two
buckets (its buckets all wait for its post-backward) and by buckets launched at the end of
backward.

[Note: scratch launches]
Two kinds of reductions carry no gradient of this rank, and run over views of one shared zero
buffer instead of bucket buffers: buckets launched *early*, at the start of a backward, because
their launch units did not run in its forward on this rank ([Note: launch order] in window.py;
on gloo, where a wait blocks the host: on NCCL they launch like any bucket, zero-filled), and the
rest of a dead micro-step's buckets ([Note: a backward that raised]). The buffer is an idle
pooled block when there is one, else one more bucket of memory, and the bound does not block on
them: a rank that skipped a layer its peer ran (an error the reduction point reports) would
otherwise wait for a bucket the peer launches at that layer's post-backward, while the peer may
be blocked on the host's collective further down this rank's backward. When the pooled block is
needed for a real bucket, the rank waits up to ``PATIENCE_S`` for the early launches (every rank
launches them at the start of its backward when the layer was skipped everywhere), then takes
a block of its own. Their results: zeros where every rank
contributed zeros (every rank skipped the layer; written into the shard, so it holds no stale
values), and values that are never used otherwise (the window is dropped on every rank). Several
in-place reductions of one buffer at a time race only on those values.
"""

from __future__ import annotations

import logging
from collections import deque
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

from .comm import Communicator, RowWork
from .layout import Layout
from .rowcopy import (add_or_copy, entry_buffer_views, entry_flat_views, entry_own_flat_view,
                      entry_own_row_view)
from .storage import ShardStorage

__all__ = ["BucketCollectives", "BufferPool", "PATIENCE_S"]

_FP32 = torch.float32
PATIENCE_S = 2.0  # how long a gloo rank waits for early launches before taking another block
logger = logging.getLogger("selzero_plugin")


def _one_view_shape(layout: Layout, t: int) -> tuple[int, ...] | None:
    """The shape of entry t's single flat view (``rowcopy.flat_views``) when it has one: every
    chunk of each of its virtual parameters full (no remainder row), chunked layout."""
    if layout.owned:
        return None
    ids = layout.entry_virtuals[t]
    first = layout.virtuals[ids[0]]
    full, rem = divmod(first.numel, first.chunk_numel)
    if rem or not full:
        return None
    return (full, first.chunk_numel) if len(ids) == 1 else (len(ids), full, first.chunk_numel)


# [Note: own row in the shard]
# A bucket's reduced row used to be copied into the gradient shard when its reduction finished
# (``ShardStorage.accumulate``): one more pass over the shard, 4.5 ms of a 195 ms step on
# workload f at world 2 (in-process A/B). Where the row's reduction can hold the own row apart
# from the buffer (one rank, and gloo's point-to-point reduce-scatter, whose driver reads only
# the peers' rows and adds into the own row: ``Communicator.own_row_apart``), the own row of a
# bucket's *first* reduction in a window is the shard's range itself (``ShardStorage.own_row``:
# when every chunk of the row is full, so the row and the range are the same elements): the
# hooks copy each gradient's own chunks there and the peers' chunks into the buffer, the driver
# adds the peers' pieces in place, and nothing is copied at the end. Later reductions of the
# window (accumulation over micro-steps, late gradients) use the buffer's row and are added as
# before. The sums are the same, in the same order: bitwise the same shard. Only for buckets
# whose entries average ``OWN_MIN_NUMEL`` elements or more: a gradient's copy is then two
# (its own chunks, the rest), which on thousands of small experts costs more per step in
# calls than the pass it saves. And only where buckets launch during the backward (``own_rows``:
# ``SelZeroConfig.launches_in_backward``), so that the shard holds nothing of this window's
# before the backward returns: under ``overlap=False`` or ``reduction="sum"`` the hooks fill
# the buckets during the backward and reduce them at the reduction point, and a write into
# ``sz.grad_shard`` in between would land in the own chunks (review finding); there the first
# reduction's row overwrites the shard, as before.
OWN_MIN_NUMEL = 65536


def _large_entries(layout: Layout, b: int) -> bool:
    entries = layout.buckets[b].entries
    numel = sum(layout.virtuals[v].numel for v in layout.buckets[b].virtuals)
    return bool(entries) and numel >= OWN_MIN_NUMEL * len(entries)


class BufferPool:
    """Full-size bucket buffers (bytes), handed out and taken back.

    [Note: buffer pool]
    On the CPU, two blocks of the largest bucket's FP32 size are allocated once and reused for
    every reduce-scatter and all-gather buffer: glibc serves large blocks that are freed and
    allocated again every step from a heap that fragments (measured: peak RSS as high as DDP's,
    not 100 MB below it, until the blocks were reused). A third block, when one is needed (a
    unit that holds more buckets), is allocated and freed. On a GPU the caching allocator
    already reuses freed blocks, in stream order, so nothing is kept: a buffer is freed as soon
    as its collective is finished (``resize_(0)`` of its storage, on this thread: the process
    group's work object, which still references the tensor, may be destroyed later on a worker
    thread; FSDP2 frees its buffers the same way). Both are safe after ``wait()``: on NCCL the
    current stream already waits for the collective.
    """

    def __init__(self, block_bytes: int, device: torch.device, *, keep: int) -> None:
        self.block_bytes = block_bytes
        self.device = device
        self.keep = keep if device.type == "cpu" else 0
        self.free = [self._new(block_bytes) for _ in range(self.keep)]
        self.kept = {b.data_ptr() for b in self.free}
        self.extra_bytes = 0  # other memory kept beside the blocks (the p2p receive temporary)

    @property
    def kept_bytes(self) -> int:
        """Bytes this pool keeps for the whole run: its blocks and ``extra_bytes``."""
        return len(self.kept) * self.block_bytes + self.extra_bytes

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        block = self.free.pop() if self.free and nbytes <= self.block_bytes else self._new(nbytes)
        return block[:nbytes].view(dtype)

    def persistent(self, buffer: torch.Tensor) -> bool:
        """Does ``buffer`` lie in a block that is kept and handed out again?"""
        return buffer.untyped_storage().data_ptr() in self.kept

    def give(self, buffer: torch.Tensor) -> None:
        storage = buffer.untyped_storage()
        if storage.data_ptr() in self.kept:
            self.free.append(torch.empty(0, dtype=torch.uint8, device=self.device).set_(
                storage, 0, (storage.nbytes(),)))
        else:
            storage.resize_(0)


@dataclass(eq=False)  # compared by identity (pending.remove)
class _Launched:
    """A launched reduction of one bucket, until finished."""

    bucket: int
    work: RowWork
    buffer: torch.Tensor  # 1D, N rows
    scratch: bool = False  # a view of a shared zero buffer ([Note: scratch launches])
    discarded: bool = False  # a dead micro-step's: its result is never used (launch_rest_now)
    in_shard: bool = False  # its own row is the shard's range ([Note: own row in the shard])


class BucketCollectives:
    def __init__(self, comm: Communicator, layout: Layout, storage: ShardStorage, *,
                 max_alive: int = 2, own_rows: bool = False) -> None:
        self.comm = comm
        self.layout = layout
        self.storage = storage
        self.max_alive = max_alive
        self.buffers: list[torch.Tensor | None] = [None] * len(layout.buckets)  # 1D, N rows
        self.largest = max((spec.buffer_numel(comm.size) for spec in layout.buckets), default=0)
        self.pool = BufferPool(self.largest * 4, comm.device,
                               keep=min(max_alive, len(layout.buckets)))  # no idle block
        # gloo: the point-to-point reductions' receive temporary ([Note: p2p reduce-scatter])
        self.pool.extra_bytes = comm.reserve_reduce_scratch(self.largest)
        self.filled: list[set[int]] = [set() for _ in layout.buckets]
        self.fill_views: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
        # [Note: own row in the shard]: per bucket, the shard range that is this micro-step's
        # own row of its buffer, or None
        self.own: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self.own_ok = [own_rows and comm.own_row_apart and _large_entries(layout, b)
                       for b in range(len(layout.buckets))]  # (owned layouts: own_row says)
        self.entry_bucket = layout.entry_bucket
        # per entry: the shape that views its flat gradient as its one block of the bucket's
        # rows (every chunk full: the common case), or None (several views, rowcopy.py)
        self.fill_shape = [_one_view_shape(layout, t) for t in range(len(layout.entry_bucket))]
        self.pending: deque[_Launched] = deque()  # launched reductions, oldest first
        self.early_scratch: torch.Tensor | None = None  # zeros, for buckets launched early
        # launch order: bucket order (reverse model order) until the window adopts the order in
        # which the launch units pass; buckets order[:next_launch] were launched this micro-step
        self.order = list(range(len(layout.buckets)))
        self.position = list(range(len(layout.buckets)))
        self.next_launch = 0
        n = len(layout.buckets)  # labels of CollectiveError messages, made once
        self.labels = {kind: [f"{kind} bucket {b} of {n}" for b in range(n)]
                       for kind in ("gradient", "parameter")}

    # ---- reduce-scatter --------------------------------------------------------------------

    def launched(self, bucket: int) -> bool:
        return self.position[bucket] < self.next_launch

    def all_launched(self) -> bool:
        return self.next_launch == len(self.order)

    def next_bucket(self) -> int:
        return self.order[self.next_launch]

    def set_order(self, order: list[int]) -> None:
        """Launch buckets in ``order`` from the next micro-step on (the same on every rank)."""
        assert sorted(order) == list(range(len(self.order))) and self.next_launch == 0
        self.order = list(order)
        self.position = [0] * len(order)
        for i, b in enumerate(order):
            self.position[b] = i

    def fill(self, t: int, flat: torch.Tensor) -> None:
        """Add trainable entry t's flat gradient into its bucket's buffer (allocated on need).
        Once per gradient (the backward's hot path): one view and one copy in the common case."""
        b = self.entry_bucket[t]
        assert self.position[b] >= self.next_launch, "a launched bucket takes no more gradients"
        buffer = self.buffers[b]
        if buffer is None:
            buffer = self._buffer(b)
        own = self.own[b]
        views = self.fill_views.get((buffer.data_ptr(), t, own is not None)) or \
            self._row_views(buffer, t, own)
        filled = self.filled[b]
        shape = self.fill_shape[t]
        if own is not None:
            rank = self.comm.rank
            add_or_copy(views, entry_flat_views(self.layout, flat, t, skip=rank) +
                        [entry_own_flat_view(self.layout, flat, t, rank)], t in filled)
        elif shape is None:
            add_or_copy(views, entry_flat_views(self.layout, flat, t), t in filled)
        elif t in filled:
            views[0].add_(flat.view(shape))
        else:
            views[0].copy_(flat.view(shape))
        filled.add(t)

    def _row_views(self, buffer: torch.Tensor, t: int, own: torch.Tensor | None
                   ) -> list[torch.Tensor]:
        """Entry t's views in its bucket's ``buffer`` (and, with ``own``, its own row's views
        in the shard instead of the buffer's), kept for reused blocks ([Note: cached views] in
        storage.py; the shard is never reallocated)."""
        key = (buffer.data_ptr(), t, own is not None)
        views = self.fill_views.get(key)
        if views is None:
            if own is None:
                views = entry_buffer_views(self.layout, buffer, t)
            else:
                rank = self.comm.rank
                views = entry_buffer_views(self.layout, buffer, t, skip=rank) + \
                    [entry_own_row_view(self.layout, own, t)]
            if self.pool.persistent(buffer):
                self.fill_views[key] = views
        return views

    def _buffer(self, b: int) -> torch.Tensor:
        buffer = self.buffers[b]
        if buffer is None:
            while self.alive() >= self.max_alive and self._finish_oldest(own_buffers=True):
                pass
            if not self.pool.free and self.early_scratch is not None and \
                    self.pool.persistent(self.early_scratch):
                self._await_early_scratch()  # it holds the pooled block this bucket would take
            # not zeroed: every real position is written by a gradient or zeroed at launch;
            # padding is never read
            buffer = self.pool.take(self.layout.buckets[b].buffer_numel(self.comm.size), _FP32)
            self.buffers[b] = buffer
            self.own[b] = self.storage.own_row(b) if self.own_ok[b] else None
        return buffer

    def alive(self) -> int:
        return sum(b is not None for b in self.buffers) + \
            sum(not p.scratch for p in self.pending)

    def launch_next(self, zero_if: torch.Tensor | None = None, *, early: bool = False) -> None:
        """Reduce-scatter the next bucket; zeros where no gradient arrived, and zeros
        throughout when the 0-dim bool ``zero_if`` is true (an inactive rank under ``sum``).
        ``early``: launched because its units did not run here ([Note: scratch launches])."""
        b = self.next_bucket()
        if early and self.comm.emulate and self.buffers[b] is None and zero_if is None:
            if self.early_scratch is None:  # an idle pooled block if there is one
                self.early_scratch = self._zeros()
            self._launch_scratch(b, self.early_scratch, discarded=False)
        else:
            self._launch(b, zero_if)
        self.next_launch += 1

    def reduce_late(self, b: int, grads: dict[int, torch.Tensor]) -> None:
        """One more reduction of bucket ``b`` after the micro-step's own, added into the shard:
        ``grads`` are this rank's late gradients of its entries (flat FP32), zeros for the
        others. Every rank calls it for the same buckets in the same order ([Note: late
        gradients] in window.py)."""
        assert not self.pending and self.next_launch == 0
        for t, grad in grads.items():
            self.fill(t, grad)
        self._launch(b, None)
        self.finish_all()

    def _launch(self, b: int, zero_if: torch.Tensor | None) -> None:
        buffer = self._buffer(b)
        own = self.own[b]
        for t in self.layout.buckets[b].entries:
            if t not in self.filled[b]:  # no gradient this micro-step: zeros
                for view in self._row_views(buffer, t, own):
                    view.zero_()
        if zero_if is not None:  # (reduction="sum": launched at the reduction point, no own row)
            buffer.masked_fill_(zero_if, 0.0)
        self.buffers[b] = None
        self.own[b] = None
        self.filled[b] = set()
        self.comm.what = self.labels["gradient"][b]
        try:
            self.pending.append(_Launched(b, self.comm.reduce_scatter_rows(
                buffer, self.layout.buckets[b].row_numels or None, own=own), buffer,
                in_shard=own is not None))
        finally:
            self.comm.what = ""

    def _launch_scratch(self, b: int, scratch: torch.Tensor, *, discarded: bool) -> None:
        """[Note: scratch launches] Bucket b's reduction over a view of a shared zero buffer."""
        spec = self.layout.buckets[b]
        buffer = scratch[:spec.buffer_numel(self.comm.size)]
        self.comm.what = self.labels["gradient"][b]
        try:
            work = self.comm.reduce_scatter_rows(buffer, spec.row_numels or None)
        finally:
            self.comm.what = ""
        self.pending.append(_Launched(b, work, buffer, scratch=True, discarded=discarded))

    def launch_rest(self) -> None:
        while not self.all_launched():
            self.launch_next()

    def launch_rest_now(self) -> None:
        """Launch the rest of this micro-step's buckets without waiting for any: a backward
        raised on this rank ([Note: a backward that raised] in window.py), and a peer still in
        its backward may be waiting for them. Their values are never used (the window is
        dropped on every rank that ran this micro-step, or the ranks' drop counts differ and
        every rank raises), so they share one scratch buffer ([Note: scratch launches]): no
        more memory than one bucket, and nothing to wait for before launching."""
        if self.all_launched():
            return
        scratch = self._zeros()
        while not self.all_launched():
            self._launch_scratch(self.next_bucket(), scratch, discarded=True)
            self.next_launch += 1

    def restart_microstep(self) -> None:
        """A further dead micro-step's reductions follow one whose were all launched (a second
        batch failed before its backward reached selzero): count them from bucket 0."""
        assert self.all_launched()
        self.next_launch = 0

    def _await_early_scratch(self) -> None:
        """Wait at most ``PATIENCE_S`` for the early launches over the pooled scratch block and
        finish them, giving the block back ([Note: scratch launches]); if a peer has not launched
        them by then, this bucket takes a block of its own."""
        early = [p for p in self.pending if p.scratch and not p.discarded]
        deadline = time.monotonic() + PATIENCE_S
        while not all(p.work.is_completed() for p in early):
            if time.monotonic() > deadline:
                logger.info("selzero: buckets launched early (their launch units did not run "
                            "on this rank) still wait for a peer after %.0f s; this bucket "
                            "takes a block of its own.", PATIENCE_S)
                return
            time.sleep(0.0002)
        for launched in early:
            self._finish(launched)

    def _zeros(self) -> torch.Tensor:
        """A zero buffer of the largest bucket for scratch launches: an idle pooled block when
        there is one (no new memory), else a fresh one."""
        block = self.pool.take(self.largest, _FP32) if self.pool.free else \
            torch.empty(self.largest, dtype=_FP32, device=self.comm.device)
        return block.zero_()

    def _finish_oldest(self, own_buffers: bool = False) -> bool:
        """Finish the oldest launched reduction (``own_buffers``: the oldest that holds a
        buffer of its own, to free memory; a scratch launch is not waited for then). Returns
        whether there was one."""
        launched = next((p for p in self.pending if not (own_buffers and p.scratch)), None)
        if launched is None:
            return False
        self._finish(launched)
        return True

    def _finish(self, launched: _Launched) -> None:
        self.pending.remove(launched)
        b, buffer = launched.bucket, launched.buffer
        row = launched.work.wait()
        if not launched.discarded:
            self.storage.accumulate(b, row)
        storage = buffer.untyped_storage()
        if not launched.scratch or not any(p.buffer.untyped_storage().data_ptr() ==
                                           storage.data_ptr() for p in self.pending):
            # a bucket's own buffer, or the last launch over a scratch buffer
            if self.early_scratch is not None and \
                    self.early_scratch.untyped_storage().data_ptr() == storage.data_ptr():
                self.early_scratch = None
            self.pool.give(buffer)
        if not launched.in_shard and row.untyped_storage().data_ptr() != storage.data_ptr():
            row.untyped_storage().resize_(0)  # NCCL's output row: its work is kept ([Note:
            # work objects at exit] in comm.py), its memory need not be

    def finish_all(self) -> None:
        while self.pending:
            self._finish_oldest()

    def end_microstep(self) -> None:
        """Every bucket was launched and finished: the next micro-step starts at bucket 0."""
        assert self.all_launched() and not self.pending
        self.next_launch = 0

    def discard(self) -> None:
        """Forget unlaunched buffers (no collective); launched ones must be finished first."""
        assert not self.pending
        for buffer in self.buffers:
            if buffer is not None:
                self.pool.give(buffer)
        self.buffers = [None] * len(self.layout.buckets)
        self.own = [None] * len(self.layout.buckets)
        self.filled = [set() for _ in self.layout.buckets]
        self.next_launch = 0

    # ---- all-gather of the updated parameters ------------------------------------------------

    def all_gather_updated(self, update: list[bool]) -> None:
        """Cast updated chunks to the parameter dtype and rebuild full parameters in place.

        Only buckets holding an updated parameter are gathered (the others are unchanged on
        every rank). Two buckets are in flight: bucket b+1's all-gather runs while bucket b is
        copied out, so at most two gathered buffers are alive.
        """
        in_flight: list[tuple[int, Any, torch.Tensor]] = []
        for b, spec in enumerate(self.layout.buckets):
            if any(update[v] for v in spec.virtuals):
                in_flight.append(self._launch_gather(b))
                if len(in_flight) == 2:
                    self._unpack(*in_flight.pop(0))
        for item in in_flight:
            self._unpack(*item)

    def _launch_gather(self, b: int) -> tuple[int, Any, torch.Tensor]:
        spec = self.layout.buckets[b]
        n, rank = self.comm.size, self.comm.rank
        dtype = self.storage.trainable[spec.entries[0]].param.dtype
        gathered = self.pool.take(spec.buffer_numel(n), dtype)
        start = spec.row_start(rank, n)
        self.storage.pack_row(b, gathered[start:start + spec.row_lengths(n)[rank]],
                              persistent=self.pool.persistent(gathered))
        self.comm.what = self.labels["parameter"][b]
        try:
            work = self.comm.all_gather_rows_(gathered, spec.row_numels or None)
        finally:
            self.comm.what = ""
        return b, work, gathered

    def _unpack(self, b: int, work: Any, gathered: torch.Tensor) -> None:
        work.wait()
        self.storage.unpack_rows(b, gathered, persistent=self.pool.persistent(gathered))
        self.pool.give(gathered)

    # ---- construction ----------------------------------------------------------------------

    def broadcast(self, tensors: list[torch.Tensor], bucket_bytes: int) -> None:
        """Broadcast ``tensors`` from group rank 0 in place, coalesced per dtype into flat
        buffers of about ``bucket_bytes``."""
        if self.comm.size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for t in group:
                chunk.append(t)
                size += t.numel() * t.element_size()
                if size >= bucket_bytes:
                    self._broadcast_flat(chunk)
                    chunk, size = [], 0
            if chunk:
                self._broadcast_flat(chunk)

    def _broadcast_flat(self, tensors: list[torch.Tensor]) -> None:
        # a buffer of its own, even for one tensor (_flatten_dense_tensors returns a view of
        # it then): freed in place after, since its work is kept ([Note: work objects at exit])
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        self.comm.broadcast(flat, src=0)
        with torch.no_grad():
            for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                t.copy_(value)
        flat.untyped_storage().resize_(0)
