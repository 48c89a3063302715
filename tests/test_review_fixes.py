"""Regressions found in review: reentrant checkpointing, no_sync after an open micro-step,
bounded bucket memory during backward, one global norm with expert groups, misspelled
hyperparameters, two instances on the same parameters, a dict config."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from selzero_plugin import (ConfigError, SelectedZero2, SelZeroConfig, UsageError,
                            clip_grad_norm_)

from .dist_utils import all_values, run_ranks


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.a, x, use_reentrant=self.reentrant)
        return checkpoint(self.b, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_equals_plain_sgd(reentrant):
    torch.manual_seed(0)
    model = _Checkpointed(reentrant)
    ref = _Checkpointed(reentrant)
    ref.load_state_dict(model.state_dict())
    sz = SelectedZero2(model, {"params": ["*"]}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = torch.randn(3, 4, requires_grad=True)
        model(x).pow(2).sum().backward()
        assert sz.step().updated == 4
        ref(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name


def test_cannot_run_a_no_sync_backward_into_an_open_reduced_microstep():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    sz = SelectedZero2(model, SelZeroConfig(params=["*"]), torch.optim.SGD, {"lr": 1.0})
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(UsageError, match="end_microstep"):
        with sz.no_sync():
            model(torch.ones(1, 3)).sum().backward()


def test_cannot_run_a_no_sync_backward_between_reduce_gradients_and_step():
    model = nn.Linear(3, 2)
    sz = SelectedZero2(model, SelZeroConfig(params=["*"]), torch.optim.SGD, {"lr": 1.0})
    model(torch.ones(1, 3)).sum().backward()
    sz.reduce_gradients()
    with pytest.raises(UsageError, match="step"):
        with sz.no_sync():
            model(torch.ones(1, 3)).sum().backward()


def test_no_sync_then_reduced_microsteps_sum_every_gradient():
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    start = model.weight.detach().clone()
    sz = SelectedZero2(model, SelZeroConfig(params=["*"]), torch.optim.SGD, {"lr": 1.0})
    with sz.no_sync():
        model(torch.full((1, 3), 2.0)).sum().backward()
    model(torch.ones(1, 3)).sum().backward()
    sz.step()
    assert torch.equal(model.weight.detach(), start - 3.0)


def _bucket_memory_during_backward(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    sz = SelectedZero2(model, SelZeroConfig(params=["*"], bucket_mb=0.01), torch.optim.SGD,
                       {"lr": 0.1})
    model(torch.randn(2, 64)).sum().backward()
    in_flight = len(sz.collectives.pending)
    buckets = len(sz.layout.buckets)
    sz.step()
    return {"buckets": buckets, "in_flight": in_flight}


def test_completed_bucket_reductions_release_their_buffers_during_backward():
    """A group of one completes every reduce-scatter at once: nothing stays pending, so no
    full-size bucket buffer outlives its reduction even before the reduction point."""
    r = all_values(run_ranks(_bucket_memory_during_backward, 1, timeout=60))[0]
    assert r["buckets"] >= 4 and r["in_flight"] == 0, r


def _expert_group_norms(rank: int, world: int, reduction: str) -> float:
    """Each rank is its own expert group (a different expert); host under plain all-reduce."""
    torch.manual_seed(rank)
    model = nn.ModuleDict({"dense": nn.Linear(3, 3), "expert": nn.Linear(3, 3)})
    groups = [dist.new_group([r]) for r in range(world)]
    sz = SelectedZero2(model, SelZeroConfig(params=["expert.*"], reduction=reduction,
                                            broadcast=False), torch.optim.SGD, {"lr": 0.1},
                       group=groups[rank])
    x = torch.randn(2, 3)
    (model["dense"](x).sum() + model["expert"](x).pow(2).sum()).backward()
    for p in model["dense"].parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    kwargs = {"active": True} if reduction == "sum" else {}
    sz.reduce_gradients(**kwargs)
    norm = clip_grad_norm_(list(model["dense"].parameters()), 0.1, subsets=[sz])
    sz.step()
    return float(norm)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_clip_norm_is_the_same_on_every_rank_with_expert_groups(reduction):
    norms = all_values(run_ranks(_expert_group_norms, 2, reduction, timeout=60))
    assert norms[0] == norms[1], norms


def test_cannot_misspell_an_optimizer_hyperparameter():
    with pytest.raises(ConfigError, match="weigth_decay.*did you mean 'weight_decay'"):
        SelectedZero2(nn.Linear(2, 2), SelZeroConfig(params=["*"]), torch.optim.AdamW,
                      {"lr": 1e-3, "weigth_decay": 0.5})
    with pytest.raises(ConfigError, match="param_groups\\[0\\]"):
        SelectedZero2(nn.Linear(2, 2), SelZeroConfig(params=["*"], param_groups=[
            {"params": ["*.bias"], "momentun": 0.0}]), torch.optim.SGD, {"lr": 0.1})


def test_cannot_build_two_instances_on_the_same_parameters_until_the_first_lets_go():
    model = nn.Linear(2, 2)
    first = SelectedZero2(model, SelZeroConfig(params=["*"]), torch.optim.SGD, {"lr": 0.1})
    with pytest.raises(UsageError, match="remove_hooks"):
        SelectedZero2(model, SelZeroConfig(params=["*"]), torch.optim.SGD, {"lr": 0.1})
    first.remove_hooks()
    second = SelectedZero2(model, SelZeroConfig(params=["*"]), torch.optim.SGD, {"lr": 0.1})
    model(torch.ones(1, 2)).sum().backward()
    assert second.step().updated == 2


def test_a_dict_config_is_accepted_and_a_wrong_type_is_a_config_error():
    sz = SelectedZero2(nn.Linear(2, 2), {"params": ["weight"]}, torch.optim.SGD, {"lr": 0.1})
    assert sz.selected_names == ["weight"]
    with pytest.raises(ConfigError):
        SelectedZero2(nn.Linear(2, 2), ["*"], torch.optim.SGD, {"lr": 0.1})
