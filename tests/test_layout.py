"""Layout arithmetic (layout.py is pure): chunks, padding, shard slots and buckets.

Properties are checked with hypothesis over many (numel, N, experts, dtype, bucket size)
combinations; a few golden cases pin the numbers the docs quote.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selzero_plugin.core.layout import EntrySpec, plan_layout

DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")

entry_specs = st.builds(
    lambda per, experts, dtype: EntrySpec(per * experts, dtype, experts),
    st.integers(1, 300), st.integers(1, 4), st.sampled_from(DTYPES))
layouts = st.tuples(st.lists(entry_specs, max_size=12), st.integers(1, 8), st.integers(1, 20_000))

fast = settings(max_examples=300, deadline=None)


def _bucket_bytes(layout, bucket) -> int:
    """FP32 bytes of the bucket's rank-major buffer (padded chunks of every rank)."""
    return sum(layout.virtuals[v].chunk_numel for v in bucket.virtuals) * layout.world_size * 4


# ---- chunks --------------------------------------------------------------------------------


@fast
@given(st.integers(1, 10**7), st.integers(1, 512))
def test_real_chunk_lengths_sum_to_numel(numel, world):
    (v,) = plan_layout([EntrySpec(numel, "torch.float32")], world, 1).virtuals
    real = [v.real_chunk_numel(r) for r in range(world)]
    assert sum(real) == numel
    assert v.chunk_numel == -(-numel // world)  # ceil
    assert 0 <= v.chunk_numel * world - numel < world  # padding is less than one element per rank
    assert all(0 <= n <= v.chunk_numel for n in real)
    nonempty = [n > 0 for n in real]
    assert nonempty == sorted(nonempty, reverse=True)  # the empty chunks are the last ranks'
    assert [v.chunk_start(r) for r in range(world)] == [r * v.chunk_numel for r in range(world)]


@pytest.mark.parametrize("numel, world, real", [
    (91, 2, [46, 45]), (91, 3, [31, 31, 29]), (13, 3, [5, 5, 3]), (1, 3, [1, 0, 0]),
    (7, 4, [2, 2, 2, 1]), (5, 4, [2, 2, 1, 0]), (12, 3, [4, 4, 4]),
])
def test_real_chunk_lengths_golden(numel, world, real):
    (v,) = plan_layout([EntrySpec(numel, "torch.float32")], world, 1).virtuals
    assert [v.real_chunk_numel(r) for r in range(world)] == real


@fast
@given(layouts)
def test_split_entries_become_equal_virtual_parameters(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    for e, spec in enumerate(entries):
        ids = layout.entry_virtuals[e]
        assert len(ids) == spec.num_experts
        per = spec.numel // spec.num_experts
        for x, v in enumerate(ids):
            virtual = layout.virtuals[v]
            assert (virtual.entry, virtual.numel, virtual.flat_offset) == (e, per, x * per)
            assert virtual.expert == (x if spec.num_experts > 1 else None)
    assert [v.index for v in layout.virtuals] == list(range(len(layout.virtuals)))


# ---- shard slots ---------------------------------------------------------------------------


@fast
@given(layouts)
def test_shard_slots_pack_each_ranks_real_chunks_in_bucket_order(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    total = 0
    for rank in range(world):
        slots = layout.shard_slots(rank)
        offset = 0
        for s in slots:
            virtual = layout.virtuals[s.virtual]
            bucket = layout.buckets[s.bucket]
            assert s.numel == virtual.real_chunk_numel(rank) > 0
            assert s.shard_offset == offset  # packed, no padding in the shard
            assert s.row_offset == bucket.row_offsets[bucket.virtuals.index(s.virtual)]
            assert s.row_offset + s.numel <= bucket.row_numel
            offset += s.numel
        assert [s.bucket for s in slots] == sorted(s.bucket for s in slots)
        expected = [v for b in layout.buckets for v in b.virtuals
                    if layout.virtuals[v].real_chunk_numel(rank) > 0]
        assert [s.virtual for s in slots] == expected
        assert layout.shard_numel(rank) == offset
        total += offset
    assert total == sum(e.numel for e in entries)


# ---- buckets -------------------------------------------------------------------------------


@fast
@given(layouts)
def test_every_entry_is_in_exactly_one_bucket_of_its_dtype(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    members = [e for b in layout.buckets for e in b.entries]
    assert sorted(members) == list(range(len(entries)))
    for b in layout.buckets:
        assert b.entries, "no empty bucket"
        assert {entries[e].dtype for e in b.entries} == {b.dtype}
        for e in b.entries:
            assert layout.entry_bucket[e] == b.index
    assert [b.index for b in layout.buckets] == list(range(len(layout.buckets)))


@fast
@given(layouts)
def test_buckets_follow_reverse_model_order(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    for b in layout.buckets:
        assert list(b.entries) == sorted(b.entries, reverse=True)
    firsts = [b.entries[0] for b in layout.buckets]
    assert firsts == sorted(firsts, reverse=True)  # bucket 0 holds the last entry
    for dtype in DTYPES:
        same = [b for b in layout.buckets if b.dtype == dtype]
        for earlier, later in zip(same, same[1:]):
            assert min(earlier.entries) > max(later.entries)


@fast
@given(layouts)
def test_a_split_entry_is_never_split_across_buckets(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    for e, ids in enumerate(layout.entry_virtuals):
        bucket = layout.buckets[layout.entry_bucket[e]]
        at = bucket.virtuals.index(ids[0])
        assert bucket.virtuals[at:at + len(ids)] == ids  # together, in expert order
        assert layout.entry_row_offset[e] == bucket.row_offsets[at]
        for other in layout.buckets:
            if other is not bucket:
                assert not set(ids) & set(other.virtuals)


@fast
@given(layouts)
def test_bucket_rows_hold_one_padded_chunk_per_virtual(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    for b in layout.buckets:
        chunks = [layout.virtuals[v].chunk_numel for v in b.virtuals]
        assert list(b.row_offsets) == [sum(chunks[:i]) for i in range(len(chunks))]
        assert b.row_numel == sum(chunks)


@fast
@given(layouts)
def test_a_bucket_closes_once_it_reaches_the_bucket_size(case):
    entries, world, bucket_bytes = case
    layout = plan_layout(entries, world, bucket_bytes)
    for dtype in DTYPES:
        same = [b for b in layout.buckets if b.dtype == dtype]
        for b in same[:-1]:  # every bucket but the last of its dtype is full ...
            assert _bucket_bytes(layout, b) >= bucket_bytes
        for b in same:  # ... and would not have been without its last entry
            last = b.entries[-1]
            without = _bucket_bytes(layout, b) - sum(
                layout.virtuals[v].chunk_numel for v in layout.entry_virtuals[last]) * world * 4
            assert without < bucket_bytes


def test_large_bucket_size_gives_one_bucket_per_dtype():
    entries = [EntrySpec(91, "torch.float32"), EntrySpec(13, "torch.bfloat16"),
               EntrySpec(7 * 3, "torch.float32", 3), EntrySpec(1, "torch.bfloat16")]
    layout = plan_layout(entries, 3, 25 * 2**20)
    assert [(b.dtype, b.entries) for b in layout.buckets] == [
        ("torch.bfloat16", (3, 1)), ("torch.float32", (2, 0))]


def test_empty_selection_has_no_buckets():
    layout = plan_layout([], 4, 1)
    assert layout.buckets == () and layout.virtuals == () and layout.shard_slots(3) == ()


def test_cannot_plan_for_an_empty_group():
    with pytest.raises(ValueError, match="world_size=0"):
        plan_layout([EntrySpec(4, "torch.float32")], 0, 1)
