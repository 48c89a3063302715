"""Instances on proper subgroups (DESIGN.md "Normalization"): building one never communicates
outside its group, so groups may hold different numbers of instances (pipeline stages with
different numbers of MoE layers); normalization over other ranks (``normalize_over="world"``, a
process group, or a list of global ranks) uses one communicator per rank set, shared by every
instance of the process, created at its first use."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from selzero_plugin import ConfigError, SelectedZero2, SelZeroConfig, clip_grad_norm_

from ._state import cached_outcomes, capture, value_of
from .dist_utils import all_errors, all_values, run_ranks

pytestmark = pytest.mark.multiproc


def _model(seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({"a": nn.Linear(5, 3), "b": nn.Linear(5, 3), "c": nn.Linear(5, 3)})


def stages_run(rank: int, world: int, normalize_over: str, reduction: str) -> dict[str, Any]:
    """Ranks {0, 1} hold one instance (on `a`); ranks {2, 3} hold two (on `b` and `c`). Under
    `weighted` the token count is summed over the normalize_over ranks at every reduction point,
    a collective over them, so there every group holds the same instances (two)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # torch's rule: every rank, in order
    mine = groups[rank // 2]
    over: Any = {"world": "world", "list": [0, 1, 2, 3], "group": dist.group.WORLD}[normalize_over]
    model = _model(rank // 2)
    names = ["b", "c"] if rank >= 2 or reduction == "weighted" else ["a"]
    instances = [SelectedZero2(model, SelZeroConfig(params=[f"{n}.*"], name=n, reduction=reduction,
                                                    normalize_over=over),
                               torch.optim.SGD, {"lr": 1.0}, group=mine) for n in names]
    x = torch.full((2, 5), float(rank + 1))
    sum(model[n](x).sum() for n in names).backward()
    kwargs = {"weight": rank + 1} if reduction == "weighted" else {}
    results = [sz.step(**kwargs) for sz in instances]
    return {"global_weight": [r.global_weight for r in results],
            "bias": {n: model[n].bias.detach().clone() for n in names}}


CASES = [(over, reduction) for over in ("world", "list", "group") for reduction in ("mean",
                                                                                   "weighted")]


def _all_cases(rank: int, world: int) -> dict[Any, Any]:
    return {case: capture(lambda: stages_run(rank, world, *case)) for case in CASES}


_outcomes = cached_outcomes(_all_cases, 4, timeout=150)


@pytest.mark.parametrize("normalize_over", ["world", "list", "group"])
@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_groups_with_different_numbers_of_instances_normalize_over_the_world(normalize_over,
                                                                              reduction):
    runs = value_of(_outcomes(), (normalize_over, reduction))
    expected = 4 if reduction == "mean" else 1 + 2 + 3 + 4
    instances = [1, 1, 2, 2] if reduction == "mean" else [2, 2, 2, 2]
    assert [r["global_weight"] for r in runs] == [[expected] * n for n in instances]
    # a bias gradient is 2 per rank (the batch), summed over the group of 2, divided by
    # `expected`; SGD with lr 1 subtracts it
    for rank, r in enumerate(runs):
        start = _model(rank // 2)
        for n, bias in r["bias"].items():
            assert torch.allclose(bias, start[n].bias.detach() - 4.0 / expected), (rank, n)


def _construction_only(rank: int, world: int) -> int:
    """Only ranks {0, 1} build anything; ranks 2 and 3 never call selzero at all."""
    group = dist.new_group([0, 1])
    if rank >= 2:
        return 0
    model = _model(0)
    sz = SelectedZero2(model, SelZeroConfig(params=["a.*"]), torch.optim.SGD, {"lr": 1.0},
                       group=group)
    model["a"](torch.ones(1, 5)).sum().backward()
    return sz.step().updated


def test_building_on_a_subgroup_does_not_involve_other_ranks():
    assert all_values(run_ranks(_construction_only, 4, timeout=60)) == [2, 2, 0, 0]


def _outside_normalize_over(rank: int, world: int) -> None:
    SelectedZero2(_model(0), SelZeroConfig(params=["a.*"], normalize_over=[0]),
                  torch.optim.SGD, {"lr": 1.0})


def test_cannot_normalize_over_ranks_that_leave_out_part_of_the_group():
    messages = all_errors(run_ranks(_outside_normalize_over, 2, timeout=60), "ConfigError")
    assert all("normalize_over" in m and "[0]" in m for m in messages)


@pytest.mark.parametrize("bad", [[], [0, 0], [-1], ["0"], "everyone", 3])
def test_cannot_give_normalize_over_a_bad_value(bad):
    with pytest.raises(ConfigError, match="normalize_over"):
        SelZeroConfig(params=["*"], normalize_over=bad)


def test_normalize_over_a_list_round_trips_through_to_dict():
    cfg = SelZeroConfig(params=["*"], normalize_over=[3, 1, 2])
    assert cfg.normalize_over == [1, 2, 3]
    assert SelZeroConfig.from_dict(cfg.to_dict()) == cfg


# ---- an agreed error in one expert group reaches the others -----------------------------------

def _group_error_run(rank: int, world: int, failure: str) -> list[Any]:
    """Each rank is its own expert group, normalizing over the world. At step 0 rank 0's group
    fails: a second backward (weighted: its reduction point), a NaN gradient (weighted:
    nonfinite='error' at its reduction point), or a NaN gradient inside clip_grad_norm_ (mean).
    Every rank must raise, none wait; after it, training goes on with the right counts."""
    groups = [dist.new_group([r]) for r in range(world)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reduction = "mean" if failure == "nan_in_clip" else "weighted"
    sz = SelectedZero2(model, SelZeroConfig(params=["1.*"], reduction=reduction,
                                            normalize_over="world", timeout_s=30),
                       torch.optim.SGD, {"lr": 0.1}, group=groups[rank])
    log: list[Any] = []
    for step in range(3):
        x = torch.randn(3, 4)
        out = model(x)
        if failure.startswith("nan") and step == 0 and rank == 0:
            out = out * float("nan")
        out.sum().backward()
        if failure == "second_backward" and step == 0 and rank == 0:
            model(x).sum().backward()
        try:
            if reduction == "weighted":
                sz.reduce_gradients(weight=10 * (step + 1) + rank)
            clip_grad_norm_(list(model[0].parameters()), 1.0, subsets=[sz])
            log.append(sz.step().global_weight)
        except ValueError as e:
            log.append(type(e).__name__)
        model.zero_grad()
    return log


@pytest.mark.parametrize("failure", ["second_backward", "nan_in_reduce", "nan_in_clip"])
def test_an_agreed_error_of_one_expert_group_is_raised_by_every_group(failure):
    runs = all_values(run_ranks(_group_error_run, 2, failure, timeout=90))
    assert all(isinstance(r[0], str) for r in runs), runs
    expected = [2, 2] if failure == "nan_in_clip" else [41, 61]
    assert [r[1:] for r in runs] == [expected] * 2, runs
