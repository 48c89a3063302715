"""Presence: ranks routing to different experts, experts with no tokens (DESIGN.md "Presence").

An expert absent on every rank gets no update, no weight decay and no step-count increment: its
weights and optimizer state stay bit-identical. An expert absent on some ranks only gets their zero
contribution, which is exactly what one process computes on the mean of the ranks' losses. No
routing pattern hangs. Per-expert modules here (ToyMoE); fused expert tensors: test_fused_experts.
"""

from __future__ import annotations

import pytest
import torch

from ._presence import expert_of, random_accumulation, toy_reference, toy_routes, toy_selzero
from ._shard import assemble
from .dist_utils import all_values, run_ranks
from .parity import max_diff, reference_run

pytestmark = pytest.mark.multiproc

E = 4  # experts; "uneven" routing never uses expert E - 1
WARM_STEPS = 4  # step 0 routes every expert, steps 1.. never route expert E - 1
RANDOM_STEPS = 30
PER_EXPERT = 5  # w1.weight, w1.bias, w2.weight, w2.bias, gain


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def warm(request):
    world = request.param
    runs = all_values(run_ranks(toy_selzero, world, WARM_STEPS, "warm", timeout=90))
    return world, runs, toy_reference(world, WARM_STEPS, "warm")


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def random_routing(request):
    world = request.param
    runs = all_values(run_ranks(toy_selzero, world, RANDOM_STEPS, "random", timeout=120))
    return world, runs, toy_reference(world, RANDOM_STEPS, "random")


def _experts_routed(world: int, step: int, pattern: str) -> list[set[int]]:
    return [set(toy_routes(step, r, E, pattern).tolist()) - {-1} for r in range(world)]


def _expert_params(params: dict[str, torch.Tensor], expert: int) -> dict[str, torch.Tensor]:
    return {n: p for n, p in params.items() if expert_of(n) == expert}


def test_expert_absent_on_every_rank_keeps_weights_bit_identical(warm):
    world, runs, _ = warm
    absent = E - 1
    for r, snaps in enumerate(runs):
        before = _expert_params(snaps[0]["params"], absent)
        assert len(before) == PER_EXPERT
        for step in range(1, WARM_STEPS):
            after = _expert_params(snaps[step]["params"], absent)
            for name in before:
                assert torch.equal(after[name], before[name]), (
                    f"rank {r} step {step}: {name} changed although no rank routed to it "
                    "(weight decay or an update leaked through)")


def test_expert_absent_on_every_rank_keeps_optimizer_state_bit_identical(warm):
    world, runs, _ = warm
    absent = E - 1
    states = [assemble([snaps[step]["shard"] for snaps in runs]) for step in range(WARM_STEPS)]
    keys = [k for k in states[0] if expert_of(k[0]) == absent]
    assert len(keys) == PER_EXPERT
    for key in keys:
        first = states[0][key]["state"]
        assert float(first["step"]) == 1.0 and set(first) == {"step", "exp_avg", "exp_avg_sq"}
        for step in range(1, WARM_STEPS):
            later = states[step][key]["state"]
            assert set(later) == set(first)
            for k in first:
                assert torch.equal(torch.as_tensor(later[k]), torch.as_tensor(first[k])), (
                    f"step {step}: {key[0]} state {k!r} changed while absent on every rank")


def test_routed_experts_move_and_count_every_step(warm):
    """What makes the two tests above able to fail: the other experts do move, every step."""
    world, runs, _ = warm
    for step in range(1, WARM_STEPS):
        state = assemble([snaps[step]["shard"] for snaps in runs])
        for expert in range(E - 1):
            before = _expert_params(runs[0][step - 1]["params"], expert)
            after = _expert_params(runs[0][step]["params"], expert)
            assert all(not torch.equal(after[n], before[n]) for n in before), (step, expert)
            for key, item in state.items():
                if expert_of(key[0]) == expert:
                    assert float(item["state"]["step"]) == step + 1, (key, step)


