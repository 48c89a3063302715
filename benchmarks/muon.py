"""Whole-tensor ownership (``partition="tensors"``): Muon through selzero against one process
running ``torch.optim.Muon`` over the same matrices, and ``tensors`` against ``chunks`` with
AdamW on the same model.

Run: ``.venv/bin/python benchmarks/muon.py [--world 2] [--rounds 5] [--steps 6]
[--experts 32] [--layers 4] [--d 128] [--h 256] [--device cpu|cuda] [--out benchmarks/results]``.

The model: ``layers`` MoE layers of ``experts`` experts, each expert two matrices, (h, d) and
(d, h) (a Linear(d, h) -> GELU -> Linear(h, d) without biases), every token routed to every
expert on every rank so that every matrix is updated every step. Rows, interleaved
round-robin in fresh processes (a busy machine slows a whole round alike), each figure the
median over rounds and each ratio taken within a round:

- ``muon-1p``: one process, ``torch.optim.Muon`` over every expert matrix, the gradients of
  the mean of the ranks' losses (each rank's batch in turn): the reference's optimizer step;
- ``muon-sz``: ``world`` gloo processes, selzero ``partition="tensors"`` with Muon: each rank
  orthogonalizes the matrices it owns (the plan balances the Newton-Schulz work) and the
  updated matrices are gathered back. ``opt ms`` is ``sz.step()`` (the reduction point's
  agreement, the owner's Muon, the all-gather), the figure to set against ``muon-1p``'s
  ``opt.step()``; ``step ms`` is the whole step (forward, backward with the reduce-scatters,
  ``sz.step()``);
- ``adamw-chunks`` / ``adamw-tensors``: selzero with AdamW under each partition, whole steps.

Every process runs one thread (``torch.set_num_threads(1)``), so on a machine with at least
``world`` cores the selzero ranks run side by side. The table goes to ``<out>/muon.md`` and the
rounds to ``<out>/muon.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import run_workers, spread  # the harness of benchmarks/bench.py

ROWS = ["muon-1p", "muon-sz", "adamw-chunks", "adamw-tensors"]


def build(args: argparse.Namespace) -> Any:
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(args.d, args.h, bias=False)
            self.down = nn.Linear(args.h, args.d, bias=False)

        def forward(self, x: Any) -> Any:
            return self.down(torch.nn.functional.gelu(self.up(x)))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(Expert() for _ in range(args.experts))

        def forward(self, x: Any) -> Any:
            return x + sum(e(x) for e in self.experts) / len(self.experts)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(args.layers))

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    return Model()


def batch(args: argparse.Namespace, step: int, rank: int, device: Any) -> Any:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    # an input that needs a gradient, as a model's hidden states do: the layers' launch units
    # fire during backward (their buckets' reductions overlap it)
    return torch.randn(args.tokens, args.d, generator=g).to(device).requires_grad_()


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def single(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    device = torch.device(args.device)
    model = build(args).to(device)
    opt = torch.optim.Muon(model.parameters(), lr=0.02)
    opt_ms = []
    for step in range(args.warmup + args.steps):
        for r in range(args.world):
            (model(batch(args, step, r, device)).pow(2).mean() / args.world).backward()
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        opt_ms.append((time.perf_counter() - start) * 1e3)
        opt.zero_grad(set_to_none=True)
    return {"opt_ms": statistics.median(opt_ms[args.warmup:]), "step_ms": -1.0}


def _worker(rank: int, world: int, row: str, args: argparse.Namespace, init: str,
            out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    from selzero_plugin import SelectedZero2

    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build(args).to(device)
    partition = "chunks" if row == "adamw-chunks" else "tensors"
    cls, kwargs = (torch.optim.Muon, {"lr": 0.02}) if row == "muon-sz" else \
        (torch.optim.AdamW, {"lr": 1e-3})
    sz = SelectedZero2(model, {"params": ["*"], "partition": partition,
                               "bucket_mb": args.bucket_mb}, cls, kwargs)
    opt_ms, step_ms = [], []
    for step in range(args.warmup + args.steps):
        _sync(device)
        start = time.perf_counter()
        model(batch(args, step, rank, device)).pow(2).mean().backward()
        _sync(device)
        mid = time.perf_counter()
        sz.step()
        _sync(device)
        end = time.perf_counter()
        opt_ms.append((end - mid) * 1e3)
        step_ms.append((end - start) * 1e3)
    times = torch.tensor([statistics.median(opt_ms[args.warmup:]),
                          statistics.median(step_ms[args.warmup:])], device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank == 0:
        owned = [sum(s.numel() for s in sz.segments)]
        Path(out).write_text(json.dumps({"opt_ms": float(times[0]), "step_ms": float(times[1]),
                                         "elements_rank0": owned[0],
                                         "balance": _balance(sz, world)}))
    dist.destroy_process_group()


def _balance(sz: Any, world: int) -> float:
    from selzero_plugin.core.ownership import balance, optimizer_cost

    if sz.owners is None:
        return 1.0
    cls = type(sz.optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    costs = [optimizer_cost(name, {}, tuple(e.param.shape)) for e in sz.trainable]
    return balance(costs, sz.owners, world)


def run_row(row: str, args: argparse.Namespace) -> dict[str, Any]:
    if row == "muon-1p":
        return single(args)
    return run_workers(_worker, args.world, row, row, args)


def table(rounds: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    med = {r: {k: statistics.median(rd[r][k] for rd in rounds) for k in ("opt_ms", "step_ms")}
           for r in ROWS}
    muon = [rd["muon-sz"]["opt_ms"] / rd["muon-1p"]["opt_ms"] for rd in rounds]
    parts = [rd["adamw-tensors"]["step_ms"] / rd["adamw-chunks"]["step_ms"] for rd in rounds]
    params = args.layers * args.experts * 2
    lines = [
        f"### Muon and whole-tensor ownership ({args.device}, {args.world} ranks for selzero)",
        "",
        f"{args.layers} layers x {args.experts} experts x 2 matrices ({args.h}x{args.d}, "
        f"{args.d}x{args.h}) = {params} matrices; {args.tokens} tokens per rank; "
        f"{len(rounds)} rounds, rows interleaved in fresh processes, one thread per process; "
        "median (min-max) over rounds, ratios within a round.",
        "",
        "| row | optimizer step ms | whole step ms |",
        "|---|---|---|",
    ]
    for r in ROWS:
        step = "n/a" if med[r]["step_ms"] < 0 else f"{med[r]['step_ms']:.1f}"
        lines.append(f"| {r} | {med[r]['opt_ms']:.1f} | {step} |")
    lines += [
        "",
        f"- Muon through selzero / single-process Muon, optimizer step: **{spread(muon)}** "
        f"(ideal 1/{args.world} plus the all-gather; plan balance "
        f"{rounds[0]['muon-sz'].get('balance', 1.0):.3f} max/mean Newton-Schulz cost)",
        f"- AdamW, `tensors` / `chunks`, whole step: **{spread(parts)}**",
        "",
        "Command: `" + " ".join(["benchmarks/muon.py", *sys.argv[1:]]) + "`",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--h", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rounds = []
    for r in range(args.rounds):
        rounds.append({row: run_row(row, args) for row in ROWS})
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{row} {rounds[-1][row]['opt_ms']:.0f}/{rounds[-1][row]['step_ms']:.0f} ms"
            for row in ROWS), file=sys.stderr)
    text = table(rounds, args)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "muon.md").write_text(text)
    (out / "muon.json").write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
