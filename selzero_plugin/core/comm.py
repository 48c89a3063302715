"""selzero's communicators and the collectives it issues, behind one small class so tests can
record or fake them.

[Note: communicators]
selzero never communicates on the host's process group. It creates groups of its own with
``dist.new_group(ranks, use_local_synchronization=True)``: only the member ranks take part, so
building an instance on an expert group never involves the other ranks. torch 2.13 names such
a group by hashing its ranks *and the number of process groups the process already has*
(``_hash_ranks_to_str``), so members that created different numbers of groups before (pipeline
stages with different numbers of instances) would rendezvous under different names and wait
forever. selzero therefore names its groups itself (``_selzero_group``): after the purpose,
the ranks and how many groups of that purpose and rank set this process created before, which
is the same on every member as long as they create the same groups in the same order:

- an instance's own group (its bucket collectives and agreements) is created at construction
  by the group's ranks, which build the same instances (the contract checks it). It is the
  instance's alone: two instances on one group whose launches came in different orders on
  different ranks could otherwise pair one's reduce-scatter with the other's;
- groups beyond the instance's group (the ``normalize_over`` ranks, the world for the global
  norm of expert groups) are shared per (rank set, timeout) by every instance of the process
  (``shared_group``) and created at first use, at a reduction point every member reaches, so
  ranks that hold different numbers of instances (pipeline stages with different numbers of
  MoE layers) still create each set the same number of times.

[Note: gloo collectives]
gloo implements ``reduce_scatter_tensor`` as a full-size ``clone()`` of the input plus an
all-reduce, and ``all_gather_into_tensor`` through a full-size temporary output: both double the
transient memory of a bucket, and both measured slower here than one all-reduce of the same
buffer (16 MiB on 2 ranks: 47 ms and 41 ms against 21-23 ms). On gloo selzero therefore reduces
a CPU bucket with a reduce-scatter of its own made of point-to-point messages ([Note: p2p
reduce-scatter] in p2p.py: (N-1)/N of the buffer per rank, 0.63x the time of an all-reduce of
it), and otherwise (CUDA tensors on gloo, more than 16 ranks, ``SELZERO_GLOO_REDUCE=all_reduce``)
with one in-place SUM all-reduce of its own buffer, reading its row (measured faster
than N ``reduce`` calls, one per row, and than the list ``reduce_scatter``); it gathers with N
asynchronous in-place broadcasts, row r from rank r: each rank receives and sends (N-1)/N of the
buffer, the all-gather's bytes, and every bit (-0.0, NaN payloads) arrives unchanged (67 MB on 2
ranks: 22 ms, against 54-57 ms for the bitwise-OR all-reduce of a zeroed buffer used before and
100 ms for gloo's all-gather). Results equal gloo's own collectives up to the order of the sum
(bitwise at N = 2). On NCCL the real reduce-scatter and an in-place all-gather run (no extra
memory either). Buckets under whole-tensor ownership have uneven rows ([Note: whole-tensor
layout] in ownership.py): gloo runs them the same way (each row's pieces to its owner, or the
all-reduce of the whole buffer; one broadcast per non-empty row); NCCL runs torch's ``reduce_scatter`` and
``all_gather`` with lists of unequal tensors, which ProcessGroupNCCL implements as one reduce
(one broadcast) per owner inside a coalesced group.

[Note: failed collectives]
A rank that dies, stalls or raises before a collective leaves its peers in that collective. Every
group selzero creates carries the config's ``timeout_s``: gloo fails a collective whose peer is
gone at once ("Connection closed by peer") and one whose peer stalls after ``timeout_s``
("Timed out waiting ... for recv"). The Communicator turns either, at launch or at ``wait()``,
into a ``CollectiveError`` naming selzero's collective (operation, size, what it was for), the
group's global ranks, the time it waited and ``timeout_s``, so a log of 1,000 ranks says which
layer of which job stopped and why. On NCCL a timed-out collective is the watchdog's to report
(it aborts the process after the group's timeout, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); a
synchronous failure is wrapped the same way. The engine's state on a rank whose collective failed
is not to be stepped again: the peers are gone. Checkpoints are untouched (a save in progress is
staged; [Note: atomic save]).

[Note: work objects at exit]
A launched collective's work object is held twice: by the caller and by the process group's
worker thread (gloo's ``runLoop``, NCCL's watchdog), which drops its reference some time after
the work completed. Whoever drops the last reference destroys the work and the tensors it holds;
a tensor made in Python then decrements its Python object, which takes the GIL. On a worker
thread during interpreter shutdown that kills the thread inside a C++ destructor:
``terminate called without an active exception``, SIGABRT, a job that trained correctly and
exits -6 (measured: the core's worker thread was destroying the all-gather's
``AsyncBroadcastWork``). So every work selzero waits for is kept after its ``wait()`` in a
bounded queue of the communicator (``retired``), synchronous collectives included (they run as
asynchronous ones waited at once): the worker's release is then never the last, and the works
die on the training thread, with the communicator, whether or not the program called
``destroy_process_group()``. The works hold views of pooled blocks, small control tensors or
storages already freed (``resize_(0)``): keeping them costs little memory, but not nothing.
A worker drops its reference as soon as the work has run, so only the last few works can still
be held by one, and the queue keeps the last ``_RETAINED`` (8). It kept 512 at first, about 100
steps of workload f (``benchmarks/bench.py``, 5 works per step): their small C++ allocations,
made during the backward among the large transient blocks, pinned glibc's heap, which grew by
12-19 MB per step; with 8 it levels off by step 20 (measured with ``mallinfo2``, 60 steps).
"""

