"""torch.amp's GradScaler, applied to selzero's gradients too.

[Note: loss scaling]
``scaler.scale(loss).backward()`` scales every gradient, the subset's included; the scaler then
unscales and checks the gradients of the optimizer it is given (``scaler.unscale_(opt)``,
``scaler.step(opt)``), which never sees selzero's: they live in its shards. Left alone, the
experts would be updated with gradients ``scale`` times too large and their inf/NaN would never
reach ``found_inf`` (the review's finding). So importing selzero wraps four methods of
``torch.amp.GradScaler`` (and of the subclasses that override them: ``torch.cuda.amp``'s,
FSDP1's ``ShardedGradScaler``), each calling the original first and acting only when a live
SelectedZero2 is concerned:

- ``scale(outputs)`` marks the node it makes; a backward whose roots come from it (wrapped
  ``torch.autograd.backward``, failed_backward.py) marks the micro-steps it opens as scaled, so
  instances that a scaled loss does not reach are left alone;
- ``unscale_(opt)``: for each instance that ``opt`` concerns (the host optimizer selzero
  mirrors; without one, an optimizer holding the selected parameters, else one over the model's
  other parameters) and whose window holds gradients (scaled, or of any backward on some rank
  of the group: a pipeline stage backwards a gradient received from the stage that scaled the
  loss, not a ``scale()`` output), ``sz.unscale_`` reduces its window (every rank calls
  ``unscale_`` at the same point), multiplies the shards by the scaler's ``1/scale``, and
  agrees across the group (over the ``normalize_over`` ranks when they extend beyond it,
  expert groups: the host's replicas must all skip or all step) whether the subset or the
  host's gradients hold inf/NaN; that flag is added to the optimizer's ``found_inf``, so the
  scaler skips the host's step and backs the scale off when the experts overflowed, and
  selzero's next ``step()`` skips when the scaler does (never raising under
  ``nonfinite="error"``: an overflow is the scaler's to handle);
- ``step(opt)`` unscales first when an instance is concerned (what the torch docs do for
  clipping; fused optimizers then get already-unscaled gradients, as after an explicit
  ``unscale_``);
- a scaled instance reduced without the scaler's unscale (``sz.step()`` before
  ``scaler.step(opt)``) raises on every rank instead of updating with scaled gradients.

The natural loop then trains like plain torch: ``scaler.scale(loss).backward();
scaler.unscale_(opt); clip...; scaler.step(opt); scaler.update(); sz.step()``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from .core.outer_backward import CURRENT, SCALED_KEY
from .core.window import WindowState
from .core.zero2 import SelectedZero2, live_instances

__all__ = ["install"]

_MARK = "_selzero_wrapped"


def install() -> None:
    """Wrap the GradScaler classes' methods (idempotent; called when selzero is imported)."""
    classes: list[type] = [torch.amp.GradScaler]
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        classes.append(ShardedGradScaler)
    except ImportError:  # a torch without it
        pass
    for cls in classes:
        for name, wrapper in (("scale", _scale), ("unscale_", _unscale), ("step", _step)):
            original = cls.__dict__.get(name)
            if original is not None and not getattr(original, _MARK, False):
                setattr(cls, name, _wrapped(original, wrapper))


def _wrapped(original: Callable[..., Any], wrapper: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(scaler: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapper(original, scaler, *args, **kwargs)

    setattr(method, _MARK, True)
    return method


def _scale(original: Callable[..., Any], scaler: Any, outputs: Any) -> Any:
    scaled = original(scaler, outputs)
    if scaler.is_enabled():
        CURRENT.scaler_seen = True
        for t in tree_leaves(scaled):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.metadata[SCALED_KEY] = True
    return scaled


def _candidates(optimizer: torch.optim.Optimizer) -> list[SelectedZero2]:
    """The instances, not yet unscaled this window, that ``optimizer`` concerns: the host
    optimizer an instance mirrors; for an instance with an optimizer of its own, one that holds
    selected parameters, else one over its model's other parameters. Local: no collective."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def concerns(sz: SelectedZero2) -> bool:
        if sz.host_optimizer is not None:
            return sz.host_optimizer is optimizer
        return any(id(p) in held for p in sz.model.parameters())

    return [sz for sz in live_instances() if not sz.window.unscaled and concerns(sz)]


def _concerned(optimizer: torch.optim.Optimizer) -> list[SelectedZero2]:
    """The candidates whose window holds gradients to unscale; a collective for some
    (_holds_gradients): called once per ``scaler.unscale_``, on every rank."""
    return [sz for sz in _candidates(optimizer) if _holds_gradients(sz)]


def _holds_gradients(sz: SelectedZero2) -> bool:
    """Whether ``sz``'s window holds gradients the scaler's ``unscale_`` must unscale: those
    of a scaled loss, or any of this window when the caller unscales the optimizer that
    concerns it (a pipeline stage's ``torch.autograd.backward(out, grad)`` with a gradient
    received from the stage that scaled the loss: its roots are no ``scale()`` output, yet
    the gradients are scaled; review finding, they were stepped ``scale`` times too large).
    A reduced micro-step's state is the same on every rank of the group, whatever the
    routing; ``no_sync`` gradients alone are not (a rank whose tokens reached no expert holds
    none: review finding, ranks disagreed and hung), so for such a window the group agrees
    whether any rank holds some (every rank of the group calls ``unscale_`` at this point).
    Unscaled, they were stepped ``scale`` times too large (review finding). With
    ``normalize_over`` beyond the group (expert groups) the question is agreed over those ranks
    at every unscale, as the unscale's own flag is: a group that holds nothing must still meet
    the others there (review finding: it did not, and they waited until ``timeout_s``)."""
    window = sz.window
    here = window.scaled or window.state is not WindowState.IDLE
    if not sz.normalizes_beyond_group:
        if here:
            return True
        comm = window.control_comm()
    else:
        comm = sz.normalize_communicator()
    held = torch.tensor([int(here or bool(window.local))], dtype=torch.int64,
                        device=sz.comm.device)
    comm.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
    return bool(held.item())


def _unscale(original: Callable[..., Any], scaler: Any, optimizer: torch.optim.Optimizer
             ) -> Any:
    out = original(scaler, optimizer)
    instances = _concerned(optimizer) if scaler.is_enabled() else []
    if not instances:
        return out
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    inv_scale = scaler._scale.double().reciprocal().float()
    for sz in instances:
        sz.window.scaled = True  # an overflow is the scaler's to handle: skipped, not raised
        device = sz.comm.device
        host = sum((t.to(device) for t in found.values()),
                   torch.zeros((), dtype=torch.float32, device=device))
        flag = sz.unscale_(inv_scale.to(device), host)
        if device in found:
            found[device].add_(flag)
        else:
            found[device] = flag
    return out


def _step(original: Callable[..., Any], scaler: Any, optimizer: torch.optim.Optimizer,
          *args: Any, **kwargs: Any) -> Any:
    if scaler.is_enabled() and _candidates(optimizer):
        from torch.amp.grad_scaler import OptState

        # no collective here: the unscale_ below agrees what it must, once, whether or not
        # the caller unscaled explicitly before (review finding: a check here agreed twice
        # on ranks that did not, and paired the wrong collectives with ranks that did)
        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)
    return original(scaler, optimizer, *args, **kwargs)
