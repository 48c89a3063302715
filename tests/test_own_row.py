"""A bucket's own row reduced in the gradient shard ([Note: own row in the shard] in
core/collectives.py) gives the shard the buffer's row would have given, bitwise, and the
parameters after it.

Each rank trains two copies of one fused-experts model side by side: one whose buckets reduce
their own row in the shard (``OWN_MIN_NUMEL = 0`` when it is built: every bucket qualifies), one
whose never do. The routing differs by rank and step (some experts get no token on a rank);
the shapes divide by 2, not by 3: at world 3 the last rank's rows hold padding and it keeps
its row in the buffer while its peers reduce theirs in the shard, in the same reductions.
Steps: plain ones; two micro-steps reduced each (``end_microstep``: the second reduction of a
bucket adds, from the buffer); ``no_sync`` then a reduced micro-step (two gradients per entry
into the own row); and a step whose routing leaves an expert without tokens on every rank and
in which one weight gets no gradient (zero-filled at its bucket's launch, own row included).
The same under ``reduction="sum"`` with a rank inactive in one step: buckets launch at the
reduction point there, so no own row is used (below).

Where buckets launch at the reduction point (``overlap=False``, ``reduction="sum"``) a write
into ``sz.grad_shard`` between the backward and the reduction point is overwritten by the
reduction, as before (no own row there: review finding); where they launch during the backward
the shard is reduced when the backward returns and the write counts, on every rank alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2
from selzero_plugin.core import collectives

from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

E, D, H, TOKENS = 5, 7, 4, 6  # D * H = 28: chunks of 14 at world 2; 10, 10, 8 at world 3


class Fused(nn.Module):
    num_experts = E  # opts in to expert_dim

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, H) / D ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, D) / H ** 0.5)

    skip_w2 = False

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(torch.bmm(x[:, None, :], self.w1[routes]))
        if self.skip_w2:  # w2 gets no gradient
            return h.mean(-1).expand(-1, D)
        return torch.bmm(h, self.w2[routes])[:, 0, :]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(Fused() for _ in range(2))

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h, routes)
        return h


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    x = torch.randn(TOKENS, D, generator=g)
    if step == 3:  # expert E-1 gets no token on any rank
        routes = torch.randint(0, E - 1, (TOKENS,), generator=g)
    else:  # rank r's tokens avoid expert r: an expert absent here, present elsewhere
        routes = (torch.randint(0, E - 1, (TOKENS,), generator=g) + rank + 1) % E
    return x, routes


def _instance(own: bool, reduction: str) -> tuple[nn.Module, SelectedZero2, list[bool]]:
    torch.manual_seed(0)
    model = Model()
    saved = collectives.OWN_MIN_NUMEL
    collectives.OWN_MIN_NUMEL = 0 if own else 1 << 62
    try:  # buckets of three weights: layer 0's w2 shares one with layer 1's
        sz = SelectedZero2(model, {"params": ["layers.*"], "expert_dim": 0, "bucket_mb": 2e-3,
                                   "reduction": reduction},
                           torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
    finally:
        collectives.OWN_MIN_NUMEL = saved
    launched: list[bool] = []  # per reduction: was the own row held apart?
    launch = sz.comm.reduce_scatter_rows

    def recording(buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        launched.append(kwargs.get("own") is not None)
        return launch(buffer, *args, **kwargs)

    sz.comm.reduce_scatter_rows = recording
    return model, sz, launched


def _own_row_run(rank: int, world: int, reduction: str) -> dict[str, Any]:
    runs = [_instance(own, reduction) for own in (True, False)]
    host = [torch.optim.SGD(m.inp.parameters(), lr=0.1) for m, _, _ in runs]
    equal, counts = [], []
    norms: dict[int, list[float]] = {id(sz): [] for _, sz, _ in runs}
    shards: dict[int, list[torch.Tensor]] = {id(sz): [] for _, sz, _ in runs}
    for step in range(4):
        for (model, sz, launched), opt in zip(runs, host):
            micros = {1: 2, 2: 2}.get(step, 1)
            model.layers[0].skip_w2 = step == 3
            for micro in range(micros):
                x, routes = _batch(rank, step, micro)
                if step == 2 and micro == 0:
                    with sz.no_sync():
                        model(x, routes).square().mean().backward()
                    continue
                model(x, routes).square().mean().backward()
                if micro < micros - 1:
                    sz.end_microstep()
            for p in model.inp.parameters():  # the host's part: mean over ranks, by hand
                torch.distributed.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()
            opt.zero_grad()
            # rank 0 inactive in step 2 under sum: its gradients do not count
            sz.reduce_gradients(**({"active": not (rank == 0 and step == 2)}
                                   if reduction == "sum" else {}))
            norms[id(sz)].append(sz.grad_norm_squared().item())  # every value, absent or not
            shards[id(sz)].append(sz.grad_shard.clone())
            sz.step()
        (a, _, own_launched), (b, _, buffer_launched) = runs
        (_, sz_a, _), (_, sz_b, _) = runs
        equal.append(all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())) and
                     norms[id(sz_a)][-1] == norms[id(sz_b)][-1] and
                     torch.equal(shards[id(sz_a)][-1], shards[id(sz_b)][-1]))
        counts.append((sum(own_launched), len(own_launched), sum(buffer_launched)))
        own_launched.clear()
        buffer_launched.clear()
    for _, sz, _ in runs:
        sz.remove_hooks()
    return {"equal": equal, "counts": counts}


@pytest.mark.parametrize("world,reduction", [(1, "mean"), (2, "mean"), (3, "mean"),
                                             (2, "sum")])
def test_own_row_in_the_shard_is_bitwise_the_buffer_row(world: int, reduction: str) -> None:
    values = all_values(run_ranks(_own_row_run, world, reduction, timeout=120))
    for rank, value in enumerate(values):
        assert all(value["equal"]), (rank, value)
        padded = world == 3 and rank == world - 1  # its rows hold padding: the buffer's row
        for step, (own, total, buffer) in enumerate(value["counts"]):
            assert buffer == 0 and total > 0, (rank, step, value["counts"])
            # a window's first reduction of each bucket holds its own row apart; the second
            # micro-step's reductions (steps 1) add from the buffer
            first = total // (2 if step == 1 else 1)
            expected = 0 if padded or reduction == "sum" else first
            assert own == expected, (rank, step, value["counts"])


def _write_run(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    """One step with ``sz.grad_shard`` scaled between the backward and the reduction point, in
    instances that may hold their own rows in the shard, beside one that never does."""
    out = []
    for own in (True, False):
        torch.manual_seed(0)
        model = Model()
        saved = collectives.OWN_MIN_NUMEL
        collectives.OWN_MIN_NUMEL = 0 if own else 1 << 62
        try:
            sz = SelectedZero2(model, {"params": ["layers.*"], "expert_dim": 0, **config},
                               torch.optim.SGD, {"lr": 0.1})
        finally:
            collectives.OWN_MIN_NUMEL = saved
        for step in range(2):  # the second window's shard holds the first one's values
            x, routes = _batch(rank, step, 0)
            model(x, routes).square().mean().backward()
            sz.grad_shard.mul_(0.5)
            sz.reduce_gradients()
            out.append(sz.grad_shard.clone())
            sz.step()
        sz.remove_hooks()
    return {"equal": all(torch.equal(a, b) for a, b in zip(out[:2], out[2:]))}


@pytest.mark.parametrize("config", [{"overlap": False}, {"reduction": "sum"}, {}])
def test_a_write_into_the_shard_before_the_reduction_point_is_the_same_with_own_rows(
        config: dict[str, Any]) -> None:
    for value in all_values(run_ranks(_write_run, 2, config, timeout=120)):
        assert value["equal"], value
