"""A GradScaler with selzero over groups smaller than the world (expert groups).

World 4, selzero over the experts in groups [0, 1] and [2, 3], the other parameters averaged over
every rank (what DDP does), one ``torch.amp.GradScaler`` per process, and at one step an inf in
an expert's gradient on rank 1 only. The host's replicas span every rank, so every rank must
skip that step and back the scale off together: review finding, group [0, 1] skipped while
group [2, 3] stepped the host and kept its scale, and the host's replicas diverged.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import BlockMoE, block_loss
from ._state import model_state
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

LAYERS, STEPS, INF_STEP = 2, 3, 1
INF_PARAM = "blocks.1.experts.0.w1.weight"  # routed on rank 1 at every step ("uneven")


def _run(rank: int, world: int, explicit: bool) -> dict[str, Any]:
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    config = SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-3,
                           reduction="weighted" if explicit else "mean",
                           normalize_over="world" if explicit else "group")
    sz = SelectedZero2(model, config, opt, group=groups[rank // 2])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scales, updated = [], []
    for step in range(STEPS):
        poison = model.get_submodule(INF_PARAM.rsplit(".", 1)[0]).weight.register_hook(
            lambda g: g * math.inf) if step == INF_STEP and rank == 1 else None
        scaler.scale(block_loss(model, step, rank, layers=LAYERS)).backward()
        for name, p in model.named_parameters():  # the host: averaged over every rank
            if "experts" not in name and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        if explicit:
            sz.reduce_gradients(weight=6)
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        updated.append(sz.step().updated)
        scales.append(scaler.get_scale())
        if poison is not None:
            poison.remove()
    state = model_state(model)
    sz.remove_hooks()
    return {"scales": scales, "updated": updated,
            "host": {k: v for k, v in state.items() if "experts" not in k}}


@pytest.mark.parametrize("explicit", [False, True], ids=["mean", "weighted-normalize_over"])
def test_an_overflow_in_one_expert_group_skips_the_step_and_backs_off_on_every_rank(explicit):
    values = all_values(run_ranks(_run, 4, explicit, timeout=150))
    for v in values:
        assert v["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], v["scales"]
        assert v["updated"][INF_STEP] == 0 and v["updated"][0] > 0 and v["updated"][2] > 0, \
            v["updated"]
    for v in values[1:]:  # the host's replicas stay equal
        for k, t in values[0]["host"].items():
            assert torch.equal(v["host"][k], t), k
