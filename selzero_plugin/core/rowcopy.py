"""Copies between a tensor's flat elements and a rank-major bucket buffer (see [Note: layout]).

An entry of ``experts * per`` elements (``experts == 1`` when not split) occupies, in each of
the N rows of the buffer, ``experts`` consecutive chunks of ``chunk`` elements starting at
``row_offset``; virtual parameter e's element i lives in row ``i // chunk``. Padding positions
are never written by ``copy_in`` (callers start from a zeroed buffer) and never read back.
"""

from __future__ import annotations

import torch

__all__ = ["copy_in", "copy_out"]


def _views(rows: torch.Tensor, flat: torch.Tensor, row_offset: int, experts: int, per: int,
           chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(row-side view, flat-side view) pairs covering every real element."""
    full, rem = divmod(per, chunk)
    if experts == 1:  # the common case, with fewer view ops (a step makes two per parameter)
        end = row_offset + chunk
        if rem == 0:
            return [(rows[:full, row_offset:end], flat.view(full, chunk))]
        pairs = [(rows[:full, row_offset:end], flat[:full * chunk].view(full, chunk))] \
            if full else []
        pairs.append((rows[full, row_offset:row_offset + rem], flat[full * chunk:]))
        return pairs
    width = experts * chunk
    region = rows[:, row_offset:row_offset + width].view(rows.shape[0], experts, chunk)
    per_expert = flat.view(experts, per)
    pairs = []
    if full:
        pairs.append((region[:full].transpose(0, 1),
                      per_expert[:, :full * chunk].view(experts, full, chunk)))
    if rem:
        pairs.append((region[full, :, :rem], per_expert[:, full * chunk:]))
    return pairs


def copy_in(rows: torch.Tensor, flat: torch.Tensor, *, row_offset: int, experts: int, per: int,
            chunk: int, accumulate: bool = False) -> None:
    """rows (N, S) <- flat (experts * per); ``accumulate`` adds instead of copying."""
    for dst, src in _views(rows, flat, row_offset, experts, per, chunk):
        if accumulate:
            dst.add_(src)
        else:
            dst.copy_(src)


def copy_out(rows: torch.Tensor, flat: torch.Tensor, *, row_offset: int, experts: int, per: int,
             chunk: int) -> None:
    """flat (experts * per) <- rows (N, S)."""
    for src, dst in _views(rows, flat, row_offset, experts, per, chunk):
        dst.copy_(src)
