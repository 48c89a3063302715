"""Gradient accumulation (3 micro-steps) and the reduction schedule.

- Parity: reduced micro-steps closed by end_microstep(), and local micro-steps inside the DDP
  model's no_sync() or sz.no_sync(), all equal one process accumulating the mean of the ranks'
  losses over the 3 micro-steps (1e-6; observed ~3e-8).
- Schedule: whatever the routing, every rank issues the same collectives in the same order:
  one reduce-scatter per bucket per reduction point, in bucket order, then one all-reduce of the
  control vector; local micro-steps issue none; the step all-gathers the updated buckets in
  order.
- Usage errors for phases called in an order that cannot work.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import pytest

from selzero_plugin.core.binding import KINDS

from ._accum_runs import (MICRO_STEPS, MODES, NUM_EXPERTS, STEPS, TOKENS, accumulate_many,
                          usage_errors)
from .dist_utils import all_values, run_ranks
from .parity import build_model, max_diff, reference_run, routes_for

pytestmark = pytest.mark.multiproc

TOLERANCE = 1e-6
CASES = ([("AdamW", mode, "uneven") for mode in MODES]
         + [("SGD", mode, "uneven") for mode in MODES]
         + [("AdamW", mode, "random") for mode in MODES])
F32, I64 = "torch.float32", "torch.int64"


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    return {"runs": accumulate_many(rank, world, CASES), "errors": usage_errors(rank, world)}


@lru_cache(maxsize=None)
def _outcomes(world: int) -> list[dict[str, Any]]:
    """One spawn per world for every case of this file (the first test of a world pays)."""
    return all_values(run_ranks(_all_cases, world, timeout=120))


def _run(world: int, case: tuple[str, str, str]) -> list[dict[str, Any]]:
    i = CASES.index(case)
    return [o["runs"][i] for o in _outcomes(world)]


def _case_id(case: tuple[str, str, str]) -> str:
    return "-".join(case)


# ---- parity -------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_accumulated_window_matches_single_process_reference(world, case):
    opt, _mode, pattern = case
    results = _run(world, case)
    ref = reference_run(world, STEPS, opt, pattern=pattern, accumulate=MICRO_STEPS)
    for r, out in enumerate(results):
        assert max_diff(out["state"], ref) <= TOLERANCE, f"rank {r}"
    assert max_diff(results[0]["state"], results[-1]["state"]) == 0.0
    init = build_model().state_dict()
    moved = max(float((ref[k] - init[k]).abs().max()) for k in ref if k.startswith("experts."))
    assert moved > 1000 * TOLERANCE


# ---- the schedule of collectives ------------------------------------------------------------

def _reduction_point(buckets: list, world: int, out: dict[str, Any]) -> list[tuple]:
    expected = [("reduce_scatter", world * rows, F32) for rows, _names in buckets]
    # one control vector, whatever the phase: per rank its call signature and three flags
    # (second backward, dropped windows, opened); active, weight, non-finite; a late-gradient
    # flag per entry; per launch unit a fired count and group rank 0's order of passing;
    # presence per virtual parameter; KINDS binding flags per entry (core/binding.py)
    size = 4 * world + 3 + out["entries"] + 2 * out["units"] + out["virtuals"] + \
        KINDS * out["entries"]
    expected.append(("all_reduce", size, I64))
    return expected


def _experts_used(step: int, world: int, pattern: str) -> set[int]:
    return {int(e) for micro in range(MICRO_STEPS) for r in range(world)
            for e in routes_for(step * MICRO_STEPS + micro, r, TOKENS, NUM_EXPERTS, pattern)
            if e >= 0}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_rank_issues_the_same_collectives_in_the_same_order(world, case):
    results = _run(world, case)
    for r, out in enumerate(results[1:], start=1):
        assert out["phases"] == results[0]["phases"], f"rank {r} differs from rank 0"


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_really_route_to_different_experts(world):
    """The schedule test above is meaningful only if the ranks' gradients differ."""
    for pattern in ("uneven", "random"):
        per_rank = [{int(e) for e in routes_for(s, r, TOKENS, NUM_EXPERTS, pattern) if e >= 0}
                    for s in range(STEPS * MICRO_STEPS) for r in range(world)]
        assert len({frozenset(x) for x in per_rank}) > 1


@pytest.mark.parametrize("world", [2, 3])
def test_small_bucket_size_gives_several_buckets(world):
    buckets = _run(world, CASES[0])[0]["buckets"]
    assert len(buckets) >= 5


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reduction_point_reduce_scatters_each_bucket_once_in_bucket_order(world, case):
    _opt, mode, _pattern = case
    for out in _run(world, case):
        buckets = out["buckets"]
        for phase in out["phases"]:
            micro = phase["micro"]
            for m in range(MICRO_STEPS - 1):
                if mode == "end_microstep":
                    assert micro[m] == _reduction_point(buckets, world, out)
                else:  # local micro-steps communicate nothing
                    assert micro[m] == []
            assert micro[-1] == _reduction_point(buckets, world, out)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_step_all_gathers_exactly_the_updated_buckets_in_bucket_order(world, case):
    _opt, _mode, pattern = case
    for out in _run(world, case):
        for step, phase in enumerate(out["phases"]):
            used = _experts_used(step, world, pattern)
            gathered = [("all_gather", world * rows, F32) for rows, names in out["buckets"]
                        if any(n.startswith(f"experts.{e}.") for n in names for e in used)]
            assert phase["step"] == gathered
            assert phase["updated"] == 5 * len(used)  # gain, w1.{weight,bias}, w2.{weight,bias}
            if pattern == "uneven":
                assert len(gathered) < len(out["buckets"])  # expert 3 never routed: not gathered


# ---- usage errors -------------------------------------------------------------------------

def _errors(world: int, case: str) -> list[tuple[str, str]]:
    return [o["errors"][case] for o in _outcomes(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_cannot_backward_twice_into_an_unclosed_reduced_microstep(world):
    for kind, message in _errors(world, "second_backward"):
        assert kind == "UsageError", message
        assert "sz.end_microstep()" in message and "no_sync()" in message


@pytest.mark.parametrize("world", [2, 3])
def test_backward_after_end_microstep_is_allowed(world):
    assert _errors(world, "second_backward_after_end_microstep") == [("no error", "")] * world
    assert _errors(world, "step_after_closed_microsteps") == [("no error", "")] * world


@pytest.mark.parametrize("world", [2, 3])
def test_cannot_reduce_gradients_twice(world):
    for case in ("reduce_twice", "end_microstep_after_reduce"):
        for kind, message in _errors(world, case):
            assert kind == "UsageError", message
            assert "already reduced" in message and "sz.step()" in message
    # the mistake changed nothing: the instance steps and trains on
    assert _errors(world, "next_step_after_mistake") == [("no error", "")] * world


@pytest.mark.parametrize("world", [2, 3])
def test_cannot_take_grad_norm_squared_before_reduce_gradients(world):
    for kind, message in _errors(world, "norm_before_reduce"):
        assert kind == "UsageError", message
        assert "grad_norm_squared()" in message and "local_grad_norm" not in message
        assert "sz.reduce_gradients(" in message
    assert _errors(world, "norm_after_reduce") == [("no error", "")] * world


@pytest.mark.parametrize("world", [2, 3])
def test_cannot_scale_gradients_before_reduce_gradients(world):
    for kind, message in _errors(world, "scale_before_reduce"):
        assert kind == "UsageError", message
        assert "scale_gradients_()" in message and "sz.reduce_gradients(" in message
