"""Memory: the per-rank footprint is the real-chunk ideal, and full-size gradients do not outlive
their bucket (DESIGN.md "Layout", "Micro-steps and reduction points"; issue 2 item 11).

The expected bytes are computed here from the parameter shapes and the world size alone (FSDP2
rule: pad to a multiple of N, rank r owns chunk r, only its real part is stored), not from
selzero's layout: grad_shard = 4 x real elements; master = 4 x real elements of bf16 parameters;
AdamW state = exp_avg + exp_avg_sq (2 x 4 x real) + one 4-byte step tensor per non-empty chunk;
SGD momentum = 4 x real.
"""

from __future__ import annotations

import pytest

from ._memory import gradient_lifetime_run, memory_run, sync_broadcast_run
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

# (name, numel of one virtual parameter, virtual parameters, bf16?) for MemModel's trainable
# selected parameters; fused (3, 5, 7) tensors split into 3 experts of 35 elements.
VIRTUALS = [("tiny", 1, 1, False), ("scale", 1, 1, True), ("dense.weight", 91, 1, False),
            ("dense.bias", 13, 1, False), ("low.weight", 35, 1, True), ("low.bias", 7, 1, True),
            ("moe.experts.weight", 35, 3, False), ("moe.hexperts.weight", 35, 3, True)]
SELECTED = ["tiny", "frozen", "scale", "dense.weight", "dense.bias", "low.weight", "low.bias",
            "moe.experts.weight", "moe.hexperts.weight"]


def real_chunk(numel: int, world: int, rank: int) -> int:
    chunk = -(-numel // world)
    return max(0, min(chunk, numel - rank * chunk))


def expected_bytes(world: int, rank: int, optimizer: str) -> dict[str, int]:
    lengths = [(real_chunk(n, world, rank), bf16) for _, n, k, bf16 in VIRTUALS for _ in range(k)]
    real = sum(n for n, _ in lengths)
    grad = 4 * real
    master = 4 * sum(n for n, bf16 in lengths if bf16)
    if optimizer == "AdamW":
        state = 8 * real + 4 * sum(1 for n, _ in lengths if n > 0)
    else:
        state = 4 * real
    total = grad + master + state
    return {"grad_shard": grad, "optimizer_state": state, "master": master, "total": total,
            "ideal_total": total}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def memory(request):
    world = request.param
    return world, all_values(run_ranks(memory_run, world, timeout=90))


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def lifetime(request):
    world = request.param
    return world, all_values(run_ranks(gradient_lifetime_run, world, timeout=90))


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_memory_report_equals_real_chunk_ideal(memory, optimizer):
    world, runs = memory
    for rank, run in enumerate(runs):
        expected = expected_bytes(world, rank, optimizer)
        for step, report in enumerate(run[optimizer]["reports"][1:], start=1):
            assert report == expected, f"rank {rank} after step {step}"
    # ranks hold different amounts: the (1,) tensors and short last chunks are really unpadded
    assert runs[0][optimizer]["reports"][1] != runs[-1][optimizer]["reports"][1]


def test_memory_report_before_first_step_has_no_optimizer_state(memory):
    world, runs = memory
    for rank, run in enumerate(runs):
        before = run["AdamW"]["reports"][0]
        expected = expected_bytes(world, rank, "AdamW")
        assert before["optimizer_state"] == 0
        assert (before["grad_shard"], before["master"]) == (expected["grad_shard"],
                                                            expected["master"])
        assert before["total"] == before["grad_shard"] + before["master"]


def test_state_parameter_count_counts_non_empty_chunks_on_this_rank(memory):
    world, runs = memory
    for rank, run in enumerate(runs):
        expected = sum(k for _, n, k, _ in VIRTUALS if real_chunk(n, world, rank) > 0)
        assert run["AdamW"]["state_parameter_count"] == expected, rank
    # the (1,) parameters have an empty chunk on every rank but 0
    assert runs[0]["AdamW"]["state_parameter_count"] == \
        runs[1]["AdamW"]["state_parameter_count"] + 2


def test_selected_and_trainable_names_are_canonical_in_model_order(memory):
    world, runs = memory
    for run in runs:
        assert run["AdamW"]["selected_names"] == SELECTED
        assert run["AdamW"]["trainable_names"] == [n for n in SELECTED if n != "frozen"]


def test_full_size_gradients_of_selected_parameters_die_in_their_hook(lifetime):
    world, runs = lifetime
    for rank, run in enumerate(runs):
        assert run["buckets"] > 1
        for step, record in enumerate(run["steps"]):
            assert record["grads_seen"] == 15, (rank, step)  # 3 experts x 5 tensors
            assert record["alive_in_backward"] == [0], (rank, step, record)
            assert record["alive_after_backward"] == 0, (rank, step)
            assert record["grad_not_none"] == [], (rank, step)


def test_bucket_buffers_are_released_at_the_reduction_point(lifetime):
    world, runs = lifetime
    for rank, run in enumerate(runs):
        for step, record in enumerate(run["steps"]):
            assert record["buffers_reduced"] == run["buckets"], (rank, step)
            assert record["buffers_alive_after_reduction"] == 0, (rank, step, record)
            # this model has no launch unit: every bucket fills before the end-of-backward flush,
            # the first two in the pool's blocks, the others in fresh ones
            assert record["from_pool"] == 2, (rank, step, record)
            assert record["bucket_buffers_held"] == [], (rank, step)


def test_a_broadcast_sync_leaves_no_buffer_alive():
    """Works are retained after their wait (exit cleanly, item 1 of the third pass): a retained
    broadcast must not keep its flat buffer, here 1 MiB per expert, alive."""
    for rank, run in enumerate(all_values(run_ranks(sync_broadcast_run, 2, timeout=90))):
        assert run["rank0_values"], rank
        assert run["alive"] == [], (rank, run)
        assert run["net"] < 2 ** 16, (rank, run)  # a few scalars at most
