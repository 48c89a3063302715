"""``selzero demo --ep E --nproc N``: the demo's MoE with expert parallelism.

Each expert-parallel rank holds ``8 / E`` of the experts (selzero_plugin.moe: tokens travel to
the rank that holds their expert and back); each expert-data-parallel group (the ranks holding
the same experts) runs its own SelectedZero2 over them, sharding their gradients and AdamW
state, with ``normalize_over="world"``; the dense layers are under DDP over every rank. Every
rank also trains, on the same batches, one process's model that holds every expert (the
reference), and the report shows the two global gradient norms side by side. Routing is the
demo's (see demo.py, [Note: demo routing]): expert 7 never gets a token.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from .core.clip import clip_grad_norm_
from .core.zero2 import SelectedZero2
from .ddp import wrap_ddp
from .demo import NUM_EXPERTS, DemoConfig, DemoMoE, _batch, _kib, _quiet, _teacher
from .groups import expert_data_parallel
from .moe import ExpertParallelMoE

CLIP = 1.0


def EPDemoModel(cfg: DemoConfig, ep_group: Any = None) -> DemoMoE:
    """The demo's model with expert-parallel MoE layers (every expert when ep_group is None)."""
    return DemoMoE(cfg, lambda: ExpertParallelMoE(cfg.dim, cfg.hidden, NUM_EXPERTS, ep_group))


def _copy_from(model: DemoMoE, full: DemoMoE) -> None:
    """Start from the reference's values: the dense layers, and this rank's slice of experts."""
    names = dict(full.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n:
                layer, rest = n.split(".experts.")
                i, tail = rest.split(".", 1)
                g = model.layers[int(layer.split(".")[1])].global_expert(int(i))
                p.copy_(names[f"{layer}.experts.{g}.{tail}"])
            else:
                p.copy_(names[n])


def worker(steps: int, ep: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = expert_data_parallel(ep)
        cfg = DemoConfig()
        torch.manual_seed(0)
        reference = EPDemoModel(cfg)
        model = EPDemoModel(cfg, groups.expert_parallel)
        _copy_from(model, reference)
        kwargs = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
        sz = SelectedZero2(model, {"params": ["*.experts.*"], "normalize_over": "world"},
                           torch.optim.AdamW, kwargs, group=groups.expert_data_parallel)
        ddp = wrap_ddp(model, sz)
        dense = [p for n, p in model.named_parameters() if ".experts." not in n]
        host_opt = torch.optim.AdamW(dense, **kwargs)
        ref_opt = torch.optim.AdamW(reference.parameters(), **kwargs)
        teacher = _teacher(cfg)
        norms, ref_norms, losses, skipped = [], [], [], 0
        started = time.perf_counter()
        for step in range(steps):
            x, y, topics = _batch(step, rank, cfg, teacher)
            loss = (ddp(x, topics) - y).pow(2).mean()
            loss.backward()
            norms.append(float(clip_grad_norm_(dense, CLIP, subsets=[sz])))
            host_opt.step()
            skipped += sz.step().skipped_absent
            host_opt.zero_grad(set_to_none=True)
            ref_loss = sum((reference(xr, tr) - yr).pow(2).mean() for xr, yr, tr in
                           (_batch(step, r, cfg, teacher) for r in range(world))) / world
            ref_loss.backward()
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)))
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            losses.append(float(ref_loss))
        train_s = time.perf_counter() - started
        report = sz.memory_report()
        held = report.grad_shard + report.optimizer_state + report.master
        local = [p for n, p in model.named_parameters() if ".experts." in n]
        ddp_bytes = sum(3 * p.numel() * p.element_size() + 4 for p in local)
        experts = [model.layers[0].global_expert(i) for i in range(len(model.layers[0].experts))]
        diff = max(float((p - dict(reference.named_parameters())[n]).abs().max())
                   for n, p in model.named_parameters() if ".experts." not in n)
        mine = torch.tensor([held, ddp_bytes, skipped], dtype=torch.int64)
        rows = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        held_experts = [None] * world
        dist.all_gather_object(held_experts, experts)
        worst = worst_gap(norms, ref_norms)
        if rank == 0:
            lines = [
                f"selzero demo: {world} processes (gloo), expert parallelism {ep} "
                f"(expert-data-parallel groups of {world // ep}), {cfg.layers} MoE layers x "
                f"{NUM_EXPERTS} experts, AdamW, {steps} steps",
                "tokens travel to the rank holding their expert (all-to-all) and back; selzero "
                "shards each group's experts, DDP the rest",
                "",
                f"  {'rank':<6}{'experts held':<16}{'selzero':>12}{'DDP + AdamW':>14}"
                f"{'ratio':>8}",
            ]
            for r in range(world):
                h, d, _ = (int(v) for v in rows[r])
                lines.append(f"  {r:<6}{str(held_experts[r]):<16}{_kib(h):>12}{_kib(d):>14}"
                             f"{h / d:>8.2f}")
            lines += [
                "",
                f"global grad norm, step 1: {norms[0]:.6f} (one process with every expert: "
                f"{ref_norms[0]:.6f}); step {steps}: {norms[-1]:.6f} ({ref_norms[-1]:.6f}); "
                f"largest relative gap {worst:.1e}",
                f"dense layers vs the one-process reference after {steps} steps: max |diff| "
                f"{diff:.1e}",
                f"expert updates skipped (no token on any rank), per group: "
                f"{[int(rows[r][2]) for r in range(ep)]} parameter updates",
                f"training time: {train_s:.1f} s",
            ]
            print("\n".join(lines), flush=True)
        failed = torch.tensor([int(diff > 1e-5 or worst > 1e-4)])
        dist.all_reduce(failed)
        if int(failed):
            raise RuntimeError("selzero demo --ep failed: the run left the one-process reference")
        sz.remove_hooks()
    finally:
        dist.destroy_process_group()


def worst_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / y for x, y in zip(a, b))


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m selzero_plugin.demo_ep")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ep", type=int, required=True)
    args, _ = parser.parse_known_args(argv)
    _quiet()
    worker(args.steps, args.ep)
    return 0


if __name__ == "__main__":
    from selzero_plugin.process_exit import exit_after

    exit_after(_main)
