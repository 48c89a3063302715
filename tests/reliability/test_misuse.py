"""Reliability 6: misuse. Each either works as documented or every rank raises the same
UsageError saying what to do, also where only one rank misbehaves (the others would otherwise
wait). World 2 and 3, routing that differs by rank.

| misuse | outcome |
|---|---|
| ``step()`` without a backward (all ranks, or one rank) | works: that rank contributes zeros, a parameter no rank has a gradient for is not updated (StepResult.updated == 0 when none) |
| a second ``step()`` without new gradients | works: nothing is updated a second time (a window is never re-applied; torch would re-apply stale ``.grad``) |
| a second backward into an unclosed reduced micro-step | UsageError on every rank: tests/test_second_backward.py |
| ``backward`` after ``step`` without zeroing host grads | works: selected parameters never keep a ``.grad``, the subset trains as with zero_grad |
| a host optimizer holding state for a selected parameter (all ranks or one) | UsageError at construction, naming the parameters and the fix; keeping them in its groups with ``grad=None`` is fine |
| the model wrapped with DDP before selzero was built | UsageError at the first reduction point (DDP writes the subset's averaged gradients back into ``.grad``) |
| the model cast or moved after setup (all ranks or one) | UsageError at the reduction point naming the parameters (core/binding.py) |
| a selected ``.grad`` left by a backward before construction (one rank) | UsageError at construction on every rank (autograd would add it into the first gradient); zeros left by ``zero_grad(set_to_none=False)`` are dropped |
| a parameter replaced on one rank, then ``load_checkpoint`` | UsageError on every rank from the read phase; every rank keeps its state |
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from .._state import capture, snapshot, strip_rank_prefix
from ..dist_utils import all_values, run_ranks
from ..models import ToyMoE, loss_fn, make_batch

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

CONFIG = {"params": ["experts.*"], "timeout_s": 20.0}


def _routes(step: int, rank: int) -> torch.Tensor:
    return (torch.arange(6) * (rank + 1) + step) % 3  # expert 3 never; ranks differ


def _loss(model: Any, rank: int, step: int) -> torch.Tensor:
    x, y = make_batch(step, rank)
    return loss_fn(model, x, y, _routes(step, rank))


def _engine(optimizer: Any = torch.optim.AdamW, model: ToyMoE | None = None
            ) -> tuple[ToyMoE, SelectedZero2]:
    if model is None:
        torch.manual_seed(0)
        model = ToyMoE()
    kwargs = None if isinstance(optimizer, torch.optim.Optimizer) else {"lr": 1e-2}
    return model, SelectedZero2(model, SelZeroConfig(**CONFIG), optimizer, kwargs)


def _selected(model: ToyMoE) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "experts" in k}


def _step_without_backward(rank: int, who: str) -> dict[str, Any]:
    model, sz = _engine()
    before = _selected(model)
    if who == "one" and rank != 1:
        _loss(model, rank, 0).backward()
    result = sz.step()
    unchanged = all(torch.equal(before[k], v) for k, v in _selected(model).items())
    return {"updated": result.updated, "unchanged": unchanged, "next": sz.step().updated}


def _second_step(rank: int) -> dict[str, Any]:
    model, sz = _engine()
    _loss(model, rank, 0).backward()
    first = sz.step().updated
    after_first = snapshot(model, sz)
    second = sz.step().updated
    same = all(torch.equal(after_first[k], v) if isinstance(v, torch.Tensor) else
               after_first[k] == v for k, v in snapshot(model, sz).items())
    return {"first": first, "second": second, "unchanged": same}


def _no_zero_grad(rank: int, zero: bool) -> dict[str, torch.Tensor]:
    model, sz = _engine()
    host = torch.optim.SGD([p for n, p in model.named_parameters() if "experts" not in n], lr=0.0)
    for step in range(3):
        _loss(model, rank, step).backward()
        assert all(p.grad is None for n, p in model.named_parameters() if "experts" in n)
        sz.step()
        host.step()
        if zero:
            host.zero_grad()
    return _selected(model)


def _host_state(rank: int, who: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ToyMoE()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if who == "all" or rank == 1:
        _loss(model, rank, 0).backward()
        host.step()
        host.zero_grad()
    _engine(host, model)
    return {}


def _host_keeps_groups(rank: int) -> dict[str, Any]:
    """The normal case: the host optimizer holds every parameter, selzero's have grad=None."""
    torch.manual_seed(0)
    model = ToyMoE()
    host = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, sz = _engine(host, model)
    for step in range(2):
        _loss(model, rank, step).backward()
        sz.step()
        host.step()
        host.zero_grad()
    selected = {id(e.param) for e in sz.entries}
    return {"host_state_for_selected": sum(id(p) in selected for p in host.state),
            "updated_by_selzero": sz.step().updated}


