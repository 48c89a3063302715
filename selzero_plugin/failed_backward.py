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
selzero's hooks (in the loss's own backward) counts the same when its graph accumulates into
the model's parameters (such a backward opens a micro-step, whatever the routing sent to the
experts). A program that drives the engine another way is still covered by the next forward of
the model, which marks the window dead without communicating.

The wrapper also numbers the outermost calls and says whether a call's roots come from a
GradScaler's ``scale()`` (core/outer_backward.py): the window records which call opened a
micro-step, and which micro-steps carry scaled gradients ([Note: loss scaling] in amp.py).
Nested calls (a reentrant checkpoint's inner backward, inside the outer one) pass straight
through.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch

from .core.outer_backward import CURRENT, SCALED_KEY
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
        if torch._C._current_graph_task_id() != -1:  # nested: inside a running backward
            return original(*args, **kwargs)
        CURRENT.call += 1
        roots = args[0] if args else kwargs.get("tensors")
        CURRENT.scaled = CURRENT.scaler_seen and _scaled(roots)
        try:
            return original(*args, **kwargs)
        except BaseException:
            _failed(signature, args, kwargs)
            raise
        finally:
            CURRENT.scaled = False

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
            sz.window.backward_failed(_reaches(sz, tensors, inputs), CURRENT.call)
    except Exception:  # noqa: BLE001 - the backward's own exception is what the caller sees
        logger.exception("selzero: handling a backward that raised failed; its window is "
                         "dropped at the next forward or reduction point instead.")


def _roots(tensors: Any) -> list[torch.Tensor]:
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or [])
    return [t for t in items if isinstance(t, torch.Tensor)]


def _scaled(tensors: Any, limit: int = 32) -> bool:
    """Do the roots come from ``GradScaler.scale()``: its node among the first ``limit`` of the
    graph (``scaler.scale(loss).backward()``, ``(scaler.scale(loss) / k).backward()``)?"""
    frontier = [t.grad_fn for t in _roots(tensors) if t.grad_fn is not None]
    seen = 0
    while frontier and seen < limit:
        node = frontier.pop(0)
        seen += 1
        if node.metadata.get(SCALED_KEY):
            return True
        frontier.extend(fn for fn, _ in node.next_functions if fn is not None)
    return False


def _reaches(sz: SelectedZero2, tensors: Any, inputs: Any) -> bool:
    """Does the graph from ``tensors`` accumulate into a trainable parameter of ``sz``'s model
    (what makes a backward open a micro-step, window.py ``_accumulates``)?"""
    selected = {id(p) for p in sz.model.parameters() if p.requires_grad}
    if inputs is not None:
        inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        return any(id(t) in selected for t in inputs)
    roots = _roots(tensors)
    if any(id(t) in selected for t in roots):
        return True
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    modules = {id(m) for m in sz.model.modules()}
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None and id(variable) in selected:
            return True
        # a reentrant checkpoint hides its function's graph until its own backward: it
        # reaches the model when it runs the model (or one of its modules, or their method)
        run = getattr(node, "run_function", None)
        if run is not None and (id(run) in modules or id(getattr(run, "__self__", None)) in
                                modules):
            return True
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return False
