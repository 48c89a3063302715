"""A GradScaler with selzero over groups smaller than the world (expert groups, pipeline stages).

World 4, selzero over the experts in groups [0, 1] and [2, 3] with ``normalize_over="world"``
(expert groups: their gradients form one average), the other parameters averaged over every rank
(what DDP does), one ``torch.amp.GradScaler`` per process, and at one step an inf in an expert's
gradient on rank 1 only. The host's replicas span every rank, so every rank must skip that step
and back the scale off together: review finding, group [0, 1] skipped while group [2, 3] stepped
the host and kept its scale, and the host's replicas diverged.

Review findings on that fix: a group that raises inside ``scaler.unscale_`` (a missing gradient
under ``missing_grad="error"``) must not leave the other groups waiting in the world's
agreement; groups configured with different ``timeout_s`` must still meet; and two pipeline
stages, stage 0 backwarding ``torch.autograd.backward(out, grad)`` with the gradient received
from stage 1 (which scaled the loss), must see stage 0's experts unscaled (they were stepped
``scale`` times too large), also when stage 1 has no MoE (no selzero instance: the stages'
agreements must not meet, review finding); and ranks of one group whose window holds ``no_sync``
gradients on one rank only (its tokens reached no expert) must not disagree whether to unscale.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import Block, BlockMoE, block_loss
from ._state import model_state
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

LAYERS, STEPS, INF_STEP = 2, 3, 1
INF_PARAM = "blocks.1.experts.0.w1.weight"  # routed on rank 1 at every step ("uneven")


def _expert_groups(rank: int, momentum: float = 0.0, **config: Any
                   ) -> tuple[BlockMoE, torch.optim.Optimizer, SelectedZero2]:
    """The model, its SGD host optimizer, and selzero over the experts in group [0, 1] or
    [2, 3]."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-3,
                                            **config), opt, group=groups[rank // 2])
    return model, opt, sz


def _run(rank: int, world: int, explicit: bool, mixed: bool = False) -> dict[str, Any]:
    """``mixed``: only group [0, 1] calls ``scaler.unscale_(opt)`` before ``scaler.step(opt)``
    (to clip, say); group [2, 3] leaves it to ``step``."""
    import torch.distributed as dist

    model, opt, sz = _expert_groups(rank, 0.9, reduction="weighted" if explicit else "mean",
                                    normalize_over="world")
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
        if not mixed or rank < 2:
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


@pytest.mark.parametrize("explicit,mixed", [(False, False), (True, False), (False, True)],
                         ids=["mean", "weighted", "unscale_-on-one-group"])
def test_an_overflow_in_one_expert_group_skips_the_step_and_backs_off_on_every_rank(explicit,
                                                                                   mixed):
    values = all_values(run_ranks(_run, 4, explicit, mixed, timeout=150))
    for v in values:
        assert v["scales"] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9], v["scales"]
        assert v["updated"][INF_STEP] == 0 and v["updated"][0] > 0 and v["updated"][2] > 0, \
            v["updated"]
    for v in values[1:]:  # the host's replicas stay equal
        for k, t in values[0]["host"].items():
            assert torch.equal(v["host"][k], t), k


def _missing(rank: int, world: int) -> dict[str, Any]:
    """Group [0, 1] misses an expert's gradient on rank 1 under ``missing_grad="error"``."""
    model, opt, sz = _expert_groups(rank, normalize_over="world", missing_grad="error",
                                    timeout_s=60)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = model_state(model)
    scaler.scale(block_loss(model, 0, rank, layers=LAYERS,
                            pattern="skewed" if rank == 0 else "uneven")).backward()
    start = time.monotonic()
    try:
        scaler.step(opt)
        error = ""
    except Exception as e:  # noqa: BLE001 - the outcome is compared
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    changed = [k for k, v in model_state(model).items() if not torch.equal(before[k], v)]
    sz.remove_hooks()
    return {"error": error, "seconds": seconds, "changed": changed}


def test_a_group_that_raises_inside_unscale_is_an_error_on_every_rank_at_once():
    values = all_values(run_ranks(_missing, 4, timeout=150))
    assert [v["error"].split(":")[0] for v in values] == \
        ["MissingGradientError"] * 2 + ["UsageError"] * 2, values
    assert all("another group" in v["error"] for v in values[2:]), values
    assert all(v["seconds"] < 30 and not v["changed"] for v in values), values


def _timeouts(rank: int, world: int) -> dict[str, Any]:
    """Groups [0, 1] and [2, 3] with different ``timeout_s``; one scaled step."""
    model, opt, sz = _expert_groups(rank, timeout_s=60 if rank < 2 else 70)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(block_loss(model, 0, rank, layers=LAYERS)).backward()
    scaler.step(opt)
    scaler.update()
    updated = sz.step().updated
    sz.remove_hooks()
    return {"updated": updated}


