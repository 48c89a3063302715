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

``register_all_grads_hook`` keeps torch's rule, and its hooks reach the nodes only through a weak
reference to an ``InputNodes``. Only inputs the engine will reach count: a unit input reached on
some ranks only (a conditioning tensor that only some experts read, with routing that differs by
rank) must not keep one rank from firing where the others fire (a review reproduced an agreed
error, and a hang against a host collective in backward, with a hook that waited for every
input). ``ForwardInputs`` holds the objects, outside the graph (anything the graph holds that
holds the nodes is a cycle again: a model output that is also a unit's input, HF's
``output_hidden_states``, made that one in review), for a bounded time:

- those of a model forward, in one group per forward, until the forward's outputs are all gone
  (after its backward, when the program drops them; or a forward never backwarded: a skipped
  step), seen at the next forward, backward end or ``step()``, or until ``MAX_FORWARDS`` (8)
  newer forwards that registered any have started. Not "until a backward used them": a
  gradient penalty's ``autograd.grad``, or a ``retain_graph`` backward, runs before the main
  backward through the same graph (a review reproduced the agreed error with that rule). Where
  the outputs feed units (hidden states), they stay alive with the group, which then goes by
  age: after a backward the nodes no longer hold saved tensors, except under
  ``retain_graph=True``, where up to 8 forwards' activations stay (a review measured 2 MB a
  step on a small model with 32);
- those of units run without the model's forward, in one group of at most ``4 x units``
  unit calls (at least 16), the oldest half dropped beyond it;
- those of a forward run during a backward (a checkpoint's recompute), until it ends.

Where the object is gone when a hook first runs, the hook waits for every input: later than
torch's rule (the unit's buckets launch at the end of the backward), never earlier; with a unit
input reached on some ranks only, the ranks then disagree and every rank raises the agreed
error. That needs a forward older than 8 forwards (a deep pipeline schedule), or a
loss taken on an intermediate after the outputs were dropped with another forward before its
backward.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Sequence

import torch

__all__ = ["InputNodes", "ForwardInputs", "register_all_grads_hook"]


class InputNodes:
    """The ``grad_fn`` nodes of a hook's tensors."""

    __slots__ = ("nodes", "__weakref__")

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = nodes


def register_all_grads_hook(tensors: Sequence[torch.Tensor], fn: Callable[[], None]
                            ) -> InputNodes:
    """Call ``fn()`` in every graph task once it has computed the gradient of each of
    ``tensors`` (distinct non-leaf tensors that require grad) that it reaches. Returns the
    ``InputNodes`` the caller keeps while the graph may run backward; the hooks hold ``fn``, a
    weak reference to it and a count per graph task ([Note: the all-gradients hook])."""
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


class _Group:
    __slots__ = ("inputs", "dead", "rootless", "__weakref__")

    def __init__(self, *, rootless: bool = False) -> None:
        self.inputs: list[InputNodes] = []
        self.dead = False  # every output of its forward is gone
        self.rootless = rootless  # units run without the model's forward: capped


def _outputs_gone(group: "weakref.ref[_Group]") -> None:
    g = group()
    if g is not None:
        g.dead = True  # (a plain store: this may run on any thread; dropped on the training one)


class ForwardInputs:
    """Holds ``InputNodes`` for the bounded time [Note: the all-gradients hook] gives. Called
    on the training thread, except the finalizer, which only sets a flag."""

    MAX_FORWARDS = 8

    def __init__(self, units: int) -> None:
        self.groups: list[_Group] = []
        self.recomputed: list[InputNodes] = []
        self.max_per_forward = max(16, 4 * units)  # unit calls of one group

    def held(self) -> int:
        return sum(len(g.inputs) for g in self.groups) + len(self.recomputed)

    def forward_started(self) -> None:
        self.prune()
        self.groups.append(_Group())
        del self.groups[:-self.MAX_FORWARDS]

    def add(self, inputs: InputNodes, *, in_backward: bool) -> None:
        if in_backward:
            self.recomputed.append(inputs)
            return
        if not self.groups:  # units run without the model's forward
            self.groups.append(_Group(rootless=True))
        group = self.groups[-1]
        group.inputs.append(inputs)
        if group.rootless and len(group.inputs) > self.max_per_forward:
            del group.inputs[:len(group.inputs) // 2]

    def forward_ended(self, outputs: Sequence[torch.Tensor]) -> None:
        """The current forward's outputs: when all their nodes are gone, so is its group."""
        if not self.groups:
            return
        nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
        if not nodes:
            return
        sentinel = _Sentinel()  # holds nothing: the nodes' metadata holds it
        for node in nodes:
            node.metadata.setdefault("selzero_forward", []).append(sentinel)
        weakref.finalize(sentinel, _outputs_gone, weakref.ref(self.groups[-1])).atexit = False

    def backward_ended(self) -> None:
        self.recomputed = []
        self.prune()

    def clear(self) -> None:
        self.groups = []
        self.recomputed = []

    def prune(self) -> None:
        """Drop the groups whose forward's outputs are all gone, and earlier forwards that
        registered nothing (under ``no_grad``: evaluation, ``generate()``)."""
        last = self.groups[-1] if self.groups else None  # (its forward may be running)
        self.groups = [g for g in self.groups if not g.dead and (g.inputs or g is last)]


class _Sentinel:
    __slots__ = ("__weakref__",)
