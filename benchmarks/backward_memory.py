"""Transient memory of selzero during backward, measured at allocation level.

Run:  .venv/bin/python benchmarks/backward_memory.py  [--bucket-mb 16.8] [--world 2] [--steps 3]

The 17M-parameter MoE of benchmarks/bench.py (workload a), selzero on its experts, DDP on the
rest, AdamW, 64 tokens per rank routed unevenly (rank r sends its tokens to experts r, r+1, r+2 of each
layer only). Every allocation and free on the training thread during ``loss.backward()`` is
recorded (``selzero_plugin.memtrace``). Per rank: the peak of allocated-minus-freed bytes during
the backward and what is still held at its end, each divided by the subset's padded FP32
gradient (what one full-size copy of the experts' gradients costs). DDP's own gradients for the
dense layers are part of both figures (0.8 MB of them).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import WORKLOADS, build_model  # noqa: E402

SPEC = WORKLOADS["a"]
E = SPEC["experts"]


def _worker(rank: int, world: int, args: argparse.Namespace, init: str, queue: object) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp
    from selzero_plugin.memtrace import track_allocations

    model = build_model(SPEC)
    sz = SelectedZero2(model, SelZeroConfig(params=["*.experts.*"], bucket_mb=args.bucket_mb),
                       torch.optim.AdamW, {"lr": 1e-4})
    selected = {id(e.param) for e in sz.entries}
    host = torch.optim.AdamW([p for p in model.parameters() if id(p) not in selected], lr=1e-4)
    ddp = wrap_ddp(model, sz)
    subset = sum(-(-e.param.numel() // world) * world * 4 for e in sz.trainable)
    # uneven routing: rank r reaches experts r..r+2 only
    model.route((torch.arange(64) % 3 + rank) % E)
    figures = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, 256, generator=g)
        loss = ddp(x).pow(2).mean()
        with track_allocations() as trace:
            loss.backward()
        figures.append((trace.peak, trace.net))
        host.step()
        sz.step()
        host.zero_grad(set_to_none=True)
    queue.put((rank, subset, len(sz.layout.buckets), figures))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args.world, args, f"{tmp}/init", queue))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    print(f"bucket_mb={args.bucket_mb}, {args.world} gloo ranks; bytes during loss.backward() "
          "(allocation level) / the subset's padded FP32 gradient")
    print(f"{'rank':<5} {'buckets':>7} {'subset MB':>10} {'peak in backward':>18} "
          f"{'held at its end':>16}")
    for rank, subset, buckets, figures in results:
        peak = max(f[0] for f in figures) / subset
        held = max(f[1] for f in figures) / subset
        print(f"{rank:<5} {buckets:>7} {subset / 1e6:>10.1f} {peak:>18.2f} {held:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
