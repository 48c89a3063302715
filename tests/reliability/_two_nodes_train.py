"""Training program for tests/reliability/test_two_nodes.py, run under torchrun (gloo, CPU).

A small expert-parallel MoE (selzero_plugin.moe.ExpertParallelMoE, real token exchange) over a
*logical* world of 4 data ranks. Two selzero instances and a host done by hand:

- ``experts``: the experts, over the expert-data-parallel groups of
  ``expert_data_parallel(EP)`` (EP 2 at world 4: expert-parallel groups {0, 1} and {2, 3},
  i.e. one per "node" of a 2 x 2 launch; expert-data-parallel groups {0, 2} and {1, 3}, i.e.
  across the nodes), named ``experts-ep{ep_rank}``. Its group rank is ``rank // EP``: neither
  the global rank (ranks 1, 2, 3) nor the local rank of a 2 x 2 launch (ranks 1, 2).
- ``head``: the output layer, over the whole world (group rank = global rank, which is not the
  local rank of ranks 2 and 3 in a 2 x 2 launch).
- the rest (input layer, router): plain AdamW, gradients all-reduced and averaged by hand.

Every step: mean squared error on this rank's tokens, the global norm clipped over the host
and both instances (clip_grad_norm_), host step, both selzero steps. The batch and the routing
of logical rank ``l`` at step ``s`` are seeded by ``(s, l)``: they differ by GLOBAL rank; a
run of W < 4 processes gives process q the logical ranks ``q * 4 / W ...`` concatenated
(equal token counts, so its loss is the mean of theirs and the job's mean is the same).

Phases (both may be given; train runs first):
- ``--train DIR``: build (seeded), probe the contract error message over the
  expert-data-parallel group, train steps [0, --total), checkpoint at --save-at into DIR
  (``save_into``: selzero's index and one folder per instance; ``sz.save_checkpoint`` per
  instance into DIR/plain/<name>; the host's part, replicated, by rank 0 into DIR/dense.pt).
- ``--load DIR``: build (seeded), load DIR (dense.pt and ``load_from``), train steps
  [--save-at, --total).

Each process writes ``--out/rank{RANK}.pt`` (torch.save of plain tensors, lists and dicts).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from selzero_plugin import ContractError, SelectedZero2, clip_grad_norm_  # noqa: E402
from selzero_plugin.checkpoint.host import load_from, save_into  # noqa: E402
from selzero_plugin.groups import expert_data_parallel  # noqa: E402
from tests.test_expert_parallel import DIM, EXPERTS, EPModel as Net  # noqa: E402

TOKENS, LOGICAL, CLIP, LR, WD = 10, 4, 0.3, 1e-2, 0.1
DEAD = EXPERTS - 1  # never routed anywhere
HOST = ("inp.", "moe.router.")


def data_rank() -> int:
    """The rank that seeds this process's data: the GLOBAL rank."""
    return int(os.environ["RANK"])


def logical_batch(step: int, logical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + logical)
    x, y = torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, 3, generator=g)
    # logical rank l leans on experts l, l + 1, ... and never routes to expert (l + 3) % 7;
    # some tokens go to no expert; expert 7 gets no token anywhere
    routes = (logical + torch.randint(0, 5, (TOKENS,), generator=g)) % DEAD
    routes[routes == (logical + 3) % DEAD] = -1
    return x, y, routes


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per = LOGICAL // world
    parts = [logical_batch(step, data_rank() * per + i) for i in range(per)]
    return tuple(torch.cat([p[k] for p in parts]) for k in range(3))  # type: ignore[return-value]


def build(ep: int):
    groups = expert_data_parallel(ep)
    torch.manual_seed(0)
    start = Net()  # every expert, as a one-process model would start
    model = Net(groups.expert_parallel)
    model.inp.load_state_dict(start.inp.state_dict())
    model.out.load_state_dict(start.out.state_dict())
    model.moe.router.load_state_dict(start.moe.router.state_dict())
    for i, expert in enumerate(model.moe.experts):
        expert.load_state_dict(start.moe.experts[model.moe.global_expert(i)].state_dict())
    experts = SelectedZero2(model, {"params": ["moe.experts.*"], "normalize_over": "world",
                                    "name": "experts"},
                            torch.optim.AdamW, {"lr": LR, "weight_decay": WD}, group=groups)
    head = SelectedZero2(model, {"params": ["out.*"], "name": "head"}, torch.optim.AdamW,
                         {"lr": LR, "weight_decay": WD})
    dense = [p for n, p in model.named_parameters() if n.startswith(HOST)]
    host = torch.optim.AdamW(dense, lr=LR, weight_decay=WD)
    return groups, model, experts, head, dense, host