from __future__ import annotations

import atexit
import collections
import datetime
import hashlib
import os
import threading
import time
import weakref
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..errors import CollectiveError, UsageError
from . import p2p

__all__ = ["Communicator", "Work", "RowWork", "group_ranks", "shared_group"]


class Work(Protocol):
    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class RowWork(Protocol):
    def wait(self) -> torch.Tensor:
        """Block (gloo) or make the current stream wait (NCCL); return this rank's row."""

    def is_completed(self) -> bool: ...


class _Done:
    def __init__(self, value: Any = None) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value

    def is_completed(self) -> bool:
        return True


class _Rows:
    """A launched reduction whose result is one row of a buffer once ``wait()`` returned."""

    def __init__(self, work: Any, row: torch.Tensor) -> None:
        self._work, self._row = work, row

    def wait(self) -> torch.Tensor:
        self._work.wait()
        return self._row

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _All:
    """Several launched collectives, finished together."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class _Guarded:
    """A launched collective whose failure (at ``wait()``) becomes a CollectiveError."""

    def __init__(self, work: Any, comm: "Communicator", op: str, t: torch.Tensor) -> None:
        self._work, self._comm, self._op, self._t = work, comm, op, t
        self._start, self._what = time.monotonic(), comm.what

    def wait(self) -> Any:
        try:
            out = self._work.wait()
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise self._comm.failure(self._op, self._t, self._start, e, self._what) from e
        self._comm.retired.append(self._work)  # [Note: work objects at exit]
        return out

    def is_completed(self) -> bool:
        try:
            return bool(self._work.is_completed())
        except RuntimeError:
            return True  # wait() raises it


# torch 2.13 names these *_single (the *_tensor names warn as deprecated); older torch has only
# the *_tensor names, with the same signature.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_RETAINED = 8  # the last completed works a communicator keeps ([Note: work objects at exit])
EXIT_GRACE_S = 0.2  # [Note: gloo teardown] (process_exit.py): for the program's own works
_GRACE_PID: int | None = None  # the process that built a communicator over a process group


def _at_exit() -> None:
    """At interpreter exit, in a process that built a distributed communicator (not a child
    forked from it, not a process with no process group): pause without the GIL."""
    if _GRACE_PID != os.getpid() or EXIT_GRACE_S <= 0:
        return
    try:
        time.sleep(EXIT_GRACE_S)  # a gloo worker that is about to release a work does it now
    except KeyboardInterrupt:  # a second Ctrl-C at exit: leave without a traceback
        pass


# Registered at import, so it runs after every atexit hook registered later (they run last in,
# first out): a program's own hook that does a final collective is covered too.
atexit.register(_at_exit)


def grace_at_exit() -> None:
    """Arm the pause at interpreter exit of [Note: gloo teardown] for this process."""
    global _GRACE_PID
    _GRACE_PID = os.getpid()


_GROUPS: dict[tuple[int, tuple[int, ...], float], Any] = {}
_CREATED: dict[tuple[int, str, tuple[int, ...]], int] = {}
_NAMING = threading.Lock()


def _selzero_group(ranks: list[int], timeout_s: float, purpose: str) -> Any:
    """A locally synchronized group over ``ranks``, named by purpose, ranks and the count of
    such groups this process made before ([Note: communicators])."""
    world = id(dist.group.WORLD)
    for stale in [k for k in _CREATED if k[0] != world]:  # a re-initialized default group
        del _CREATED[stale]
    key = (world, purpose, tuple(sorted(ranks)))
    index = _CREATED.get(key, 0)
    _CREATED[key] = index + 1
    text = f"selzero:{purpose}:{'_'.join(map(str, key[2]))}:{index}"
    name = "selzero-" + hashlib.sha1(text.encode()).hexdigest()[:24]
    timeout = datetime.timedelta(seconds=timeout_s)
    naming = getattr(c10d, "_process_group_name", None)
    if naming is None:  # another torch: its own naming
        return dist.new_group(list(key[2]), timeout=timeout, use_local_synchronization=True)
    with _NAMING:
        c10d._process_group_name = lambda *args, **kwargs: name
        try:
            return dist.new_group(list(key[2]), timeout=timeout, use_local_synchronization=True)
        finally:
            c10d._process_group_name = naming


def shared_group(ranks: list[int], timeout_s: float) -> Any:
    """selzero's process group over ``ranks``: created once per process, then shared."""
    world = dist.group.WORLD
    key = (id(world), tuple(sorted(ranks)), float(timeout_s))
    for stale in [k for k in _GROUPS if k[0] != id(world)]:  # a re-initialized default group
        del _GROUPS[stale]
    if key not in _GROUPS:
        _GROUPS[key] = _selzero_group(list(key[1]), timeout_s, f"shared-{timeout_s}")
    return _GROUPS[key]


