"""``torch.amp.GradScaler`` covers selzero's gradients ([Note: loss scaling] in amp.py).

The natural loop, with the README's setup (a host optimizer over ``model.parameters()``,
``wrap_ddp``), a loss scale of 1024 that grows every 2 steps, and at one step an inf in an
expert's gradient on rank 1 only: ``scaler.scale(loss).backward(); scaler.unscale_(opt);
clip_grad_norm_(...); scaler.step(opt); scaler.update(); sz.step()``. It must equal plain torch
running the same loop on one process: the experts get unscaled gradients, the inf reaches the
scaler (which skips the host's step and halves the scale), and selzero skips with it. Also with
a fused host optimizer (``scaler.step`` then unscales nothing itself) and no explicit
``unscale_``, and with SGD (which, unlike AdamW, is not blind to a constant gradient factor). ``sz.step()`` before the scaler's unscale is refused on every rank.
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
    return {"state": model_state(model), "scales": scales,
            "skipped": [r.skipped_nonfinite for r in results],
            "updated": [r.updated for r in results]}


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
