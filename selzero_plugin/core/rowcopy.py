"""Copies between a tensor's flat elements and a rank-major bucket buffer (see [Note: layout]).

An entry of ``experts * per`` elements (``experts == 1`` when not split) occupies, in each of
the N rows of the buffer, ``experts`` consecutive chunks of ``chunk`` elements starting at
``row_offset``; virtual parameter e's element i lives in row ``i // chunk``. Padding positions
are never written by ``copy_in`` nor read back by ``copy_out``.

The row side and the flat side of a copy are separate view lists (``row_views`` /
``flat_views``, pairwise the same shapes), so that callers can keep the row side of a buffer
that is reused every step and pay only for the side that changes ([Note: cached views] in
storage.py). ``skip`` leaves out one row (a rank's own row, already in place).

Under whole-tensor ownership an entry is a list of pieces (layout.py, ``Piece``): each a run
of the entry's flat elements held whole at an offset of the bucket's (uneven-row) buffer;
``piece_buffer_views`` / ``piece_flat_views`` pair up the same way. ``entry_buffer_views`` /
``entry_flat_views`` give an entry's pair under either layout.
"""

from __future__ import annotations

import torch

from .layout import Layout, Piece

__all__ = ["copy_in", "copy_out", "row_views", "flat_views", "add_or_copy", "piece_buffer_views",
           "piece_flat_views", "entry_buffer_views", "entry_flat_views", "entry_own_row_view",
           "entry_own_flat_view",
           "coalesce_copies"]


def _row_ranges(per: int, chunk: int, skip: int | None) -> tuple[list[tuple[int, int]], int]:
    """Ranges of whole rows, and the length of the partial row ``per // chunk`` (0: none)."""
    full, rem = divmod(per, chunk)
    if skip is None or skip > full:
        return ([(0, full)] if full else []), rem
    ranges = [(a, b) for a, b in ((0, min(skip, full)), (skip + 1, full)) if b > a]
    return ranges, (0 if skip == full else rem)


def row_views(rows: torch.Tensor, *, row_offset: int, experts: int, per: int, chunk: int,
              skip: int | None = None) -> list[torch.Tensor]:
    """The row-side views of an entry in ``rows`` (N, S), pairing with ``flat_views``."""
    ranges, rem = _row_ranges(per, chunk, skip)
    full = per // chunk
    if experts == 1:
        end = row_offset + chunk
        views = [rows[a:b, row_offset:end] for a, b in ranges]
        if rem:
            views.append(rows[full, row_offset:row_offset + rem])
        return views
    region = rows[:, row_offset:row_offset + experts * chunk].view(rows.shape[0], experts, chunk)
    views = [region[a:b].transpose(0, 1) for a, b in ranges]
    if rem:
        views.append(region[full, :, :rem])
    return views


def flat_views(flat: torch.Tensor, *, experts: int, per: int, chunk: int,
               skip: int | None = None) -> list[torch.Tensor]:
    """The flat-side views of an entry's ``experts * per`` elements (``flat``: contiguous, of
    any shape), pairing with ``row_views``."""
    ranges, rem = _row_ranges(per, chunk, skip)
    full = per // chunk
    if experts == 1:
        if per == full * chunk and ranges == [(0, full)]:
            return [flat.view(full, chunk)]  # the common case: one view op (a gradient's hook)
        flat = flat.view(-1)
        views = [flat[a * chunk:b * chunk].view(b - a, chunk) for a, b in ranges]
        if rem:
            views.append(flat[full * chunk:])
        return views
    per_expert = flat.view(experts, per)
    views = [per_expert[:, a * chunk:b * chunk].view(experts, b - a, chunk) for a, b in ranges]
    if rem:
        views.append(per_expert[:, full * chunk:])
    return views


def copy_in(rows: torch.Tensor, flat: torch.Tensor, *, row_offset: int, experts: int, per: int,
            chunk: int, accumulate: bool = False) -> None:
    """rows (N, S) <- flat (experts * per); ``accumulate`` adds instead of copying."""
    dsts = row_views(rows, row_offset=row_offset, experts=experts, per=per, chunk=chunk)
    add_or_copy(dsts, flat_views(flat, experts=experts, per=per, chunk=chunk), accumulate)


def add_or_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor], accumulate: bool) -> None:
    for dst, src in zip(dsts, srcs):
        if accumulate:
            dst.add_(src)
        else:
            dst.copy_(src)


def copy_out(rows: torch.Tensor, flat: torch.Tensor, *, row_offset: int, experts: int, per: int,
             chunk: int, skip: int | None = None) -> None:
    """flat (experts * per) <- rows (N, S), except row ``skip``."""
    srcs = row_views(rows, row_offset=row_offset, experts=experts, per=per, chunk=chunk, skip=skip)
    for src, dst in zip(srcs, flat_views(flat, experts=experts, per=per, chunk=chunk, skip=skip)):
        dst.copy_(src)


def piece_buffer_views(buffer: torch.Tensor, pieces: tuple[Piece, ...], *,
                       skip: int | None = None) -> list[torch.Tensor]:
    """The buffer-side views of an owned entry (``buffer``: the bucket's 1-D buffer)."""
    return [buffer[p.buffer_offset:p.buffer_offset + p.numel] for p in pieces if p.owner != skip]