def _ddp_first(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ToyMoE()
    ddp = DistributedDataParallel(model)
    _, sz = _engine(model=model)
    x, y = make_batch(0, rank)
    # every expert used on every rank, or DDP never finishes its reduction (and raises at the
    # next forward: "Expected to have finished reduction in the prior iteration")
    loss_fn(ddp, x, y, (torch.arange(6) + rank) % 4).backward()
    sz.step()
    return {}


def _ddp_after(rank: int) -> dict[str, Any]:
    """The documented order works: selzero first, then wrap_ddp."""
    model, sz = _engine()
    ddp = wrap_ddp(model, sz)
    _loss(ddp, rank, 0).backward()
    return {"updated": sz.step().updated}


def _moved(rank: int, who: str) -> dict[str, Any]:
    model, sz = _engine()
    if who == "all" or rank == 1:
        model.double()
    x, y = make_batch(0, rank)
    loss_fn(model, x.to(model.inp.weight.dtype), y.to(model.inp.weight.dtype),
            _routes(0, rank)).sum().backward()
    sz.step()
    return {}


def _load_replaced(rank: int, folder: str) -> dict[str, Any]:
    """A parameter object replaced on one rank, then a load: every rank refuses in the read
    phase and keeps its state (review finding: the others had swapped theirs in)."""
    model, sz = _engine()
    _loss(model, rank, 0).backward()
    sz.step()
    sz.save_checkpoint(folder)
    _loss(model, rank, 1).backward()
    sz.step()
    if rank == 1:
        old = model.experts[0].w1.weight
        model.experts[0].w1.weight = torch.nn.Parameter(old.detach().clone())
    before = snapshot(model, sz)
    try:
        sz.load_checkpoint(folder)
    finally:
        after = snapshot(model, sz)
        assert before.keys() == after.keys() and all(
            torch.equal(before[k], v) if isinstance(v, torch.Tensor) else before[k] == v
            for k, v in after.items()), "state changed by a refused load"
    return {}


def _stale_grad(rank: int, kind: str) -> dict[str, Any]:
    """A backward before construction (on one rank: rank 1): its .grad would be added into the
    first gradient. Zeros left by zero_grad(set_to_none=False) are fine."""
    torch.manual_seed(0)
    model = ToyMoE()
    if rank == 1 or kind == "zeros":
        _loss(model, rank, 0).backward()
        if kind == "zeros":
            model.zero_grad(set_to_none=False)
    _, sz = _engine(model=model)
    return {"grads": [n for n, p in model.named_parameters() if "experts" in n and
                      p.grad is not None]}


def misuse_run(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {
        "stale_grad/one": capture(lambda: _stale_grad(rank, "values")),
        "stale_grad/zeros": capture(lambda: _stale_grad(rank, "zeros")),
        "load_replaced/one": capture(lambda: _load_replaced(rank, folder)),
        "step_without_backward/all": capture(lambda: _step_without_backward(rank, "all")),
        "step_without_backward/one": capture(lambda: _step_without_backward(rank, "one")),
        "second_step": capture(lambda: _second_step(rank)),
        "no_zero_grad": capture(lambda: _no_zero_grad(rank, zero=False)),
        "zero_grad": capture(lambda: _no_zero_grad(rank, zero=True)),
        "host_state/all": capture(lambda: _host_state(rank, "all")),
        "host_state/one": capture(lambda: _host_state(rank, "one")),
        "host_keeps_groups": capture(lambda: _host_keeps_groups(rank)),
        "ddp_first": capture(lambda: _ddp_first(rank)),
        "ddp_after": capture(lambda: _ddp_after(rank)),
        "moved/all": capture(lambda: _moved(rank, "all")),
        "moved/one": capture(lambda: _moved(rank, "one")),
    }


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def runs(request, tmp_path_factory):
    world = request.param
    folder = tmp_path_factory.mktemp(f"misuse-w{world}") / "ckpt"
    return world, all_values(run_ranks(misuse_run, world, str(folder), timeout=180))


def _values(runs: Any, key: str) -> list[Any]:
    world, results = runs
    out = []
    for r in range(world):
        got = results[r][key]
        assert "error" not in got, f"rank {r} {key}: {got.get('message')}\n{got.get('traceback')}"
        out.append(got["value"])
    return out


def _same_usage_error(runs: Any, key: str, needles: list[str]) -> None:
    world, results = runs
    messages = []
    for r in range(world):
        got = results[r][key]
        assert got.get("error") == "UsageError", f"rank {r} {key}: {got}"
        assert got["message"].startswith(f"[rank {r}/{world}]"), got["message"]
        for needle in needles:
            assert needle in got["message"], f"{needle!r} not in {got['message']!r}"
        messages.append(strip_rank_prefix(got["message"]))
    assert len(set(messages)) == 1, messages


@pytest.mark.parametrize("who", ["all", "one"])
def test_step_without_backward_updates_only_what_got_gradients(runs, who):
    values = _values(runs, f"step_without_backward/{who}")
    for v in values:
        if who == "all":
            assert v["updated"] == 0 and v["unchanged"], v
        else:  # the other ranks' gradients train; the rank without backward added zeros
            assert v["updated"] > 0 and not v["unchanged"], v
        assert v["next"] == 0, v


def test_a_second_step_without_new_gradients_updates_nothing(runs):
    for v in _values(runs, "second_step"):
        assert v["first"] > 0 and v["second"] == 0 and v["unchanged"], v


def test_backward_after_step_without_zero_grad_trains_the_subset_as_with_it(runs):
    for kept, zeroed in zip(_values(runs, "no_zero_grad"), _values(runs, "zero_grad")):
        assert kept.keys() == zeroed.keys()
        for k in kept:
            assert torch.equal(kept[k], zeroed[k]), k


@pytest.mark.parametrize("who", ["all", "one"])
def test_a_host_optimizer_with_state_for_a_selected_parameter_is_refused(runs, who):
    _same_usage_error(runs, f"host_state/{who}", [
        "holds state", "experts.0.", "Build SelectedZero2 before the host's first step",
        "host.state.pop(p)"])
    if who == "one":
        assert "failed on group rank 1" in runs[1][0][f"host_state/{who}"]["message"]


def test_a_host_optimizer_that_keeps_the_selected_parameters_in_its_groups_is_fine(runs):
    for v in _values(runs, "host_keeps_groups"):
        assert v == {"host_state_for_selected": 0, "updated_by_selzero": 0}, v


def test_ddp_built_before_selzero_is_refused_at_the_first_reduction(runs):
    _same_usage_error(runs, "ddp_first", ["hold a .grad at the reduction point",
                                          "DistributedDataParallel", "wrap_ddp(model, sz)"])
    for v in _values(runs, "ddp_after"):
        assert v["updated"] > 0


@pytest.mark.parametrize("who", ["all", "one"])
def test_a_model_cast_after_setup_is_refused_on_every_rank(runs, who):
    _same_usage_error(runs, f"moved/{who}", ["changed dtype", "experts.0.",
                                             "Cast the model before building SelectedZero2"])


def test_a_load_after_a_parameter_was_replaced_on_one_rank_is_refused_by_every_rank(runs):
    _same_usage_error(runs, "load_replaced/one", ["failed on group rank 1",
                                                  "no longer the model's parameter objects",
                                                  "experts.0.w1.weight"])


def test_a_gradient_left_before_construction_is_refused_and_zeros_are_dropped(runs):
    _same_usage_error(runs, "stale_grad/one", ["failed on group rank 1", "non-zero .grad",
                                               "zero_grad(set_to_none=True)"])
    for v in _values(runs, "stale_grad/zeros"):
        assert v == {"grads": []}, v
