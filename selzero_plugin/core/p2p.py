"""A bucket's reduce-scatter from point-to-point messages, for gloo on the CPU.

[Note: p2p reduce-scatter]
gloo has no reduce-scatter of its own: torch's ``reduce_scatter_tensor`` on gloo clones the
input and all-reduces it, and selzero reduced a bucket with one in-place all-reduce instead
([Note: gloo collectives] in comm.py). An all-reduce moves 2(N-1)/N of the buffer per rank; a
reduce-scatter needs (N-1)/N. Measured on one 24 MiB bucket (``benchmarks/gloo_reduce.py``):
the all-reduce 29.1 ms at world 2, 73.6 ms at world 4; the point-to-point reduce-scatter below
18.3 and 48.5 ms. So for 2 <= N <= ``MAX_P2P_WORLD`` selzero reduces a CPU bucket on gloo this
way:

- rank r sends row j of its buffer to rank j, for every peer j, in pieces (a piece is a
  message with a tag of its own: the job's base tag plus the piece's index in its row);
- it receives the peers' pieces of its own row r into a temporary of ``SLOTS`` pieces per peer,
  and adds each into row r, peers in ascending rank order (a fixed order of the sum: at N = 2
  the result equals the all-reduce's bitwise; at N > 2 it may differ in the last bit, as any
  other order of the sum would).

Memory: the temporary holds at most an eighth of the bucket (``temp_numel``); it is allocated
once, on the training thread, beside the pooled bucket blocks ([Note: buffer pool]), and counts
in their accounting (``BufferPool.kept_bytes``). The buffer's rows other than r are only read,
never written (scratch launches share one buffer: [Note: scratch launches]).

Progress: gloo's point-to-point works cannot be polled (``is_completed()`` stays false until
``wait()``; a ``wait`` with a timeout that expires closes the connection), and a receive needs
its memory posted before the sender's bytes move (gloo's receiver-driven protocol). Someone has
to wait for each piece, add it, and post the next receive while the backward runs: a
``Driver`` thread per communicator (as gloo keeps worker threads per process group), which
runs the reductions in the order they were launched. Every rank of the group launches the same
reductions in the same order, and each driver posts a reduction's sends before it waits for its
receives, so a driver never waits for anything a peer's driver does later, and never for the
peer's training thread: a rank's ``wait()`` needs only that its peers launched the same
reduction, as with the all-reduce. The training thread blocks only in ``wait()`` (an event,
without the GIL).

Failures: a peer that died or stalled fails the driver's ``wait`` of a piece ("Connection closed
by peer" at once, a timeout after the group's ``timeout_s``); the driver keeps the error and the
training thread's ``wait()`` raises it as the communicator's CollectiveError ([Note: failed
collectives] in comm.py). At interpreter exit selzero waits for every driver's reductions
(bounded by ``timeout_s``) before the interpreter finalizes, so no Python thread resumes inside
torch at shutdown ([Note: work objects at exit]; ``Driver``). A rank whose backward raised and
that exits therefore leaves once its peers have launched the reductions it launched, or failed.

Keep the driver's loop minimal: whatever it does between a piece's arrival and posting the
next receive delays the transfer on both ranks. Measured and not taken (``bench.py --workloads
f --modes ddp,selzero --rounds 1``, four rounds each, interleaved): writing a bucket's first
sums straight into the gradient shard instead of into its row (saving the training thread's copy
of the row, 5 ms a step) took f from 0.88 to 0.915 of DDP's step time, and checking each piece
for inf/NaN there as well (saving the reduction point's pass over the shard) to 0.935.

The GIL: the driver takes it for a few microseconds per piece. While the training thread runs
Python for long stretches (a Python autograd Function's backward) a piece can wait for it
(``sys.getswitchinterval()``, 5 ms); in a backward of torch's own ops it is released most of the
time (measured: no difference in step time beside the all-reduce on a small-expert model).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Any

import torch

from ..config import ENV_GLOO_REDUCE
from ..errors import UsageError

__all__ = ["Driver", "P2PReduceScatter", "SLOTS", "MAX_P2P_WORLD", "piece_numel", "temp_numel"]

SLOTS = 2  # pieces of each peer in flight at once
TEMP_FRACTION = 8  # the temporary holds at most 1/TEMP_FRACTION of a bucket
MAX_P2P_WORLD = 16  # beyond: more than 16 pieces per row; the all-reduce stays
TAG_SPACE = 1 << 30  # tags wrap around below int32's limit (gloo matches per tag in order)


ENV = ENV_GLOO_REDUCE  # "p2p" (the default) or "all_reduce": the way back


def chosen(*, strict: bool = False) -> str:
    """How gloo reductions run, from ``SELZERO_GLOO_REDUCE``: "p2p" or "all_reduce" (another
    value: "p2p", or with ``strict`` a UsageError; SelectedZero2 checks it strictly on every
    rank before it builds a communicator, and agrees on it in its contract)."""
    value = os.environ.get(ENV, "p2p").strip().lower()
    if value not in ("p2p", "all_reduce"):
        if not strict:
            return "p2p"
        raise UsageError(f"environment variable {ENV}={os.environ[ENV]!r} is not a way selzero "
                         "reduces gradient buckets on gloo; expected 'p2p' (the default: a "
                         "point-to-point reduce-scatter) or 'all_reduce' (one in-place "
                         f"all-reduce per bucket, as before). Fix: unset {ENV} or set one of "
                         "those.")
    return value


def piece_numel(buffer_numel: int, size: int) -> int:
    """Elements per message of a bucket of ``buffer_numel`` elements over ``size`` ranks."""
    return max(1, -(-buffer_numel // (TEMP_FRACTION * (size - 1) * SLOTS)))


def temp_numel(buffer_numel: int, size: int) -> int:
    """Elements of the receive temporary for such a bucket: ``SLOTS`` pieces per peer."""
    return (size - 1) * SLOTS * piece_numel(buffer_numel, size)


def _bounds(length: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(length, a + piece)) for a in range(0, length, piece)]


class P2PReduceScatter:
    """One bucket's reduction, run by a ``Driver``; ``wait()`` returns this rank's row."""

    def __init__(self, group: Any, rank: int, rows: list[torch.Tensor], temp: torch.Tensor,
                 tag: int, piece: int) -> None:
        self._group, self._rank, self._rows, self._temp = group, rank, rows, temp
        self._tag, self._piece = tag, piece
        self.row = rows[rank]
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        """On the driver thread: send, receive, add. Records an error instead of raising."""
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread's wait()
            self.error = e
        finally:
            self._rows = []  # the driver keeps no view of the buffer
            self._done.set()

    def _run(self) -> None:
        group, rank, rows, temp, tag = self._group, self._rank, self._rows, self._temp, self._tag
        size = len(rows)
        # sends first, all of them: they move once the peer's driver posts the receive
        sends = [group.send([rows[j][a:b]], j, tag + i)
                 for j in [(rank + k) % size for k in range(1, size)]
                 for i, (a, b) in enumerate(_bounds(rows[j].numel(), self._piece))]
        peers = [j for j in range(size) if j != rank]
        mine = self.row
        pieces = _bounds(mine.numel(), self._piece)
        posted: dict[int, list[Any]] = {}

        def post(i: int) -> None:
            n = pieces[i][1] - pieces[i][0]
            posted[i] = [group.recv([temp[k, i % SLOTS, :n]], j, tag + i)
                         for k, j in enumerate(peers)]

        for i in range(min(SLOTS, len(pieces))):
            post(i)
        for i, (a, b) in enumerate(pieces):
            for k, work in enumerate(posted.pop(i)):
                work.wait()
                mine[a:b].add_(temp[k, i % SLOTS, :b - a])
            if i + SLOTS < len(pieces):
                post(i + SLOTS)
        for work in sends:
            work.wait()

    def wait(self) -> torch.Tensor:
        """Block until the driver finished; the raw error (the communicator wraps it)."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        return self.row

    def is_completed(self) -> bool:
        return self._done.is_set()


