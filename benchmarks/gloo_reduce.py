"""Ways to reduce-scatter and all-gather a bucket on gloo, timed side by side: what selzero does
today beside point-to-point alternatives, against DDP's one all-reduce of the same buffer.

On gloo selzero reduces a bucket with one in-place SUM all-reduce of the whole buffer and reads
its row, and gathers with one broadcast per rank's row ([Note: gloo collectives] in
selzero_plugin/core/comm.py): an all-reduce moves 2(N-1)/N of the buffer per rank, a
reduce-scatter needs only (N-1)/N. This script times, for one fp32 buffer of ``--mib`` MiB on
``--world`` processes (modes interleaved, median over rounds):

- ``allreduce``: ``dist.all_reduce(buffer)`` (selzero's reduction today; also DDP's whole step
  of communication for that buffer);
- ``p2p-rs``: a reduce-scatter from point-to-point messages: rank r sends row j to rank j for
  every j != r and receives the N-1 contributions to its own row into a temporary of
  (N-1)/N of the buffer, then adds them in rank order (one receive buffer per peer);
- ``p2p-rs-pieces``: the same in ``--pieces`` pieces per row, two pieces in flight, so the
  temporary is two pieces per peer instead of a row (the memory ZeRO-2 allows);
- ``bcast-ag``: selzero's gather today: N asynchronous broadcasts, row r from rank r;
- ``p2p-ag``: the gather from point-to-point messages: rank r sends its row to every peer and
  receives each peer's row in place.

The reduce-scatter variants are checked against the all-reduce's row (equal up to the order of
the sum at N > 2; bitwise at N = 2). Figures for the closing note of issue 23; run on an idle
machine:

    .venv/bin/python benchmarks/gloo_reduce.py --world 2 --mib 16 --rounds 21
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world: int, port: int, mib: float, rounds: int, pieces: int,
            out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    numel = int(mib * (1 << 20)) // 4 // world * world
    row = numel // world
    gen = torch.Generator().manual_seed(rank)
    source = torch.randn(numel, generator=gen)
    buffer = torch.empty(numel)
    rows = buffer.view(world, row)
    peers = [j for j in range(world) if j != rank]
    temp = torch.empty(len(peers), row)
    piece = -(-row // pieces)
    temp_pieces = torch.empty(len(peers), 2, piece)
    tag = [0]

    def next_tag() -> int:
        tag[0] += 1
        return tag[0]

    def allreduce() -> torch.Tensor:
        dist.all_reduce(buffer)
        return rows[rank]

    def p2p_rs() -> torch.Tensor:
        t = next_tag()
        sends = [dist.isend(rows[j], j, tag=t) for j in peers]
        recvs = [dist.irecv(temp[k], j, tag=t) for k, j in enumerate(peers)]
        mine = rows[rank]
        for k, w in enumerate(recvs):  # rank order of the peers: a fixed order of the sum
            w.wait()
            mine.add_(temp[k])
        for w in sends:
            w.wait()
        return mine

    def p2p_rs_pieces() -> torch.Tensor:
        mine = rows[rank]
        t = next_tag()
        bounds = [(i * piece, min(row, (i + 1) * piece)) for i in range(pieces)]
        bounds = [(a, b) for a, b in bounds if b > a]

        def post(i: int) -> list[Any]:
            a, b = bounds[i]
            return ([dist.isend(rows[j, a:b], j, tag=t + i) for j in peers] +
                    [dist.irecv(temp_pieces[k, i % 2, :b - a], j, tag=t + i)
                     for k, j in enumerate(peers)])

        tag[0] += len(bounds)
        flight = [post(i) for i in range(min(2, len(bounds)))]
        for i, (a, b) in enumerate(bounds):
            works = flight[i]
            for k in range(len(peers)):
                works[len(peers) + k].wait()
                mine[a:b].add_(temp_pieces[k, i % 2, :b - a])
            for w in works[:len(peers)]:
                w.wait()
            if i + 2 < len(bounds):
                flight.append(post(i + 2))
        return mine

    def bcast_ag() -> None:
        works = [dist.broadcast(rows[j], j, async_op=True) for j in range(world)]
        for w in works:
            w.wait()

    def p2p_ag() -> None:
        t = next_tag()
        works = [dist.isend(rows[rank], j, tag=t) for j in peers] + \
            [dist.irecv(rows[j], j, tag=t) for j in peers]
        for w in works:
            w.wait()

    def sync() -> None:
        dist.all_reduce(torch.zeros(1))

    # correctness: each reduce-scatter's row against the all-reduce's
    buffer.copy_(source)
    expected = allreduce().clone()
    checks = {}
    for name, fn in (("p2p-rs", p2p_rs), ("p2p-rs-pieces", p2p_rs_pieces)):
        buffer.copy_(source)
        got = fn()
        checks[name] = {"bitwise": bool(torch.equal(got, expected)),
                        "max_abs_diff": float((got - expected).abs().max())}
    modes: dict[str, Callable[[], Any]] = {"allreduce": allreduce, "p2p-rs": p2p_rs,
                                           "p2p-rs-pieces": p2p_rs_pieces,
                                           "bcast-ag": bcast_ag, "p2p-ag": p2p_ag}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds + 2):
        for name, fn in modes.items():
            buffer.copy_(source)
            sync()
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            if r >= 2:  # warm-up rounds
                times[name].append(elapsed)
    # the slowest rank's time decides a step: the maximum over ranks of each sample
    stacked = torch.tensor([times[m] for m in modes], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    if rank == 0:
        ms = {m: 1000 * statistics.median(stacked[i].tolist()) for i, m in enumerate(modes)}
        result = {"world": world, "mib": mib, "rounds": rounds, "pieces": pieces,
                  "median_ms": {m: round(v, 2) for m, v in ms.items()},
                  "ratio_vs_allreduce": {m: round(v / ms["allreduce"], 3) for m, v in ms.items()},
                  "selzero_today_ms": round(ms["allreduce"] + ms["bcast-ag"], 2),
                  "p2p_ms": round(ms["p2p-rs-pieces"] + ms["bcast-ag"], 2),
                  "checks": checks}
        Path(out).write_text(json.dumps(result, indent=1))
    sync()
    dist.destroy_process_group()


def main() -> int:
    import tempfile

    import torch.multiprocessing as mp

    from selzero_plugin.ports import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--pieces", type=int, default=8)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args.world, free_port(), args.mib, args.rounds, args.pieces,
                                path), nprocs=args.world)
        result = json.loads(Path(path).read_text())
    result["command"] = ("benchmarks/gloo_reduce.py --world {world} --mib {mib:g} --rounds "
                         "{rounds} --pieces {pieces}").format(**result)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
