"""A backward that raises is seen as it leaves ``torch.autograd.backward``.

[Note: seeing a failed backward]
An exception inside backward (an OOM on one batch) ends the engine's graph task without running
its end-of-backward callbacks, and autograd offers no hook for it. A rank whose backward raised
early would then leave a peer, still in its own backward, waiting for that micro-step's bucket
reductions: on gloo the peer's host blocks there (it bounds its buffers by waiting), and the
rank that failed may be about to block in a collective of the host (a validation metric's
all-reduce) that the peer never reaches. So importing selzero wraps ``torch.autograd.backward``
(``loss.backward()``, DeepSpeed's, Accelerate's and the Trainer's backward all call it): when
it raises, each live SelectedZero2 marks its window dead and launches the rest of the
micro-step's reductions at once, without waiting for any ([Note: a backward that raised] in
core/window.py), and the exception goes on unchanged. A backward that raised before it reached
selzero's hooks (in the loss's own backward) counts the same when its graph holds a selected
parameter. A program that drives the engine another way is still covered by the next forward
of the model, which marks the window dead without communicating.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from .core.zero2 import SelectedZero2, live_instances

__all__ = ["install"]

_MARK = "_selzero_wrapped"
logger = logging.getLogger("selzero_plugin")


def install() -> None:
    """Wrap ``torch.autograd.backward`` (idempotent; called when selzero is imported)."""
    original = torch.autograd.backward
    if getattr(original, _MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        except BaseException:
            _failed(signature, args, kwargs)
            raise

    setattr(backward, _MARK, True)
    torch.autograd.backward = backward


def _failed(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> None:
    instances = live_instances()
    if not instances:
        return
    try:
        bound = signature.bind(*args, **kwargs)
        tensors, inputs = bound.arguments.get("tensors"), bound.arguments.get("inputs")
        for sz in instances:
            sz.window.backward_failed(_reaches(sz, tensors, inputs))
    except Exception:  # noqa: BLE001 - the backward's own exception is what the caller sees
        logger.exception("selzero: handling a backward that raised failed; its window is "
                         "dropped at the next forward or reduction point instead.")


def _reaches(sz: SelectedZero2, tensors: Any, inputs: Any) -> bool:
    """Does the graph from ``tensors`` accumulate into a selected parameter of ``sz``?"""
    selected = {id(e.param) for e in sz.trainable}
    if inputs is not None:
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        return any(id(t) in selected for t in inputs)
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or [])
    if any(id(t) in selected for t in roots):
        return True
    stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None and id(variable) in selected:
            return True
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return False
