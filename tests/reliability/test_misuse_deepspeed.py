"""Reliability 6 through the DeepSpeed entry (ZeRO-2, world 2; rank functions in
_misuse_deepspeed.py): each misuse raises the same UsageError on every rank, saying what to do.

| misuse | outcome |
|---|---|
| ``engine.step()`` without a backward, and a second ``engine.step()`` after one | UsageError before DeepSpeed's own KeyError / TypeError in ``scaled_global_norm`` |
| a client optimizer that already stepped a selected parameter | refused at ``deepspeed.initialize`` on every rank (DeepSpeed's copy of it would otherwise be dropped silently) |
| a second SelectedZero2 built on the model before ``deepspeed.initialize`` | refused: DeepSpeed would take its gradients too |
| the module cast on one rank after ``initialize`` | refused on every rank at the reduction point |
| ``"managed_gradient_accumulation": false`` | ConfigError at ``initialize`` (the subset would never be stepped) |
| ZeRO-Offload (not misuse: the step check must not fire) | trains |
"""

from __future__ import annotations

import pytest

from .._state import strip_rank_prefix
from ..dist_utils import all_values, run_ranks
from ._misuse_deepspeed import misuse_deepspeed_run

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

EXPECTED = {
    "step_without_backward": ["engine.step()", "without a backward", "engine.backward(loss)"],
    "second_step": ["engine.step()", "without a backward"],
    "client_with_state": ["client optimizer (AdamW) holds state", "blocks.0.experts.0.",
                          "without stepping it"],
    "second_instance": ["belong to a SelectedZero2 built before deepspeed.initialize",
                        "'dense'", "inp.weight", "remove_hooks()"],
    "cast_after": ["changed dtype", "blocks.0.experts.0."],
}


@pytest.fixture(scope="module")
def results():
    return all_values(run_ranks(misuse_deepspeed_run, 2, timeout=300,
                                env={"DS_ACCELERATOR": "cpu"}))


@pytest.mark.parametrize("case", list(EXPECTED))
def test_every_rank_raises_the_same_usage_error(results, case):
    messages = []
    for rank, got in enumerate(results):
        got = got[case]
        assert got.get("error") == "UsageError", f"rank {rank}: {got}"
        for needle in EXPECTED[case]:
            assert needle in got["message"], f"{needle!r} not in {got['message']!r}"
        messages.append(strip_rank_prefix(got["message"]))
    assert len(set(messages)) == 1, messages


def test_unmanaged_gradient_accumulation_is_refused(results):
    for got in results:
        got = got["unmanaged_accumulation"]
        assert got.get("error") == "ConfigError", got
        assert "managed_gradient_accumulation" in got["message"], got


def test_zero_offload_is_not_taken_for_a_step_without_backward(results):
    for got in results:
        assert got["offload"].get("value", {}).get("updated", 0) > 0, got["offload"]
