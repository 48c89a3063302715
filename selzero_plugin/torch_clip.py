"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` see the selected parameters.

[Note: torch's clipping idioms]
The selected parameters hold no ``.grad`` (their gradients live in selzero's shards), so torch's
own clipping over ``model.parameters()`` would skip them silently: the norm misses the subset
and the subset is never clipped (review: 1.0e-2 off after a few steps, through Accelerate's
``clip_grad_value_`` 1.7e-2). Importing selzero wraps both functions (``torch.nn.utils.X`` and
``torch.nn.utils.clip_grad.X``, what Accelerate and most scripts call through the module):
when the given parameters include every trainable parameter of some live SelectedZero2, they
run selzero's clipping over the host's gradients and those subsets (the one global norm;
subsets not reduced yet are reduced there, ``mean`` mode); when they include only some of an
instance's parameters, every rank raises (selzero clips a subset as a whole); otherwise torch's
own function runs unchanged. A name bound before selzero was imported (``from torch.nn.utils
import clip_grad_norm_`` at the top of a script) keeps torch's function: call
``selzero_plugin.clip_grad_norm_`` there.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .core.clip import clip_grad_norm_ as _selzero_clip_norm
from .core.window import WindowState
from .core.zero2 import SelectedZero2, live_instances, owning_instance
from .errors import UsageError

__all__ = ["install"]

_MARK = "_selzero_wrapped"


def _split(parameters: Any, what: str) -> tuple[list[torch.Tensor], list[SelectedZero2]]:
    """(the host's parameters, the instances whose parameters were given: all of them)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if not live_instances():
        return params, []
    host: list[torch.Tensor] = []
    given: dict[int, tuple[SelectedZero2, set[int]]] = {}
    for p in params:
        sz = owning_instance(p)
        if sz is None:
            host.append(p)
        else:
            given.setdefault(id(sz), (sz, set()))[1].add(id(p))
    for sz, ids in given.values():
        if not sz.spans_world:  # (expert groups, a stage's group): ranks without an instance
            # would run torch's local function while these run a world collective
            raise UsageError(
                f"torch.nn.utils.{what} over parameters of selzero instance "
                f"{sz.config.name!r}, whose group is not the whole world: ranks without such an "
                "instance would clip locally while this one waits for them. Call "
                "selzero_plugin.clip_grad_norm_(host_parameters, max_norm, subsets=[...]) on "
                "every rank (a rank without instances passes subsets=[]).")
        if not sz.window.sync:
            raise UsageError(
                f"torch.nn.utils.{what} inside no_sync() (a micro-step that accumulates "
                "locally, e.g. accelerator.accumulate before its sync step): selzero's gradients "
                "are reduced only at the sync step. Clip there (`if "
                "accelerator.sync_gradients:`).")
        trainable = {id(e.param) for e in sz.trainable}
        if not trainable <= ids:
            raise UsageError(
                f"torch.nn.utils.{what}: {len(ids & trainable)} of selzero's "
                f"{len(trainable)} trainable parameters (instance {sz.config.name!r}) were given; "
                "selzero clips its subset as a whole. Pass all of them (e.g. "
                "model.parameters()) or none.")
    return host, [sz for sz, _ in given.values()]


def _reduced(sz: SelectedZero2, what: str) -> None:
    if sz.state is WindowState.REDUCED:
        return
    if sz.config.reduction != "mean":
        raise UsageError(f"torch.nn.utils.{what} with selzero reduction="
                         f"{sz.config.reduction!r}: call sz.reduce_gradients(weight=...) first.")
    sz.reduce_gradients()


def install() -> None:
    """Wrap torch's clipping functions (idempotent; called when selzero is imported)."""
    from torch.nn.utils import clip_grad

    original_norm: Callable[..., Any] = clip_grad.clip_grad_norm_
    original_value: Callable[..., Any] = clip_grad.clip_grad_value_
    if getattr(original_norm, _MARK, False):
        return

    @functools.wraps(original_norm)
    def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> Any:
        host, subsets = _split(parameters, "clip_grad_norm_")
        if not subsets:
            return original_norm(host, max_norm, norm_type, error_if_nonfinite, foreach)
        total = _selzero_clip_norm(host, max_norm, subsets, norm_type=norm_type)
        if error_if_nonfinite and not math.isfinite(float(total)):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from "
                               "`parameters` is non-finite, so it cannot be clipped.")
        return total

    @functools.wraps(original_value)
    def clip_grad_value_(parameters: Any, clip_value: float,
                         foreach: bool | None = None) -> None:
        host, subsets = _split(parameters, "clip_grad_value_")
        if host or not subsets:
            original_value(host, clip_value, foreach)
        for sz in subsets:
            _reduced(sz, "clip_grad_value_")
            sz.clip_grad_value_(clip_value)

    for fn in (clip_grad_norm_, clip_grad_value_):
        setattr(fn, _MARK, True)
    clip_grad.clip_grad_norm_ = clip_grad_norm_
    clip_grad.clip_grad_value_ = clip_grad_value_
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad_value_ = clip_grad_value_
