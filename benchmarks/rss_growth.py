#!/usr/bin/env python
"""Host memory over many steps: does RSS level off, beside DDP's, on a bench.py workload?

bench.py's peak RSS covers 9 steps; a leak or a fragmenting heap shows over more. Each mode runs
``--steps`` steps at world ``--world`` (gloo) in fresh processes and rank 0 reports, every
``--every`` steps: peak RSS (``ru_maxrss``), current RSS, and glibc's main arena
(``mallinfo2``: bytes in use, bytes free inside the heap). In use growing is a leak; free
growing with in use flat is fragmentation (blocks kept alive across steps pin the heap).

    benchmarks/rss_growth.py --workload f --modes ddp,selzero --steps 60 --every 10
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench  # noqa: E402


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]


def _heap() -> tuple[float, float]:
    """(in use, free) MiB of glibc's main arena; (-1, -1) without glibc 2.33+."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
        return m.uordblks / 2**20, m.fordblks / 2**20
    except (OSError, AttributeError):
        return -1.0, -1.0


def _rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, mode: str, args: argparse.Namespace, init: str,
            out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    bench.install_counters()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    spec = bench.WORKLOADS[args.workload]
    model = bench.build_model(spec)
    subset = [p for n, p in model.named_parameters() if bench.is_expert(spec, n)]
    step, _ = bench._setup(mode, model, spec, subset, {id(p) for p in subset},
                           argparse.Namespace(bucket_mb=args.bucket_mb, backend="gloo"))
    batch = bench._batch(spec, rank, mode, torch.device("cpu"))
    rows = []
    for i in range(1, args.steps + 1):
        step(batch)
        if i % args.every == 0 or i == 1:
            in_use, free = _heap()
            rows.append({"step": i, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         / 1024.0, "rss": _rss_now(), "in_use": in_use, "free": free})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="f", choices=sorted(bench.WORKLOADS))
    parser.add_argument("--modes", default="ddp,selzero")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.start_processes(_worker, nprocs=args.world, start_method="spawn",
                               args=(args.world, mode, args, os.path.join(tmp, "init"), out))
            results[mode] = json.loads(Path(out).read_text())
    print(f"workload {args.workload}, world {args.world}, rank 0, MiB "
          "(peak RSS / RSS / heap in use / heap free):")
    print("| step | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k, row in enumerate(next(iter(results.values()))):
        cells = [" / ".join(f"{r[k][f]:.0f}" for f in ("peak", "rss", "in_use", "free"))
                 for r in results.values()]
        print(f"| {row['step']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