def global_params(model: Net) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, experts under their GLOBAL index."""
    out = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." not in n}
    for i, expert in enumerate(model.moe.experts):
        for n, p in expert.named_parameters():
            out[f"moe.experts.{model.moe.global_expert(i)}.{n}"] = p.detach().clone()
    return out


def describe(sz: SelectedZero2) -> dict:
    return {"name": sz.config.name, "rank": sz.comm.rank, "size": sz.comm.size,
            "ranks": list(sz.comm.global_ranks), "selected": list(sz.selected_names),
            "expert_parallel": sz.expert_parallel}


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def probe(groups) -> list[str]:
    """A contract mismatch on global rank 2 (group rank 1 of expert-data-parallel group
    {0, 2}): what each rank of that group is told (naming group ranks, not global or local)."""
    tiny = nn.Linear(3, 2)
    lr = 0.2 if dist.get_rank() == 2 else 0.1
    try:
        SelectedZero2(tiny, {"params": ["*"], "name": "probe", "normalize_over": "world"},
                      torch.optim.SGD, {"lr": lr}, group=groups).remove_hooks()
    except ContractError as e:
        return [str(e)]
    return []


def train_steps(model, experts, head, dense, host, first: int, last: int, world: int
                ) -> tuple[list[float], list[float], list[int]]:
    losses, norms, skipped = [], [], []
    for step in range(first, last):
        x, y, routes = batch(step, world)
        loss = (model(x, routes) - y).pow(2).mean()
        loss.backward()
        for p in dense:  # the host, by hand: DDP's mean over the world
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        norms.append(float(clip_grad_norm_(dense, CLIP, subsets=[experts, head])))
        host.step()
        skipped.append(experts.step().skipped_absent + head.step().skipped_absent)
        host.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms, skipped


def run_train(args, world: int) -> dict:
    rank = dist.get_rank()
    groups, model, experts, head, dense, host = build(args.ep)
    result = {"probe": probe(groups), "experts": describe(experts), "head": describe(head),
              "initial": global_params(model)}
    ckpt = Path(args.train)
    losses, norms, skipped = train_steps(model, experts, head, dense, host, 0, args.save_at,
                                         world)
    result["at_save"] = global_params(model)
    save_into(ckpt, [experts, head])
    for sz in (experts, head):
        sz.save_checkpoint(ckpt / "plain" / sz.config.name)
    if rank == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()
                               if n.startswith(HOST)}, "host": host.state_dict()},
                   ckpt / "dense.pt")
    dist.barrier()
    result["listing"] = listing(ckpt)
    more = train_steps(model, experts, head, dense, host, args.save_at, args.total, world)
    result.update(losses=losses + more[0], norms=norms + more[1], skipped=skipped + more[2],
                  final=global_params(model))
    experts.remove_hooks()
    head.remove_hooks()
    return result


def run_load(args, world: int) -> dict:
    groups, model, experts, head, dense, host = build(args.ep)
    ckpt = Path(args.load)
    saved = torch.load(ckpt / "dense.pt", weights_only=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith(HOST):
                p.copy_(saved["params"][n])
    host.load_state_dict(saved["host"])
    load_from(ckpt, [experts, head])
    result = {"experts": describe(experts), "head": describe(head),
              "after_load": global_params(model)}
    losses, norms, skipped = train_steps(model, experts, head, dense, host, args.save_at,
                                         args.total, world)
    result.update(losses=losses, norms=norms, skipped=skipped, final=global_params(model))
    experts.remove_hooks()
    head.remove_hooks()
    return result


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--train", default=None, help="checkpoint folder to write")
    parser.add_argument("--load", default=None, help="checkpoint folder to resume from")
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--save-at", type=int, required=True)
    parser.add_argument("--total", type=int, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    records = _Records()
    logging.getLogger("selzero_plugin").addHandler(records)
    logging.getLogger("selzero_plugin").setLevel(logging.DEBUG)
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE",
                                          "LOCAL_WORLD_SIZE", "ROLE_RANK")}
    print(f"[global rank {rank}/{world}] local rank {env['LOCAL_RANK']}, node "
          f"{env['GROUP_RANK']}", flush=True)
    result: dict = {"rank": rank, "world": world, "env": env}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.train:
            result["train"] = run_train(args, world)
        if args.load:
            result["load"] = run_load(args, world)
    result["warnings"] = [str(w.message) for w in caught]
    result["logs"] = records.lines
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
