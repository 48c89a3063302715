"""Rank functions and references for missing_grad / nonfinite policies and argument disagreement.

The runs select the experts of the toy MoE (``experts.*``) with ``reduction="mean"`` and freeze
every other parameter, so selzero is the whole trainable model and the single-process reference
is plain AdamW on the mean of the ranks' losses. Step 0 creates optimizer state, so that "state
untouched after an error" compares real tensors.

Routings per step (6 tokens, 4 experts):
- ``all``: every rank uses every expert;
- ``drop2``: the last rank routes no token to expert 2 (others use every expert);
- ``no3``: no rank uses expert 3 (absent on every rank).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._state import capture, differences, model_state, snapshot
from .models import ToyMoE, loss_fn, make_batch

__all__ = ["policies_rank", "reference", "expert_names", "routes", "build"]

E = 4
TOKENS = 6
ADAMW_KW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
EXPERT_PARAMS = ("w1.weight", "w1.bias", "w2.weight", "w2.bias", "gain")


def expert_names(e: int) -> list[str]:
    return [f"experts.{e}.{n}" for n in EXPERT_PARAMS]


def build() -> ToyMoE:
    torch.manual_seed(0)
    model = ToyMoE(E)
    for name, p in model.named_parameters():
        if not name.startswith("experts."):
            p.requires_grad_(False)
    return model


def routes(kind: str, rank: int, world: int) -> torch.Tensor:
    if kind == "drop2" and rank == world - 1:
        return torch.tensor([0, 1, 3])[torch.arange(TOKENS) % 3]
    if kind == "no3":
        return torch.arange(TOKENS) % 3
    return torch.arange(TOKENS) % E


def _backward(model: nn.Module, step: int, rank: int, world: int, kind: str) -> None:
    x, y = make_batch(step, rank, tokens=TOKENS)
    loss_fn(model, x, y, routes(kind, rank, world)).backward()


def _make(model: nn.Module, **config: Any) -> SelectedZero2:
    return SelectedZero2(model, SelZeroConfig(params=["experts.*"], **config), torch.optim.AdamW,
                         ADAMW_KW)


def reference(world: int, plan: list[tuple[int, str, list[str]]]) -> dict[str, torch.Tensor]:
    """Plain AdamW; ``plan`` = (data step, routing, parameter names whose gradient is dropped)."""
    model = build()
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW_KW)
    for step, kind, dropped in plan:
        losses = []
        for r in range(world):
            x, y = make_batch(step, r, tokens=TOKENS)
            losses.append(loss_fn(model, x, y, routes(kind, r, world)))
        torch.stack(losses).mean().backward()
        for name in dropped:
            params[name].grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model_state(model)


def _failing_window(rank: int, world: int, *, config: dict[str, Any], kind: str,
                    inject: Callable[[nn.Module, int], Any] | None = None) -> dict[str, Any]:
    """Step 0 ok; step 1 (routing ``kind``, optional gradient injection) expected to raise;
    step 2 ok; step 3 with expert 3 absent on every rank."""
    model = build()
    sz = _make(model, **config)
    _backward(model, 0, rank, world, "all")
    sz.step()
    before = snapshot(model, sz)
    handle = inject(model, rank) if inject else None
    _backward(model, 1, rank, world, kind)
    if handle is not None:
        handle.remove()
    error = capture(sz.step)
    after_error = snapshot(model, sz)
    _backward(model, 2, rank, world, "all")
    ok = sz.step()
    _backward(model, 3, rank, world, "no3")
    absent = capture(sz.step)
    return {"error": error, "changed_by_error": differences(before, after_error),
            "optim_keys": sum(k.startswith("optim/") for k in before), "next": ok,
            "absent_everywhere": absent, "state": model_state(model)}


def _missing_skip(rank: int, world: int) -> dict[str, Any]:
    model = build()
    sz = _make(model, missing_grad="skip")
    _backward(model, 0, rank, world, "all")
    sz.step()
    before = snapshot(model, sz)
    _backward(model, 1, rank, world, "drop2")
    result = sz.step()
    after = snapshot(model, sz)
    _backward(model, 2, rank, world, "all")
    sz.step()
    return {"result": result, "before": before, "after": after, "state": model_state(model)}


def _inject(name: str, value: float, where: str) -> Callable[[nn.Module, int], Any]:
    """On the last rank, replace one element of ``name``'s gradient by ``value``."""

    def install(model: nn.Module, rank: int) -> Any:
        p = dict(model.named_parameters())[name]

        def hook(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g.view(-1)[0 if where == "first" else -1] = value
            return g

        return p.register_hook(hook) if rank == _last[0] else None

    return install


_last = [0]  # the last rank of the current run (set by the rank function)


def _disagreements(rank: int, world: int) -> dict[str, Any]:
    """Ranks that make different reduction calls all raise; the next, agreed, step works."""
    out: dict[str, Any] = {}
    cases: list[tuple[str, str, Callable[[SelectedZero2], Any]]] = [
        # (name, reduction, what this rank calls)
        ("weight_on_one_rank", "weighted",
         lambda sz: sz.step(weight=6) if rank == 0 else sz.step()),
        ("end_microstep_vs_reduce", "mean",
         lambda sz: sz.end_microstep() if rank == 0 else sz.reduce_gradients()),
        ("weight_under_sum", "sum",
         lambda sz: sz.step(weight=3) if rank == 0 else sz.step(active=True)),
        ("active_under_mean", "mean",
         lambda sz: sz.step(active=True) if rank == world - 1 else sz.step()),
        ("non_integer_weight", "weighted",
         lambda sz: sz.step(weight=2.5) if rank == world - 1 else sz.step(weight=6)),
    ]
    for name, mode, call in cases:
        model = build()
        sz = _make(model, reduction=mode)
        _backward(model, 0, rank, world, "all")
        before = snapshot(model, sz)
        error = capture(lambda: call(sz))
        changed = differences(before, snapshot(model, sz))
        _backward(model, 1, rank, world, "all")
        agreed = {"weighted": {"weight": 6}, "sum": {"active": True}}.get(mode, {})
        nxt = capture(lambda: sz.step(**agreed))
        out[name] = {"error": error, "changed_by_error": changed, "next": nxt,
                     "state": model_state(model)}
    return out


def policies_rank(rank: int, world: int) -> dict[str, Any]:
    _last[0] = world - 1
    return {
        "missing_error": capture(lambda: _failing_window(
            rank, world, config={"missing_grad": "error"}, kind="drop2")),
        "missing_skip": capture(lambda: _missing_skip(rank, world)),
        "nonfinite_error": capture(lambda: _failing_window(
            rank, world, config={}, kind="all",
            inject=_inject("experts.1.w2.weight", float("inf"), "first"))),
        "nonfinite_skip": capture(lambda: _failing_window(
            rank, world, config={"nonfinite": "skip"}, kind="all",
            inject=_inject("experts.0.w1.bias", float("nan"), "last"))),
        "disagreements": capture(lambda: _disagreements(rank, world)),
    }