def piece_flat_views(flat: torch.Tensor, pieces: tuple[Piece, ...], *,
                     skip: int | None = None) -> list[torch.Tensor]:
    """The flat-side views of an owned entry (``flat``: contiguous, of any shape)."""
    flat = flat.view(-1)
    return [flat[p.flat_offset:p.flat_offset + p.numel] for p in pieces if p.owner != skip]


def entry_buffer_views(layout: Layout, buffer: torch.Tensor, t: int, *,
                       skip: int | None = None) -> list[torch.Tensor]:
    """Trainable entry t's views in its bucket's 1-D ``buffer``, under either layout."""
    if layout.owned:
        return piece_buffer_views(buffer, layout.entry_pieces[t], skip=skip)
    ids = layout.entry_virtuals[t]
    first = layout.virtuals[ids[0]]
    return row_views(buffer.view(layout.world_size, -1), row_offset=layout.entry_row_offset[t],
                     experts=len(ids), per=first.numel, chunk=first.chunk_numel, skip=skip)


def entry_flat_views(layout: Layout, flat: torch.Tensor, t: int, *,
                     skip: int | None = None) -> list[torch.Tensor]:
    """Entry t's flat-side views of ``flat`` (its gradient or parameter), pairing with
    ``entry_buffer_views``."""
    if layout.owned:
        return piece_flat_views(flat, layout.entry_pieces[t], skip=skip)
    ids = layout.entry_virtuals[t]
    first = layout.virtuals[ids[0]]
    return flat_views(flat, experts=len(ids), per=first.numel, chunk=first.chunk_numel,
                      skip=skip)


def entry_own_row_view(layout: Layout, row: torch.Tensor, t: int) -> torch.Tensor:
    """Chunked entry t's chunks in one rank's row held apart from the bucket's buffer (``row``:
    that row alone, 1-D; [Note: own row in the shard] in collectives.py), pairing with
    ``entry_own_flat_view``; beside ``entry_buffer_views(..., skip=rank)``."""
    ids = layout.entry_virtuals[t]
    chunk = layout.virtuals[ids[0]].chunk_numel
    at = layout.entry_row_offset[t]
    if len(ids) == 1:
        return row[at:at + chunk]
    return row[at:at + len(ids) * chunk].view(len(ids), chunk)


def entry_own_flat_view(layout: Layout, flat: torch.Tensor, t: int, rank: int) -> torch.Tensor:
    """Chunked entry t's chunks on ``rank`` in ``flat`` (its gradient), every one of them full
    there; pairs with ``entry_own_row_view``, beside ``entry_flat_views(..., skip=rank)``."""
    ids = layout.entry_virtuals[t]
    first = layout.virtuals[ids[0]]
    lo = rank * first.chunk_numel
    if len(ids) == 1:
        return flat.view(-1)[lo:lo + first.chunk_numel]
    return flat.view(len(ids), first.numel)[:, lo:lo + first.chunk_numel]


def coalesce_copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Pairwise copies ``dst_i <- src_i`` of 1-D pieces, with runs of them merged into one 2-D
    strided copy each: consecutive pieces of equal length whose destinations follow one
    another in one storage and whose sources lie at one stride in one storage (a fused expert
    tensor's chunks on this rank: one per expert, ``per`` elements apart, that pack side by
    side in a scratch or a bucket row). A foreach copy then takes one tensor per fused tensor
    instead of one per expert. Either list may be the destination of the copies made."""
    out_d: list[torch.Tensor] = []
    out_s: list[torch.Tensor] = []
    i, n = 0, len(dsts)
    while i < n:
        d0, s0 = dsts[i], srcs[i]
        k = d0.numel()
        j = i + 1
        if j < n and k and _follows(d0, d0, 0, k) and _follows(s0, d0, None, k):
            # pieces at a stride of at least their length (ascending, no overlap): parameters
            # laid out in model order in one buffer (vector_to_parameters) lie at a negative
            # stride in bucket order, which as_strided refuses (review finding)
            stride = srcs[j].storage_offset() - s0.storage_offset()
            while stride >= k and j < n and _follows(dsts[j], d0, (j - i) * k, k) and \
                    _follows(srcs[j], s0, (j - i) * stride, k):
                j += 1
        if j - i > 1:
            out_d.append(d0.as_strided((j - i, k), (k, 1), d0.storage_offset()))
            out_s.append(s0.as_strided((j - i, k), (stride, 1), s0.storage_offset()))
        else:
            out_d.append(d0)
            out_s.append(s0)
        i = j
    return out_d, out_s


def _follows(t: torch.Tensor, first: torch.Tensor, offset: int | None, k: int) -> bool:
    """``t`` is 1-D, contiguous, of ``k`` elements; unless ``offset`` is None, also of
    ``first``'s dtype and storage, ``offset`` elements further."""
    if t.dim() != 1 or t.numel() != k or t.stride() != (1,):
        return False
    return offset is None or (
        t.dtype == first.dtype and t.storage_offset() == first.storage_offset() + offset
        and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
