"""Fused expert tensors (transformers Qwen3-MoE and Mixtral) with ``expert_dim=0`` and without.

With ``expert_dim=0`` each expert of a fused (E, ...) tensor is its own virtual parameter: an
expert whose gradient rows are exactly zero on every rank is absent (rows and optimizer state
bit-identical, no step count), one absent on some ranks only gets their zero contribution; the
result equals a per-expert single-process reference. With ``expert_dim=None`` the fused tensor is
one stock parameter: its unrouted rows decay like plain torch's. See tests/_fused.py.
"""

from __future__ import annotations

import pytest
import torch

from ._fused import KINDS, fused_reference, fused_selzero
from ._shard import assemble
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

STEPS = 6


@pytest.fixture(scope="module", params=[(k, w) for k in KINDS for w in (2, 3)],
                ids=lambda p: f"{p[0]}-world{p[1]}")
def fused(request):
    kind, world = request.param
    runs = all_values(run_ranks(fused_selzero, world, kind, STEPS, timeout=120))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded: same kernels, same rounding
    try:
        refs = {"0": fused_reference(kind, world, STEPS, split=True),
                "None": fused_reference(kind, world, STEPS, split=False)}
    finally:
        torch.set_num_threads(threads)
    return world, runs, refs


def _routed_anywhere(runs, key: str, step: int) -> dict[str, torch.Tensor]:
    names = runs[0][key][step]["routed"]
    return {n: torch.stack([run[key][step]["routed"][n] for run in runs]).any(0) for n in names}


def _state(runs, key: str, step: int):
    return assemble([run[key][step]["shard"] for run in runs])


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k]))
                                    for k in a)


def test_routing_differs_across_ranks_and_leaves_experts_without_tokens(fused):
    """The scenario the other tests rely on, checked rather than assumed."""
    world, runs, refs = fused
    absent_with_state = partial = 0
    for step in range(1, STEPS):
        for name, anywhere in _routed_anywhere(runs, "0", step).items():
            per_rank = torch.stack([run["0"][step]["routed"][name] for run in runs])
            partial += int((per_rank.any(0) & ~per_rank.all(0)).sum())
            before = _state(runs, "0", step - 1)
            absent_with_state += sum(1 for e in range(anywhere.numel())
                                     if not anywhere[e] and before[(name, e)]["state"])
    assert partial > 0 and absent_with_state > 0, (partial, absent_with_state)
    for step in range(STEPS):  # same routing as the single-process reference
        for name, ref_routed in refs["0"][step]["routed"].items():
            ours = torch.stack([run["0"][step]["routed"][name] for run in runs])
            assert torch.equal(ours, ref_routed), (step, name)


def test_fused_expert_absent_on_every_rank_keeps_rows_and_state_bit_identical(fused):
    world, runs, _ = fused
    checked = 0
    for step in range(1, STEPS):
        before, after = _state(runs, "0", step - 1), _state(runs, "0", step)
        for name, anywhere in _routed_anywhere(runs, "0", step).items():
            for e in (~anywhere).nonzero().flatten().tolist():
                for r, run in enumerate(runs):
                    assert torch.equal(run["0"][step]["params"][name][e],
                                       run["0"][step - 1]["params"][name][e]), (
                        f"rank {r} step {step}: {name}[expert {e}] changed while absent")
                assert _same(after[(name, e)]["state"], before[(name, e)]["state"]), (
                    f"step {step}: {name}[expert {e}] optimizer state changed while absent")
                assert torch.equal(after[(name, e)]["value"], before[(name, e)]["value"])
                checked += 1
    assert checked > 0


def test_fused_routed_experts_move_and_count_steps(fused):
    """What makes the test above able to fail: routed experts do move and count their steps."""
    world, runs, _ = fused
    counts: dict[tuple[str, int], int] = {}
    for step in range(STEPS):
        state = _state(runs, "0", step)
        for name, anywhere in _routed_anywhere(runs, "0", step).items():
            for e in range(anywhere.numel()):
                counts[(name, e)] = counts.get((name, e), 0) + int(anywhere[e])
                assert float(state[(name, e)]["state"].get("step", 0)) == counts[(name, e)]
                if anywhere[e] and step:
                    assert not torch.equal(runs[0]["0"][step]["params"][name][e],
                                           runs[0]["0"][step - 1]["params"][name][e])


