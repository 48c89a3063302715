"""One device-to-host read per reduction point (DESIGN.md "Micro-steps and reduction points"):
the signature check, the weight, presence, the non-finite flags and the launch-unit check travel
in one all-reduced tensor, read once. Counted here as every ``aten._local_scalar_dense``
(``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor) plus every ``Tensor.tolist()``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._blocks import BlockMoE, block_loss
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

LAYERS = 3


class CountHostReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


class CountToList(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.tolist:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _count(fn: Any) -> int:
    with CountHostReads() as dispatch, CountToList() as function:
        fn()
    return dispatch.reads + function.reads


def host_reads_run(rank: int, world: int, reduction: str, expert_dim: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], reduction=reduction,
                                            bucket_mb=1e-4, missing_grad="zero",
                                            nonfinite="skip"),
                       torch.optim.AdamW, {"lr": 1e-2})
    weight = {"weighted": {"weight": torch.tensor(6)}, "sum": {"active": torch.tensor(True)},
              "mean": {}}[reduction]
    micro = {"sum": {"active": torch.tensor(True)}}.get(reduction, {})
    counts: dict[str, int] = {}
    for step in range(2):
        block_loss(model, 2 * step, rank, layers=LAYERS).backward()
        counts["end_microstep"] = _count(lambda: sz.end_microstep(**micro))
        block_loss(model, 2 * step + 1, rank, layers=LAYERS).backward()
        counts["reduce_gradients"] = _count(lambda: sz.reduce_gradients(**weight))
        sz.step()
    return counts


@pytest.mark.parametrize("reduction", ["mean", "weighted", "sum"])
def test_each_reduction_point_reads_the_device_once(reduction):
    for counts in all_values(run_ranks(host_reads_run, 2, reduction, False, timeout=60)):
        assert counts == {"end_microstep": 1, "reduce_gradients": 1}, counts
