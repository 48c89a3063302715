"""live_instances() order: the same on every rank."""

from __future__ import annotations

import torch

from selzero_plugin import SelectedZero2


def test_live_instances_come_in_construction_order():
    """Review finding: a GradScaler's unscale and a failed backward issue collectives per
    instance in live_instances() order, which came from a WeakSet (address order, different
    on each rank): two instances under one scaler waited for each other until the timeout."""
    from selzero_plugin.core.zero2 import live_instances

    built = []
    keep = []
    for i in range(12):
        keep.append(torch.zeros(1000 * (12 - i)))  # vary the addresses
        model = torch.nn.Sequential(torch.nn.Linear(3, 3))
        built.append(SelectedZero2(model, {"params": ["0.*"], "name": f"i{i}"},
                                   torch.optim.SGD, {"lr": 0.1}))
    try:
        mine = [sz.config.name for sz in live_instances() if any(sz is b for b in built)]
        assert mine == [f"i{i}" for i in range(12)]
    finally:
        for sz in built:
            sz.remove_hooks()
