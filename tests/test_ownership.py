"""The whole-tensor ownership plan (core/ownership.py) and its layout (core/layout.py, uneven
rows): deterministic, within LPT's 4/3 bound of the optimum, balanced on the issue's model (64
experts x 3 matrices of three shapes at N = 3), experts of a fused tensor in contiguous blocks,
and every element of a bucket in exactly one owner's row with no padding."""

from __future__ import annotations

import itertools
import random

import pytest

from selzero_plugin.core.layout import EntrySpec, plan_layout
from selzero_plugin.core.ownership import (balance, contiguous_runs, elementwise_cost, is_muon_like,
                                           loads, newton_schulz_cost, optimizer_cost, plan_owners,
                                           plan_tensor_owners)


def _expert_model(experts: int = 64) -> list[tuple[int, int]]:
    # gate (1024 x 256), up (1024 x 256), down (256 x 1024) are two shapes; make three
    return [s for _ in range(experts) for s in ((512, 128), (128, 512), (384, 96))]


def test_costs():
    assert elementwise_cost((3, 5, 7)) == 105
    m, n = 96, 384
    assert newton_schulz_cost((n, m)) == newton_schulz_cost((m, n)) == \
        5 * (4 * m * m * n + 2 * m ** 3) + 4 * m * n
    assert newton_schulz_cost((7,)) == 7  # not a matrix: elementwise


def test_the_plan_is_a_function_of_the_costs_and_the_group_size():
    rng = random.Random(0)
    costs = [rng.choice([1.0, 2.0, 3.0, 5.0]) for _ in range(40)]  # many ties
    plan = plan_owners(costs, 3)
    assert plan == plan_owners(list(costs), 3)
    assert set(plan) == {0, 1, 2}
    # ties go to the lower index first, then the lower rank
    assert plan_owners([1.0, 1.0, 1.0], 3) == [0, 1, 2]
    assert plan_owners([1.0, 2.0], 2) == [1, 0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_lpt_bound_against_the_optimum_on_small_cases(world):
    rng = random.Random(world)
    for _ in range(30):
        costs = [float(rng.randint(1, 20)) for _ in range(rng.randint(1, 7))]
        got = max(loads(costs, plan_owners(costs, world), world))
        best = min(max(loads(costs, assign, world))
                   for assign in itertools.product(range(world), repeat=len(costs)))
        assert got <= best * 4 / 3 + 1e-9, (costs, got, best)


@pytest.mark.parametrize("cost", [newton_schulz_cost, elementwise_cost])
def test_the_issue_model_is_balanced_at_three_ranks(cost):
    costs = [cost(s) for s in _expert_model()]
    plan = plan_owners(costs, 3)
    figure = balance(costs, plan, 3)
    assert figure < 1.01, figure  # 192 tensors of three sizes over 3 ranks
    assert balance(costs, [0] * len(costs), 3) == pytest.approx(3.0)  # the figure can fail


def test_refusals():
    with pytest.raises(ValueError, match="world=0"):
        plan_owners([1.0], 0)
    with pytest.raises(ValueError, match="finite"):
        plan_owners([float("nan")], 2)
    assert plan_owners([], 3) == []


def test_the_cost_model_follows_the_class_name():
    assert is_muon_like("torch.optim._muon.Muon") and is_muon_like("muon.MuonWithAuxAdam")
    assert not is_muon_like("torch.optim.adamw.AdamW") and not is_muon_like("mu.on.Adafactor")
    assert optimizer_cost("torch.optim.Muon", {"ns_steps": 3}, (64, 16)) == \
        newton_schulz_cost((64, 16), 3)
    assert optimizer_cost("torch.optim.AdamW", {}, (64, 16)) == 1024


def test_contiguous_runs_keep_every_rank_load_and_make_blocks():
    costs = [4.0] * 8 + [3.0, 2.0]
    owners = plan_owners(costs, 3)
    runs = [list(range(8))]
    blocks = contiguous_runs(owners, runs)
    assert sorted(blocks[:8]) == sorted(owners[:8]) and blocks[8:] == owners[8:]
    assert loads(costs, blocks, 3) == loads(costs, owners, 3)
    assert blocks[:8] == sorted(blocks[:8])  # each rank's experts one block


def test_the_plan_deals_each_fused_tensor_in_contiguous_blocks():
    """plan_tensor_owners (the engine's and the offline tools' plan): each fused tensor's
    experts (consecutive, one key) in contiguous blocks, every rank's load LPT's."""
    costs = [5.0] * 8 + [4.0] * 6 + [3.0, 2.0]
    fused = ["a"] * 8 + ["b"] * 6 + [None, None]
    owners = plan_tensor_owners(costs, fused, 3)
    for key in ("a", "b"):
        run = [o for o, f in zip(owners, fused) if f == key]
        assert run == sorted(run) and len(set(run)) == 3, (key, owners)
    assert loads(costs, owners, 3) == loads(costs, plan_owners(costs, 3), 3)


def _check_uneven_layout(entries, owners, world):
    layout = plan_layout(entries, world, 1 << 30, owners=owners)
    for bucket in layout.buckets:
        seen = []
        for t in bucket.entries:
            for p in layout.entry_pieces[t]:
                start = bucket.row_start(p.owner, world)
                assert start <= p.buffer_offset < start + bucket.row_numels[p.owner]
                seen += list(range(p.buffer_offset, p.buffer_offset + p.numel))
        assert sorted(seen) == list(range(bucket.buffer_numel(world)))  # no gap, no overlap
    for r in range(world):
        assert sum(s.numel for s in layout.shard_slots(r)) == sum(
            v.numel for v in layout.virtuals if v.owner == r)
    return layout


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_uneven_rows_hold_every_element_once_without_padding(world):
    rng = random.Random(world)
    entries = [EntrySpec(rng.randint(1, 40) * 6, "torch.float32", rng.choice([1, 1, 2, 3]))
               for _ in range(12)]
    costs = [float(e.numel // e.num_experts) for e in entries for _ in range(e.num_experts)]
    owners = plan_owners(costs, world)
    layout = _check_uneven_layout(entries, owners, world)
    assert layout.owned and all(v.owner == o for v, o in zip(layout.virtuals, owners))


def test_a_rank_may_own_nothing_in_a_bucket():
    layout = _check_uneven_layout([EntrySpec(10, "torch.float32")], [1], 3)
    assert layout.buckets[0].row_numels == (0, 10, 0)
    assert layout.shard_slots(0) == () and layout.shard_slots(1)[0].numel == 10