def group_ranks(group: Any) -> list[int]:
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


def _emulates_with_all_reduce(group: Any, device: torch.device) -> bool:
    backend = str(dist.get_backend(group))
    if "gloo" not in backend:
        return False
    return device.type == "cpu" or "nccl" not in backend


class Communicator:
    """Collectives over one process group; ``trace`` (a list) records every call when set."""

    def __init__(self, group: Any, rank: int, size: int, global_ranks: list[int],
                 device: torch.device = torch.device("cpu"), *, emulate: bool = False,
                 timeout_s: float | None = None, label: str = "selzero") -> None:
        self.group = group
        self.device = device  # where control tensors live (the selected parameters' device)
        self.rank = rank
        self.size = size
        self.global_ranks = global_ranks
        self.emulate = emulate  # gloo: see [Note: gloo collectives]
        self.trace: list[Any] | None = None
        self.timeout_s = timeout_s
        self.label = label  # what the group is for, in error messages
        self.what = ""  # set by callers around a phase (e.g. "bucket 3 reduce-scatter")
        # works already waited for, kept so that no worker thread destroys them
        self.retired: collections.deque[Any] = collections.deque(maxlen=_RETAINED)
        # [Note: p2p reduce-scatter]: the reduction's driver, its receive temporary, its tags
        self.p2p = emulate and device.type == "cpu" and 2 <= size <= p2p.MAX_P2P_WORLD and \
            p2p.chosen() == "p2p"
        self._driver: p2p.Driver | None = None
        self._p2p_temp = torch.empty(0)
        self._p2p_tag = 0
        if group is not None:  # and the program's own: [Note: gloo teardown] in process_exit.py
            grace_at_exit()

    @classmethod
    def create(cls, ranks: list[int], *, timeout_s: float, device: torch.device,
               shared: bool = False, purpose: str = "instance") -> "Communicator":
        """A communicator of its own over ``ranks`` (an instance's bucket collectives), or with
        ``shared`` the process-wide one for that rank set ([Note: communicators])."""
        start = time.monotonic()
        if shared:
            purpose = "shared"
        try:
            group = shared_group(ranks, timeout_s) if shared else \
                _selzero_group(ranks, timeout_s, purpose)
        except RuntimeError as e:
            raise CollectiveError(
                f"[global rank {dist.get_rank()}] creating selzero's {purpose} communicator over "
                f"global ranks {sorted(ranks)} failed after {time.monotonic() - start:.1f} s "
                f"(timeout_s={timeout_s:g}): {_first_line(e)}. Every rank of the group must build "
                "the same selzero instances in the same order; one that died, stalled or raised "
                "before building this one leaves the others here"
                + (" (a communicator shared by several groups, over their normalize_over ranks "
                   "or the world, is named by its timeout_s: give those groups' instances the "
                   "same timeout_s)." if shared else ".")) from e
        return cls(group, dist.get_rank(group), len(ranks), sorted(ranks), device,
                   emulate=_emulates_with_all_reduce(group, device), timeout_s=timeout_s,
                   label=f"selzero {purpose} group")

    @classmethod
    def single(cls, device: torch.device) -> "Communicator":
        """A group of one process, for use without torch.distributed (every collective is local)."""
        return cls(None, 0, 1, [0], device)

    def failure(self, op: str, t: torch.Tensor, start: float, cause: BaseException,
                what: str | None = None) -> CollectiveError:
        """The CollectiveError for collective ``op`` over ``t`` that failed ([Note: failed
        collectives])."""
        timeout = f"timeout_s={self.timeout_s:g}" if self.timeout_s is not None else "timeout_s"
        what = self.what if what is None else what
        what = f", {what}" if what else ""
        return CollectiveError(
            f"[rank {self.rank}/{self.size}] selzero collective {op} ({t.numel()} x "
            f"{str(t.dtype).replace('torch.', '')}{what}) of the {self.label} over global ranks "
            f"{self.global_ranks} failed after {time.monotonic() - start:.1f} s ({timeout}): "
            f"{_first_line(cause)}. A rank of this group died, stalled longer than {timeout} or "
            "raised before reaching the same collective; its log says which. Do not step this "
            "instance again: restart the job from the last complete checkpoint (a failed run "
            "never touches it).")

    def _sync(self, op: str, t: torch.Tensor, fn: Any) -> Any:
        start = time.monotonic()
        try:
            return fn()
        except CollectiveError:
            raise
        except RuntimeError as e:
            raise self.failure(op, t, start, e) from e

    def _async(self, op: str, t: torch.Tensor, fn: Any) -> _Guarded:
        return _Guarded(self._sync(op, t, fn), self, op, t)

    def _blocking(self, op: str, t: torch.Tensor, fn: Any) -> None:
        """A collective launched asynchronously by ``fn`` and waited for here (so its work is
        retired like the others: [Note: work objects at exit])."""
        self._async(op, t, fn).wait()

    def _record(self, op: str, t: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((op, t.numel(), str(t.dtype)))

    # ---- bucket collectives (rank-major buffers of N rows) ----------------------------------

    def reserve_reduce_scratch(self, buffer_numel: int) -> int:
        """Allocate now, on this thread, the receive temporary that reductions of buffers of up
        to ``buffer_numel`` elements need ([Note: p2p reduce-scatter]); returns its bytes
        (0 where reductions need none)."""
        if not self.p2p or buffer_numel == 0:
            return 0
        self._p2p_scratch(buffer_numel)
        return self._p2p_temp.numel() * 4

    def _p2p_scratch(self, buffer_numel: int) -> torch.Tensor:
        need = p2p.temp_numel(buffer_numel, self.size)
        if self._p2p_temp.numel() < need:  # a reduction in flight keeps the one it has
            self._p2p_temp = torch.empty(need, dtype=torch.float32, device=self.device)
        return self._p2p_temp

    @property
    def own_row_apart(self) -> bool:
        """Can a reduction's own row live outside its buffer (``reduce_scatter_rows(own=)``)?
        Where nothing reduces (one rank) and on the point-to-point reduce-scatter, whose driver
        reads only the peers' rows of the buffer and adds into the own row wherever it is;
        not where the whole buffer is reduced (gloo's all-reduce, NCCL)."""
        return self.size == 1 or self.p2p

    def _reduce_p2p(self, buffer: torch.Tensor, rows: tuple[int, ...] | None,
                    own: torch.Tensor | None = None) -> RowWork:
        piece = p2p.piece_numel(buffer.numel(), self.size)
        temp = self._p2p_scratch(buffer.numel())[:p2p.temp_numel(buffer.numel(), self.size)]
        parts = self._rows(buffer, rows)
        if own is not None:
            parts[self.rank] = own
        tag = self._p2p_tag
        pieces = max(-(-part.numel() // piece) for part in parts)
        self._p2p_tag = (tag + pieces) % p2p.TAG_SPACE
        job = p2p.P2PReduceScatter(self.group, self.rank, parts,
                                   temp.view(self.size - 1, p2p.SLOTS, piece), tag, piece)
        if self._driver is None or not self._driver.submit(job):  # none yet, or closed
            self._driver = p2p.Driver(f"{p2p.DRIVER_PREFIX}-{self.label}", self.timeout_s)
            weakref.finalize(self, self._driver.close)  # the thread ends with this communicator
            self._driver.submit(job)
        return _Guarded(job, self, "reduce_scatter", buffer)

    def reduce_scatter_rows(self, buffer: torch.Tensor, rows: tuple[int, ...] | None = None,
                            *, own: torch.Tensor | None = None) -> RowWork:
        """Launch the SUM reduction of ``buffer`` (N rank-major rows; ``rows``: their uneven
        lengths, [Note: whole-tensor layout]); ``wait()`` returns row ``rank`` of the result.
        ``buffer`` must stay untouched until then. ``own`` (only where ``own_row_apart``): this
        rank's row, held apart from ``buffer`` (whose row ``rank`` is then neither read nor
        written); the result is summed into it in place and returned."""
        self._record("reduce_scatter", buffer)
        if own is not None and not (self.size == 1 or
                                    (self.p2p and buffer.dtype == torch.float32)):
            raise AssertionError("own= needs own_row_apart (one rank, or the p2p reduction)")
        mine = self._row(buffer, rows, self.rank) if own is None else own
        if self.size == 1:
            return _Done(mine)
        if self.p2p and buffer.dtype == torch.float32:
            return self._reduce_p2p(buffer, rows, own)
        if self.emulate:
            return _Rows(self._async("reduce_scatter", buffer, lambda: dist.all_reduce(
                buffer, group=self.group, async_op=True)), mine)
        output = torch.empty_like(mine)
        if rows is None:
            work = self._async("reduce_scatter", buffer, lambda: _REDUCE_SCATTER(
                output, buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        else:  # uneven: ProcessGroupNCCL runs one reduce per owner, coalesced
            work = self._async("reduce_scatter", buffer, lambda: dist.reduce_scatter(
                output, list(buffer.split(list(rows))), op=dist.ReduceOp.SUM,
                group=self.group, async_op=True))
        return _Rows(work, output)

    def all_gather_rows_(self, gathered: torch.Tensor, rows: tuple[int, ...] | None = None
                         ) -> Work:
        """Fill every row of ``gathered`` in place from the rank that owns it; the caller has
        written its own row ``rank`` (``rows``: uneven lengths). Launched asynchronously;
        ``wait()`` before reading."""
        self._record("all_gather", gathered)
        if self.size == 1:
            return _Done()
        if self.emulate:
            return self._async("all_gather", gathered, lambda: _All([
                dist.broadcast(part, group=self.group, group_src=r, async_op=True)
                for r, part in enumerate(self._rows(gathered, rows)) if part.numel()]))
        if rows is None:
            return self._async("all_gather", gathered, lambda: _ALL_GATHER(
                gathered, self._row(gathered, None, self.rank), group=self.group,
                async_op=True))
        # uneven: ProcessGroupNCCL runs one broadcast per owner, coalesced, into the views
        parts = self._rows(gathered, rows)
        return self._async("all_gather", gathered, lambda: dist.all_gather(
            parts, parts[self.rank], group=self.group, async_op=True))

    def _rows(self, buffer: torch.Tensor, rows: tuple[int, ...] | None) -> list[torch.Tensor]:
        """The N rows of a bucket buffer (equal, or of the uneven lengths ``rows``)."""
        if rows is None:
            return list(buffer.view(self.size, -1).unbind(0))
        return list(buffer.split(list(rows)))

    def _row(self, buffer: torch.Tensor, rows: tuple[int, ...] | None, r: int) -> torch.Tensor:
        """Row r alone (one view: the reduce-scatter's launch needs no other)."""
        if rows is None:
            return buffer.view(self.size, -1)[r]
        return buffer.narrow(0, sum(rows[:r]), rows[r])

    # ---- small collectives ----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM,
                   async_op: bool = False) -> Work:
        self._record("all_reduce", tensor)
        if self.size == 1:
            return _Done()
        work = self._async("all_reduce", tensor, lambda: dist.all_reduce(
            tensor, op=op, group=self.group, async_op=True))
        if async_op:
            return work
        work.wait()
        return _Done()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Gather ``input`` of every rank into ``output`` (rank-major); small tensors only."""
        self._record("all_gather", output)
        if self.size == 1:
            output.copy_(input)
            return
        self._blocking("all_gather", output, lambda: _ALL_GATHER(output, input, group=self.group,
                                                                 async_op=True))

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0) -> None:
        """Broadcast from group rank ``src``."""
        self._record("broadcast", tensor)
        if self.size > 1:
            self._blocking("broadcast", tensor, lambda: dist.broadcast(
                tensor, group=self.group, group_src=src, async_op=True))

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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
