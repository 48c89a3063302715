"""selzero beside an FSDP2 host (raw ``fully_shard`` on gloo): the selected parameters are
``ignored_params`` of every ``fully_shard``, so they stay plain tensors whose gradients selzero
takes; the host optimizer runs over *all* of the model's parameters with ``foreach=True``
(stock FSDP2 breaks on such mixed DTensor/plain lists, pytorch#183207: here the selected ones
have no gradient at the host's step)."""

from __future__ import annotations

from typing import Any

import torch

from ._blocks import BlockMoE, block_loss

LAYERS, LR, WD, CLIP = 2, 1e-2, 0.1, 0.05


def fsdp2_run(rank: int, world: int, steps: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_

    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-4),
                       torch.optim.AdamW, {"lr": LR, "weight_decay": WD})
    ignored = {e.param for e in sz.entries}
    for block in model.blocks:
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)
    host = [p for p in model.parameters() if p not in ignored]
    norms = []
    for step in range(steps):
        block_loss(model, step, rank, layers=LAYERS).backward()
        norms.append(float(clip_grad_norm_(host, CLIP, subsets=[sz])))
        opt.step()
        sz.step()
        opt.zero_grad(set_to_none=True)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}
    return {"params": full, "norms": norms,
            "dtensors": sum(hasattr(p, "full_tensor") for p in model.parameters()),
            "plain_selected": all(not hasattr(p, "full_tensor") for p in ignored)}


def fsdp2_reference(world: int, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        (sum(block_loss(model, step, r, layers=LAYERS) for r in range(world)) / world).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms
