"""Global-norm clipping runs: selzero + DDP vs torch.nn.utils.clip_grad_norm_ on one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_, wrap_ddp

from .models import loss_fn, make_batch
from .parity import OPTIMIZERS, build_model, routes_for

__all__ = ["VARIANTS", "reference", "clipped_run", "clipped_many", "ep_norms", "EP_SIZE"]

TOKENS = 6
NUM_EXPERTS = 4
VARIANTS = ("api", "phases")
"""`api`: clip_grad_norm_(model.parameters(), max_norm, subsets=[sz]); `phases`: the host norm by
hand plus reduce_gradients -> grad_norm_squared -> scale_gradients_ -> step."""


def _batch_loss(model: Any, s: int, r: int) -> torch.Tensor:
    return loss_fn(model, *make_batch(s, r), routes_for(s, r, TOKENS, NUM_EXPERTS, "uneven"))


def reference(world: int, opt: str, max_norm: float, steps: int = 5) -> dict[str, Any]:
    """One process: mean of the ranks' losses, torch's clip_grad_norm_ over every parameter."""
    model = build_model(num_experts=NUM_EXPERTS)
    cls, kwargs = OPTIMIZERS[opt]
    optimizer = cls(model.parameters(), **kwargs)
    norms = []
    for s in range(steps):
        torch.stack([_batch_loss(model, s, r) for r in range(world)]).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "norms": norms}


def clipped_run(rank: int, world: int, opt: str, variant: str, max_norm: float,
                steps: int = 5) -> dict[str, Any]:
    model = build_model(num_experts=NUM_EXPERTS)
    cls, kwargs = OPTIMIZERS[opt]
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"]), cls, kwargs)
    selected = {id(e.param) for e in sz.entries}
    host_params = [p for p in model.parameters() if id(p) not in selected]
    host = cls(host_params, **kwargs)
    ddp = wrap_ddp(model, sz)
    norms = []
    for s in range(steps):
        _batch_loss(ddp, s, rank).backward()
        if variant == "api":
            norms.append(float(clip_grad_norm_(model.parameters(), max_norm, subsets=[sz])))
        else:
            sz.reduce_gradients()
            host_sq = sum(float(p.grad.pow(2).sum()) for p in host_params if p.grad is not None)
            total = (host_sq + float(sz.grad_norm_squared())) ** 0.5
            coef = min(1.0, max_norm / (total + 1e-6))
            for p in host_params:
                if p.grad is not None:
                    p.grad.mul_(coef)
            sz.scale_gradients_(coef)
            norms.append(total)
        host.step()
        sz.step()
        host.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "norms": norms}


def clipped_many(rank: int, world: int, cases: list[tuple[str, str, float]]) -> list[dict[str, Any]]:
    return [clipped_run(rank, world, opt, variant, max_norm) for opt, variant, max_norm in cases]


# ---- expert parallelism: two instances over disjoint expert groups -------------------------

EP_SIZE = 2  # ranks (2 d, 2 d + 1) exchange tokens; rank r holds experts of ep_rank = r % 2


def local_experts(ep_rank: int) -> list[int]:
    per = NUM_EXPERTS // EP_SIZE
    return list(range(ep_rank * per, (ep_rank + 1) * per))


def ep_norms(rank: int, world: int, steps: int = 2) -> list[dict[str, float]]:
    """World 4 = 2 expert-parallel ranks x 2 data-parallel replicas. Rank r holds the experts
    of ep_rank r % 2 and one selzero instance over them on its expert-data-parallel group
    {r % 2, r % 2 + 2}, normalize_over="world". Expert parallelism is simulated: each rank
    backpropagates the summed losses of its expert-parallel group (the tokens an all-to-all
    would bring it), so its local experts' gradients arrive already summed over EP ranks."""
    groups = [dist.new_group([e, e + EP_SIZE]) for e in range(EP_SIZE)]  # every rank makes both
    ep_rank, dp_rank = rank % EP_SIZE, rank // EP_SIZE
    model = build_model(num_experts=NUM_EXPERTS)
    patterns = [f"experts.{e}.*" for e in local_experts(ep_rank)]
    sz = SelectedZero2(model, SelZeroConfig(params=patterns, normalize_over="world"),
                       torch.optim.SGD, {"lr": 0.1}, group=groups[ep_rank])
    out = []
    for s in range(steps):
        peers = range(dp_rank * EP_SIZE, (dp_rank + 1) * EP_SIZE)
        torch.stack([_batch_loss(model, s, r) for r in peers]).sum().backward()
        model.zero_grad(set_to_none=True)  # the dense part is not under test here
        sz.reduce_gradients()
        group_sq = float(sz.grad_norm_squared())
        world_sq = torch.tensor([group_sq])
        dist.all_reduce(world_sq)  # what summing every rank's group norm would give
        norm = float(clip_grad_norm_([], 1e9, subsets=[sz]))
        out.append({"norm": norm, "group_sq": group_sq, "naive_world_sq": float(world_sq[0])})
        sz.step()
        # The other EP rank's experts: its updated copy (an all-to-all would use it in place).
        for e, expert in enumerate(model.experts):
            owner = e // (NUM_EXPERTS // EP_SIZE)  # global rank of that ep_rank's replica 0
            for p in expert.parameters():
                dist.broadcast(p.data, src=owner)
    return out


def ep_reference_norms(world: int, steps: int = 2) -> list[float]:
    """Norm of the experts' gradient of the mean loss, with the same SGD updates of the experts."""
    model = build_model(num_experts=NUM_EXPERTS)
    experts = [p for n, p in model.named_parameters() if n.startswith("experts.")]
    optimizer = torch.optim.SGD(experts, lr=0.1)
    norms = []
    for s in range(steps):
        torch.stack([_batch_loss(model, s, r) for r in range(world)]).mean().backward()
        grads = [p.grad for p in experts if p.grad is not None]
        norms.append(float(torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()))
        optimizer.step()
        model.zero_grad(set_to_none=True)
    return norms
