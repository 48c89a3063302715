"""A hook that runs once a backward has computed the gradients of all of some tensors.

[Note: the all-gradients hook]
A launch unit has passed when the backward has computed the gradients of all of its forward
inputs that this backward reaches ([Note: the reduction schedule]). torch's
``register_multi_grad_hook(mode="all")`` says exactly that, but in torch 2.13 every call leaks:
its hooks hold, in their closure, the inputs' ``grad_fn`` nodes (it asks the engine, at the first
gradient, which of them the running backward will execute), and the hooks are themselves held by
those nodes (a tensor hook lives in its ``grad_fn``'s pre-hooks). The cycle runs through C++, so
Python's garbage collector never sees it: each call keeps its nodes and hooks alive for good
(measured: 1.4 KB per call, after ``gc.collect()``, in a loop of 2,000 steps; ``mode="any"``
holds no node and does not leak). selzero registers one per launch unit and forward, so a model
of 2,048 experts lost 1.7 MB of C heap per step (workload c of ``benchmarks/bench.py``); a
non-reentrant activation checkpoint's recompute registers hooks that never fire, on nodes
holding recomputed activations.

``register_all_grads_hook`` keeps torch's rule and breaks the cycle: the nodes sit in an
``InputNodes`` object that the hooks reach only through a weak reference. Its owner keeps it
alive exactly as long as the graph can run: selzero puts the objects of a model forward's
units in the ``metadata`` of the model outputs' nodes (downstream of every unit input, so no
node of the cycle holds them) and those of a forward run during a backward (a checkpoint's
recompute) in a list cleared when that backward ends. Counting only the inputs the engine will
reach matters: a unit input reached on some ranks only (a conditioning tensor that only some
experts use, with routing that differs by rank) must not keep one rank from firing where the
others fire (a review reproduced an agreed error, and a hang against a host collective in
backward, with a hook that waited for every input). Where the object is gone (an owner that
dropped it: a unit run outside the model's forward), the hook waits for every input, which
is later than torch's at worst: the unit's buckets launch at the end of the backward.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import torch

__all__ = ["InputNodes", "register_all_grads_hook"]


class InputNodes:
    """The ``grad_fn`` nodes of a hook's tensors, held by the graph's owner, not by the hook."""

    __slots__ = ("nodes", "__weakref__")

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = nodes


def register_all_grads_hook(tensors: Sequence[torch.Tensor], fn: Callable[[], None]
                            ) -> InputNodes:
    """Call ``fn()`` in every graph task once it has computed the gradient of each of
    ``tensors`` (distinct non-leaf tensors that require grad) that it reaches. Returns the
    ``InputNodes`` the caller must keep alive while the graph may run backward; the hooks hold
    ``fn``, a weak reference to it and a count per graph task ([Note: the all-gradients hook])."""
    held = InputNodes([t.grad_fn for t in tensors])
    ref = weakref.ref(held)
    total = len(tensors)
    left: dict[int, int] = {}  # graph task id -> gradients still to come
    lock = threading.Lock()  # the engine may run hooks on several device threads

    def hook(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in left:
                nodes = ref()
                left[task] = total if nodes is None else \
                    sum(map(torch._C._will_engine_execute_node, nodes.nodes))
            remaining = left[task] - 1
            if remaining > 0:
                left[task] = remaining
            else:
                del left[task]
        if remaining <= 0:
            fn()

    for t in tensors:
        t.register_hook(hook)
    return held
