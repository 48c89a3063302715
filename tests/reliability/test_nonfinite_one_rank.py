"""Reliability: a non-finite gradient on one rank only (DESIGN.md "Non-finite gradients").

The reduced shards are checked and the verdict is agreed across the group, so every rank takes
the same decision, whichever rank produced the inf/NaN and whichever rank's chunk holds it:
under ``nonfinite="error"`` every rank raises ``NonFiniteGradientError`` with the same message
(after its ``[rank r/N]`` prefix) naming exactly the bad parameter; under ``"skip"`` every rank
returns a ``StepResult`` with ``updated == 0`` and ``skipped_nonfinite`` equal to the number of
parameters that would have been updated, and the model (every parameter, the host's too), the
flat master buffer (empty here: fp32 parameters are their own masters) and the optimizer state
are bit-identical to before the step (under "error" too: nothing was updated). In both cases the next, finite step trains
normally: every rank equals a single-process ``torch.optim.AdamW`` reference that never saw the
bad batch (same weights after the step, so the skipped step left no step count behind either).

The model: a dense input and output layer (the host: ``torch.optim.AdamW`` over gradients
all-reduced by hand, skipped by the caller when selzero skips) around one block holding four
experts (``block.experts``, a ``ModuleList``) and fused experts (``block.fused``: three experts
stacked on dim 0, ``expert_dim=0``), all selected. Routing differs by rank: rank r sends its
tokens to its own expert r and to expert 3 (world 2: expert 2 gets no token anywhere), and to
fused experts r % 2 and 2; ranks have 4 + r tokens, so ``weighted`` differs from ``mean``.

The cases form a full grid (240 cases; ``test_the_grid_has_the_documented_size`` checks it):

- world 2 and 3, the bad rank being each rank in turn (5);
- the value: ``inf`` in the first element of the target (a chunk of group rank 0), ``-inf`` in
  its last element (a chunk of the last group rank), ``nan`` in every element (3);
- the target: an expert weight every rank routes to, an expert bias every rank routes to, the
  weight of the expert only the bad rank routes to, the row of one fused expert (4);
- ``nonfinite="error"`` and ``"skip"`` (2); reduction ``mean`` and ``weighted`` (2).

The value is put into the gradient on the bad rank only, by a hook on the target parameter that
runs before the gradient is accumulated (so selzero's hooks see it as the parameter's gradient).
The cases of one world size run in one spawn; those of one configuration (world, policy,
reduction: 36 or 24 of them) run one after another on one instance, each a bad step followed by
a finite one, so the instance also survives many faults in a row and the reference is plain
AdamW over the finite batches only. (A case that breaks the state makes the later cases of its
configuration fail too: the first failing one is the cause.) A non-finite *host* gradient seen
through ``clip_grad_norm_`` is tests/test_nonfinite_clip.py; a NaN in one expert group of
several, tests/test_subgroups.py.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from selzero_plugin import NonFiniteGradientError, SelectedZero2, SelZeroConfig, StepResult

from .._ckpt import FusedExperts
from .._state import cached_outcomes, capture, differences, snapshot, strip_rank_prefix, value_of
from ..models import D, H, Expert

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

EXPERTS, FUSED = 4, 3
SHARED = 3  # the expert every rank routes to
FUSED_SHARED = 2  # the fused expert every rank routes to
OPT = {"lr": 1e-2, "weight_decay": 0.1}

WORLDS = (2, 3)
VALUES = ("inf", "-inf", "nan")
TARGETS = ("expert_weight", "expert_bias", "own_expert", "fused")
POLICIES = ("error", "skip")
REDUCTIONS = ("mean", "weighted")
CASES = [(w, r, v, t, p, red) for w in WORLDS for r in range(w) for v in VALUES
         for t in TARGETS for p in POLICIES for red in REDUCTIONS]
DOCUMENTED_CASES = 240


class NFBlock(nn.Module):
    """The launch unit of the ModuleList experts; the fused experts are their own unit."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(D, H) for _ in range(EXPERTS))
        self.fused = FusedExperts(FUSED, D, 5)

    def forward(self, h: torch.Tensor, routes: torch.Tensor, fused_routes: torch.Tensor
                ) -> torch.Tensor:
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (routes == e).nonzero().flatten()
            if idx.numel():
                y = y.index_add(0, idx, expert(h[idx]))
        return h + y + self.fused(h, fused_routes)


class NFModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.block = NFBlock()
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, routes: torch.Tensor, fused_routes: torch.Tensor
                ) -> torch.Tensor:
        return self.out(self.block(torch.tanh(self.inp(x)), routes, fused_routes))


def build() -> NFModel:
    torch.manual_seed(0)
    return NFModel()


def tokens(rank: int) -> int:
    return 4 + rank


def rank_loss(model: nn.Module, batch: int, rank: int, reduction: str) -> torch.Tensor:
    """Rank ``rank``'s loss on batch ``batch``: the mean over its tokens under ``mean``, their
    sum under ``weighted`` (whose weight is the token count)."""
    n = tokens(rank)
    g = torch.Generator().manual_seed(1000 * batch + rank)
    x, y = torch.randn(n, D, generator=g), torch.randn(n, 3, generator=g)
    even = torch.arange(n) % 2 == 0
    routes = torch.where(even, torch.tensor(rank), torch.tensor(SHARED))
    fused_routes = torch.where(even, torch.tensor(rank % 2), torch.tensor(FUSED_SHARED))
    per_token = (model(x, routes, fused_routes) - y).pow(2).sum(-1)
    return per_token.mean() if reduction == "mean" else per_token.sum()


def target_name(target: str, bad_rank: int) -> str:
    """The parameter the bad value goes into, as selzero's messages name it."""
    return {"expert_weight": f"block.experts.{SHARED}.w1.weight",
            "expert_bias": f"block.experts.{SHARED}.w2.bias",
            "own_expert": f"block.experts.{bad_rank}.w2.weight",
            "fused": f"block.fused.gate_up[expert {FUSED_SHARED}]"}[target]


def present_count(world: int) -> int:
    """Virtual parameters that get a gradient on some rank: 5 per routed expert, plus one per
    fused expert of gate_up, down and bias (every fused expert is routed)."""
    routed = set(range(world)) | {SHARED}
    return 5 * len(routed) + 3 * FUSED


def _poison(value: str, target: str) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        flat = (grad[FUSED_SHARED] if target == "fused" else grad).view(-1)
        if value == "inf":
            flat[0] = math.inf
        elif value == "-inf":
            flat[-1] = -math.inf
        else:
            flat.fill_(math.nan)
        return grad
    return hook


def _target_param(model: NFModel, target: str, bad_rank: int) -> torch.Tensor:
    name = target_name(target, bad_rank).split("[")[0]
    return model.get_parameter(name)


def _step(model: NFModel, sz: SelectedZero2, host: torch.optim.Optimizer, batch: int, rank: int,
          world: int, reduction: str) -> StepResult:
    """One training step; the host skips its update when selzero skips (the caller's business
    under a plain host, DESIGN.md)."""
    rank_loss(model, batch, rank, reduction).backward()
    denom = world if reduction == "mean" else sum(tokens(r) for r in range(world))
    for p in (*model.inp.parameters(), *model.out.parameters()):
        dist.all_reduce(p.grad)
        p.grad.div_(denom)
    try:
        result = sz.step(weight=tokens(rank)) if reduction == "weighted" else sz.step()
        if result.skipped_nonfinite == 0:
            host.step()
        return result
    finally:
        host.zero_grad(set_to_none=True)


def _full_state(model: NFModel, sz: SelectedZero2) -> dict[str, Any]:
    return {**snapshot(model, sz), "master": sz.master_flat.detach().clone()}


def config_run(rank: int, world: int, policy: str, reduction: str) -> dict[tuple, Any]:
    """Every case of one configuration, one after another on one instance: a finite step, then
    per case the bad step and a finite one (the instance also survives many faults in a row)."""
    model = build()
    sz = SelectedZero2(model, SelZeroConfig(params=["block.*"], expert_dim=0, nonfinite=policy,
                                            reduction=reduction, timeout_s=30.0),
                       torch.optim.AdamW, dict(OPT))
    host = torch.optim.AdamW([*model.inp.parameters(), *model.out.parameters()], **OPT)
    _step(model, sz, host, 0, rank, world, reduction)
    out = {}
    for k, case in enumerate(config_cases(world, policy, reduction)):
        out[case] = capture(lambda k=k, case=case: _case(model, sz, host, rank, world, case, k))
    sz.remove_hooks()
    return out


