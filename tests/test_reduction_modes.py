"""Reduction modes (issue #2, rule 4): weighted, sum, normalize_over="world", zero global weight.

Why every parameter is selected (no DDP) in these runs: see ``[Note: why these runs select every
parameter]`` in tests/_reduction.py. Each spawn runs several scenarios (tests/_reduction.py);
the tests below read one scenario each.
"""

import pytest

from ._reduction import (E, GROUPS, SUM_STEPS, build_ep, ep_reference, expert_parallel_rank,
                         group_modes_rank, sum_reference, weighted_reference)
from ._state import model_state, moved, value_of
from .dist_utils import run_ranks
from .parity import max_diff

pytestmark = pytest.mark.multiproc

EXPERT3 = [f"experts.{E - 1}.{n}" for n in ("w1.weight", "w1.bias", "w2.weight", "w2.bias", "gain")]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def group_runs(request):
    world = request.param
    return world, run_ranks(group_modes_rank, world, timeout=90)


@pytest.fixture(scope="module")
def ep_runs():
    return run_ranks(expert_parallel_rank, 4, timeout=90)


# ---- weighted ------------------------------------------------------------------------------


def test_weighted_divides_loss_sum_gradients_by_exact_global_token_count(group_runs):
    world, outcomes = group_runs
    runs = value_of(outcomes, "weighted")
    ref = weighted_reference(world, 3)
    assert moved(ref["state"], weighted_reference(world, 0)["state"]) > 1e-3  # it trained
    for r, run in enumerate(runs):
        assert max_diff(run["state"], ref["state"]) <= 1e-6, f"rank {r}"
    assert max_diff(runs[0]["state"], runs[-1]["state"]) == 0.0


def test_weighted_global_weight_is_the_all_reduced_token_count(group_runs):
    world, outcomes = group_runs
    expected = weighted_reference(world, 3)["global_weights"]
    assert len(set(expected)) > 1 and world not in expected  # not the world size, not constant
    for run in value_of(outcomes, "weighted"):
        assert run["global_weights"] == expected


def test_weighted_zero_global_weight_updates_nothing(group_runs):
    _, outcomes = group_runs
    for run in value_of(outcomes, "weighted_zero"):
        assert run["optim_keys"] > 0  # momentum buffers exist and are compared
        assert run["changed"] == []
        assert run["result"].global_weight == 0 and run["result"].updated == 0


# ---- sum -----------------------------------------------------------------------------------


def test_sum_does_not_divide_and_inactive_ranks_contribute_nothing(group_runs):
    world, outcomes = group_runs
    ref = sum_reference(world)
    for r, run in enumerate(value_of(outcomes, "sum")):
        assert max_diff(run["state"], ref) <= 1e-6, f"rank {r}"


def test_sum_global_weight_counts_active_ranks(group_runs):
    world, outcomes = group_runs
    for run in value_of(outcomes, "sum"):
        # step 1: the last rank inactive; step 2: rank 0 inactive in one micro-step only
        assert [res.global_weight for res in run["results"]] == [world, world - 1, world]
        assert len(run["results"]) == SUM_STEPS


def test_sum_all_inactive_window_changes_nothing(group_runs):
    _, outcomes = group_runs
    for run in value_of(outcomes, "sum_all_inactive"):
        assert run["optim_keys"] > 0
        assert run["changed"] == [], "weights or optimizer state changed"
        for res in run["results"]:
            assert res.global_weight == 0 and res.updated == 0
        assert run["moved_after"], "the next active step should update"


def test_sum_inactive_rank_contributes_no_presence(group_runs):
    world, outcomes = group_runs
    for r, run in enumerate(value_of(outcomes, "sum_skip_presence")):
        res = run["result"]
        assert res.global_weight == world - 1
        assert (res.updated, res.skipped_absent) == (26 - 5, 5), f"rank {r}: {res}"
        for name in EXPERT3:
            assert (run["after"][name] == run["before"][name]).all(), name
        assert moved(run["before"], run["after"], ["experts.0.w1.weight"]) > 0


# ---- normalize_over="world" (expert parallelism, world 4) ----------------------------------


@pytest.mark.parametrize("mode", ["mean", "weighted"])
def test_normalize_over_world_divides_by_the_world(ep_runs, mode):
    runs = value_of(ep_runs, mode)
    for g, members in enumerate(GROUPS):
        ref = ep_reference(g, mode)
        assert moved(ref["state"], model_state(build_ep(g))) > 1e-4  # the experts trained
        for r in members:
            assert runs[r]["group_size"] == 2
            assert runs[r]["global_weights"] == ref["global_weights"], f"rank {r}"
            assert max_diff(runs[r]["state"], ref["state"]) <= 1e-6, f"rank {r} (group {g})"
    # the two groups hold different experts: the comparison above is per group
    assert max_diff(runs[0]["state"], runs[2]["state"]) > 1e-3


def test_normalize_over_world_zero_global_weight_updates_nothing(ep_runs):
    for r, run in enumerate(value_of(ep_runs, "zero")):
        assert run["changed"] == [], f"rank {r}"
        assert run["result"].global_weight == 0 and run["result"].updated == 0
