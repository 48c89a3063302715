"""Presence of split fused experts (expert_dim=0) is decided per row from the gradient's values:
a row is present when it holds anything but +-0 (one non-zero element, a tiny subnormal, a
NaN); a row of zeros or of -0.0 is absent and gets no update, no weight decay."""

from __future__ import annotations

import torch
from torch import nn

from selzero_plugin import SelectedZero2

E = 6


class Fused(nn.Module):
    num_experts = E  # opts in to the split ([Note: fused experts])

    def __init__(self, row: tuple[int, int] = (3, 5)) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(E, *row))

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return (self.w * scale).sum()


def test_row_presence_rule():
    torch.manual_seed(0)
    model = Fused()
    sz = SelectedZero2(model, {"params": ["w"], "expert_dim": 0}, torch.optim.AdamW,
                       {"lr": 1e-2, "weight_decay": 0.1})
    scale = torch.zeros(E, 3, 5)
    scale[1, 2, 4] = 1.0  # one element
    scale[2] = 1.0  # the whole row
    scale[3] = -0.0  # -0.0 only: absent
    scale[4, 0, 0] = 1e-45  # a subnormal
    scale[5, 1, 1] = -2.0  # negative only: max is 0, min is not
    before = model.w.detach().clone()
    model(scale).backward()
    result = sz.step()
    assert result.updated == 4 and result.skipped_absent == 2
    changed = [not torch.equal(model.w[e], before[e]) for e in range(E)]
    assert changed == [False, True, True, False, True, True]


def test_a_nan_row_is_present_and_non_finite():
    torch.manual_seed(0)
    model = Fused()
    sz = SelectedZero2(model, {"params": ["w"], "expert_dim": 0, "nonfinite": "skip"},
                       torch.optim.AdamW, {"lr": 1e-2})
    scale = torch.zeros(E, 3, 5)
    scale[2, 0, 0] = float("nan")
    before = model.w.detach().clone()
    model(scale).backward()
    result = sz.step()
    assert result.skipped_nonfinite == 1 and result.updated == 0
    assert torch.equal(model.w, before)


def test_row_presence_rule_outside_the_sample():
    """The only non-zero value of a row lies outside the sample (the row's last element, and
    the element just past a sampled block): the row is present all the same; so is a row whose
    sample holds zeros and a negative value elsewhere, and one with a NaN outside the sample."""
    torch.manual_seed(0)
    model = Fused((64, 64))  # rows of 4,096: read through a sample first
    sz = SelectedZero2(model, {"params": ["w"], "expert_dim": 0, "nonfinite": "skip"},
                       torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
    scale = torch.zeros(E, 64, 64)
    scale[1, 63, 63] = 1.0  # the last element only
    scale[2, 16, 0] = 1.0  # inside the second sampled block (row 16 starts it): sampled
    scale[3].view(-1)[64] = -3.0  # just past the first block, negative: max 0, min not
    scale[4].view(-1)[1000:1010] = -0.0  # -0.0 only: absent
    scale[5, 40, 3] = 1e-45  # a subnormal outside the sample
    before = model.w.detach().clone()
    model(scale).backward()
    result = sz.step()
    assert result.updated == 4 and result.skipped_absent == 2, result
    changed = [not torch.equal(model.w[e], before[e]) for e in range(E)]
    assert changed == [False, True, True, True, False, True]
    # a NaN outside the sample: present, and non-finite
    model.zero_grad()
    scale = torch.zeros(E, 64, 64)
    scale[0, 50, 50] = float("nan")
    model(scale).backward()
    result = sz.step()
    assert result.skipped_nonfinite == 1 and result.updated == 0, result
