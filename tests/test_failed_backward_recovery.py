"""Recovery from a backward that raised, as plain torch users do it (DESIGN.md "Micro-steps and
reduction points"; [Note: a backward that raised] in core/window.py).

Both ranks skip the same batch (an OOM inside backward) and do what a plain loop does:
``model.zero_grad()``, next batch. They fail at *different points* of their backward: one after
selzero opened the micro-step but before any bucket launched or any gradient arrived (at the
model's output), the other inside the first block, after two blocks' buckets launched (reduced
micro-steps) or their gradients were taken (``no_sync`` micro-steps). That is a skipped batch
on both, and training equals plain torch without that batch. After the failure rank 0 alone runs
a ``torch.no_grad()`` validation forward and every rank then joins a world all-reduce: dropping
the failed window must not issue a collective from that forward (it deadlocked). And a rank
that fails while its peer does not is an error on every rank (the dropped-window count).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch import nn
from torch.utils.checkpoint import checkpoint

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import Block, BlockMoE, block_batch, block_loss, block_routes, reference_blocks
from ._state import cached_outcomes, capture, value_of

pytestmark = pytest.mark.multiproc

LAYERS, STEPS, FAILED = 3, 4, 1
OPT = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


class SimulatedOOM(RuntimeError):
    pass


class _Fail(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, armed: bool) -> torch.Tensor:
        ctx.armed = armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.armed:
            raise SimulatedOOM("CUDA out of memory (simulated)")
        return grad, None


class FailingBlock(Block):
    """Fails inside the block: after its parameters' gradients, before its unit passes."""

    armed = False

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return super().forward(_Fail.apply(h, self.armed), routes)


class FailingMoE(BlockMoE):
    """``fail_at``: "loss" (in the loss's own backward, before the backward reaches the model:
    selzero's hooks hear nothing), "output" (the first op of the model's backward: selzero
    opened the micro-step, nothing else happened), "block0" (after blocks 2 and 1 passed), or
    None."""

    fail_at: str | None = None

    def __init__(self, host: bool = False) -> None:
        super().__init__(layers=LAYERS, block=FailingBlock)
        if not host:
            self.out.requires_grad_(False)  # no host: everything trainable is selzero's

    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            block.armed = self.fail_at == f"block{i}"
        return _Fail.apply(super().forward(x, routes), self.fail_at == "output")


def _build() -> FailingMoE:
    torch.manual_seed(0)
    return FailingMoE()


def _sz(model: FailingMoE, overlap: bool = True) -> SelectedZero2:
    return SelectedZero2(model, SelZeroConfig(params=["inp.*", "blocks.*"], bucket_mb=1e-4,
                                              overlap=overlap), OPT[0], OPT[1])


def _loss(model: FailingMoE, step: int, rank: int, pattern: str = "uneven") -> torch.Tensor:
    """block_loss, failing in the loss's own backward when ``model.fail_at == "loss"``."""
    x, y = block_batch(step, rank)
    out = model(x, block_routes(step, rank, layers=LAYERS, pattern=pattern))
    return (_Fail.apply(out, model.fail_at == "loss") - y).pow(2).mean()


def _validate_and_meet(model: FailingMoE, rank: int) -> None:
    """Rank 0 alone runs a validation forward; then every rank joins a world collective."""
    if rank == 0:
        with torch.no_grad():
            block_loss(model, 99, rank, layers=LAYERS)
    dist.all_reduce(torch.zeros(1))


def reduced_run(rank: int, world: int, fail_at: tuple[str, str], overlap: bool,
                failed: tuple[int, ...] = (FAILED,)) -> dict[str, Any]:
    """One backward per step; at the steps ``failed`` rank r fails at ``fail_at[r]``."""
    model = _build()
    sz = _sz(model, overlap)
    updated = []
    for step in range(STEPS):
        model.fail_at = fail_at[rank] if step in failed else None
        loss = _loss(model, step, rank)
        try:
            loss.backward()
        except SimulatedOOM:
            model.zero_grad(set_to_none=True)
            _validate_and_meet(model, rank)
            continue
        updated.append(sz.step().updated)
    model.fail_at = None
    return {"state": _state(model), "updated": updated}


