"""``torch.amp.GradScaler`` covers selzero's gradients ([Note: loss scaling] in amp.py).

The natural loop, with the README's setup (a host optimizer over ``model.parameters()``,
``wrap_ddp``), a loss scale of 1024 that grows every 2 steps, and at one step an inf in an
expert's gradient on rank 1 only: ``scaler.scale(loss).backward(); scaler.unscale_(opt);
clip_grad_norm_(...); scaler.step(opt); scaler.update(); sz.step()``. It must equal plain torch
running the same loop on one process: the experts get unscaled gradients, the inf reaches the
scaler (which skips the host's step and halves the scale), and selzero skips with it. Also with
a fused host optimizer (``scaler.step`` then unscales nothing itself) and no explicit
``unscale_``, and with SGD (which, unlike AdamW, is not blind to a constant gradient factor). ``sz.step()`` before the scaler's unscale is refused on every rank.

Two shapes from review: two optimizers under one scaler (dense SGD unscaled first, then the
experts' AdamW that selzero mirrors; the inf in an expert must still reach the scaler), and a
second model in the same loop trained without any scaler (its ``sz.step()`` must not be refused
because another model's loss was scaled).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_, wrap_ddp

from ._blocks import BlockMoE, block_loss
from ._state import cached_outcomes, capture, model_state, value_of

pytestmark = pytest.mark.multiproc

LAYERS, STEPS, INF_STEP, CLIP = 2, 5, 2, 0.5
INF_PARAM = "blocks.1.experts.0.w1.weight"  # routed on rank 1 at every step ("uneven")
OPTS = {"adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
        "fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9})}


def _build() -> BlockMoE:
    torch.manual_seed(0)
    return BlockMoE(layers=LAYERS)


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)


def _poison(model: BlockMoE) -> Any:
    """An inf in one expert's gradient (a hook on the parameter, removed after the step)."""
    return model.get_submodule(INF_PARAM.rsplit(".", 1)[0]).weight.register_hook(
        lambda g: g * math.inf)


def _outcome(model: BlockMoE, scales: list[float], results: list[Any]) -> dict[str, Any]:
    return {"state": model_state(model), "scales": scales,
            "skipped": [r.skipped_nonfinite for r in results],
            "updated": [r.updated for r in results]}


def run(rank: int, world: int, opt_name: str, explicit_unscale: bool) -> dict[str, Any]:
    model = _build()
    cls, kwargs = OPTS[opt_name]
    opt = cls(model.parameters(), **kwargs)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]), opt)
    ddp = wrap_ddp(model, sz)
    host = [p for n, p in model.named_parameters() if ".experts." not in n]
    scaler, results, scales = _scaler(), [], []
    for step in range(STEPS):
        hook = _poison(model) if step == INF_STEP and rank == 1 else None
        scaler.scale(block_loss(ddp, step, rank, layers=LAYERS)).backward()
        if explicit_unscale:
            scaler.unscale_(opt)
            clip_grad_norm_(host, CLIP, subsets=[sz])
        scaler.step(opt)
        scaler.update()
        results.append(sz.step())
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        if hook is not None:
            hook.remove()
    return _outcome(model, scales, results)


def step_before_scaler(rank: int, world: int) -> dict[str, Any]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), **OPTS["adamw"][1])
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]), opt)
    ddp = wrap_ddp(model, sz)
    before = model_state(model)
    _scaler().scale(block_loss(ddp, 0, rank, layers=LAYERS)).backward()
    outcome = capture(sz.step)
    experts = [k for k in before if ".experts." in k]
    return {"outcome": outcome,
            "unchanged": all(torch.equal(model_state(model)[k], before[k]) for k in experts)}


def _two_opts(model: BlockMoE) -> list[torch.optim.Optimizer]:
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    return [torch.optim.SGD(dense, lr=0.05, momentum=0.9),
            torch.optim.AdamW(experts, lr=1e-2, weight_decay=0.1)]


def two_optimizers(rank: int, world: int) -> dict[str, Any]:
    model = _build()
    opts = _two_opts(model)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"]), opts[1])
    ddp = wrap_ddp(model, sz)
    scaler, results, scales = _scaler(), [], []
    for step in range(STEPS):
        hook = _poison(model) if step == INF_STEP and rank == 1 else None
        scaler.scale(block_loss(ddp, step, rank, layers=LAYERS)).backward()
        for opt in opts:  # the dense optimizer first: selzero's is not the first unscaled
            scaler.unscale_(opt)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        results.append(sz.step())
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        if hook is not None:
            hook.remove()
    return _outcome(model, scales, results)


