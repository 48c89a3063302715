"""Contract mismatch across ranks, and the constructor's broadcast (issue #2, rule 7).

On a mismatch every rank raises the same ContractError naming the first differing group rank and
the field, within seconds (no collective waits for its timeout). Cases run in one spawn per world
size (tests/_contract.py).
"""

import pytest

from ._contract import CASES, contract_rank, deviants_for
from ._state import strip_rank_prefix, value_of
from .dist_utils import run_ranks

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def runs(request):
    world = request.param
    # "Within seconds" is asserted per rank on the construction itself (< 10 s, below); the
    # run's own limit also covers spawning ranks that import torch on a loaded 2-core machine
    # (up to ~28 s seen here), and still fails long before selzero's 600 s collective timeout.
    return world, run_ranks(contract_rank, world, timeout=60)


@pytest.mark.parametrize("case", list(CASES))
def test_cannot_construct_when_ranks_disagree(runs, case):
    world, outcomes = runs
    results = [o.value[case] for o in outcomes]
    first = deviants_for(case, world)[0]
    messages = []
    for r, got in enumerate(results):
        assert got.get("error") == "ContractError", f"rank {r}: {got}"
        assert got["seconds"] < 10, f"rank {r} took {got['seconds']:.1f}s"
        message = got["message"]
        assert message.startswith(f"[rank {r}/{world}]"), message
        assert f"group rank {first} differs from group rank 0" in message, message
        for needle in CASES[case]:
            assert needle in message, f"{needle!r} not in {message!r}"
        messages.append(strip_rank_prefix(message))
    assert len(set(messages)) == 1, messages


def test_contract_error_names_the_first_differing_rank_and_counts_the_others(runs):
    world, outcomes = runs
    deviants = deviants_for("lr", world)  # world 3: ranks 1 and 2
    message = outcomes[0].value["lr"]["message"]
    assert f"{len(deviants)} rank(s) differ: {deviants}" in message, message


def test_constructor_broadcasts_selected_parameters_from_group_rank_0(runs):
    world, outcomes = runs
    results = value_of(outcomes, "broadcast")
    selected = results[0]["selected"]
    assert "experts.3.gain" in selected  # frozen, still selected and broadcast
    for r, res in enumerate(results):
        for name, value in res["after"].items():
            if name in selected:
                assert (value == results[0]["before"][name]).all(), f"rank {r}: {name}"
            else:  # not selzero's: left to the host strategy
                assert (value == res["before"][name]).all(), f"rank {r}: {name}"
        if r:
            assert not (res["before"]["experts.0.w1.weight"]
                        == results[0]["before"]["experts.0.w1.weight"]).all()


def test_broadcast_false_leaves_each_rank_its_values(runs):
    _, outcomes = runs
    for r, res in enumerate(value_of(outcomes, "no_broadcast")):
        for name, value in res["after"].items():
            assert (value == res["before"][name]).all(), f"rank {r}: {name}"
