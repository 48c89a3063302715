"""selzero's gloo collectives ([Note: gloo collectives]): the all-gather (one broadcast per row)
delivers every bit of every row; the reduce-scatter (an all-reduce) gives each rank its row of
the sum; the non-finite check of the reduced shard sees every inf and NaN wherever it is."""

from __future__ import annotations

import pytest
import torch

from selzero_plugin.core.comm import Communicator
from selzero_plugin.core.storage import holds_nonfinite
from tests.dist_utils import all_values, run_ranks

_SPECIAL = [-0.0, float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e-45]


def _row(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s row: random values, the special floats, and a NaN with a payload."""
    g = torch.Generator().manual_seed(100 + rank)
    row = torch.randn(numel, generator=g)
    row[rank:rank + len(_SPECIAL)] = torch.tensor(_SPECIAL)
    row.view(torch.int32)[-1] = 0x7FC0_1234 + rank  # a NaN whose payload differs by rank
    return row


def _gather_and_reduce(rank: int, world: int, numel: int) -> tuple[list[int], list[int], bool]:
    comm = Communicator.create(list(range(world)), timeout_s=60, device=torch.device("cpu"))
    assert comm.emulate
    gathered = torch.full((world, numel), 7.0)  # stale values in the other rows
    gathered[rank] = _row(rank, numel)
    comm.all_gather_rows_(gathered.view(-1)).wait()
    expected = torch.stack([_row(r, numel) for r in range(world)])
    bits_equal = torch.equal(gathered.view(torch.int32), expected.view(torch.int32))

    g = torch.Generator().manual_seed(rank)
    buffer = torch.randn(world * numel, generator=g)
    mine = comm.reduce_scatter_rows(buffer.clone()).wait()
    total = sum(torch.randn(world * numel, generator=torch.Generator().manual_seed(r))
                for r in range(world))
    return (gathered.view(torch.int32)[:, -1].tolist(), [int(bits_equal)],
            torch.allclose(mine, total.view(world, numel)[rank], rtol=0, atol=1e-6))


@pytest.mark.parametrize("world", [2, 3])
def test_gather_is_bitwise_and_reduce_gives_each_rank_its_row(world: int) -> None:
    values = all_values(run_ranks(_gather_and_reduce, world, 37, timeout=120))
    for payloads, (bits_equal,), reduced in values:
        assert bits_equal == 1
        assert payloads == [0x7FC0_1234 + r for r in range(world)]
        assert reduced


def _uneven(rank: int, world: int, rows: tuple[int, ...]) -> tuple[bool, bool]:
    """Uneven rows (whole-tensor ownership), an empty one among them."""
    comm = Communicator.create(list(range(world)), timeout_s=60, device=torch.device("cpu"))
    total = sum(rows)
    starts = [sum(rows[:r]) for r in range(world)]
    gathered = torch.full((total,), 7.0)
    mine = _row(rank, max(rows[rank], 16))[:rows[rank]]
    gathered[starts[rank]:starts[rank] + rows[rank]] = mine
    comm.all_gather_rows_(gathered, rows).wait()
    expected = torch.cat([_row(r, max(rows[r], 16))[:rows[r]] for r in range(world)])
    bits_equal = torch.equal(gathered.view(torch.int32), expected.view(torch.int32))
    buffers = [torch.randn(total, generator=torch.Generator().manual_seed(r))
               for r in range(world)]
    reduced = comm.reduce_scatter_rows(buffers[rank].clone(), rows).wait()
    want = sum(buffers)[starts[rank]:starts[rank] + rows[rank]]
    return bits_equal, reduced.shape == want.shape and torch.allclose(reduced, want, atol=1e-6)


@pytest.mark.parametrize("rows", [(5, 0, 11), (0, 9, 3), (4, 4, 4)])
def test_uneven_rows_gather_bitwise_and_reduce_to_their_owner(rows) -> None:
    for bits_equal, reduced in all_values(run_ranks(_uneven, 3, rows, timeout=120)):
        assert bits_equal and reduced


@pytest.mark.parametrize("value", _SPECIAL[1:4])
@pytest.mark.parametrize("where", [0, 4_000, 9_999])
def test_nonfinite_found_anywhere(value: float, where: int) -> None:
    flat = torch.randn(10_000)
    assert not bool(holds_nonfinite(flat))
    flat[where] = value
    assert bool(holds_nonfinite(flat))


def test_large_finite_values_are_not_nonfinite() -> None:
    """A sum of squares (or a plain sum) overflows here; the check must not."""
    flat = torch.full((1_000,), 3e38)
    flat[::2] = -3e38
    assert not bool(holds_nonfinite(flat))
    assert not bool(holds_nonfinite(torch.full((1_000,), 3e38)))
    assert not bool(holds_nonfinite(torch.empty(0)))


def test_nonfinite_answer_is_on_the_input_device_under_a_default_device() -> None:
    """A process default device (``torch.set_default_device``) must not move the answer."""
    with torch.device("meta"):
        assert holds_nonfinite(torch.ones(8, device="cpu")).device.type == "cpu"
        assert holds_nonfinite(torch.empty(0, device="cpu")).device.type == "cpu"
