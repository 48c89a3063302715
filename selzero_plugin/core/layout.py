"""Chunk, pad and bucket arithmetic. Pure Python: no torch.distributed, no tensors.

[Note: layout]
Each selected trainable (virtual) parameter of ``numel`` elements is padded to
``chunk_numel * N`` (``chunk_numel = ceil(numel / N)``) and split into N equal chunks; group rank
r owns chunk r, whose *real* length is ``clamp(numel - r * chunk_numel, 0, chunk_numel)``.
Padding exists only in communication buffers: the optimizer, the gradient shard and the
checkpoint see real lengths only.

Buckets gather whole parameters of one dtype (a fused expert tensor's virtual parameters always
share a bucket, since its gradient arrives at once) and are numbered in reverse model order,
the order in which backward produces gradients. A bucket's communication buffer is rank-major:
row r (``row_numel`` elements) holds chunk r of every virtual parameter of the bucket, at
``row_offsets[i]``; one reduce-scatter hands each rank its row, one all-gather rebuilds all rows.

Under whole-tensor ownership (``partition="tensors"``, [Note: ownership plan] in ownership.py)
a virtual parameter has one owner instead of N chunks: it is one piece, whole, in its owner's
row. Rows are then *uneven*: row r holds exactly the tensors rank r owns in the bucket, one
after another in bucket order, with no padding (``row_numels``); the buffer is the rows one
after another. A rank that owns nothing in a bucket has an empty row. An entry's pieces
(``entry_pieces``) are its owners' runs: consecutive experts of a fused tensor owned by one
rank are one piece. Everything else (buckets, their order, their launch points) is as for
chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EntrySpec", "VirtualSpec", "BucketSpec", "ShardSlot", "Piece", "Layout", "plan_layout",
           "ceil_div"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EntrySpec:
    """What the layout needs to know of one selected trainable tensor."""

    numel: int
    dtype: str
    num_experts: int = 1  # split into this many equal virtual parameters along dim 0
    split: bool = False  # a fused expert tensor (expert_dim=0), also with one (local) expert


@dataclass(frozen=True)
class VirtualSpec:
    index: int  # position in the global virtual-parameter order (presence vector)
    entry: int  # index of the owning trainable entry
    expert: int | None  # expert index when the entry is split, else None
    flat_offset: int  # start of this virtual parameter in the entry's flattened tensor
    numel: int  # real (unpadded) number of elements
    chunk_numel: int  # ceil(numel / N): the padded chunk every rank gets (owned: numel)
    owner: int | None = None  # whole-tensor ownership: the group rank that holds it whole

    def real_chunk_numel(self, rank: int) -> int:
        if self.owner is not None:
            return self.numel if rank == self.owner else 0
        return max(0, min(self.chunk_numel, self.numel - rank * self.chunk_numel))

    def chunk_start(self, rank: int) -> int:
        """Offset of rank's chunk within the entry's flattened tensor."""
        if self.owner is not None:
            return self.flat_offset
        return self.flat_offset + rank * self.chunk_numel


@dataclass(frozen=True)
class BucketSpec:
    index: int
    dtype: str
    entries: tuple[int, ...]  # trainable entry indices, in the order their hooks usually fire
    virtuals: tuple[int, ...]  # virtual indices, in row order
    row_offsets: tuple[int, ...]  # offset of each virtual's chunk within a rank row (owned:
    #                               within its owner's row)
    row_numel: int  # padded elements per rank row (uneven rows: the longest)
    row_numels: tuple[int, ...] = ()  # uneven rows (whole-tensor ownership): each rank's length

    def row_lengths(self, world: int) -> tuple[int, ...]:
        return self.row_numels if self.row_numels else (self.row_numel,) * world

    def buffer_numel(self, world: int) -> int:
        return sum(self.row_lengths(world))

    def row_start(self, rank: int, world: int) -> int:
        return sum(self.row_lengths(world)[:rank])


@dataclass(frozen=True)
class ShardSlot:
    """Where a virtual parameter's real chunk lives in this rank's flat gradient shard."""

    virtual: int
    bucket: int
    row_offset: int  # offset in the bucket's rank row (reduce-scatter output)
    shard_offset: int  # offset in the rank's flat shard (real lengths only)
    numel: int  # real length on this rank (> 0)


@dataclass(frozen=True)
class Piece:
    """A run of an owned entry's elements that one rank holds, whole (uneven rows)."""

    owner: int
    buffer_offset: int  # in the bucket's buffer (its owner's row start + offset in the row)
    flat_offset: int  # in the entry's flattened tensor
    numel: int


