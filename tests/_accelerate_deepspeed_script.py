"""Run by tests/test_e2e_deepspeed.py under `accelerate launch --use_deepspeed`: the DDP
program's model and data, trained by Accelerate's DeepSpeed path with the "selected_zero2" entry.

Usage: accelerate launch --use_deepspeed --deepspeed_config_file CFG --num_processes 2 \
    tests/_accelerate_deepspeed_script.py OUT.safetensors STEPS SEED
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import selzero_plugin.deepspeed  # noqa: F401 - registers the entry

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "integrations/ddp/train.py")
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)


def main() -> None:
    from accelerate import Accelerator

    out, steps, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    acc = Accelerator()
    model = train.build_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=train.LR, weight_decay=train.WEIGHT_DECAY)
    model, opt = acc.prepare(model, opt)
    assert hasattr(model, "selzero"), type(model)
    print(f"selzero config bucket_mb={model.selzero.config.bucket_mb} "
          f"name={model.selzero.config.name}", flush=True)
    # Accelerate 1.15 on CPU reports num_processes=1 under DeepSpeed although the process group
    # spans both ranks: take the rank from torch.distributed
    rank = dist.get_rank()
    gas = model.gradient_accumulation_steps()
    for step in range(steps):
        for micro in range(gas):
            x, y, routes = train.make_batch(seed, step * gas + micro, rank)
            with acc.accumulate(model):  # sets DeepSpeed's accumulation boundary
                loss = train.loss_fn(model, x, y, routes)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
    if rank == 0:
        from safetensors.torch import save_file

        save_file({k: v.detach().float().contiguous().clone()
                   for k, v in model.module.state_dict().items()}, out)
    done = torch.zeros(1)
    dist.all_reduce(done)
    dist.destroy_process_group()


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(main)  # ends with os._exit: see [Note: gloo teardown]