def test_expert_absent_on_some_ranks_contributes_zero(warm):
    world, runs, ref = warm
    routed = _experts_routed(world, 1, "warm")
    partial = [e for e in range(E) if 0 < sum(e in s for s in routed) < world]
    assert partial, f"routing {routed} has no expert absent on some ranks only"
    for step in range(WARM_STEPS):
        for r, snaps in enumerate(runs):
            for name, p in snaps[step]["params"].items():
                diff = float((p - ref[step]["params"][name]).abs().max())
                assert diff <= 1e-6, f"rank {r} step {step}: {name} differs by {diff}"
        state = assemble([snaps[step]["shard"] for snaps in runs])
        for (name, _), item in state.items():
            expected = ref[step]["state"][name]
            assert float(item["state"]["step"]) == float(expected["step"]), (name, step)
            torch.testing.assert_close(item["state"]["exp_avg"], expected["exp_avg"].reshape(-1),
                                       atol=1e-7, rtol=1e-5)


def test_step_result_counts_experts_absent_on_every_rank(warm):
    world, runs, _ = warm
    total = E * PER_EXPERT
    for r, snaps in enumerate(runs):
        first = snaps[0]["result"]
        assert (first.updated, first.skipped_absent, first.global_weight) == (total, 0, world)
        for step in range(1, WARM_STEPS):
            result = snaps[step]["result"]
            assert (result.updated, result.skipped_absent) == (total - PER_EXPERT, PER_EXPERT), (
                f"rank {r} step {step}: {result}")


def test_random_routing_never_hangs_and_matches_reference_every_step(random_routing):
    """30 steps of random routing: ranks with no expert at all, experts absent everywhere after
    having state, experts present on some ranks only. Step counts must match the reference
    exactly at every step (presence agreed correctly), values within fp32 rounding."""
    world, runs, ref = random_routing
    seen = {"rank_without_expert": False, "absent_everywhere_with_state": False,
            "partial": False}
    had_state: set[int] = set()
    for step in range(RANDOM_STEPS):
        routed = _experts_routed(world, step, "random")
        seen["rank_without_expert"] |= any(not s for s in routed)
        counts = [sum(e in s for s in routed) for e in range(E)]
        seen["partial"] |= any(0 < c < world for c in counts)
        seen["absent_everywhere_with_state"] |= any(c == 0 and e in had_state
                                                    for e, c in enumerate(counts))
        had_state |= {e for e, c in enumerate(counts) if c}
        state = assemble([snaps[step]["shard"] for snaps in runs])
        for (name, _), item in state.items():
            expected = ref[step]["state"].get(name, {})
            assert float(item["state"].get("step", 0)) == float(expected.get("step", 0)), (
                f"step {step}: {name}")
        absent_everywhere = sum(PER_EXPERT for c in counts if c == 0)
        for snaps in runs:
            assert snaps[step]["result"].skipped_absent == absent_everywhere, step
    assert all(seen.values()), f"the random pattern did not exercise: {seen}"
    for r, snaps in enumerate(runs):
        for name, p in snaps[-1]["params"].items():
            diff = float((p - ref[-1]["params"][name]).abs().max())
            assert diff <= 1e-5, f"rank {r}: {name} differs by {diff} after {RANDOM_STEPS} steps"
        assert all(torch.equal(p, runs[0][-1]["params"][n]) for n, p in snaps[-1]["params"].items())


@pytest.mark.parametrize("world", [2, 3])
def test_random_routing_with_accumulation_never_hangs_and_matches_reference(world):
    """3 micro-steps per step, closed by end_microstep() or run under no_sync(): an expert may
    get tokens in one micro-step and none in the next, a rank none in any."""
    steps, micro = 6, 3
    runs = all_values(run_ranks(random_accumulation, world, steps, micro, timeout=120))
    ref = reference_run(world, steps, "AdamW", pattern="random", accumulate=micro)
    for r, run in enumerate(runs):
        for mode, state in run.items():
            assert max_diff(state, ref) <= 1e-6, f"rank {r}, {mode}"
