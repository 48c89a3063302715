"""Randomized parity: seeded scenarios of selzero + DDP equal plain torch.optim on one process.

Each seed draws a scenario (tests/_random_runs.py): world size 2 or 3; selected experts with
awkward shapes beside a host part; optionally a fused (E, a, b) expert tensor split per expert
(expert_dim=0) or whole; per-rank random routing (experts absent on some or every rank, ranks
routing to no expert); AdamW / SGD (momentum, weight decay) / Adam, as class + kwargs or a
mirrored host instance, with an optional group override; tiny or default buckets; 1-3 micro-steps
closed by end_microstep() or under no_sync(); optional global-norm clipping; an optional lr
schedule; 3-5 steps. Every parameter matches the reference within 1e-6 (observed <= 1.2e-7 on
these seeds; see [Note: ill-conditioned first steps] in tests/_random_runs.py), every rank holds
the same parameters, and StepResult.updated counts what the reference updated. All scenarios of
one world size run in one spawn; each is its own test case, named by its world size and seed
(replay one with draw_scenario(seed, world)).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest
import torch

from ._random_runs import (FUSED_SHAPES, MICRO_MODES, OPT_NAMES, SHAPES, Scenario, build_model,
                           draw_scenario, reference_run, run_scenarios)
from .dist_utils import all_values, run_ranks
from .parity import max_diff

pytestmark = pytest.mark.multiproc

TOLERANCE = 1e-6
SEEDS = {2: range(1000, 1016), 3: range(2000, 2016)}
SCENARIOS = [draw_scenario(seed, world) for world, seeds in SEEDS.items() for seed in seeds]


@lru_cache(maxsize=None)
def _outcomes(world: int) -> list[list[dict[str, Any]]]:
    """One spawn per world size for all its scenarios (the first test of a world pays)."""
    scenarios = [sc for sc in SCENARIOS if sc.world == world]
    return all_values(run_ranks(run_scenarios, world, scenarios, timeout=150))


@lru_cache(maxsize=None)
def _reference(sc: Scenario) -> dict[str, Any]:
    return reference_run(sc)


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: sc.name)
def test_random_scenario_matches_single_process_reference(sc: Scenario) -> None:
    i = [s for s in SCENARIOS if s.world == sc.world].index(sc)
    runs = [rank_runs[i] for rank_runs in _outcomes(sc.world)]
    for r, run in enumerate(runs):
        assert run["error"] is None, f"{sc.describe()}\nrank {r} raised:\n{run['error']}"
    ref = _reference(sc)
    for r, run in enumerate(runs):
        diffs = {k: max_diff({k: run["state"][k]}, {k: ref["state"][k]}) for k in ref["state"]}
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= TOLERANCE, (
            f"{sc.describe()}\nrank {r}: {worst} differs from the reference by "
            f"{diffs[worst]:.3g}; {_exact_comparison(sc, run['state'], ref['state'], worst)}")
        assert run["updated"] == ref["updated"], (
            f"{sc.describe()}\nrank {r}: StepResult.updated {run['updated']}, "
            f"reference {ref['updated']}")
    for r, run in enumerate(runs[1:], start=1):
        assert max_diff(run["state"], runs[0]["state"]) == 0.0, f"{sc.describe()}\nrank {r} vs 0"


def _exact_comparison(sc: Scenario, ours: dict[str, Any], ref: dict[str, Any], name: str) -> str:
    """Rounding or bug? Both FP32 runs against FP64 (see [Note: ill-conditioned first steps])."""
    exact = {name: reference_run(sc, torch.float64)["state"][name]}
    return (f"against an FP64 reference: selzero {max_diff({name: ours[name]}, exact):.3g}, "
            f"FP32 reference {max_diff({name: ref[name]}, exact):.3g}")


def test_random_scenarios_train_and_cover_every_feature() -> None:
    """The draws exercise what the brief lists, and the runs move the weights (not vacuous)."""
    def some(pred) -> bool:
        return any(pred(sc) for sc in SCENARIOS)

    assert {sc.world for sc in SCENARIOS} == {2, 3}
    assert {sc.opt for sc in SCENARIOS} == set(OPT_NAMES)
    assert {s for sc in SCENARIOS for e in sc.experts for s in e} == set(SHAPES)
    assert {sc.fused for sc in SCENARIOS if sc.fused} >= set(FUSED_SHAPES[:3])
    assert some(lambda sc: sc.expert_dim == 0)
    assert some(lambda sc: sc.fused and sc.expert_dim is None)
    assert some(lambda sc: sc.bucket_mb < 0.001) and some(lambda sc: sc.bucket_mb >= 25)
    assert {m for sc in SCENARIOS for m in sc.micro_modes} == set(MICRO_MODES)
    assert {sc.accumulate for sc in SCENARIOS} == {1, 2, 3}
    assert some(lambda sc: sc.instance) and some(lambda sc: not sc.instance)
    assert some(lambda sc: sc.override) and some(lambda sc: sc.frozen)
    assert some(lambda sc: sc.schedule) and some(lambda sc: not sc.schedule)
    assert some(lambda sc: any(_reference(sc)["clipped"]))  # clipping really scales
    assert some(lambda sc: sc.clip and not all(_reference(sc)["clipped"]))
    assert some(_target_absent_on_every_rank_in_a_step)
    assert some(lambda sc: _absent_everywhere_after_an_update(sc, fused=False))
    assert some(lambda sc: sc.expert_dim == 0
                and _absent_everywhere_after_an_update(sc, fused=True))
    assert some(_target_present_on_some_ranks_only)
    assert some(_rank_without_expert_for_a_whole_step)
    for sc in SCENARIOS:
        ref, start = _reference(sc), _initial_state(sc)
        assert max_diff(ref["state"], start) > 1e-3, sc.describe()


def _initial_state(sc: Scenario) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in build_model(sc).state_dict().items()}


def _targets_per_rank(sc: Scenario, step: int) -> list[set[int]]:
    return [{t for micro in sc.routes[step] for t in micro[r] if t >= 0} for r in range(sc.world)]


def _target_absent_on_every_rank_in_a_step(sc: Scenario) -> bool:
    return any(len(set().union(*_targets_per_rank(sc, s))) < sc.num_targets
               for s in range(sc.steps))


def _target_present_on_some_ranks_only(sc: Scenario) -> bool:
    return any(set().union(*ranks) - set.intersection(*ranks)
               for ranks in (_targets_per_rank(sc, s) for s in range(sc.steps)))


def _absent_everywhere_after_an_update(sc: Scenario, *, fused: bool) -> bool:
    """A target (plain expert or fused expert) routed in one step and on no rank in a later one:
    its weights and optimizer state must then stay as they were."""
    first = len(sc.experts) if fused else 0
    last = sc.num_targets if fused else len(sc.experts)
    seen: set[int] = set()
    for s in range(sc.steps):
        routed = set().union(*_targets_per_rank(sc, s))
        if any(t in seen and t not in routed for t in range(first, last)):
            return True
        seen |= routed
    return False


def _rank_without_expert_for_a_whole_step(sc: Scenario) -> bool:
    return any(not targets for s in range(sc.steps) for targets in _targets_per_rank(sc, s))