def test_groups_with_different_timeouts_agree_the_scalers_flag():
    assert all(v["updated"] > 0 for v in all_values(run_ranks(_timeouts, 4, timeout=150)))


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(7, 7)
        self.block = Block(3, 7, 13)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.inp(x)), routes)


def _pipeline(rank: int, world: int, scale: float, moe_stages: int = 2) -> dict[str, Any]:
    """Stage 0 on ranks [0, 1], stage 1 on [2, 3]; each stage's experts sharded over its
    data-parallel group, its other parameters averaged over it; 2 steps. ``moe_stages=1``: stage
    1's experts are plain parameters of its host (no selzero instance there)."""
    import torch.distributed as dist

    stage, peer = rank // 2, rank % 2
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(stage)
    model = _Stage()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sz = SelectedZero2(model, SelZeroConfig(params=["block.experts.*"], bucket_mb=1e-3),
                       opt, group=groups[stage]) if stage < moe_stages else None
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale != 1.0)
    routes = torch.tensor([0, 1, 0, 1, 2, 0])
    for step in range(2):
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(10 * step + peer))
        if stage == 0:
            y = model(x, routes)
            dist.send(y.detach().contiguous(), rank + 2)
            grad = torch.empty_like(y)
            dist.recv(grad, rank + 2)
            torch.autograd.backward(y, grad)
            scaler.scale(torch.zeros(()))  # (torch's scaler sets its scale at the first scale())
        else:
            act = torch.empty(6, 7)
            dist.recv(act, rank - 2)
            act.requires_grad_(True)
            scaler.scale(model(act, routes).pow(2).mean()).backward()
            dist.send(act.grad.contiguous(), rank - 2)
        for name, p in model.named_parameters():  # the host: averaged over the stage's group
            if (sz is None or "experts" not in name) and p.grad is not None:
                dist.all_reduce(p.grad, group=groups[stage])
                p.grad /= 2
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if sz is not None:
            sz.step()
    state = model_state(model)
    if sz is not None:
        sz.remove_hooks()
    return state


@pytest.mark.parametrize("moe_stages", [2, 1])
def test_a_pipeline_stage_that_backwards_a_received_gradient_is_unscaled(moe_stages):
    """The scale is a power of two: the scaled run equals the unscaled one bit for bit."""
    plain = all_values(run_ranks(_pipeline, 4, 1.0, moe_stages, timeout=150))
    scaled = all_values(run_ranks(_pipeline, 4, 1024.0, moe_stages, timeout=150))
    for a, b in zip(plain, scaled):
        for k, v in a.items():
            assert torch.equal(v, b[k]), (k, float((v - b[k]).abs().max()))


def _local_only(rank: int, world: int, scale: float, idle: tuple[int, ...]) -> dict[str, Any]:
    """Two ``no_sync`` micro-steps of a received-gradient backward (a pipeline stage's), the
    tokens of the ranks ``idle`` reaching no expert, then the scaler's step and ``sz.step()``.
    World 2: the group is the world; world 4: expert groups [0, 1] and [2, 3] under
    ``normalize_over="world"``."""
    import torch.distributed as dist

    from ._blocks import block_batch, block_routes

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else None
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-3,
                                            timeout_s=60, normalize_over="world"), opt,
                       group=groups[rank // 2] if groups else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=scale != 1.0)
    for micro in range(2):
        x, _ = block_batch(micro, rank)
        routes = block_routes(micro, rank, layers=LAYERS,
                              pattern="none" if rank in idle else "uneven")
        with sz.no_sync():
            y = model(x, routes)
            torch.autograd.backward(y, torch.ones_like(y) * scale)
    scaler.scale(torch.zeros(()))
    for name, p in model.named_parameters():
        if "experts" not in name and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world
    scaler.step(opt)
    scaler.update()
    updated = sz.step().updated
    state = model_state(model)
    sz.remove_hooks()
    return {"updated": updated, "state": state}


@pytest.mark.parametrize("world,idle", [(2, (1,)), (4, (2, 3))], ids=["group", "expert-groups"])
def test_no_sync_gradients_on_some_ranks_only_are_unscaled_on_every_rank(world, idle):
    """Every rank steps (they hung: at world 2 rank 0 unscaled and rank 1 did not; at world 4
    group [2, 3], holding nothing, never met group [0, 1]), equal to the unscaled run bit for
    bit (such gradients were stepped 1024 times too large)."""
    plain = all_values(run_ranks(_local_only, world, 1.0, idle, timeout=150))
    scaled = all_values(run_ranks(_local_only, world, 1024.0, idle, timeout=150))
    assert any(v["updated"] > 0 for v in plain)
    for a, b in zip(plain, scaled):
        assert b["updated"] == a["updated"]
        for k, v in a["state"].items():
            assert torch.equal(v, b["state"][k]), (k, float((v - b["state"][k]).abs().max()))
