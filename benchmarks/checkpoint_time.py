"""Checkpoint save and load time and bytes: selzero beside DDP, stock DeepSpeed ZeRO-2, and
DeepSpeed with the ``"selected_zero2"`` entry, on the same model (workload a of bench.py).

Run: ``.venv/bin/python benchmarks/checkpoint_time.py [--rounds 3] [--workload a]``

Per mode, in fresh processes, interleaved by round: one training step (so optimizer state
exists), then the save timed on every rank (the slowest rank counts), the bytes written (the
whole checkpoint folder), then a load into the same engine timed the same way. selzero + DDP
saves only selzero's part (``checkpoint.host.save_into``: shards + manifests + index); the
dense parameters and their optimizer are the host's (torch.save of their state dicts here, as
a plain DDP script would). Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench import (WORKLOADS, _batch, _loss, build_model, deepspeed_engine,  # noqa: E402
                   is_expert)

MODES = ["selzero", "deepspeed", "deepspeed-sz"]


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _worker(rank: int, world: int, mode: str, spec: dict[str, Any], work: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu",
                       "MASTER_PORT": str(29500 + os.getpid() % 400)})
    dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank,
                            world_size=world)
    model = build_model(spec)
    batch = _batch(spec, rank, mode, "cpu")
    kwargs = {"lr": 1e-4, "weight_decay": 0.1}
    folder = Path(work) / "ckpt"
    if mode == "selzero":
        from selzero_plugin import SelectedZero2, wrap_ddp
        from selzero_plugin.checkpoint.host import load_from, save_into

        sz = SelectedZero2(model, {"params": ["*.experts.*"]}, torch.optim.AdamW, kwargs)
        ddp = wrap_ddp(model, sz)
        dense = [p for n, p in model.named_parameters() if not is_expert(spec, n)]
        host = torch.optim.AdamW(dense, **kwargs)
        _loss(model, spec, batch, ddp).backward()
        host.step()
        sz.step()

        def save() -> None:
            save_into(folder, [sz])
            if rank == 0:
                torch.save({"model": {n: p for n, p in model.named_parameters()
                                      if not is_expert(spec, n)},
                            "optimizer": host.state_dict()}, folder / "host.pt")

        def load() -> None:
            state = torch.load(folder / "host.pt", weights_only=True)
            host.load_state_dict(state["optimizer"])
            load_from(folder, [sz])
    else:
        engine = deepspeed_engine(model, kwargs, {"params": ["*.experts.*"]}
                                  if mode == "deepspeed-sz" else None)
        engine.backward(_loss(engine.module, spec, batch, engine))
        engine.step()

        def save() -> None:
            engine.save_checkpoint(str(folder), tag="t")

        def load() -> None:
            engine.load_checkpoint(str(folder), tag="t")

    times = {}
    for name, fn in (("save", save), ("load", load)):
        dist.all_reduce(torch.zeros(1))
        t0 = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times[name] = float(elapsed)
    if rank == 0:
        Path(out).write_text(json.dumps({"mode": mode, **times,
                                         "bytes": _folder_bytes(folder)}))
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workload", default="a")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    spec = WORKLOADS[args.workload]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for mode in MODES:
            with tempfile.TemporaryDirectory() as work:
                out = os.path.join(work, "result.json")
                mp.start_processes(_worker, nprocs=args.world, start_method="spawn",
                                   args=(args.world, mode, spec, work, out))
                row[mode] = json.loads(Path(out).read_text())
        rounds.append(row)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} save {row[m]['save']:.2f} s load {row[m]['load']:.2f} s" for m in MODES),
            file=sys.stderr)
    lines = [f"### Checkpoint save / load, workload {args.workload}, {args.world} gloo ranks, "
             f"median over {args.rounds} rounds (slowest rank)", "",
             "| mode | save s | load s | bytes on disk | save vs deepspeed |", "|---|---|---|---|---|"]
    for mode in MODES:
        save = statistics.median(rd[mode]["save"] for rd in rounds)
        load = statistics.median(rd[mode]["load"] for rd in rounds)
        ratio = statistics.median(rd[mode]["save"] / rd["deepspeed"]["save"] for rd in rounds)
        lines.append(f"| {mode} | {save:.2f} | {load:.2f} | "
                     f"{rounds[0][mode]['bytes'] / 1e6:.1f} MB | {ratio:.2f} |")
    lines += ["", "Command: `" + " ".join(["benchmarks/checkpoint_time.py", *sys.argv[1:]]) + "`",
              ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"checkpoint-{args.workload}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
