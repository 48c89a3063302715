"""A non-finite host gradient makes the global norm non-finite: the subset follows `nonfinite`."""

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_

from .dist_utils import all_errors, all_values, run_ranks

pytestmark = pytest.mark.multiproc


def _clip_with_inf_host_grad(rank: int, world: int, policy: str) -> dict:
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "experts": nn.Linear(3, 3)})
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], nonfinite=policy),
                       torch.optim.SGD, {"lr": 0.1})
    before = model["experts"].weight.detach().clone()
    x = torch.randn(2, 3)
    (model["experts"](x).sum() + model["a"](x).sum() * float("inf")).backward()
    host = [p for n, p in model.named_parameters() if not n.startswith("experts")]
    norm = clip_grad_norm_(host, 1.0, subsets=[sz])
    result = sz.step()
    # the next, finite step works
    model["experts"](x).sum().backward()
    after_skip = model["experts"].weight.detach().clone()
    next_result = sz.step()
    return {"norm": float(norm), "result": result, "unchanged": torch.equal(before, after_skip),
            "next_updated": next_result.updated}


@pytest.mark.parametrize("world", [1, 2])
def test_nonfinite_global_norm_skips_the_subset_update_under_skip(world):
    for r in all_values(run_ranks(_clip_with_inf_host_grad, world, "skip", timeout=60)):
        assert r["norm"] != r["norm"] or r["norm"] == float("inf")
        assert r["unchanged"], "experts must keep their weights when the step is skipped"
        assert r["result"].updated == 0 and r["result"].skipped_nonfinite == 2
        assert r["next_updated"] == 2


def test_nonfinite_global_norm_raises_on_every_rank_under_error():
    messages = all_errors(run_ranks(_clip_with_inf_host_grad, 2, "error", timeout=60),
                          "NonFiniteGradientError")
    assert all("global gradient norm is not finite" in m for m in messages)
