"""Backward passes that are not plain ``loss.backward()`` after one forward (found in review):
forwards that are never backwarded, DDP's forward-only ``no_sync()``, input-gradient penalties
(``autograd.grad``), launch units that change their input in place, blocks run in another order
than they are registered, usage errors raised inside backward, two instances on one group, and
numpy token counts. Each against plain torch / DDP or the documented error."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from selzero_plugin import SelectedZero2, SelZeroConfig, UsageError, wrap_ddp
from selzero_plugin.memtrace import track_allocations

from ._blocks import Block, BlockMoE, SkippingMoE, block_batch, block_loss, block_routes
from ._state import cached_outcomes, capture, value_of

LAYERS = 2
SGD = (torch.optim.SGD, {"lr": 0.1})


def _split(model: nn.Module, use_sz: bool, **config: Any) -> tuple[Any, torch.optim.Optimizer]:
    if not use_sz:
        return None, torch.optim.SGD(model.parameters(), lr=0.1)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], **config), *SGD)
    selected = {id(e.param) for e in sz.entries}
    return sz, torch.optim.SGD([p for p in model.parameters() if id(p) not in selected], lr=0.1)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- multi-rank scenarios (one spawn for all) -----------------------------------------------

def forward_only_no_sync(rank: int, world: int, use_sz: bool) -> dict[str, torch.Tensor]:
    """torch's documented pattern: only the forward inside ddp.no_sync()."""
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz, host = _split(model, use_sz)
    ddp = wrap_ddp(model, sz) if use_sz else DDP(model, find_unused_parameters=True)
    for step in range(2):
        for micro in range(2):
            if micro == 0:
                with ddp.no_sync():
                    loss = block_loss(ddp, 2 * step + micro, rank, layers=LAYERS) / 2
            else:
                loss = block_loss(ddp, 2 * step + micro, rank, layers=LAYERS) / 2
            loss.backward()
        host.step()
        if sz is not None:
            sz.step()
        host.zero_grad(set_to_none=True)
    return _state(model)