def test_fused_expert_dim0_matches_per_expert_reference(fused):
    """Experts absent on some ranks contribute zeros: parity with the per-expert reference."""
    world, runs, refs = fused
    for step in range(STEPS):
        ref = refs["0"][step]
        for r, run in enumerate(runs):
            for name, p in run["0"][step]["params"].items():
                diff = float((p - ref["params"][name]).abs().max())
                assert diff <= 2e-6, f"rank {r} step {step}: {name} differs by {diff}"
        state = _state(runs, "0", step)
        assert set(state) >= set(ref["state"])
        for key, item in state.items():
            expected = ref["state"].get(key, {})
            assert set(item["state"]) == set(expected), (step, key)
            for k, v in expected.items():
                torch.testing.assert_close(torch.as_tensor(item["state"][k]).reshape(-1),
                                           v.reshape(-1), atol=1e-7, rtol=1e-4,
                                           msg=f"step {step}: {key} {k}")


def test_fused_step_result_counts_experts_absent_on_every_rank(fused):
    world, runs, _ = fused
    for step in range(STEPS):
        routed = _routed_anywhere(runs, "0", step)
        absent = sum(int((~a).sum()) for a in routed.values())
        total = sum(a.numel() for a in routed.values())
        for run in runs:
            result = run["0"][step]["result"]
            assert (result.updated, result.skipped_absent) == (total - absent, absent), step


def test_fused_gradients_are_taken_by_selzero(fused):
    world, runs, _ = fused
    for run in runs:
        for key in ("0", "None"):
            assert all(not snap["grads_left"] for snap in run[key])


def test_expert_dim_none_fused_tensor_is_one_stock_parameter(fused):
    """Unsplit, a fused tensor matches plain torch, unrouted rows decaying included."""
    world, runs, refs = fused
    decayed = 0
    for step in range(STEPS):
        ref = refs["None"][step]
        for r, run in enumerate(runs):
            for name, p in run["None"][step]["params"].items():
                diff = float((p - ref["params"][name]).abs().max())
                assert diff <= 2e-6, f"rank {r} step {step}: {name} differs by {diff}"
        state = _state(runs, "None", step)
        for (name, expert), item in state.items():
            assert expert is None
            assert float(item["state"]["step"]) == step + 1
            torch.testing.assert_close(item["state"]["exp_avg"],
                                       ref["state"][(name, None)]["exp_avg"].reshape(-1),
                                       atol=1e-7, rtol=1e-4)
        if step:
            for name, anywhere in _routed_anywhere(runs, "None", step).items():
                for e in (~anywhere).nonzero().flatten().tolist():
                    assert not torch.equal(runs[0]["None"][step]["params"][name][e],
                                           runs[0]["None"][step - 1]["params"][name][e])
                    decayed += 1
    assert decayed > 0, "no row was unrouted everywhere: the decay check did not run"


def test_fused_experts_are_split_under_a_submodule_named_like_a_module_method():
    """``model.half`` is also ``nn.Module.half``: finding the owner must not go through getattr."""
    from selzero_plugin.core.selection import resolve_selection

    from ._memory import FusedExperts

    model = torch.nn.Module()
    model.half = inner = torch.nn.Module()
    inner.experts = FusedExperts(3, torch.float32)
    model.weight = torch.nn.Parameter(torch.zeros(3, 2))
    entries = resolve_selection(model, params=["*"], modules=[], expert_dim=0)
    assert [(e.name, e.num_experts) for e in entries] == [("weight", None),
                                                           ("half.experts.weight", 3)]


def test_a_submodule_named_like_a_module_method_trains():
    """The binding check at the reduction point must not take ``Module.half`` for the child
    ``model.half`` either (review finding: every step was refused as "no longer the model's
    parameter objects")."""
    from selzero_plugin import SelectedZero2

    from ._memory import FusedExperts

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.half = inner = torch.nn.Module()
    inner.experts = FusedExperts(3, torch.float32)
    model.weight = torch.nn.Parameter(torch.zeros(3, 2))
    sz = SelectedZero2(model, {"params": ["*"], "expert_dim": 0}, torch.optim.SGD, {"lr": 0.1})
    w = inner.experts.weight
    before = w.detach().clone()
    ((w * torch.randn_like(w)).sum() + model.weight.sum()).backward()
    assert sz.step().updated == 4
    assert not torch.equal(before, w)
