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


def test_coalesce_copies_merges_a_fused_tensors_chunks_into_one_strided_copy():
    """rank 1 of 2 holds the second half of each of 5 experts of 6 elements: 5 pieces 6 apart
    in the parameter, side by side in the scratch; a bias between them is another storage."""
    from selzero_plugin.core.rowcopy import coalesce_copies

    param = torch.arange(30.0)
    bias = torch.arange(100.0, 103.0)
    scratch = torch.zeros(18)
    srcs = [param[e * 6 + 3:e * 6 + 6] for e in range(5)] + [bias]
    dsts = list(torch.split(scratch, [3] * 5 + [3]))
    merged_d, merged_s = coalesce_copies(dsts, srcs)
    assert [tuple(d.shape) for d in merged_d] == [(5, 3), (3,)]
    torch._foreach_copy_(merged_d, merged_s)
    expected = torch.cat([param.view(5, 6)[:, 3:].reshape(-1), bias])
    assert torch.equal(scratch, expected)
    scratch.mul_(-1)  # and back the other way (the copy-out)
    torch._foreach_copy_(merged_s, merged_d)
    assert torch.equal(param.view(5, 6)[:, 3:].reshape(-1), -expected[:15])


@pytest.mark.parametrize("case", ["gap", "lengths", "storages", "order"])
def test_coalesce_copies_keeps_pieces_apart_that_do_not_line_up(case):
    from selzero_plugin.core.rowcopy import coalesce_copies

    a, b = torch.arange(12.0), torch.arange(12.0) + 50
    scratch = torch.zeros(8)
    srcs, dsts = [a[0:2], a[4:6]], [scratch[0:2], scratch[2:4]]
    if case == "gap":  # the destinations do not follow one another
        dsts = [scratch[0:2], scratch[3:5]]
    elif case == "lengths":
        srcs, dsts = [a[0:2], a[4:7]], [scratch[0:2], scratch[2:5]]
    elif case == "storages":
        srcs = [a[0:2], b[4:6]]
    else:  # a third piece breaks the stride
        srcs, dsts = [a[0:2], a[4:6], a[7:9]], [scratch[0:2], scratch[2:4], scratch[4:6]]
    merged_d, merged_s = coalesce_copies(dsts, srcs)
    torch._foreach_copy_(merged_d, merged_s)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s), case
    assert len(merged_d) == (2 if case == "order" else len(dsts)), case


def test_coalesce_copies_leaves_pieces_at_a_descending_stride_apart():
    """Review finding: parameters laid out in model order in one buffer
    (``torch.nn.utils.vector_to_parameters``) lie at a negative stride in bucket order (reverse
    model order); as_strided refuses negative strides, and every step raised (one rank alone
    where the other's padding broke its run, which then hung in the all-gather)."""
    from selzero_plugin.core.rowcopy import coalesce_copies

    flat = torch.arange(20.0)
    srcs = [flat[12:16], flat[6:10], flat[0:4]]  # descending, stride -6
    scratch = torch.zeros(12)
    dsts = list(torch.split(scratch, [4, 4, 4]))
    merged_d, merged_s = coalesce_copies(dsts, srcs)
    torch._foreach_copy_(merged_d, merged_s)
    assert torch.equal(scratch, torch.cat(srcs))
    overlapping = [flat[0:4], flat[2:6]]  # a stride below the length: no merge either
    merged_d, _ = coalesce_copies(list(torch.split(torch.zeros(8), [4, 4])), overlapping)
    assert len(merged_d) == 2
