"""Gradient accumulation runs (3 micro-steps a step) with the collective trace of every rank.

Micro-step s of step t uses batch and routing number 3 t + s, as parity.reference_run does, so
`reference_run(world, steps, opt, accumulate=3, pattern=...)` is the single-process reference.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from .models import loss_fn, make_batch
from .parity import OPTIMIZERS, build_model, routes_for

__all__ = ["MODES", "MICRO_STEPS", "STEPS", "accumulate_run", "accumulate_many", "usage_errors"]

MODES = ("end_microstep", "ddp_no_sync", "sz_no_sync")
"""How the first micro-steps of a window run: reduced and closed by `sz.end_microstep()`, or
local inside the DDP model's `no_sync()`, or inside `sz.no_sync()` alone (DDP then averages the
host's gradients at every micro-step, which accumulates to the same mean)."""
MICRO_STEPS = 3
STEPS = 2  # windows per run: the second one starts from the first one's reset state
TOKENS = 6
NUM_EXPERTS = 4
SMALL_BUCKET_MB = 0.0001  # ~100 bytes: the toy experts spread over about ten buckets


def accumulate_run(rank: int, world: int, opt: str, mode: str, *, pattern: str = "uneven",
                   steps: int = STEPS, bucket_mb: float = SMALL_BUCKET_MB) -> dict[str, Any]:
    """Returns the final state, and per step the collectives selzero issued in each phase:
    `micro` (one list per micro-step: its backward plus its reduction point, if any) and
    `step` (sz.step() after an explicit reduce_gradients(), i.e. the update's all-gathers)."""
    model = build_model(num_experts=NUM_EXPERTS)
    cls, kwargs = OPTIMIZERS[opt]
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=bucket_mb), cls, kwargs)
    selected = {id(e.param) for e in sz.entries}
    host = cls([p for p in model.parameters() if id(p) not in selected], **kwargs)
    ddp = wrap_ddp(model, sz)
    phases: list[dict[str, Any]] = []
    for step in range(steps):
        micro_traces = []
        for micro in range(MICRO_STEPS):
            s = step * MICRO_STEPS + micro
            last = micro == MICRO_STEPS - 1
            sz.comm.trace = []
            with _micro_context(ddp, sz, mode, last):
                x, y = make_batch(s, rank)
                (loss_fn(ddp, x, y, routes_for(s, rank, TOKENS, NUM_EXPERTS, pattern))
                 / MICRO_STEPS).backward()
            if last:
                sz.reduce_gradients()
            elif mode == "end_microstep":
                sz.end_microstep()
            micro_traces.append(sz.comm.trace)
        sz.comm.trace = []
        result = sz.step()
        phases.append({"micro": micro_traces, "step": sz.comm.trace, "updated": result.updated})
        sz.comm.trace = None
        host.step()
        host.zero_grad(set_to_none=True)
    names = {t: e.name for t, e in enumerate(sz.trainable)}
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "phases": phases,
        "buckets": [(b.row_numel, [names[t] for t in b.entries]) for b in sz.layout.buckets],
        "virtuals": len(sz.layout.virtuals),
        "entries": len(sz.trainable),
        "units": len(sz.units.names),
    }


def _micro_context(ddp: Any, sz: SelectedZero2, mode: str, last: bool) -> Any:
    if last or mode == "end_microstep":
        return contextlib.nullcontext()
    return ddp.no_sync() if mode == "ddp_no_sync" else sz.no_sync()


def accumulate_many(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Several (opt, mode, pattern) cases in one set of processes."""
    return [accumulate_run(rank, world, opt, mode, pattern=pattern) for opt, mode, pattern in cases]


# ---- usage errors -------------------------------------------------------------------------


def _fresh(bucket_mb: float = SMALL_BUCKET_MB) -> tuple[torch.nn.Module, SelectedZero2]:
    model = build_model(num_experts=NUM_EXPERTS)
    return model, SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=bucket_mb),
                                torch.optim.AdamW, {"lr": 1e-2})


def _backward(model: torch.nn.Module, rank: int, s: int = 0) -> None:
    # "same" routing: every rank fills the same buckets, so the collectives a failed window
    # already launched pair up across ranks and the next case starts clean.
    x, y = make_batch(s, rank)
    loss_fn(model, x, y, routes_for(s, rank, TOKENS, NUM_EXPERTS, "same")).backward()


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return "no error", ""


def usage_errors(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """Phase-order mistakes, each on a fresh instance; (error class, message) per case."""
    out: dict[str, tuple[str, str]] = {}

    model, sz = _fresh()
    _backward(model, rank, 0)
    _backward(model, rank, 1)  # seen at once, raised (on every rank) at the reduction point
    out["second_backward"] = _outcome(sz.step)

    model, sz = _fresh()
    _backward(model, rank, 0)
    sz.reduce_gradients()
    out["reduce_twice"] = _outcome(sz.reduce_gradients)
    out["end_microstep_after_reduce"] = _outcome(sz.end_microstep)
    sz.step()  # the instance is still usable: the mistake changed nothing
    _backward(model, rank, 1)
    out["next_step_after_mistake"] = _outcome(sz.step)

    model, sz = _fresh()
    _backward(model, rank, 0)
    out["norm_before_reduce"] = _outcome(sz.grad_norm_squared)
    out["scale_before_reduce"] = _outcome(lambda: sz.scale_gradients_(0.5))
    out["norm_after_reduce"] = _outcome(lambda: (sz.reduce_gradients(), sz.grad_norm_squared()))

    model, sz = _fresh()
    _backward(model, rank, 0)
    sz.end_microstep()
    out["second_backward_after_end_microstep"] = _outcome(lambda: _backward(model, rank, 1))
    out["step_after_closed_microsteps"] = _outcome(sz.step)
    return out
