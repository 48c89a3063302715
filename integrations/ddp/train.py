"""Plain torchrun + DDP training with selzero on the experts.

    torchrun --nproc-per-node 2 integrations/ddp/train.py --steps 20 \
        --config configs/selzero.yaml --out result.json

The experts of a small MoE are selected by the selzero config (ZeRO-2: sharded gradients and
AdamW state); ``wrap_ddp`` gives every other parameter to DDP. Each rank routes its tokens to
different experts, and one expert never gets a token. One step is ``--accumulate`` micro-steps
(the earlier ones inside ``ddp.no_sync()``, which covers selzero too), optional global clipping
over host + experts, the host optimizer's step, then ``sz.step()``.

Everything above ``main()`` is importable without a process group, so a test can rerun the same
training on one process with plain torch (the mean of the ranks' losses) and compare.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_, wrap_ddp

DIM, HIDDEN, NUM_EXPERTS, TOKENS = 7, 15, 4, 6  # (15, 7) / (7, 15) weights divide by no world size
LR, WEIGHT_DECAY = 1e-2, 0.1
DEFAULT_CONFIG = {"params": ["*.experts.*"]}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w_in = nn.Linear(DIM, HIDDEN)
        self.w_out = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(torch.tanh(self.w_in(x)))


class MoELayer(nn.Module):
    """Router (DDP) and explicit per-expert modules (selzero); the routes come with the data."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, NUM_EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(NUM_EXPERTS))

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(h), dim=-1)
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (routes == e).nonzero().flatten()
            if idx.numel():  # an expert without tokens gets no gradient on this rank
                y = y.index_add(0, idx, expert(h[idx]) * gates[idx, e:e + 1])
        return h + y


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoELayer()
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(torch.relu(self.inp(x)), routes))


def build_model(seed: int) -> MoE:
    torch.manual_seed(seed)
    return MoE()


def make_batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's micro-batch: inputs, targets, and a top-1 route per token.

    Rank r's tokens go to experts {r, r + 1} mod (E - 1), so ranks disagree on which experts got
    tokens, and expert E - 1 never gets one.
    """
    g = torch.Generator().manual_seed(1_000_003 * seed + 1009 * step + rank)
    x = torch.randn(TOKENS, DIM, generator=g)
    y = torch.randn(TOKENS, 3, generator=g) + x[:, :3]
    choice = torch.randint(0, 2, (TOKENS,), generator=g)
    routes = (rank + choice) % (NUM_EXPERTS - 1)
    return x, y, routes


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
            routes: torch.Tensor) -> torch.Tensor:
    return (model(x, routes) - y).pow(2).mean()


def checksum(model: nn.Module) -> float:
    """Order-sensitive float64 fingerprint of the parameters (equal on every replica)."""
    total = 0.0
    for i, p in enumerate(model.parameters()):
        total += (i + 1) * float(p.detach().double().sum()) + float(p.detach().double().abs().sum())
    return total


def load_config(path: str | None) -> SelZeroConfig:
    cfg = SelZeroConfig.from_file(path) if path else SelZeroConfig.from_dict(DEFAULT_CONFIG)
    if cfg.reduction != "mean":
        raise SystemExit(f"--config {path}: reduction={cfg.reduction!r}, but this program averages "
                         "like DDP (mean loss per rank); set `reduction: mean`.")
    return cfg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--config", default=None,
                   help="selzero YAML/JSON file (default: params ['*.experts.*'])")
    p.add_argument("--out", default=None, help="JSON file for the losses and a parameter checksum")
    p.add_argument("--save-model", default=None, help="safetensors file for the final weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accumulate", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--clip", type=float, default=None, help="global max grad norm")
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.seed)
    sz = SelectedZero2(model, load_config(args.config), torch.optim.AdamW,
                       {"lr": LR, "weight_decay": WEIGHT_DECAY})
    selected = {id(e.param) for e in sz.entries}
    host_params = [p for p in model.parameters() if id(p) not in selected]
    host_opt = torch.optim.AdamW(host_params, lr=LR, weight_decay=WEIGHT_DECAY)
    ddp = wrap_ddp(model, sz)
    losses, skipped = [], 0
    for step in range(args.steps):
        step_loss = 0.0
        for micro in range(args.accumulate):
            batch = make_batch(args.seed, step * args.accumulate + micro, rank)
            last = micro == args.accumulate - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():
                loss = loss_fn(ddp, *batch) / args.accumulate
                loss.backward()
            step_loss += loss.item()
        if args.clip is not None:
            clip_grad_norm_(host_params, args.clip, subsets=[sz])
        host_opt.step()
        skipped += sz.step().skipped_absent
        host_opt.zero_grad(set_to_none=True)
        losses.append(step_loss)

    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    sums = torch.zeros(world, dtype=torch.float64)
    sums[rank] = checksum(model)
    dist.all_reduce(sums)  # every rank's checksum, to show the replicas agree
    return {"world_size": world, "steps": args.steps, "accumulate": args.accumulate,
            "clip": args.clip, "seed": args.seed, "losses": mean_losses.tolist(),
            "first_loss": float(mean_losses[0]), "final_loss": float(mean_losses[-1]),
            "checksum": float(sums[0]), "rank_checksums": sums.tolist(),
            "skipped_absent": skipped, "selected": sz.selected_names,
            "config": sz.config.to_dict(), "model": model}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = train(args)
        model = result.pop("model")
        if dist.get_rank() == 0:
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            if args.save_model:
                from safetensors.torch import save_file

                weights = {k: v.detach().contiguous().clone()
                           for k, v in model.state_dict().items()}
                save_file(weights, args.save_model)
            print(f"loss {result['first_loss']:.4f} -> {result['final_loss']:.4f} over "
                  f"{args.steps} steps; checksum {result['checksum']:.10g}", flush=True)
        done = torch.zeros(1)
        dist.all_reduce(done)  # a tiny last collective, safer than a gloo barrier at exit
    finally:
        from selzero_plugin.process_exit import leave_now

        leave_now()  # not destroy_process_group(): it can hang on gloo ([Note: gloo teardown])


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(main)  # ends with os._exit: see [Note: gloo teardown] in that module
