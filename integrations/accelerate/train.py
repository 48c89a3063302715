"""A plain Accelerate training script; `selzero-accelerate launch --selzero_config FILE` gives its
experts to selzero without a line changed.

    ACCELERATE_USE_CPU=1 selzero-accelerate launch --multi_gpu --num_processes 2 \
        --selzero_config configs/selzero.yaml integrations/accelerate/train.py --steps 6
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \
        integrations/accelerate/train.py --steps 6          # the same run without selzero

The model is integrations/ddp/train.py's MoE. Each rank routes its tokens to two experts of its
own (rank r: experts 2r and 2r + 1, mod 4), so ranks differ while every expert gets tokens
somewhere: plain DDP (find_unused_parameters) then trains exactly like one process of plain
torch, and the two runs can be compared. Gradient accumulation runs inside
``accelerator.accumulate``; clipping through ``accelerator.clip_grad_norm_``; an lr schedule.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

_spec = importlib.util.spec_from_file_location(
    "selzero_ddp_train", Path(__file__).resolve().parents[1] / "ddp" / "train.py")
ddp_train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ddp_train)


def make_batch(seed: int, step: int, rank: int):
    x, y, _ = ddp_train.make_batch(seed, step, rank)
    g = torch.Generator().manual_seed(7 * step + rank)
    routes = (2 * rank + torch.randint(0, 2, (x.shape[0],), generator=g)) % 4
    return x, y, routes


def clip(acc, model, args) -> None:
    if args.clip_with == "torch":
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    elif args.clip_with == "value":
        acc.clip_grad_value_(model.parameters(), args.clip / 50)
    else:
        acc.clip_grad_norm_(model.parameters(), args.clip)


def main() -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--clip", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="safetensors file for the final weights")
    p.add_argument("--save-state", default=None, help="accelerator.save_state folder")
    p.add_argument("--save-at", type=int, default=None, help="optimizer step to save after")
    p.add_argument("--resume", default=None, help="accelerator.load_state folder")
    p.add_argument("--start", type=int, default=0, help="first optimizer step (after resume)")
    p.add_argument("--mode", default="accumulate", choices=["accumulate", "manual", "no_sync"],
                   help="gradient accumulation: accelerator.accumulate, by hand without "
                        "no_sync (DDP reduces every micro-step), or the model's own no_sync")
    p.add_argument("--prepare", default="together",
                   choices=["together", "model-first", "optimizer-first", "methods"],
                   help="one accelerator.prepare call, the model and the optimizer apart, or "
                        "accelerator.prepare_model / prepare_optimizer / prepare_scheduler")
    p.add_argument("--clip-with", default="accelerator",
                   choices=["accelerator", "torch", "value"],
                   help="accelerator.clip_grad_norm_, torch.nn.utils.clip_grad_norm_ or "
                        "accelerator.clip_grad_value_ (by --clip)")
    p.add_argument("--skip-step", type=int, default=None,
                   help="drop this optimizer step's batch after backward and clipping "
                        "(optimizer.zero_grad() without step(): a loss-spike guard)")
    args = p.parse_args()
    torch.set_num_threads(1)
    acc = Accelerator(gradient_accumulation_steps=args.accumulate,
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = ddp_train.build_model(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=ddp_train.LR,
                            weight_decay=ddp_train.WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if args.prepare == "together":
        model, opt, sched = acc.prepare(model, opt, sched)
    elif args.prepare == "model-first":
        model = acc.prepare(model)
        opt, sched = acc.prepare(opt, sched)
    elif args.prepare == "optimizer-first":
        opt, sched = acc.prepare(opt, sched)
        model = acc.prepare(model)
    else:
        model = acc.prepare_model(model)
        opt = acc.prepare_optimizer(opt)
        sched = acc.prepare_scheduler(sched)
    sz = getattr(acc, "selzero", None)  # set when launched with --selzero_config
    if acc.is_main_process:
        print(f"selzero: {len(sz.trainable_names)} parameters" if sz else "selzero: off",
              flush=True)
    if args.resume:
        acc.load_state(args.resume)
    rank = acc.process_index
    for step in range(args.start, args.steps):
        for micro in range(args.accumulate):
            x, y, routes = make_batch(args.seed, step * args.accumulate + micro, rank)
            if args.mode == "accumulate":
                with acc.accumulate(model):
                    loss = ddp_train.loss_fn(model, x, y, routes)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        clip(acc, model, args)
                    if acc.sync_gradients and step == args.skip_step:
                        opt.zero_grad()  # this batch is dropped: no step
                        continue
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                continue
            last = micro == args.accumulate - 1
            with model.no_sync() if args.mode == "no_sync" and not last \
                    else contextlib.nullcontext():
                # accelerator.backward divides by gradient_accumulation_steps itself
                acc.backward(ddp_train.loss_fn(model, x, y, routes))
            if last:
                clip(acc, model, args)
                opt.step()
                sched.step()
                opt.zero_grad()
        if args.save_state and args.save_at == step + 1:
            acc.save_state(args.save_state)
    if acc.is_main_process and args.out:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().clone()
                   for k, v in acc.unwrap_model(model).state_dict().items()}, args.out)
    if dist.is_initialized():
        done = torch.zeros(1)
        dist.all_reduce(done)
    from selzero_plugin.process_exit import leave_now

    leave_now()  # not destroy_process_group(): it can hang on gloo ([Note: gloo teardown])


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(main)  # ends with os._exit: see [Note: gloo teardown] in that module
