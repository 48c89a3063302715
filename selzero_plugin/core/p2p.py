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
collectives] in comm.py). At interpreter exit the drivers are stopped (``stop_all``) before the
interpreter finalizes, so no Python thread is left to resume inside torch at shutdown ([Note:
work objects at exit]); a driver still blocked in a collective of a failed job is left behind
after a short join (the job has failed already).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
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


_DRIVERS: "weakref.WeakSet[Driver]" = weakref.WeakSet()


class Driver:
    """A daemon thread that runs one communicator's point-to-point reductions in order."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[P2PReduceScatter | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _DRIVERS.add(self)

    def submit(self, job: P2PReduceScatter) -> None:
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            job.run()
            del job  # hold nothing between jobs

    def stop(self, timeout_s: float = 1.0) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)


def stop_all() -> None:
    """Stop every driver of this process (at interpreter exit)."""
    for driver in list(_DRIVERS):
        driver.stop()


atexit.register(stop_all)
