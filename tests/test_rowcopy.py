"""copy_in / copy_out against an element-by-element reference of [Note: layout]: virtual
parameter e's element i lives in row i // chunk at column row_offset + e * chunk + i % chunk;
padding is never written; also the one-expert fast path, divisible or not, and per < chunk."""

from __future__ import annotations

import pytest
import torch

from selzero_plugin.core.layout import ceil_div
from selzero_plugin.core.rowcopy import copy_in, copy_out


def _reference_in(rows: torch.Tensor, flat: torch.Tensor, row_offset: int, experts: int,
                  per: int, chunk: int) -> torch.Tensor:
    out = rows.clone()
    for e in range(experts):
        for i in range(per):
            out[i // chunk, row_offset + e * chunk + i % chunk] += flat[e * per + i]
    return out


@pytest.mark.parametrize("n, experts, per", [(1, 1, 7), (2, 1, 8), (2, 1, 9), (3, 1, 10),
                                             (4, 1, 2), (3, 1, 1), (2, 3, 5), (3, 4, 7),
                                             (4, 2, 3)])
def test_copy_in_and_out_match_the_layout(n, experts, per):
    chunk = ceil_div(per, n)
    row_offset, width = 3, 3 + experts * chunk + 2
    g = torch.Generator().manual_seed(n * 100 + experts * 10 + per)
    flat = torch.randn(experts * per, generator=g)
    rows = torch.zeros(n, width)
    copy_in(rows, flat, row_offset=row_offset, experts=experts, per=per, chunk=chunk)
    expected = _reference_in(torch.zeros(n, width), flat, row_offset, experts, per, chunk)
    assert torch.equal(rows, expected)
    copy_in(rows, flat, row_offset=row_offset, experts=experts, per=per, chunk=chunk,
            accumulate=True)
    assert torch.equal(rows, 2 * expected)
    back = torch.full_like(flat, float("nan"))
    copy_out(rows, back, row_offset=row_offset, experts=experts, per=per, chunk=chunk)
    assert torch.equal(back, 2 * flat)


@pytest.mark.parametrize("n, experts, per", [(2, 1, 8), (2, 1, 9), (3, 1, 10), (4, 1, 2),
                                             (3, 1, 1), (2, 3, 5), (3, 4, 7), (4, 2, 3),
                                             (4, 1, 13)])
def test_copy_out_skipping_a_row_leaves_exactly_that_rows_elements(n, experts, per):
    """copy_out(skip=r) writes every element except those of row r (a rank's own row, whose
    values are already in place), for every r, padding-only rows included."""
    chunk = ceil_div(per, n)
    row_offset, width = 1, 1 + experts * chunk + 1
    flat = torch.arange(1, experts * per + 1, dtype=torch.float32)
    rows = torch.zeros(n, width)
    copy_in(rows, flat, row_offset=row_offset, experts=experts, per=per, chunk=chunk)
    for skip in range(n):
        back = torch.full_like(flat, -1.0)
        copy_out(rows, back, row_offset=row_offset, experts=experts, per=per, chunk=chunk,
                 skip=skip)
        in_row = torch.tensor([(i % per) // chunk == skip for i in range(experts * per)])
        assert torch.equal(back[~in_row], flat[~in_row])
        assert bool((back[in_row] == -1.0).all())
