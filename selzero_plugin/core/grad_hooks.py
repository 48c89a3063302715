"""A hook that runs once a backward has computed the gradients of all of some tensors.

[Note: the all-gradients hook]
A launch unit has passed when the backward has computed the gradients of all of its forward
inputs ([Note: the reduction schedule]). torch's ``register_multi_grad_hook(mode="all")`` says
exactly that, but in torch 2.13 every call leaks: its hooks hold, in their closure, the inputs'
``grad_fn`` nodes, and the hooks are themselves held by those nodes (a tensor hook lives in its
``grad_fn``'s pre-hooks). The cycle runs through C++, so Python's garbage collector never sees
it: each call keeps its nodes and hooks alive for good (measured: 1.4 KB per call, after
``gc.collect()``, in a loop of 2,000 steps; ``mode="any"`` holds no node and does not leak).
selzero registers one per launch unit and forward, so a model of 2,048 experts lost 1.7 MB of
C heap per step (workload c of ``benchmarks/bench.py``; on the fused workload f the pinned
blocks fragmented glibc's heap: RSS grew 12-19 MB per step, to 1.8 GiB after 80 steps, while
DDP's stayed at 0.96 GiB). A non-reentrant activation checkpoint makes it worse: its
recompute registers hooks that never fire, on nodes holding recomputed activations.

``register_all_grads_hook`` holds no node: it counts, per graph task, the registered tensors
whose gradient has been computed, and calls ``fn`` when all of them have. torch's version
instead counts only the tensors whose node the running backward will execute (it asks the engine
with those nodes, at the first gradient). The two agree whenever the backward reaches every
input, as a training backward through a unit does. Where it does not (an input the loss does
not depend on, ``backward(inputs=...)``), this hook does not fire, and the unit's buckets launch
at the end of the backward, as for any unit that cannot fire: later, never wrong.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

__all__ = ["register_all_grads_hook"]


def register_all_grads_hook(tensors: Sequence[torch.Tensor], fn: Callable[[], None]) -> None:
    """Call ``fn()`` in every graph task that computes the gradient of each of ``tensors``
    (distinct non-leaf tensors that require grad), once that task has computed the last of
    them. The hooks hold ``fn`` and a count per graph task, never a graph node
    ([Note: the all-gradients hook])."""
    total = len(tensors)
    left: dict[int, int] = {}  # graph task id -> gradients still to come
    lock = threading.Lock()  # the engine may run hooks on several device threads

    def hook(_grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            remaining = left.get(task, total) - 1
            if remaining:
                left[task] = remaining
            else:
                left.pop(task, None)
        if not remaining:
            fn()

    for t in tensors:
        t.register_hook(hook)
