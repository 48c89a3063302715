"""The launch units' all-gradients hook, and what a training step leaves alive.

torch's ``register_multi_grad_hook(mode="all")`` keeps every graph node it was given alive for
good (a cycle through C++: [Note: the all-gradients hook]); selzero registered one per launch unit
and forward, and lost C heap at every step. The probes here are objects put in a node's
``metadata`` dict: they live exactly as long as the node.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from selzero_plugin.core.grad_hooks import register_all_grads_hook

from ._blocks import Block, BlockMoE, block_loss
from .dist_utils import all_values, run_ranks


class _Probe:
    pass


def _tag(t: torch.Tensor, probes: list[Any]) -> None:
    probe = _Probe()
    t.grad_fn.metadata["probe"] = probe
    probes.append(weakref.ref(probe))


def test_fires_once_per_backward_after_the_last_input_gradient():
    w = torch.randn(3, requires_grad=True)
    a, b = w * 2, w * 3
    seen: list[str] = []
    a.register_hook(lambda g: seen.append("a"))
    b.register_hook(lambda g: seen.append("b"))
    register_all_grads_hook([a, b], lambda: seen.append("all"))
    loss = (a * b).sum() + a.sum()
    loss.backward(retain_graph=True)
    assert seen.count("all") == 1 and seen[-1] == "all" and set(seen[:2]) == {"a", "b"}
    loss.backward()  # a second graph task through the same graph fires again
    assert seen.count("all") == 2 and seen[-1] == "all"


def test_does_not_fire_when_an_input_gets_no_gradient():
    w = torch.randn(3, requires_grad=True)
    a, b = w * 2, w * 3
    fired: list[int] = []
    register_all_grads_hook([a, b], lambda: fired.append(1))
    a.sum().backward()  # b is not reached: the unit's buckets launch at the end of backward
    assert fired == []


def test_holds_no_graph_node():
    """torch's register_multi_grad_hook(mode="all") here leaves 2 of the 6 probes alive."""
    probes: list[Any] = []
    for _ in range(3):
        w = torch.randn(3, requires_grad=True)
        a, b = w * 2, w.exp()
        _tag(a, probes)
        _tag(b, probes)
        register_all_grads_hook([a, b], lambda: None)
        (a * b).sum().backward()
        del w, a, b
    gc.collect()
    assert [p() for p in probes] == [None] * 6


class _TaggingBlock(Block):
    """Tags the node of its input, which selzero's unit hook is registered on, at every call
    (a checkpoint's recompute included)."""

    probes: list[Any] = []

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and h.grad_fn is not None:
            _tag(h, _TaggingBlock.probes)
        return super().forward(h, routes)


class _CheckpointedMoE(BlockMoE):
    def forward(self, x: torch.Tensor, routes: list[torch.Tensor]) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block, r in zip(self.blocks, routes):
            h = checkpoint(block, h, r, use_reentrant=False)
        return self.out(h)


def _steps_free_their_graphs(rank: int, world: int, checkpointed: bool) -> dict[str, int]:
    from selzero_plugin import SelectedZero2, SelZeroConfig

    torch.manual_seed(0)
    _TaggingBlock.probes = []
    cls = _CheckpointedMoE if checkpointed else BlockMoE
    model = cls(layers=3, block=_TaggingBlock)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-3),
                       torch.optim.AdamW)
    host = torch.optim.AdamW([p for n, p in model.named_parameters() if ".experts." not in n])
    first = next(p for n, p in model.named_parameters() if ".experts." in n).detach().clone()
    for step in range(4):  # routing differs by rank (block_routes "uneven")
        block_loss(model, step, rank, layers=3).backward()
        host.step()
        sz.step()
        host.zero_grad()
    gc.collect()
    moved = not torch.equal(first, next(p for n, p in model.named_parameters()
                                        if ".experts." in n))
    return {"probes": len(_TaggingBlock.probes),
            "alive": sum(p() is not None for p in _TaggingBlock.probes), "moved": int(moved)}


@pytest.mark.multiproc
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_training_steps_leave_no_graph_alive(checkpointed: bool):
    """World 2, routing that differs by rank, every block a launch unit: after four steps no
    node the units' hooks were registered on is alive. With torch's multi-grad hook, 8 of 12
    were (plain) and 8 of 24 (checkpoint: the recompute's forwards count too)."""
    for run in all_values(run_ranks(_steps_free_their_graphs, 2, checkpointed, timeout=120)):
        assert run["probes"] >= 12 and run["moved"] == 1, run
        assert run["alive"] == 0, run