def _case(model: NFModel, sz: SelectedZero2, host: torch.optim.Optimizer, rank: int, world: int,
          case: tuple, k: int) -> dict[str, Any]:
    _, bad_rank, value, target, _, reduction = case
    before = _full_state(model, sz)
    assert any(key.startswith("optim/") for key in before)  # there is state to keep
    handle = _target_param(model, target, bad_rank).register_hook(_poison(value, target)) \
        if rank == bad_rank else None
    try:
        bad: dict[str, Any] = {"result": _step(model, sz, host, bad_batch(k), rank, world,
                                               reduction)}
    except NonFiniteGradientError as e:
        bad = {"error": str(e)}
    finally:
        if handle is not None:
            handle.remove()
    changed = differences(before, _full_state(model, sz))
    after = _step(model, sz, host, finite_batch(k + 1), rank, world, reduction)
    return {**bad, "changed": changed, "after": after,
            "final": {key: v.detach().clone() for key, v in model.state_dict().items()}}


def config_cases(world: int, policy: str, reduction: str) -> list[tuple]:
    return [c for c in CASES if c[0] == world and c[4] == policy and c[5] == reduction]


def finite_batch(k: int) -> int:
    return 2 * k


def bad_batch(k: int) -> int:
    return 2 * k + 1


def world_run(rank: int, world: int) -> dict[tuple, Any]:
    out: dict[tuple, Any] = {}
    for policy in POLICIES:
        for reduction in REDUCTIONS:
            out.update(config_run(rank, world, policy, reduction))
    return out


_OUTCOMES = {world: cached_outcomes(world_run, world, timeout=240) for world in WORLDS}


@functools.lru_cache(maxsize=None)
def reference(world: int, reduction: str) -> list[dict[str, torch.Tensor]]:
    """One process, plain torch AdamW over every parameter, the bad batches left out: the state
    after each finite batch, trained on the mean of the ranks' losses (``mean``) or on their
    token sum over every rank's tokens (``weighted``)."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    states = []
    for k in range(len(config_cases(world, POLICIES[0], reduction)) + 1):
        losses = torch.stack([rank_loss(model, finite_batch(k), r, reduction)
                              for r in range(world)])
        total = losses.mean() if reduction == "mean" else \
            losses.sum() / sum(tokens(r) for r in range(world))
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append({key: v.detach().clone() for key, v in model.state_dict().items()})
    return states


def _case_id(case: tuple) -> str:
    world, bad_rank, value, target, policy, reduction = case
    return f"w{world}-bad{bad_rank}-{value}-{target}-{policy}-{reduction}"


def test_the_grid_has_the_documented_size():
    assert len(CASES) == len(set(CASES)) == DOCUMENTED_CASES
    assert len(CASES) == sum(WORLDS) * len(VALUES) * len(TARGETS) * len(POLICIES) * \
        len(REDUCTIONS)
    assert {c[3] for c in CASES} == set(TARGETS) and {c[1] for c in CASES} == {0, 1, 2}


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_every_rank_takes_the_same_decision_and_the_next_step_trains(case):
    world, bad_rank, value, target, policy, reduction = case
    runs = value_of(_OUTCOMES[world](), case)
    name = target_name(target, bad_rank)
    if policy == "error":
        for rank, run in enumerate(runs):
            assert "error" in run, f"rank {rank} did not raise: {run.get('result')}"
            assert run["error"].startswith(f"[rank {rank}/{world}] "), run["error"]
        messages = {strip_rank_prefix(run["error"]) for run in runs}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert f"in 1 selected parameter(s): [{name!r}]" in message, message
        assert "Nothing was updated" in message, message
    else:
        weight = world if reduction == "mean" else sum(tokens(r) for r in range(world))
        expected = StepResult(global_weight=weight, updated=0,
                              skipped_absent=EXPERTS * 5 + 3 * FUSED - present_count(world),
                              skipped_nonfinite=present_count(world))
        for rank, run in enumerate(runs):
            assert "error" not in run, f"rank {rank} raised: {run['error']}"
            assert run["result"] == expected, (rank, run["result"])
    for rank, run in enumerate(runs):
        # skip: nothing moved; error: nothing was updated either (and the host did not step)
        assert run["changed"] == [], (rank, run["changed"][:5])
    k = config_cases(world, policy, reduction).index(case)
    ref = reference(world, reduction)[k + 1]
    for rank, run in enumerate(runs):
        assert run["after"].updated == present_count(world) and \
            run["after"].skipped_nonfinite == 0, (rank, run["after"])
        assert run["final"].keys() == ref.keys()
        for key, expected_value in ref.items():
            assert torch.allclose(run["final"][key], expected_value, rtol=0, atol=1e-6), (
                rank, key, float((run["final"][key] - expected_value).abs().max()))
