"""Rank functions for the contract check and the constructor's broadcast (issue #2, rule 7).

Each mismatch case builds, on every rank, the same toy MoE / config / optimizer, except on the
deviating ranks, which change exactly one thing; every rank then constructs SelectedZero2 and
records the error (class, message) and how long construction took.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from selzero_plugin import SelectedZero2, SelZeroConfig

from ._state import capture, model_state
from .models import ToyMoE

__all__ = ["contract_rank", "deviants_for", "CASES"]

E = 4

# case -> substrings the error message must contain (the field that differs)
CASES: dict[str, tuple[str, ...]] = {
    "params": ("params",),
    "shape": ('.shape (parameter "experts.0.w1.weight")', "[13, 7]", "[14, 7]"),
    "dtype": ('.dtype (parameter "experts.1.gain")', "torch.bfloat16"),
    "frozen": ('.frozen (parameter "experts.2.gain")',),
    "optimizer_class": ("optimizer.class", "SGD", "AdamW"),
    "lr": ("optimizer.groups[0].hyperparameters.lr", "0.001", "0.002"),
    "reduction": ("config.reduction", "weighted"),
    "bucket_mb": ("config.bucket_mb",),
    "expert_dim": ("config.expert_dim",),
}


def _build(case: str, deviant: bool) -> tuple[ToyMoE, SelZeroConfig, type, dict[str, Any]]:
    torch.manual_seed(0)
    model = ToyMoE(E, h=14 if case == "shape" and deviant else 13)
    config: dict[str, Any] = {"params": ["experts.*"]}
    opt: type = torch.optim.AdamW
    kwargs: dict[str, Any] = {"lr": 1e-3}
    if deviant:
        if case == "params":
            config["params"] = ["experts.0.*", "experts.1.*"]
        elif case == "dtype":
            model.experts[1].to(torch.bfloat16)
        elif case == "frozen":
            model.experts[2].gain.requires_grad_(False)
        elif case == "optimizer_class":
            opt = torch.optim.SGD
        elif case == "lr":
            kwargs["lr"] = 2e-3
        elif case == "reduction":
            config["reduction"] = "weighted"
        elif case == "bucket_mb":
            config["bucket_mb"] = 1.0
        elif case == "expert_dim":
            config["expert_dim"] = 0
    return model, SelZeroConfig(**config), opt, kwargs


def deviants_for(case: str, world: int) -> list[int]:
    """The last rank deviates; in world 3 the lr case has ranks 1 and 2 deviate (1 is named)."""
    return [1, 2] if case == "lr" and world == 3 else [world - 1]


def _construct(case: str, rank: int, world: int) -> dict[str, Any]:
    model, config, opt, kwargs = _build(case, rank in deviants_for(case, world))
    start = time.monotonic()
    got = capture(lambda: SelectedZero2(model, config, opt, kwargs) and None)
    got["seconds"] = time.monotonic() - start
    return got


def _broadcast(rank: int, broadcast: bool) -> dict[str, Any]:
    """Every rank starts from different values (seed = rank); one selected parameter is frozen."""
    torch.manual_seed(rank)
    model = ToyMoE(E)
    with torch.no_grad():
        for e in model.experts:
            e.gain.normal_()
    model.experts[3].gain.requires_grad_(False)
    before = model_state(model)
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], broadcast=broadcast),
                       torch.optim.AdamW, {"lr": 1e-3})
    return {"before": before, "after": model_state(model), "selected": sz.selected_names}


def contract_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {case: _construct(case, rank, world) for case in CASES}
    out["broadcast"] = capture(lambda: _broadcast(rank, True))
    out["no_broadcast"] = capture(lambda: _broadcast(rank, False))
    return out