@dataclass(frozen=True)
class Layout:
    world_size: int
    virtuals: tuple[VirtualSpec, ...]
    buckets: tuple[BucketSpec, ...]
    entry_virtuals: tuple[tuple[int, ...], ...]  # virtual indices of each trainable entry
    entry_bucket: tuple[int, ...]  # bucket index of each trainable entry
    entry_row_offset: tuple[int, ...]  # offset of each entry's first chunk in its bucket's rows
    entry_pieces: tuple[tuple[Piece, ...], ...] = ()  # whole-tensor ownership: per entry

    @property
    def owned(self) -> bool:
        """Whole-tensor ownership (``partition="tensors"``)?"""
        return bool(self.entry_pieces)

    def shard_slots(self, rank: int) -> tuple[ShardSlot, ...]:
        """This rank's non-empty chunks, in bucket order, packed without padding."""
        slots: list[ShardSlot] = []
        offset = 0
        for bucket in self.buckets:
            for v, row_offset in zip(bucket.virtuals, bucket.row_offsets):
                n = self.virtuals[v].real_chunk_numel(rank)
                if n > 0:
                    slots.append(ShardSlot(v, bucket.index, row_offset, offset, n))
                    offset += n
        return tuple(slots)

    def shard_numel(self, rank: int) -> int:
        return sum(s.numel for s in self.shard_slots(rank))


def plan_layout(entries: list[EntrySpec], world_size: int, bucket_bytes: int, *,
                owners: list[int] | None = None) -> Layout:
    """Virtual parameters, chunks and buckets for ``entries`` (in model order) over N ranks.
    ``owners`` (one group rank per virtual parameter, in virtual order): whole-tensor ownership
    with uneven rows instead of chunks."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected >= 1")
    virtuals: list[VirtualSpec] = []
    entry_virtuals: list[tuple[int, ...]] = []
    for e, spec in enumerate(entries):
        per = spec.numel // spec.num_experts
        assert per * spec.num_experts == spec.numel, "split entries divide evenly by construction"
        ids = []
        for x in range(spec.num_experts):
            expert = x if spec.num_experts > 1 or spec.split else None
            if owners is None:
                virtuals.append(VirtualSpec(len(virtuals), e, expert, x * per, per,
                                            ceil_div(per, world_size)))
            else:
                owner = owners[len(virtuals)]
                assert 0 <= owner < world_size
                virtuals.append(VirtualSpec(len(virtuals), e, expert, x * per, per, per, owner))
            ids.append(len(virtuals) - 1)
        entry_virtuals.append(tuple(ids))
    if owners is not None:
        assert len(owners) == len(virtuals), "one owner per virtual parameter"

    # Reverse model order; one open bucket per dtype, closed once it reaches bucket_bytes.
    groups: list[tuple[str, list[int]]] = []
    open_by_dtype: dict[str, tuple[list[int], list[int]]] = {}  # dtype -> (entries, [bytes])
    for e in reversed(range(len(entries))):
        dtype = entries[e].dtype
        if dtype not in open_by_dtype:
            members: list[int] = []
            groups.append((dtype, members))
            open_by_dtype[dtype] = (members, [0])
        members, size = open_by_dtype[dtype]
        members.append(e)
        padded = entries[e].numel if owners is not None else \
            sum(virtuals[v].chunk_numel for v in entry_virtuals[e]) * world_size
        size[0] += padded * 4
        if size[0] >= bucket_bytes:
            del open_by_dtype[dtype]

    buckets: list[BucketSpec] = []
    entry_bucket = [0] * len(entries)
    entry_row_offset = [0] * len(entries)
    entry_pieces: list[tuple[Piece, ...]] = [()] * len(entries)
    for b, (dtype, members) in enumerate(groups):
        vids: list[int] = []
        offsets: list[int] = []
        row = 0
        fill = [0] * world_size  # uneven rows: each owner's row so far
        for e in members:
            entry_bucket[e] = b
            entry_row_offset[e] = row
            for v in entry_virtuals[e]:
                vids.append(v)
                owner = virtuals[v].owner
                if owner is None:
                    offsets.append(row)
                    row += virtuals[v].chunk_numel
                else:
                    offsets.append(fill[owner])
                    fill[owner] += virtuals[v].numel
        if owners is None:
            buckets.append(BucketSpec(b, dtype, tuple(members), tuple(vids), tuple(offsets), row))
            continue
        spec = BucketSpec(b, dtype, tuple(members), tuple(vids), tuple(offsets), max(fill),
                          tuple(fill))
        buckets.append(spec)
        where = dict(zip(vids, offsets))
        for e in members:
            entry_pieces[e] = _pieces(spec, world_size, [virtuals[v] for v in entry_virtuals[e]],
                                      where)
    return Layout(world_size, tuple(virtuals), tuple(buckets), tuple(entry_virtuals),
                  tuple(entry_bucket), tuple(entry_row_offset),
                  tuple(entry_pieces) if owners is not None else ())


def _pieces(bucket: BucketSpec, world: int, virtuals: list[VirtualSpec],
            row_offset: dict[int, int]) -> tuple[Piece, ...]:
    """An owned entry's runs: consecutive virtuals of one owner, adjacent in its row."""
    starts = [bucket.row_start(r, world) for r in range(world)]
    pieces: list[Piece] = []
    for v in virtuals:
        assert v.owner is not None
        offset = starts[v.owner] + row_offset[v.index]
        last = pieces[-1] if pieces else None
        if last is not None and last.owner == v.owner and \
                last.buffer_offset + last.numel == offset and \
                last.flat_offset + last.numel == v.flat_offset:
            pieces[-1] = Piece(v.owner, last.buffer_offset, last.flat_offset,
                               last.numel + v.numel)
        else:
            pieces.append(Piece(v.owner, offset, v.flat_offset, v.numel))
    return tuple(pieces)