def no_sync_run(rank: int, world: int, fail_at: tuple[str, str], forward_only: bool = False
                ) -> dict[str, Any]:
    """Two micro-steps per step, the first inside ``sz.no_sync()`` (``forward_only``: around
    its forward only, as DDP users write it: the mode is taken at forward time); at step FAILED
    the first fails (rank r at ``fail_at[r]``) and the loop goes on with the second."""
    model = _build()
    sz = _sz(model)
    for step in range(STEPS):
        for micro in range(2):
            model.fail_at = fail_at[rank] if (step, micro) == (FAILED, 0) else None
            try:
                with sz.no_sync() if micro == 0 else contextlib.nullcontext():
                    loss = _loss(model, 2 * step + micro, rank) / 2
                    if not forward_only:
                        loss.backward()
                if forward_only:
                    loss.backward()
            except SimulatedOOM:
                model.zero_grad(set_to_none=True)
                _validate_and_meet(model, rank)
        sz.step()
    model.fail_at = None
    return {"state": _state(model)}


def host_run(rank: int, world: int) -> dict[str, Any]:
    """Only the experts are selzero's, a host trains the rest (gradients averaged by hand). In
    the failed batch rank 1's tokens reach no expert and its backward fails in the loss; rank 0's
    fails inside block 0: a backward that raised before selzero heard of it is a failed
    micro-step all the same when it would have opened one (whatever the routing)."""
    torch.manual_seed(0)
    model = FailingMoE(host=True)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-4),
                       OPT[0], OPT[1])
    host = [p for n, p in model.named_parameters() if ".experts." not in n]
    opt = OPT[0](host, **OPT[1])
    for step in range(STEPS):
        failing = step == FAILED
        model.fail_at = ("block0", "loss")[rank] if failing else None
        loss = _loss(model, step, rank, "none" if failing and rank == 1 else "uneven")
        try:
            loss.backward()
        except SimulatedOOM:
            model.zero_grad(set_to_none=True)
            _validate_and_meet(model, rank)
            continue
        for p in host:
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        sz.step()
    model.fail_at = None
    return {"state": _state(model)}


class ScaledInput(nn.Module):
    """The whole model under a reentrant activation checkpoint, as a user wraps it, and a
    learnable input scale outside it: selzero's first event of the backward comes from the
    checkpoint's inner backward, whose end closes the micro-step before the outer one ends."""

    def __init__(self, model: FailingMoE) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(7))
        self.model = model

    def loss(self, step: int, rank: int, fail_at: str | None) -> torch.Tensor:
        x, y = block_batch(step, rank)
        x = _Fail.apply(x * self.scale, fail_at == "input")
        out = checkpoint(self.model, x, block_routes(step, rank, layers=LAYERS),
                         use_reentrant=True)
        return (_Fail.apply(out, fail_at == "loss") - y).pow(2).mean()


def _checkpointed() -> ScaledInput:
    return ScaledInput(_build())


def checkpointed_run(rank: int, world: int) -> dict[str, Any]:
    """At step FAILED rank 0 fails on the input path (after the model's backward), rank 1 in
    the loss (before it)."""
    outer = _checkpointed()
    sz = _sz(outer.model)
    opt = OPT[0]([outer.scale], **OPT[1])
    for step in range(STEPS):
        try:
            outer.loss(step, rank, ("input", "loss")[rank] if step == FAILED else None).backward()
        except SimulatedOOM:
            outer.zero_grad(set_to_none=True)
            continue
        dist.all_reduce(outer.scale.grad)
        outer.scale.grad /= world
        opt.step()
        opt.zero_grad(set_to_none=True)
        sz.step()
    return {"state": _state(outer)}


