"""missing_grad and nonfinite policies; ranks that disagree on a reduction call (issue #2, rule 5).

Where a policy raises, every rank raises the same error class, names the parameter(s) (and, for
missing gradients, the ranks), leaves parameters and optimizer state bit-identical, and the next
step works: the run then matches a single-process reference that never took the failed step.
Scenarios run in one spawn per world size (tests/_policies.py).
"""

import pytest

from ._policies import expert_names, policies_rank, reference
from ._state import strip_rank_prefix, value_of
from .dist_utils import run_ranks
from .parity import max_diff

pytestmark = pytest.mark.multiproc

AFTER_FAILED_STEP = [(0, "all", []), (2, "all", []), (3, "no3", [])]


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def runs(request):
    world = request.param
    return world, run_ranks(policies_rank, world, timeout=90)


def _errors(results: list[dict], cls: str) -> list[str]:
    messages = []
    for r, res in enumerate(results):
        got = res["error"]
        assert got.get("error") == cls, f"rank {r}: expected {cls}, got {got}"
        messages.append(got["message"])
    assert len({strip_rank_prefix(m) for m in messages}) == 1, messages
    return messages


def _untouched_and_recovers(results: list[dict], world: int) -> None:
    ref = reference(world, AFTER_FAILED_STEP)
    for r, res in enumerate(results):
        assert res["optim_keys"] > 0
        assert res["changed_by_error"] == [], f"rank {r}: {res['changed_by_error'][:5]}"
        assert res["next"].updated == 20
        assert max_diff(res["state"], ref) <= 1e-6, f"rank {r}"


# ---- missing_grad --------------------------------------------------------------------------


def test_missing_grad_error_raises_on_every_rank_naming_parameters_and_ranks(runs):
    world, outcomes = runs
    for message in _errors(value_of(outcomes, "missing_error"), "MissingGradientError"):
        for name in expert_names(2):
            assert f"{name} (no gradient on group rank(s) [{world - 1}])" in message, message
        assert "experts.1." not in message and "experts.3." not in message


def test_missing_grad_error_leaves_state_untouched_and_next_step_works(runs):
    world, outcomes = runs
    _untouched_and_recovers(value_of(outcomes, "missing_error"), world)


def test_missing_grad_error_does_not_fire_for_a_parameter_absent_on_every_rank(runs):
    # [Note] missing_grad governs parameters present on some ranks only (DESIGN.md, Presence); a
    # parameter absent on every rank (an expert no rank routed to) just gets no update.
    _, outcomes = runs
    for res in value_of(outcomes, "missing_error"):
        got = res["absent_everywhere"]
        assert "value" in got, got
        assert (got["value"].updated, got["value"].skipped_absent) == (15, 5)


def test_missing_grad_skip_does_not_update_a_parameter_missing_on_some_rank(runs):
    world, outcomes = runs
    ref = reference(world, [(0, "all", []), (1, "drop2", expert_names(2)), (2, "all", [])])
    for r, res in enumerate(value_of(outcomes, "missing_skip")):
        assert (res["result"].updated, res["result"].skipped_absent) == (15, 5)
        for name in expert_names(2):
            assert (res["after"][f"param/{name}"] == res["before"][f"param/{name}"]).all()
        assert not (res["after"]["param/experts.1.w1.weight"]
                    == res["before"]["param/experts.1.w1.weight"]).all()
        assert max_diff(res["state"], ref) <= 1e-6, f"rank {r}"


# ---- nonfinite -----------------------------------------------------------------------------


def test_nonfinite_error_raises_on_every_rank_naming_the_parameter(runs):
    _, outcomes = runs
    for message in _errors(value_of(outcomes, "nonfinite_error"), "NonFiniteGradientError"):
        assert "experts.1.w2.weight" in message
        assert "experts.0." not in message and "experts.1.w1" not in message


def test_nonfinite_error_leaves_state_untouched_and_next_step_works(runs):
    world, outcomes = runs
    _untouched_and_recovers(value_of(outcomes, "nonfinite_error"), world)


def test_nonfinite_skip_updates_nothing_and_next_step_works(runs):
    world, outcomes = runs
    results = value_of(outcomes, "nonfinite_skip")
    for res in results:
        skipped = res["error"].get("value")
        assert skipped is not None, res["error"]
        assert (skipped.updated, skipped.skipped_nonfinite) == (0, 20)
    _untouched_and_recovers(results, world)


# ---- ranks that disagree on the call -------------------------------------------------------


@pytest.mark.parametrize("case", ["weight_on_one_rank", "end_microstep_vs_reduce",
                                  "weight_under_sum", "active_under_mean",
                                  "non_integer_weight"])
def test_cannot_disagree_on_the_reduction_call(runs, case):
    _, outcomes = runs
    results = [v[case] for v in value_of(outcomes, "disagreements")]
    for message in _errors(results, "UsageError"):
        assert "did not make the same reduction call" in message
    for r, res in enumerate(results):
        assert res["changed_by_error"] == [], f"rank {r}"
        assert "value" in res["next"], res["next"]
        assert res["next"]["value"].updated == 20
        assert max_diff(res["state"], results[0]["state"]) == 0.0