def forwards_without_backward(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 alone runs an extra grad-enabled forward that is never backwarded (a debug or
    validation forward), and every rank runs two forwards but backwards only the first."""
    from .test_backward_memory import D, EXPERTS, H, _padded_fp32_bytes

    torch.manual_seed(0)
    model = BlockMoE(layers=4, num_experts=EXPERTS, d=D, h=H)
    bucket = _padded_fp32_bytes(model.blocks[0].experts.parameters(), world)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"],
                                            bucket_mb=bucket / 2 ** 20), *SGD)
    pooled = sz.collectives.pool.kept_bytes
    peaks = []  # buckets alive at most: the pool's plus those allocated inside the backward
    for step in range(3):
        if rank == 0:
            block_loss(model, 100 + step, rank, layers=4, d=D, tokens=8, num_experts=EXPERTS)
        loss = block_loss(model, step, rank, layers=4, d=D, tokens=8, num_experts=EXPERTS)
        block_loss(model, 200 + step, rank, layers=4, d=D, tokens=8, num_experts=EXPERTS)
        with track_allocations() as trace:
            loss.backward()
        peaks.append((trace.peak + pooled) / bucket)
        sz.step()
    return {"peaks": peaks}


def usage_errors_in_backward(rank: int, world: int) -> list[str]:
    """selzero's own usage error raised inside a backward; then what a plain loop does next."""
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz, _ = _split(model, True)
    log = []
    block_loss(model, 0, rank, layers=LAYERS).backward()
    sz.reduce_gradients()  # e.g. clip_grad_norm_, then the loop skips this step
    for step in (1, 2):
        try:
            block_loss(model, step, rank, layers=LAYERS).backward()
            log.append(f"updated {sz.step().updated}")
        except UsageError as e:
            log.append("UsageError" + (" step()" if "step()" in str(e) else ""))
    block_loss(model, 3, rank, layers=LAYERS).backward()  # reduced, not closed
    try:
        with sz.no_sync():
            block_loss(model, 4, rank, layers=LAYERS).backward()
    except UsageError:
        log.append("UsageError no_sync")
    model.zero_grad()
    block_loss(model, 5, rank, layers=LAYERS).backward()
    log.append(f"updated {sz.step().updated}")
    return log


def two_instances_one_group(rank: int, world: int) -> dict[str, Any]:
    """Instance A on block 1's experts, B on block 0's, both on the default group; rank 1 skips
    block 1 once: A raises the agreed error, B must still be exact."""
    def build() -> SkippingMoE:
        torch.manual_seed(0)
        return SkippingMoE(layers=LAYERS)

    model, ref = build(), build()
    a = SelectedZero2(model, SelZeroConfig(params=["blocks.1.experts.*"], name="a",
                                           bucket_mb=1e-4), *SGD)
    b = SelectedZero2(model, SelZeroConfig(params=["blocks.0.experts.*"], name="b",
                                           bucket_mb=1e-4), *SGD)
    model.skip = rank == 1
    block_loss(model, 0, rank, layers=LAYERS).backward()
    error = capture(a.step)
    b.step()
    # the reference for block 0's experts: the mean of both ranks' losses, as each rank ran it
    losses = []
    for r in range(world):
        ref.skip = r == 1
        losses.append(block_loss(ref, 0, r, layers=LAYERS))
    torch.stack(losses).mean().backward()
    diff = max(float((p.detach() - q.detach() + (0 if q.grad is None else 0.1 * q.grad))
                     .abs().max())
               for (n, p), q in zip(model.named_parameters(), ref.parameters())
               if n.startswith("blocks.0.experts."))
    return {"a_error": error.get("message", ""), "b_diff": diff}


def no_sync_ref(rank: int, world: int) -> dict[str, torch.Tensor]:
    return forward_only_no_sync(rank, world, False)


def no_sync_sz(rank: int, world: int) -> dict[str, torch.Tensor]:
    return forward_only_no_sync(rank, world, True)


SCENARIOS = {
    "no_sync_ref": no_sync_ref,
    "no_sync_sz": no_sync_sz,
    "forwards_without_backward": forwards_without_backward,
    "usage_errors": usage_errors_in_backward,
    "two_instances": two_instances_one_group,
}


def _all(rank: int, world: int) -> dict[str, Any]:
    return {k: capture(lambda fn=fn: fn(rank, world)) for k, fn in SCENARIOS.items()}


_outcomes = cached_outcomes(_all, 2, timeout=180)


@pytest.mark.multiproc
def test_a_forward_only_no_sync_equals_ddp():
    ref, got = value_of(_outcomes(), "no_sync_ref"), value_of(_outcomes(), "no_sync_sz")
    for r in range(2):
        assert all(torch.allclose(got[r][k], ref[r][k], atol=1e-6, rtol=0) for k in ref[r])


@pytest.mark.multiproc
def test_forwards_that_are_never_backwarded_change_nothing():
    for run in value_of(_outcomes(), "forwards_without_backward"):
        assert all(p < 2.5 for p in run["peaks"]), run  # bounded, and no false agreed error


@pytest.mark.multiproc
def test_a_usage_error_inside_backward_is_dropped_at_the_next_batch():
    for log in value_of(_outcomes(), "usage_errors"):
        assert log[0] == "UsageError step()" and log[1].startswith("updated"), log
        assert log[2] == "UsageError no_sync" and log[3].startswith("updated"), log
        assert all(int(line.split()[1]) > 0 for line in log if line.startswith("updated"))


@pytest.mark.multiproc
def test_two_instances_on_one_group_never_pair_their_collectives():
    for run in value_of(_outcomes(), "two_instances"):
        assert "launch unit(s) ['blocks.1']" in run["a_error"], run
        assert run["b_diff"] <= 1e-6, run


# ---- single process ---------------------------------------------------------------------------

def _penalty_run(use_sz: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz, host = _split(model, use_sz)
    for step in range(2):
        x, y = block_batch(step, 0)
        x.requires_grad_(True)
        out = model(x, block_routes(step, 0, layers=LAYERS, pattern="skewed"))
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # input-gradient penalty
        ((out - y).pow(2).mean() + 0.1 * gx.pow(2).sum()).backward()
        host.step()
        if sz is not None:
            assert sz.step().updated > 0
        host.zero_grad(set_to_none=True)
    return _state(model)


def test_an_input_gradient_penalty_is_not_a_backward():
    ref, got = _penalty_run(False), _penalty_run(True)
    assert all(torch.allclose(got[k], ref[k], atol=1e-6, rtol=0) for k in ref)


class InPlaceBlock(Block):
    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = h * 1.0
        return super().forward(torch.relu_(h), routes)


class InPlaceInputBlock(Block):
    """Modifies the tensor it was given (the launch unit's own input) in place."""

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.relu(h, inplace=True), routes)


class InPlaceMoE(BlockMoE):
    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = self.inp(x)  # not a leaf, free to be modified in place by the block
        for block, r in zip(self.blocks, routes):
            h = block(h, r)
        return self.out(h)


def _inplace_run(use_sz: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = InPlaceMoE(layers=LAYERS, block=InPlaceInputBlock)
    sz, host = _split(model, use_sz)
    for step in range(2):
        block_loss(model, step, 0, layers=LAYERS).backward()
        host.step()
        if sz is not None:
            sz.step()
        host.zero_grad(set_to_none=True)
    return _state(model)


def test_a_launch_unit_may_modify_its_input_in_place():
    ref, got = _inplace_run(False), _inplace_run(True)
    assert all(torch.allclose(got[k], ref[k], atol=1e-6, rtol=0) for k in ref)


class ReversedMoE(BlockMoE):
    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block, r in zip(reversed(self.blocks), routes):
            h = block(h, r)
        return self.out(h)


def test_blocks_run_in_another_order_than_registered_stay_bounded_after_one_step():
    from .test_backward_memory import D, EXPERTS, H, _padded_fp32_bytes

    torch.manual_seed(0)
    model = ReversedMoE(layers=4, num_experts=EXPERTS, d=D, h=H)
    bucket = _padded_fp32_bytes(model.blocks[0].experts.parameters(), 1)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"],
                                            bucket_mb=bucket / 2 ** 20), *SGD)
    pooled = sz.collectives.pool.kept_bytes  # CPU: 2 buckets
    peaks = []  # buckets alive at most: the pool's plus those allocated inside the backward
    for step in range(3):
        loss = block_loss(model, step, 0, layers=4, d=D, tokens=8, num_experts=EXPERTS)
        with track_allocations() as trace:
            loss.backward()
        peaks.append((trace.peak + pooled) / bucket)
        sz.step()
    assert peaks[0] > 3.5 and all(p < 2.5 for p in peaks[1:]), peaks  # like DDP's rebuild


def test_a_numpy_token_count_is_a_weight():
    model = nn.Linear(3, 2)
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], reduction="weighted"), *SGD)
    model(torch.randn(4, 3)).sum().backward()
    assert sz.step(weight=np.int64(4)).global_weight == 4
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(UsageError, match="every rank|invalid value") as info:
        sz.step(weight=np.float64(2.5))
    assert "did not make the same" not in str(info.value)
