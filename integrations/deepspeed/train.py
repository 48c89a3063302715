"""DeepSpeed training with the "selected_zero2" config entry: ZeRO-2 for the experts by selzero,
DeepSpeed (ZeRO stage 0/1/2) for everything else.

    deepspeed --num_gpus 2 integrations/deepspeed/train.py \
        --deepspeed_config configs/deepspeed_zero2_experts.json --steps 8 --out result.json
    torchrun --nproc-per-node 2 integrations/deepspeed/train.py --deepspeed_config ...

The program is plain DeepSpeed: ``import selzero_plugin.deepspeed`` is the only line selzero
adds; the config's "selected_zero2" block does the rest. The model, data and routing are those
of integrations/ddp/train.py (ranks route to different experts, one expert gets no token), so
a test can compare the run with one process of plain torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import selzero_plugin.deepspeed  # noqa: F401 - registers the "selected_zero2" entry

_spec = importlib.util.spec_from_file_location(
    "selzero_ddp_train", Path(__file__).resolve().parents[1] / "ddp" / "train.py")
ddp_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ddp_train)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import deepspeed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for losses, norms and checksums")
    p.add_argument("--save-model", default=None, help="safetensors file for the final weights")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def train(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed

    model = ddp_train.build_model(args.seed)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model)
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    dtype = engine.module.inp.weight.dtype
    losses, norms = [], []
    for step in range(args.steps):
        total = 0.0
        for micro in range(gas):
            x, y, routes = ddp_train.make_batch(args.seed, step * gas + micro, rank)
            out = engine(x.to(dtype), routes)
            loss = (out.float() - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
        norms.append(float(engine.get_global_grad_norm()))
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_losses)
    mean_losses /= world
    sums = torch.zeros(world, dtype=torch.float64)
    sums[rank] = ddp_train.checksum(engine.module)
    dist.all_reduce(sums)
    sz = engine.selzero
    report = sz.memory_report()
    return {"world_size": world, "steps": args.steps, "gas": gas, "seed": args.seed,
            "zero_stage": engine.zero_optimization_stage(), "dtype": str(dtype),
            "losses": mean_losses.tolist(), "norms": norms,
            "first_loss": float(mean_losses[0]), "final_loss": float(mean_losses[-1]),
            "rank_checksums": sums.tolist(), "selected": sz.selected_names,
            "selzero_bytes": report.total, "selzero_ideal_bytes": report.ideal_total,
            "engine": engine}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    try:
        result = train(args)
        engine = result.pop("engine")
        if dist.get_rank() == 0:
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            if args.save_model:
                from safetensors.torch import save_file

                save_file({k: v.detach().float().contiguous().clone()
                           for k, v in engine.module.state_dict().items()}, args.save_model)
            print(f"loss {result['first_loss']:.4f} -> {result['final_loss']:.4f} over "
                  f"{args.steps} steps (ZeRO-{result['zero_stage']}, {result['dtype']})",
                  flush=True)
        done = torch.zeros(1)
        dist.all_reduce(done)
    finally:
        from selzero_plugin.process_exit import leave_now

        leave_now()  # not destroy_process_group(): it can hang on gloo ([Note: gloo teardown])


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(main)
