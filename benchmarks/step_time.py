"""Step time and expert-state memory: selzero beside DDP vs DDP, FSDP2 and DeepSpeed ZeRO-2.

Run (2 gloo ranks on this machine):  .venv/bin/python benchmarks/step_time.py
Options: --modes ddp,selzero,fsdp2,deepspeed  --steps 8 --warmup 3 --tokens 64

Workload (research/prior-art.md, "what ZeRO-2 costs with the peers"): a 17M-parameter MoE, 4
layers, each a dense Linear(256, 256) and 8 experts Linear(256, 1024) -> GELU -> Linear(1024, 256);
64 tokens per rank per step routed evenly (token i -> expert i % 8 on every rank), so that the
peers run at all (they hang or train wrong on uneven routing); AdamW. Each mode runs in fresh
processes; the figure is the median step time after warm-up, and per-rank bytes of expert
gradients + AdamW state (+ masters), measured from live tensor storages.
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

D, H, E, LAYERS = 256, 1024, 8, 4


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.gelu(self.w1(x)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(D, D)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x))
        routes = torch.arange(x.shape[0]) % E
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (routes == e).nonzero().flatten()
            y = y.index_add(0, idx, expert(h[idx]))
        return x + y


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            if hasattr(t, "to_local"):
                t = t.to_local()
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".experts." in n]


def _worker(rank: int, world: int, mode: str, args: argparse.Namespace, init: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"})
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = MoE()
    expert_ids = {id(p) for p in _expert_params(model)}
    step_fn, mem_fn = _setup(mode, model, expert_ids)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, D, generator=g)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step_fn(x)
        times.append(time.perf_counter() - t0)
    result = {"mode": mode, "ms": 1000 * statistics.median(times[args.warmup:]),
              "expert_bytes": mem_fn()}
    t = torch.zeros(1)
    dist.all_reduce(t)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _setup(mode: str, model: nn.Module, expert_ids: set[int]):
    kwargs = {"lr": 1e-4, "weight_decay": 0.1}
    if mode == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), **kwargs)

        def step(x):
            ddp(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # DDP keeps its gradient buckets alive anyway

        def mem():
            ps = _expert_params(model)
            return _bytes([p.grad for p in ps] + [v for p in ps for v in opt.state[p].values()])
        return step, mem
    if mode == "selzero":
        from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

        sz = SelectedZero2(model, SelZeroConfig(params=["*.experts.*"]), torch.optim.AdamW, kwargs)
        ddp = wrap_ddp(model, sz)
        host = torch.optim.AdamW([p for p in model.parameters() if id(p) not in expert_ids], **kwargs)

        def step(x):
            ddp(x).pow(2).mean().backward()
            host.step()
            sz.step()
            host.zero_grad()

        return step, lambda: sz.memory_report().total
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            for expert in layer.experts:
                fully_shard(expert, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), **kwargs)

        def step(x):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        def mem():
            ps = _expert_params(model)
            return _bytes([p.grad for p in ps] + [v for p in ps for v in opt.state[p].values()])
        return step, mem
    if mode == "deepspeed":
        import deepspeed

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        opt = torch.optim.AdamW(model.parameters(), **kwargs)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9})

        def step(x):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()

        return step, lambda: -1
    raise SystemExit(f"unknown mode {mode!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="ddp,selzero,fsdp2,deepspeed")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            try:
                mp.start_processes(_worker, nprocs=args.world, start_method="spawn",
                                   args=(args.world, mode, args, os.path.join(tmp, "init"), out))
            except mp.ProcessExitedException as e:
                # gloo can abort a process at interpreter exit after its work is done
                if not os.path.exists(out):
                    raise
                print(f"note: {mode}: a process ended abnormally after reporting ({e})",
                      file=sys.stderr)
            with open(out) as f:
                rows.append(json.load(f))
    base = next((r for r in rows if r["mode"] == "ddp"), rows[0])
    print(f"{'mode':<10} {'ms/step':>9} {'vs ddp':>7} {'expert grad+state MB/rank':>26} {'vs ddp':>7}")
    for r in rows:
        mb = r["expert_bytes"] / 1e6 if r["expert_bytes"] >= 0 else float("nan")
        ratio_mem = r["expert_bytes"] / base["expert_bytes"] if r["expert_bytes"] >= 0 else float("nan")
        print(f"{r['mode']:<10} {r['ms']:>9.1f} {r['ms'] / base['ms']:>7.2f} {mb:>26.1f} "
              f"{ratio_mem:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