def two_optimizers_reference() -> dict[str, Any]:
    model = _build()
    opts = _two_opts(model)
    scaler, scales = _scaler(), []
    for step in range(STEPS):
        hook = _poison(model) if step == INF_STEP else None
        loss = torch.stack([block_loss(model, step, r, layers=LAYERS) for r in range(2)]).mean()
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.unscale_(opt)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        if hook is not None:
            hook.remove()
    return {"state": model_state(model), "scales": scales}


def other_model_unscaled(rank: int, world: int) -> dict[str, Any]:
    """Model A under a GradScaler, model B (an auxiliary model) in the same loop without one."""
    torch.manual_seed(0)
    a = BlockMoE(layers=LAYERS)
    torch.manual_seed(1)
    b = BlockMoE(layers=LAYERS)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    sz_a = SelectedZero2(a, SelZeroConfig(name="a", params=["blocks.*.experts.*"]), opt_a)
    sz_b = SelectedZero2(b, SelZeroConfig(name="b", params=["blocks.*.experts.*"]), opt_b)
    ddp_a, ddp_b = wrap_ddp(a, sz_a), wrap_ddp(b, sz_b)
    scaler, updated = _scaler(), []
    for step in range(3):
        loss_b = block_loss(ddp_b, step, rank, layers=LAYERS)
        scaler.scale(block_loss(ddp_a, step, rank, layers=LAYERS)).backward()
        scaler.step(opt_a)
        scaler.update()
        sz_a.step()
        opt_a.zero_grad()
        loss_b.backward()
        opt_b.step()
        updated.append(sz_b.step().updated)
        opt_b.zero_grad()
    return {"updated": updated}


def reference(opt_name: str, explicit_unscale: bool) -> dict[str, Any]:
    model = _build()
    cls, kwargs = OPTS[opt_name]
    opt = cls(model.parameters(), **kwargs)
    scaler, scales = _scaler(), []
    for step in range(STEPS):
        hook = _poison(model) if step == INF_STEP else None
        loss = torch.stack([block_loss(model, step, r, layers=LAYERS) for r in range(2)]).mean()
        scaler.scale(loss).backward()
        if explicit_unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        if hook is not None:
            hook.remove()
    return {"state": model_state(model), "scales": scales}


# AdamW hardly sees a constant factor on its gradients (m / sqrt(v)); clipping and SGD do
CASES = {"natural": ("adamw", True), "fused": ("fused", False), "sgd": ("sgd", False)}


def _all(rank: int, world: int) -> dict[str, Any]:
    out = {k: capture(lambda c=c: run(rank, world, *c)) for k, c in CASES.items()}
    out["misordered"] = capture(lambda: step_before_scaler(rank, world))
    out["two"] = capture(lambda: two_optimizers(rank, world))
    out["other"] = capture(lambda: other_model_unscaled(rank, world))
    return out


_outcomes = cached_outcomes(_all, 2, timeout=180)


@pytest.mark.parametrize("case", list(CASES))
def test_a_grad_scaler_loop_equals_torch_and_skips_the_overflow_with_it(case):
    runs = value_of(_outcomes(), case)
    ref = reference(*CASES[case])
    for run_ in runs:
        assert run_["scales"] == ref["scales"]
        assert ref["scales"][INF_STEP] == ref["scales"][INF_STEP - 1] / 2  # the scaler backed off
        assert run_["skipped"][INF_STEP] > 0 and run_["updated"][INF_STEP] == 0
        assert all(run_["updated"][s] > 0 for s in range(STEPS) if s != INF_STEP)
        for k, v in ref["state"].items():
            assert torch.allclose(run_["state"][k], v, atol=1e-6, rtol=0), \
                (k, float((run_["state"][k] - v).abs().max()))


def test_cannot_step_scaled_gradients_before_the_scaler_unscales_them():
    for run_ in value_of(_outcomes(), "misordered"):
        assert run_["outcome"].get("error") == "UsageError", run_["outcome"]
        assert "GradScaler" in run_["outcome"]["message"] and run_["unchanged"]


def test_two_optimizers_under_one_scaler_equal_torch_whichever_is_unscaled_first():
    ref = two_optimizers_reference()
    assert ref["scales"][INF_STEP] == ref["scales"][INF_STEP - 1] / 2
    for run_ in value_of(_outcomes(), "two"):
        assert run_["scales"] == ref["scales"]
        assert run_["skipped"][INF_STEP] > 0 and run_["updated"][INF_STEP] == 0
        for k, v in ref["state"].items():
            assert torch.allclose(run_["state"][k], v, atol=1e-6, rtol=0), \
                (k, float((run_["state"][k] - v).abs().max()))


def test_a_model_trained_without_a_scaler_beside_one_that_has_it_steps():
    for run_ in value_of(_outcomes(), "other"):
        assert all(u > 0 for u in run_["updated"]), run_