def one_rank_fails(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 fails a batch its peer trains on; the loop steps anyway (no zero_grad)."""
    model = _build()
    sz = _sz(model)
    model.fail_at = "block0" if rank == 0 else None
    try:
        block_loss(model, 0, rank, layers=LAYERS).backward()
    except SimulatedOOM:
        model.zero_grad(set_to_none=True)
    return capture(sz.step)


def _state(model: FailingMoE) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


REDUCED = [(("output", "block0"), True), (("block0", "output"), True),
           (("output", "block0"), False), (("loss", "block0"), True)]
NO_SYNC = [("output", "block0"), ("block0", "output")]


def _all(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {("reduced", *c): capture(lambda c=c: reduced_run(rank, world, *c))
                           for c in REDUCED}
    out.update({("no_sync", c): capture(lambda c=c: no_sync_run(rank, world, c))
                for c in NO_SYNC})
    out["no_sync_forward"] = capture(lambda: no_sync_run(rank, world, ("loss", "block0"), True))
    out["twice"] = capture(lambda: reduced_run(rank, world, ("loss", "block0"), True,
                                               (FAILED, FAILED + 1)))
    out["host"] = capture(lambda: host_run(rank, world))
    out["checkpointed"] = capture(lambda: checkpointed_run(rank, world))
    out["one_rank"] = capture(lambda: one_rank_fails(rank, world))
    return out


_outcomes = cached_outcomes(_all, 2, timeout=180)


def _reference(micro_steps: int, failed: tuple[int, ...] = (FAILED,),
               build: Any = _build) -> dict[str, torch.Tensor]:
    if micro_steps == 1:
        return reference_blocks(2, [s for s in range(STEPS) if s not in failed], build, OPT,
                                layers=LAYERS)
    model = _build()  # two micro-steps per step, the first of step FAILED skipped
    optimizer = OPT[0](model.parameters(), **OPT[1])
    for step in range(STEPS):
        for micro in range(2):
            if (step, micro) == (FAILED, 0):
                continue
            losses = [block_loss(model, 2 * step + micro, r, layers=LAYERS) / 2
                      for r in range(2)]
            torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return _state(model)


def _check(runs: list[dict[str, Any]], ref: dict[str, torch.Tensor]) -> None:
    for run in runs:
        for k, v in ref.items():
            assert torch.allclose(run["state"][k], v, atol=1e-6, rtol=0), \
                (k, float((run["state"][k] - v).abs().max()))
    assert all(torch.equal(runs[0]["state"][k], runs[1]["state"][k]) for k in ref)


@pytest.mark.parametrize("fail_at,overlap", REDUCED,
                         ids=["output-block0", "block0-output", "output-block0-no_overlap",
                              "loss-block0"])
def test_ranks_failing_at_different_points_of_one_batch_both_skip_it(fail_at, overlap):
    runs = value_of(_outcomes(), ("reduced", fail_at, overlap))
    _check(runs, _reference(1))
    assert all(len(run["updated"]) == STEPS - 1 for run in runs)


@pytest.mark.parametrize("fail_at", NO_SYNC, ids=["output-block0", "block0-output"])
def test_a_no_sync_micro_step_that_failed_at_different_points_is_skipped_on_both(fail_at):
    _check(value_of(_outcomes(), ("no_sync", fail_at)), _reference(2))


def test_a_no_sync_forward_whose_backward_fails_before_the_model_is_a_local_micro_step():
    _check(value_of(_outcomes(), "no_sync_forward"), _reference(2))


def test_two_batches_in_a_row_that_fail_before_reaching_selzero_are_both_skipped():
    _check(value_of(_outcomes(), "twice"), _reference(1, (FAILED, FAILED + 1)))


def test_a_rank_whose_tokens_reach_no_expert_and_that_fails_in_the_loss_skips_too():
    def build() -> FailingMoE:
        torch.manual_seed(0)
        return FailingMoE(host=True)

    _check(value_of(_outcomes(), "host"), _reference(1, build=build))


def test_a_model_under_a_reentrant_checkpoint_skips_a_batch_failed_on_either_side():
    outer = _checkpointed()
    opt = OPT[0](outer.parameters(), **OPT[1])
    for step in range(STEPS):
        if step == FAILED:
            continue
        torch.stack([outer.loss(step, r, None) for r in range(2)]).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _check(value_of(_outcomes(), "checkpointed"), _state(outer))


def test_a_rank_that_alone_skips_a_batch_is_an_error_on_every_rank():
    for outcome in value_of(_outcomes(), "one_rank"):
        assert outcome.get("error") == "UsageError", outcome
        assert "dropped different numbers of windows" in outcome["message"]