DRIVER_PREFIX = "selzero-reduce"  # the drivers' thread names
EXIT_JOIN_S = 30.0  # at exit, a driver's wait beyond its group's 2 x timeout_s


class _Channel:
    """A driver's queue and whether it still takes jobs (shared with its thread, which holds
    nothing else: the Driver and its communicator can go)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[P2PReduceScatter | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.open = True


class Driver:
    """A daemon thread that runs one communicator's point-to-point reductions in order.

    At interpreter exit (``finish_all``, an atexit hook registered at import, so it runs after
    the program's own atexit hooks registered later) every driver is closed and joined until
    its reductions are done or failed, before the interpreter finalizes: a Python thread that
    resumes inside torch while the interpreter finalizes is killed there (SIGABRT, "terminate
    called without an active exception": review finding, a rank whose backward raised and
    whose driver still waited for a peer's pieces at exit). Each wait is bounded by the
    group's ``timeout_s``, and a connection that failed fails the later waits at once; the join
    gives up after 2 x ``timeout_s`` + ``EXIT_JOIN_S``. Until then a driver never ends by
    itself (an idle one costs nothing: it blocks on its queue), so a reduction launched from a
    thread that outlives the main thread, or from an atexit hook, always finds it. ``close()``
    also ends it with its communicator (``weakref.finalize``)."""

    def __init__(self, name: str, timeout_s: float | None) -> None:
        self._channel = _Channel()
        self._thread = threading.Thread(target=_loop, args=(self._channel,), name=name,
                                        daemon=True)
        self._thread.start()
        _RUNNING[:] = [entry for entry in _RUNNING if entry[0].is_alive()]
        _RUNNING.append((self._thread, self._channel, timeout_s))

    def submit(self, job: P2PReduceScatter) -> bool:
        """Queue ``job``; False when this driver no longer takes jobs (closed at exit, or its
        thread is gone: a forked child) and the caller needs a new one."""
        with self._channel.lock:
            if not self._channel.open or not self._thread.is_alive():
                return False
            self._channel.jobs.put(job)
            return True

    def close(self) -> None:
        """End the thread after the reductions already submitted (no wait here)."""
        _close(self._channel)


def _close(channel: _Channel) -> None:
    with channel.lock:
        if channel.open:
            channel.open = False
            channel.jobs.put(None)


_RUNNING: list[tuple[threading.Thread, _Channel, float | None]] = []


def finish_all() -> None:
    """At interpreter exit: close every driver and wait for its reductions ([Note: p2p
    reduce-scatter], ``Driver``)."""
    while _RUNNING:
        thread, channel, timeout_s = _RUNNING.pop()
        _close(channel)
        thread.join(2 * (timeout_s or 600.0) + EXIT_JOIN_S)


atexit.register(finish_all)


def _loop(channel: _Channel) -> None:
    """The driver thread: its channel only."""
    while True:
        job = channel.jobs.get()
        if job is None:
            return
        job.run()
        del job  # hold nothing between jobs
