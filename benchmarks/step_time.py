"""Step time, expert-state memory and peak RSS: selzero beside DDP vs DDP, FSDP2, DeepSpeed ZeRO-2.

Run (2 gloo ranks on this machine):  .venv/bin/python benchmarks/step_time.py
Options: --modes ddp,selzero,fsdp2,deepspeed  --rounds 3  --steps 8 --warmup 3 --tokens 64
         --bucket-mb 25 --backend gloo|nccl  --json OUT.json

Workload (research/prior-art.md, "what ZeRO-2 costs with the peers"): a 17M-parameter MoE, an
input Linear(256, 256) then 4 layers, each a dense Linear(256, 256) and 8 experts
Linear(256, 1024) -> GELU -> Linear(1024, 256); 64 tokens per rank per step routed evenly (token
i -> expert i % 8 on every rank), so that the peers run at all (they hang or train wrong on
uneven routing); AdamW.

Modes are interleaved round-robin within one run (ddp, selzero, fsdp2, deepspeed, ddp, ...),
each run in fresh processes, so a busy machine slows every mode of a round alike. Per mode and
round: the median step time after warm-up, the per-rank bytes of expert gradients + AdamW state
(+ masters) from live tensor storages, and the peak RSS of each rank's process
(``ru_maxrss``: imports, model, optimizer, every transient buffer). The table gives medians over
rounds and, for each ratio to DDP, the median and min-max of the ratios taken within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
        routes = torch.arange(x.shape[0], device=x.device) % E
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (routes == e).nonzero().flatten()
            y = y.index_add(0, idx, expert(h[idx]))
        return x + y


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
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


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _worker(rank: int, world: int, mode: str, args: argparse.Namespace, init: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 400)})
    device = torch.device("cpu")
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(args.backend, init_method=f"file://{init}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = MoE().to(device)
    expert_ids = {id(p) for p in _expert_params(model)}
    step_fn, mem_fn = _setup(mode, model, expert_ids, args)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, D, generator=g).to(device)
    times = []
    for i in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.tensor([_peak_rss_mib()], dtype=torch.float64, device=device)
    peaks = torch.zeros(world, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(peaks, peak)
    result = {"mode": mode, "ms": 1000 * statistics.median(times[args.warmup:]),
              "expert_bytes": mem_fn(), "peak_rss_mib": peaks.tolist()}
    if device.type == "cuda":
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2 ** 20
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _setup(mode: str, model: nn.Module, expert_ids: set[int], args: argparse.Namespace):
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

        sz = SelectedZero2(model, SelZeroConfig(params=["*.experts.*"], bucket_mb=args.bucket_mb),
                           torch.optim.AdamW, kwargs)
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

        os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.backend == "gloo" else "cuda")
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


def _run_mode(mode: str, args: argparse.Namespace) -> dict:
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
            return json.load(f)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="ddp,selzero,fsdp2,deepspeed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--json", default=None, help="also write every round's figures here")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if args.backend == "gloo" else "cuda")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    modes = args.modes.split(",")
    rounds = []
    for r in range(args.rounds):
        rounds.append({mode: _run_mode(mode, args) for mode in modes})
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{m} {rounds[-1][m]['ms']:.0f} ms, peak {max(rounds[-1][m]['peak_rss_mib']):.0f} MiB"
            for m in modes), file=sys.stderr)
    base = "ddp" if "ddp" in modes else modes[0]
    print(f"{args.world} ranks ({args.backend}), {args.rounds} rounds, modes interleaved; "
          f"median (min-max) over rounds; ratios taken within a round")
    print(f"{'mode':<10} {'ms/step':>8} {'vs ' + base:>18} {'expert grad+state/rank':>23} "
          f"{'peak RSS MiB per rank':>26} {'vs ' + base:>18}")
    for mode in modes:
        ms = [rd[mode]["ms"] for rd in rounds]
        ratio = [rd[mode]["ms"] / rd[base]["ms"] for rd in rounds]
        expert = rounds[0][mode]["expert_bytes"]
        expert_txt = f"{expert / 1e6:.1f} MB" if expert >= 0 else "not measured"
        per_rank = [[rd[mode]["peak_rss_mib"][k] for rd in rounds] for k in range(args.world)]
        rss_txt = " / ".join(f"{min(v):.0f}-{max(v):.0f}" for v in per_rank)
        rss_ratio = [max(rd[mode]["peak_rss_mib"]) / max(rd[base]["peak_rss_mib"]) for rd in rounds]
        print(f"{mode:<10} {statistics.median(ms):>8.1f} {_spread(ratio):>18} {expert_txt:>23} "
              f"{rss_txt:>26} {_spread(rss_ratio):>18}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
