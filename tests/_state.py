"""Snapshots of a model and of selzero's optimizer state, compared bit for bit; scenario capture.

Rank functions of the semantic tests run several scenarios in one spawn (spawning gloo ranks costs
seconds); each scenario's outcome is captured so that one failing scenario is reported by the test
that owns it instead of masking the others.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["model_state", "optimizer_state", "snapshot", "differences", "capture", "value_of",
           "cached_outcomes",
           "strip_rank_prefix", "moved"]


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_state(sz: Any) -> dict[str, Any]:
    """Every optimizer state value of every segment, keyed by segment index and state key."""
    out: dict[str, Any] = {}
    for i, seg in enumerate(sz.segments):
        for key, value in sz.optimizer.state.get(seg, {}).items():
            out[f"segment{i}/{key}"] = value.detach().clone() if isinstance(value, torch.Tensor) \
                else value
    return out


def snapshot(model: nn.Module, sz: Any) -> dict[str, Any]:
    return {**{f"param/{k}": v for k, v in model_state(model).items()},
            **{f"optim/{k}": v for k, v in optimizer_state(sz).items()}}


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ in dtype, shape or any bit, or that only one side has."""
    diff = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and \
                torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        else:
            same = x == y
        if not same:
            diff.append(k)
    return diff


def moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys: list[str] | None = None
          ) -> float:
    """Largest absolute change between two states (over ``keys`` or all common keys)."""
    keys = keys if keys is not None else [k for k in a if k in b]
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in keys)


def capture(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one scenario; record its value, or the error it raised (class, message, traceback)."""
    try:
        return {"value": fn()}
    except Exception as e:  # noqa: BLE001 - reported to the test that owns the scenario
        return {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}


def value_of(outcomes: list[Any], key: str) -> list[Any]:
    """The captured value of scenario ``key`` on every rank; fail with a rank's traceback."""
    values = []
    for o in outcomes:
        if o.error_type is not None:
            raise AssertionError(f"rank {o.rank} raised {o.error_type}:\n{o.traceback}")
        got = o.value[key]
        if "error" in got:
            raise AssertionError(f"scenario {key!r} on rank {o.rank} raised {got['error']}: "
                                 f"{got['message']}\n{got['traceback']}")
        values.append(got["value"])
    return values


def strip_rank_prefix(message: str) -> str:
    """Drop the leading ``[rank r/N] `` so messages of different ranks can be compared."""
    return message.split("] ", 1)[1] if message.startswith("[rank ") else message


def cached_outcomes(fn: Callable[..., Any], world: int, *, timeout: float) -> Callable[[], Any]:
    """One spawn of ``fn`` on ``world`` ranks for every test of a module that asks: its result,
    or its failure (a hang's TimeoutError), is kept and given to each test, never re-run."""
    from .dist_utils import run_ranks

    result: list[Any] = []

    def get() -> Any:
        if not result:
            try:
                result.append(run_ranks(fn, world, timeout=timeout))
            except Exception as e:  # noqa: BLE001 - every test of the module reports it
                result.append(e)
        if isinstance(result[0], Exception):
            raise result[0]
        return result[0]
    return get
