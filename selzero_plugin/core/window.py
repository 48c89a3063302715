"""The reduction window: hooks, launch points, WindowState, presence, agreement, reset.

[Note: the reduction schedule]
Ranks of an MoE do not receive the same gradients, so "launch a collective when its gradients
are ready" would issue collectives at different moments on different ranks. selzero's schedule
is the same on every rank whatever the routing:

- every reduced micro-step issues exactly one reduce-scatter per bucket, in bucket order;
- bucket b is launched when the backward has passed every launch unit of its parameters
  ([Note: launch units]), detected by a hook on the unit's forward inputs that runs once the
  backward has computed all of their gradients ([Note: the all-gradients hook]; leaf inputs
  first pass through an identity autograd function, to have a node).
  Units run on every rank, so every rank launches bucket b at the same point of its backward,
  relative to the host's collectives too. Missing gradients are zeros in the bucket buffer;
- the end-of-backward callback launches what is left (units that cannot fire) and finishes every
  reduction. It is queued by a hook on the model's outputs (the first thing a backward computes),
  so it runs before the host's own end-of-backward callback (DDP's wait);
- every reduction point (``end_microstep()`` / ``reduce_gradients()``) launches what is still
  unlaunched, then all-reduces *one* control vector: each rank's call signature, its flags (a
  second backward, a dropped window, gradients that came after their launch), which units fired,
  presence, the token weight and the non-finite flag. One device-to-host read of the result
  decides everything, identically on every rank.

``overlap=False`` and ``reduction="sum"`` launch every bucket at the reduction point instead
(under ``sum`` the rank's ``active`` flag, known only there, decides whether its gradients count).

[Note: presence]
Each rank records which (virtual) parameters received a gradient in the window; the group sums
the records. A parameter absent on every rank keeps ``grad=None`` on its segment, so torch's
optimizer skips it: no update, no weight decay, no step count.

[Note: non-finite check]
The reduction point must know whether the reduced shard holds an inf or NaN. The agreement
carries each rank's *sum test* (``may_hold_nonfinite``: the shard's sum is finite, which proves
every value finite): one read pass that was faster in place than the min-and-max pass
(``holds_nonfinite``), about 3 ms of a 195 ms step on workload f at world 2. A rank whose
sum is not finite (a non-finite value, or finite values that overflow together) makes the
agreed count positive; every rank of the group then runs the exact check and the group agrees
its count in one more small all-reduce, so a sum that merely overflowed skips nothing. Writes
into ``sz.grad_shard`` after the backward are seen, as the check reads the shard itself.

[Note: a backward that raised]
An exception inside backward (an OOM on one batch) leaves the micro-step open: its
end-of-backward callback never runs. The next forward of the model notices (outside backward)
and marks the window *dead*, locally: a forward may run on one rank alone (a validation
forward), so nothing is communicated there. The window is dropped at the next point every rank
of the group reaches: the start of the next backward into selzero's parameters, a reduction
point, ``zero_grad()``, a checkpoint save or load, ``sync_from_params(broadcast=True)``. When
buckets launch during backward, every rank whose dead micro-step reached selzero first launches
the rest of that micro-step's buckets (zero-filled) and finishes them, so each such rank issued
exactly one reduction per bucket, wherever its backward failed; then every gradient, shard value
and presence record of the window is forgotten. A rank counts the drop when the window held
something before that micro-step, or when the micro-step's collectives had to be completed: so
ranks that skipped the same batch count the same, wherever their backward failed, and the next
reduction point checks that every rank dropped the same number of windows (a rank that did
not skip, or that failed before its backward reached selzero at all, is told so on every
rank; ``zero_grad()`` on every rank reconciles the latter, agreeing how many buckets any rank
launched).

[Note: late gradients]
A gradient that reaches selzero after its bucket was launched (a parameter used outside its
launch unit, a unit re-run by a reentrant activation checkpoint, a module applied twice) is kept,
full size in FP32, beside the window. The reduction point's control vector says which entries got
late gradients on any rank; every rank then reduces those buckets once more, in bucket order
(zeros where it has none), adds the result to its shard, and from then on launches those buckets
at the end of backward, when every gradient is in (one log line). The result equals plain
torch; the cost is one more reduction per such bucket, once.

[Note: launch order]
Buckets launch in one order, the same on every rank. It starts as bucket order (reverse model
order) and follows the backward as group rank 0 saw it at every reduction point: buckets whose
units all passed there are put in the order they became ready, keeping the places of buckets
whose units did not run in that micro-step (a layer skipped everywhere: one odd step does not
move them for good); buckets whose units cannot fire (inputs that need no gradient) and buckets
that got late gradients go last, launched at the end of backward. Inside a backward, a bucket
whose units did not run in its forward (expected nowhere in it) launches at its turn, from the
start of the backward on, over a shared zero buffer that the memory bound does not wait for
([Note: scratch launches] in collectives.py). A gloo rank waits for an older launched bucket as
long as the communicator's timeout allows: a slower peer is not a reason to hold more memory.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config import SelZeroConfig
from ..errors import MissingGradientError, NonFiniteGradientError, UsageError
from .binding import EDITED, KINDS, MOVED, RECAST, REPLACED, STRAY_GRAD, Bindings
from .collectives import BucketCollectives
from .comm import Communicator
from .grad_hooks import ForwardInputs, register_all_grads_hook
from .layout import Layout
from .outer_backward import CURRENT as OUTER
from .selection import SelectedEntry
from .storage import ShardStorage, holds_nonfinite
from .units import ROOT_NAME, Units

__all__ = ["WindowState", "Decision", "ReductionWindow"]

logger = logging.getLogger("selzero_plugin")

_FP32, _I64 = torch.float32, torch.int64
# group rank 0's state of each launch unit in a micro-step, in the control vector: the position
# (1, 2, ...) at which it passed, or
_UNIT_DID_NOT_RUN, _UNIT_CANNOT_FIRE = 0, -1
_PHASE_END_MICROSTEP, _PHASE_REDUCE = 1, 2
_ARG_NONE, _ARG_WEIGHT, _ARG_ACTIVE = 0, 1, 2
_ERR_NONE, _ERR_ARG_NOT_ACCEPTED, _ERR_WEIGHT_MISSING, _ERR_BAD_VALUE, _ERR_SCALED = 0, 1, 2, 3, 4
_ERR_TEXT = {
    _ERR_ARG_NOT_ACCEPTED: "passed an argument its reduction mode does not take",
    _ERR_WEIGHT_MISSING: "called reduce_gradients/step without weight=",
    _ERR_BAD_VALUE: "passed an invalid value (weight must be an integer >= 0, active a bool)",
}


class WindowState(enum.Enum):
    """Where the current accumulation window stands."""

    IDLE = "idle"  # no reduced micro-step open (local no_sync gradients may be pending)
    OPEN = "open"  # a backward is delivering gradients into a reduced micro-step
    AWAITING_CLOSE = "awaiting_close"  # that backward ended; end_microstep/reduce_gradients next
    REDUCED = "reduced"  # reduce_gradients done; grad_norm_squared / scale / step allowed


@dataclass
class Decision:
    """What the window's reduction decided, the same on every rank."""

    update: list[bool]  # per virtual parameter
    global_weight: int
    updated: int
    skipped_absent: int
    skipped_nonfinite: int
    nonfinite: bool = False  # the reduced subset (or, under a GradScaler, the host) held inf/NaN
    presence: tuple[int, ...] = ()  # per virtual parameter: group ranks that had a gradient


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _Identity(torch.autograd.Function):
    """Gives leaf inputs of a launch unit a node of ordinary priority to hook."""

    @staticmethod
    def forward(ctx: Any, *inputs: torch.Tensor) -> Any:
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return grads


class _Control:
    """Offsets in the control vector (int64) all-reduced at every reduction point. Its length
    does not depend on the phase, so ranks that make different calls still pair one all-reduce
    and then all raise."""

    def __init__(self, ranks: int, entries: int, units: int, virtuals: int,
                 frozen: int) -> None:
        self.size = 0
        self.signature = self._take(ranks)  # one code per rank: phase, argument kind, error
        self.second_backward = self._take(ranks)
        self.dropped = self._take(ranks)
        self.opened = self._take(ranks)
        self.active = self._take(1)
        self.weight = self._take(1)
        self.nonfinite = self._take(1)
        self.late = self._take(entries)  # ranks with gradients that came after the launch
        self.passed = self._take(units)
        self.order = self._take(units)  # group rank 0's unit states: see _UNIT_* below
        self.presence = self._take(virtuals)
        self.binding = self._take(KINDS * entries)  # ranks that see each entry rebound
        self.unfrozen = self._take(frozen)  # ranks where a frozen selected parameter trains

    def _take(self, n: int) -> slice:
        s = slice(self.size, self.size + n)
        self.size += n
        return s


class ReductionWindow:
    """Micro-steps, reduction points and the decision of one accumulation window."""

    def __init__(self, *, config: SelZeroConfig, comm: Communicator, layout: Layout,
                 storage: ShardStorage, collectives: BucketCollectives,
                 trainable: list[SelectedEntry], frozen: list[SelectedEntry], units: Units,
                 model: nn.Module,
                 normalize_ranks: list[int],
                 normalize_weight: Callable[[torch.Tensor, bool, bool],
                                            tuple[int, bool, bool]] | None,
                 control_comm: Callable[[], Communicator], bindings: Bindings) -> None:
        self.config = config
        self.bindings = bindings
        self.comm = comm
        self.layout = layout
        self.storage = storage
        self.collectives = collectives
        self.trainable = trainable
        self.frozen = frozen  # selected, frozen at construction: no slot; must stay frozen
        self.units = units
        self.model = model
        self.normalize_ranks = normalize_ranks  # global ranks of the normalize_over set
        self.normalize_size = len(normalize_ranks)
        # sums a weight over the normalize_over ranks (when not the group), with a failure flag
        self.normalize_weight = normalize_weight
        self.control_comm = control_comm  # a second communicator of the group (zero_grad)
        self.launches_in_backward = config.launches_in_backward
        self.bucket_units = [sorted({units.of_entry[t] for t in spec.entries})
                             for spec in layout.buckets]
        device = comm.device
        v = len(layout.virtuals)
        self.control = _Control(comm.size, len(trainable), len(units.names), v, len(frozen))
        # presence of this micro-step: whole parameters on the host (no kernel per gradient),
        # the rows of split fused experts on the device (whether a row is zero is a device fact)
        self.present: set[int] = set()
        # per entry: its virtual parameter when it is one whole parameter, else -1 (rows)
        self.whole_virtual = [ids[0] if layout.virtuals[ids[0]].expert is None else -1
                              for ids in layout.entry_virtuals]
        self.micro_presence = torch.zeros(v, dtype=_I64, device=device)
        self.window_presence = torch.zeros(v, dtype=_I64, device=device)
        self.window_active = torch.zeros((), dtype=_I64, device=device)
        self.local: dict[int, torch.Tensor] = {}  # no_sync accumulation, full size FP32 (1D)
        # gradients that came after their bucket's launch ([Note: late gradients]), full FP32
        self.late_grads: dict[int, torch.Tensor] = {}
        self.deferred: set[int] = set()  # buckets launched at the end of backward from now on
        self.sync = True  # False inside no_sync()
        self.order_logged = False
        self.logged_first_backward = False
        self.launched_in_backward: tuple[int, int] | None = None  # last backward's (early, all)
        self.dropped = 0  # windows dropped (since the last agreement), see settle()
        # [Note: a backward that raised]: a dead window waits for settle(); dead_schedule: its
        # micro-step's bucket collectives are to be completed there
        self.dead = False
        self.dead_schedule = False
        self.rest_pending = False  # its reductions are still to be launched (at settle())
        self.held_at_open = False  # the window held something when this micro-step opened
        self.opened_in = 0  # the outermost backward call that opened it (outer_backward.py)
        self.last_forward_sync = True  # the no_sync() mode of the last grad-enabled forward
        # selzero_plugin/amp.py: a GradScaler scaled this window's loss; its unscale_ ran
        self.scaled = False
        self.unscaled = False
        self.decision: Decision | None = None
        self.forward_counts = [0] * len(units.names)  # unit forwards in the running model forward
        self.forward_unfirable: set[int] = set()  # units it ran whose inputs need no gradient
        self.forward_ran: set[int] = set()  # units it ran at all
        self._probes: list[Any] = []
        self._hooks: list[Any] = []
        # launch units' input nodes, held for a bounded time ([Note: the all-gradients hook])
        self._unit_inputs = ForwardInputs(len(units.names))
        self._reset()

    # ---- hooks -----------------------------------------------------------------------------

    def install(self) -> None:
        model = self.model
        self._hooks.append(model.register_forward_pre_hook(self._on_model_forward_start))
        self._hooks.append(model.register_forward_hook(self._on_model_forward_end))
        for u, module in enumerate(self.units.modules):
            self._hooks.append(module.register_forward_pre_hook(
                self._unit_pre_forward(u), with_kwargs=True))
        for t, e in enumerate(self.trainable):
            self._hooks.append(e.param.register_post_accumulate_grad_hook(self._grad_hook(t)))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._unit_inputs.clear()

    @property
    def installed(self) -> bool:
        return bool(self._hooks)

    def _grad_hook(self, t: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if grad is not None:
                self._on_grad(t, grad)
        return hook

    def _unit_pre_forward(self, u: int) -> Callable[..., Any]:
        """Registers the unit's post-backward: a hook on its inputs that runs once their
        gradients are all computed. The hook runs with the node that produced an input, which
        comes after every node of the unit (and so after the unit's parameters' gradients,
        accumulated first); the graph is not changed, so in-place ops on the inputs stay legal.
        A leaf input's node is a gradient accumulator, which runs as early as the unit's own, so
        leaves first pass through an identity (a leaf that requires grad takes no in-place op)."""
        def passed() -> None:
            self._on_unit_passed(u)

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            # A forward during backward is an activation-checkpoint recompute: it may fire (a
            # reentrant checkpoint's inner backward) or never (a non-reentrant one), so it is
            # not waited for; see _on_pre_backward for the forwards that are. A forward under
            # no_grad inside the model's (a reentrant checkpoint's first pass) ran all the same.
            outside = not _in_backward()
            if outside:
                self.forward_ran.add(u)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not idx:
                self.forward_unfirable.add(u)
                return None
            if outside:
                self.forward_counts[u] += 1
            leaves = [i for i in idx if flat[i].is_leaf]
            if leaves:
                for i, x in zip(leaves, _Identity.apply(*[flat[i] for i in leaves])):
                    flat[i] = x
            inputs = list({id(flat[i]): flat[i] for i in idx}.values())
            self._unit_inputs.add(register_all_grads_hook(inputs, passed),
                                  in_backward=not outside)  # [Note: the all-gradients hook]
            return tree_unflatten(flat, spec) if leaves else None
        return hook

    def _on_model_forward_start(self, module: nn.Module, args: Any) -> None:
        if not _in_backward():
            self._note_interrupted()  # local only: this forward may run on one rank alone
            self._unit_inputs.forward_started()
            self.forward_counts = [0] * len(self.units.names)
            self.forward_unfirable = set()
            self.forward_ran = set()

    def _on_model_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or _in_backward():
            return
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        self._unit_inputs.forward_ended(tensors)
        # What the backward through *these* outputs will meet: the unit forwards of this model
        # forward (a forward that is never backwarded counts for nothing), and the no_sync()
        # mode at forward time (as DDP decides it).
        counts, sync = list(self.forward_counts), self.sync
        unfirable, ran = set(self.forward_unfirable), set(self.forward_ran)
        self.last_forward_sync = sync

        def pre_backward(_grad: torch.Tensor) -> None:
            self._on_pre_backward(counts, unfirable, ran, sync)

        torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")

    def _on_pre_backward(self, counts: list[int], unfirable: set[int], ran: set[int],
                         sync: bool) -> None:
        self._enter_backward(sync)
        self.unit_expected = [a + b for a, b in zip(self.unit_expected, counts)]
        self.unfirable |= unfirable
        self.ran |= ran
        self.expecting = True  # units expected nowhere in this backward did not run
        if self.taking and self.syncing and self.launches_in_backward:
            # buckets of units that did not run launch now, at the start of the backward: a
            # peer where they ran waits for them at their post-backward ([Note: launch order])
            self._launch_ready()

    # ---- backward --------------------------------------------------------------------------

    def _enter_backward(self, sync: bool | None = None) -> bool:
        """A backward reached selzero (model outputs, a hook, a unit); whether its gradients
        are taken. The first event of a backward queues the end-of-backward callback on it.

        A pass that accumulates no parameter gradient (``autograd.grad(..., inputs)``: an input
        gradient penalty) is not a micro-step; but neither does the outer pass of a backward
        whose parameters all sit in reentrant checkpoints, whose inner passes do. So such a
        pass stays *tentative*: it opens a micro-step only when an event comes from a nested
        (inner) pass."""
        task = torch._C._current_graph_task_id()
        if not self.callback_queued:
            self.callback_queued = True
            self.backward_task = task
            self.backward_sync = self.sync if sync is None else sync
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            if not self._accumulates():
                self.tentative = True
                return False
            return self._open()
        if self.tentative:
            if task == self.backward_task:
                return False
            self.tentative = False
            return self._open()
        return self.taking

    def _open(self) -> bool:
        me = f"[rank {self.comm.rank}/{self.comm.size}]"
        self.settle()  # the start of a backward into the subset: every rank reaches it
        self.held_at_open = self._holds_anything()
        self.opened_in = OUTER.call
        self.scaled = self.scaled or OUTER.scaled  # selzero_plugin/amp.py
        unfrozen = [e.name for e in self.frozen if e.param.requires_grad]
        if unfrozen:
            self.raised = True
            raise UsageError(_unfrozen_text(me, unfrozen))
        if self.state is WindowState.REDUCED:
            self.raised = True  # the next forward or reduction point drops the window
            raise UsageError(f"{me} a backward reached selzero's parameters after "
                             "reduce_gradients() and before step(); call sz.step() first, "
                             "or sz.zero_grad() to drop the reduced window.")
        if not self.backward_sync:
            if self.state is not WindowState.IDLE:
                self.raised = True
                raise UsageError(f"{me} a no_sync() backward followed a reduced backward whose "
                                 "micro-step was not closed; call sz.end_microstep() first, or "
                                 "run the earlier micro-steps inside no_sync() too.")
            self.local_open = True
            self.taking = True
        elif self.state is WindowState.IDLE:
            self.state = WindowState.OPEN
            self.opened = True
            self.taking = True
        else:  # AWAITING_CLOSE: a second backward into a reduced micro-step not closed
            self.second_backward = True
            self.taking = False
        return self.taking

    def _accumulates(self) -> bool:
        """Does the running backward accumulate parameter gradients? (``autograd.grad`` and
        ``backward(inputs=...)`` of non-parameters do not; their passes are not micro-steps.)"""
        for refresh in (False, True):
            if refresh or not self._probes:
                self._probes = [torch.autograd.graph.get_gradient_edge(p).node
                                for p in self.model.parameters() if p.requires_grad]
            try:
                if any(torch._C._will_engine_execute_node(n) for n in self._probes):
                    return True
            except RuntimeError:  # "a leaf node was passed ... running autograd.grad()"
                return False
        return False

    @property
    def syncing(self) -> bool:
        return self.backward_sync if self.backward_sync is not None else self.sync

    def _on_grad(self, t: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            self.raised = True
            raise UsageError(f"parameter {self.trainable[t].name!r} got a sparse gradient; selzero "
                             "reduces dense gradients. Use a dense embedding (sparse=False) or leave "
                             "this parameter out of `params`.")
        # once per gradient: the common case (a backward already under way) without calls
        if self.callback_queued and not self.tentative:
            if not self.taking:
                return
        elif not self._enter_backward():
            return
        whole = self.whole_virtual[t]
        if whole >= 0:
            self.present.add(whole)
        else:
            self._record_presence(t, grad)
        # any shape: the copies view it (one view op for most parameters)
        flat = grad if grad.is_contiguous() and not grad.requires_grad else \
            grad.detach().contiguous()
        sync = self.backward_sync
        if not (self.sync if sync is None else sync):
            _accumulate_into(self.local, t, flat)
            return
        collectives = self.collectives
        if collectives.launched(collectives.entry_bucket[t]):
            _accumulate_into(self.late_grads, t, flat)  # reduced at the reduction point
            return
        collectives.fill(t, flat)
        if self.local:
            local = self.local.pop(t, None)
            if local is not None:
                collectives.fill(t, local)

    def _record_presence(self, t: int, grad: torch.Tensor) -> None:
        """The rows of a split fused expert tensor that got a gradient (whole parameters are
        recorded by the hook itself)."""
        ids = self.layout.entry_virtuals[t]
        # a row is present when it holds a value other than (+-)0: its max or min is
        # non-zero (NaN counts). Reductions only, no full-size temporary (`ne(0)` made a
        # bool copy of the gradient and took 7x as long)
        rows = grad.detach().reshape(len(ids), -1)
        if rows.device.type == "cpu":  # [Note: row presence from a sample]
            present = _row_sample(rows).amax(dim=(1, 2)) != 0
            zero = (~present).nonzero().flatten()  # (a host read)
            if zero.numel():
                rest = rows.index_select(0, zero)
                present[zero] = (rest.amax(dim=1) != 0) | (rest.amin(dim=1) != 0)
        else:  # no host read inside backward
            present = (rows.amax(dim=1) != 0) | (rows.amin(dim=1) != 0)
        self.micro_presence[ids[0]:ids[-1] + 1] |= present.to(_I64)

    def _on_unit_passed(self, u: int) -> None:
        if not self._enter_backward():
            return
        self.unit_fired[u] += 1
        if not self.syncing or self.unit_passed[u] or self.unit_fired[u] < self.unit_expected[u]:
            return
        self.unit_passed[u] = True
        self.pass_order.append(u)
        if self.launches_in_backward:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in the agreed order, every bucket whose units the backward has passed, or
        did not run in this backward's forward ([Note: launch order]); buckets deferred to the
        end of backward wait for it."""
        c = self.collectives
        while not c.all_launched():
            b = c.next_bucket()
            units = self.bucket_units[b]
            if b in self.deferred:
                return
            if all(self.unit_passed[u] for u in units):
                self._launch_one(None)
            elif all(self.unit_passed[u] or self._did_not_run(u) for u in units):
                self._launch_one(None, early=True)
            else:
                return

    def _did_not_run(self, u: int) -> bool:
        """Unit u ran in none of the forwards this backward goes through, so it never passes:
        a layer skipped on this rank."""
        return self.expecting and u not in self.ran

    def _launch_one(self, zero_if: torch.Tensor | None, *, early: bool = False) -> None:
        b = self.collectives.next_bucket()
        for t in self.layout.buckets[b].entries:
            local = self.local.pop(t, None)
            if local is not None:
                self.collectives.fill(t, local)
        self.collectives.launch_next(zero_if, early=early)

    def _backward_done(self) -> None:
        """End of the graph task the first hook of this backward ran in."""
        self.callback_queued = False
        self._unit_inputs.backward_ended()
        self.backward_sync = None
        self.tentative = False
        self.taking = False
        self.local_open = False
        if self.state is WindowState.OPEN:
            self.state = WindowState.AWAITING_CLOSE
            if self.launches_in_backward:
                first = self.collectives.next_launch
                self.launched_in_backward = (first, len(self.layout.buckets))  # (DEBUG log)
                while not self.collectives.all_launched():
                    self._launch_one(None)
                self.collectives.finish_all()
                self._log_first_backward(first)
        self.unit_expected = [0] * len(self.units.names)
        self.unit_fired = [0] * len(self.units.names)
        self.expecting = False

    def _log_first_backward(self, first: int) -> None:
        if self.logged_first_backward:
            return
        self.logged_first_backward = True
        order = self.collectives.order
        late = [b for b in order[first:]
                if not all(self.unit_passed[u] for u in self.bucket_units[b])]
        units = sorted({self.units.names[u] for b in late for u in self.bucket_units[b]
                        if not self.unit_passed[u]})
        if late and self.comm.rank == 0:
            # The whole model as the unit (a model that is one MoE block) ends its backward with
            # the backward itself: launching then costs nothing, so that is no warning.
            if units == [ROOT_NAME]:
                logger.info("selzero %r: %d of %d bucket(s) launch at the end of backward: their "
                            "launch unit is the whole model %s, whose backward ends with it "
                            "(nothing is held longer; nothing to change).", self.config.name,
                            len(late), len(self.layout.buckets), units)
            else:
                logger.warning(
                    "selzero %r: %d of %d bucket(s) launch at the end of backward, their full "
                    "FP32 gradients held until then: launch unit(s) %s did not fire (inputs "
                    "that need no gradient?); set launch_modules to modules whose inputs need "
                    "one.", self.config.name, len(late), len(self.layout.buckets), units[:5])

    # ---- local micro-steps -----------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous = self.sync
        self.sync = False
        try:
            yield
        finally:
            self.sync = previous

    # ---- a backward that raised; resets ----------------------------------------------------

    def _note_interrupted(self, *, launch_now: bool = False) -> None:
        """Outside backward, local only unless ``launch_now``: mark the window dead if the
        backward that opened a micro-step raised (its callback never ran) or selzero raised a
        usage error inside a backward ([Note: a backward that raised]). Nothing is waited for
        here: see settle()."""
        self.callback_queued = False  # no callback can be pending outside a backward
        self.backward_sync = None
        self.tentative = False
        self.taking = False
        self.expecting = False
        if self.dead or (self.state is not WindowState.OPEN and not self.local_open
                         and not self.raised):
            return
        self._die(self.state is WindowState.OPEN and self.launches_in_backward,
                  self.held_at_open, launch_now)

    def _die(self, schedule: bool, held: bool, launch_now: bool) -> None:
        """A micro-step died. Count the drop when another rank could tell (the window held
        something before it, or its reductions are issued); ``schedule``: its reductions are
        to be issued, now (``launch_now``: without waiting, [Note: seeing a failed backward]
        in failed_backward.py) or at settle(). A window already dead (a second batch failed
        before its backward reached selzero) issues the rest of the first micro-step's first."""
        if self.dead and self.rest_pending:
            self.collectives.launch_rest_now()
            self.rest_pending = False
        if self.dead and schedule:
            self.collectives.restart_microstep()
        self.dropped += int(held or schedule)
        self.dead = True
        self.dead_schedule = schedule
        self.local_open = False
        if schedule and launch_now:
            self.collectives.launch_rest_now()
        else:
            self.rest_pending = schedule

    def backward_failed(self, reached: bool, call: int) -> None:
        """A backward raised on this rank and left ``torch.autograd.backward``
        (selzero_plugin/failed_backward.py): mark the window dead and launch the rest of the
        micro-step's reductions at once, without waiting: a peer still in its backward may be
        waiting for them (on gloo its host blocks there), and the next point every rank
        reaches may be a host's collective. ``reached``: the failed graph accumulates into the
        model's parameters, so a backward that raised before its first event reached selzero
        (in the loss's own backward) is a failed micro-step all the same. ``call``: the
        outermost call's number ([Note: ...] in outer_backward.py)."""
        if _in_backward():
            return  # an inner backward (a reentrant checkpoint's): its outer one raises too
        if self.state is WindowState.AWAITING_CLOSE and call and self.opened_in == call and \
                not self.dead:
            # a nested backward's callback closed this call's micro-step (the whole model under
            # a reentrant checkpoint): it died all the same, its reductions all issued
            self.state = WindowState.OPEN
        if self.callback_queued or self.local_open or self.raised or \
                self.state is WindowState.OPEN:
            self._note_interrupted(launch_now=True)
            return
        if not reached or (self.state is not WindowState.IDLE and not self.dead):
            return
        # it raised before it reached selzero's hooks: the micro-step it would have opened
        self._note_interrupted()
        self._die(self.launches_in_backward and self.last_forward_sync,
                  not self.dead and self._holds_anything(), True)

    def settle(self) -> bool:
        """At a point every rank of the group reaches: drop a dead window, first completing its
        micro-step's bucket collectives (the rest of them, in order, zero-filled) and waiting
        for them ([Note: a backward that raised]). Returns whether that micro-step issued its
        reductions (a reduction point then has none left to flush: they were this
        micro-step's)."""
        if not self.dead:
            return False
        if self.rest_pending:
            self.collectives.launch_rest_now()
        self.collectives.finish_all()
        issued = self.dead_schedule
        self._forget_window()
        return issued

    def reduced(self) -> bool:
        """Outside backward: is the window reduced (and not dropped since by a backward that
        raised)?"""
        self._note_interrupted()
        return self.state is WindowState.REDUCED and not self.dead

    def settle_outside_backward(self) -> None:
        """settle() from a public call every rank makes (a save, a load, a broadcast, step())."""
        if _in_backward():
            return
        self._note_interrupted()
        self.settle()

    def _holds_anything(self) -> bool:
        """Whether the window holds something another rank could notice: launched
        collectives, reduced values, local gradients."""
        return self.collectives.next_launch > 0 or not self.storage.stale or bool(self.local)

    def zero_grad(self) -> None:
        """Forget the window on every rank (all call it). The ranks first agree, on a second
        communicator, how many buckets of the current micro-step any of them launched, and
        each launches the rest up to that count: the collective schedule stays whole even when
        ranks' backwards failed at different points, some before reaching selzero at all."""
        if _in_backward():
            raise UsageError(f"[rank {self.comm.rank}/{self.comm.size}] sz.zero_grad() was called "
                             "inside backward; call it between steps.")
        self._note_interrupted()
        launched = torch.tensor([self.collectives.next_launch], dtype=_I64,
                                device=self.comm.device)
        self.control_comm().all_reduce(launched, op=torch.distributed.ReduceOp.MAX)
        target = int(launched.item())
        while self.collectives.next_launch < target:
            self.collectives.launch_next()
        self.collectives.finish_all()
        self.dropped = 0
        self._reset()

    def _reset(self) -> None:
        """Forget the window and any backward in progress: after step(), a raised agreement,
        zero_grad()."""
        self._forget_window()
        self.scaled = False
        self.unscaled = False
        self.callback_queued = False
        self.backward_sync: bool | None = None
        self.backward_task = -2
        self.tentative = False
        self.taking = False
        self.expecting = False

    def _forget_window(self) -> None:
        """Forget the window's gradients, presence and reduced values (not the flags of a
        backward that may be running: settle() runs at the start of one)."""
        assert not self.collectives.pending, "launched reductions are finished before a reset"
        self.collectives.discard()
        self.storage.stale = True
        for seg in self.storage.segments:
            seg.grad = None
        self.present.clear()
        self.micro_presence.zero_()
        self.window_presence.zero_()
        self.window_active.zero_()
        self.local.clear()
        self.late_grads.clear()
        self.state = WindowState.IDLE
        self.local_open = False
        self.raised = False
        self.dead = False
        self.dead_schedule = False
        self.rest_pending = False
        self._reset_microstep()
        self.decision = None

    def _reset_microstep(self) -> None:
        self.opened = False
        self.second_backward = False
        self.unfirable: set[int] = set()  # units of this micro-step's forwards that cannot fire
        self.ran: set[int] = set()  # units that ran in them
        self.pass_order: list[int] = []
        self.unit_expected = [0] * len(self.units.names)
        self.unit_fired = [0] * len(self.units.names)
        self.unit_passed = [False] * len(self.units.names)

    # ---- reduction points ------------------------------------------------------------------

    def end_microstep(self, active: Any) -> None:
        values, _ = self._close(_PHASE_END_MICROSTEP, None, active)
        self._raise_agreed(self._disagreement(values))
        self._after_agreement(values)

    def reduce(self, weight: Any, active: Any, *, host_nonfinite: torch.Tensor | None = None,
               from_step: bool = False) -> Decision:
        """Close the window. ``host_nonfinite`` (a GradScaler's unscale, selzero_plugin/amp.py):
        the host's inf/NaN flag joins the subset's in the agreement. A window a GradScaler
        scaled is skipped when non-finite, never raised (the scaler handles overflows); reduced
        by ``step()`` without the scaler's unscale, it is an error on every rank."""
        values, local_weight = self._close(_PHASE_REDUCE, weight, active, host_nonfinite,
                                           from_step)
        skip_nonfinite = self.scaled
        error = self._disagreement(values)
        if error is None:  # the late gradients' sums join ``values`` before anything is sent
            # beyond the group (review finding: an overflow in them was raised in this group
            # only, the other normalize_over groups updated)
            self._check_late_sums(values, self._reduce_late(values))
        c = self.control
        mode = self.config.reduction
        if mode == "weighted" and self.normalize_weight is not None:
            # a collective beyond the group: reached even when the group fails, so that the
            # other groups of the normalize_over ranks learn it instead of waiting
            fails = error is not None or self._decide_would_raise(values, skip_nonfinite)
            # a group whose call was invalid sends no weight: a bad tensor weight (negative,
            # fractional) is only seen after it was read, and must not reach the other groups'
            # sum (review finding: one rank's weight of -100 made another group update with a
            # global weight of -82); a group that raises for its values sends its own
            sent = local_weight if error is None else torch.zeros_like(local_weight)
            global_weight, others_failed, others_invalid = self.normalize_weight(
                sent, fails, error is not None)
            # another group's invalid call raises everywhere, whatever the weights (review
            # finding: weights summing to 0 elsewhere let those groups step); one that raises
            # for its values does so only under a positive global weight, and so do the others
            if error is None and not fails and (others_invalid or
                                                (others_failed and global_weight > 0)):
                # (a group that fails itself raises its own error: review finding)
                error = UsageError(
                    f"[rank {self.comm.rank}/{self.comm.size}] reduce_gradients() failed on "
                    f"another group of the normalize_over ranks {self.normalize_ranks} (its "
                    "ranks raised the reason); this group's window was dropped too. Fix what "
                    "that error names; every rank then goes on together.")
        elif mode == "weighted":
            global_weight = values[c.weight.start]
        elif mode == "mean":
            global_weight = self.normalize_size
        else:
            global_weight = values[c.active.start]
        self._raise_agreed(error)
        self._follow_launch_order(values)  # (_after_agreement, the late reductions done above)
        expected = values[c.active.start] if mode == "sum" else self.comm.size
        decision = self._decide(global_weight, values[c.presence], values[c.nonfinite.start],
                                expected, skip_nonfinite=skip_nonfinite)
        if global_weight > 1 and mode != "sum":  # (a weight of 1 divides by nothing)
            self.storage.grad_shard.div_(global_weight)
        self.decision = decision
        self.state = WindowState.REDUCED
        return decision

    def _close(self, phase: int, weight: Any, active: Any,
               host_nonfinite: torch.Tensor | None = None, from_step: bool = False
               ) -> tuple[list[int], torch.Tensor]:
        """Flush the micro-step and all-reduce the control vector (errors: _disagreement)."""
        me = f"[rank {self.comm.rank}/{self.comm.size}]"
        if _in_backward():
            raise UsageError(f"{me} a reduction point was called from inside backward; call it "
                             "after loss.backward() returns.")
        self._note_interrupted()
        flushed = self.settle()
        if self.state is WindowState.REDUCED:
            raise UsageError(f"{me} gradients were already reduced for this step; call sz.step() "
                             "(or drop the extra reduce_gradients()).")
        arg_kind, error, active_t, weight_t, bad_t = self._validate_args(phase, weight, active)
        if error == _ERR_NONE and from_step and self.scaled and host_nonfinite is None:
            error = _ERR_SCALED  # step() of scaled gradients no scaler unscaled
        inactive = None if self.config.reduction != "sum" else active_t == 0
        if not flushed:
            while not self.collectives.all_launched():
                self._launch_one(inactive)
            self.collectives.finish_all()
            assert not self.local, "every local gradient joins a bucket at its launch"
            self.collectives.end_microstep()
        if self.present:
            index = torch.tensor(sorted(self.present), dtype=_I64)
            self.micro_presence[index.to(self.comm.device)] = 1
            self.present.clear()
        self.window_presence |= self.micro_presence * active_t
        self.window_active |= active_t
        self.micro_presence.zero_()
        values = self._agree(phase, arg_kind, error, bad_t, weight_t, host_nonfinite)
        self.dropped = 0
        self._reset_microstep()
        self.state = WindowState.IDLE
        return values, weight_t

    def _agree(self, phase: int, arg_kind: int, error: int, bad: torch.Tensor,
               weight: torch.Tensor, host_nonfinite: torch.Tensor | None = None) -> list[int]:
        c, r = self.control, self.comm.rank
        vector = torch.zeros(c.size, dtype=_I64, device=self.comm.device)
        code = torch.tensor(phase + 4 * arg_kind + 16 * error, dtype=_I64, device=self.comm.device)
        if error == _ERR_NONE:
            code = code + 16 * _ERR_BAD_VALUE * bad
        vector[c.signature.start + r] = code
        vector[c.second_backward.start + r] = int(self.second_backward)
        vector[c.dropped.start + r] = self.dropped
        vector[c.opened.start + r] = int(self.opened)
        vector[c.active] = self.window_active
        vector[c.weight] = weight
        if phase == _PHASE_REDUCE:  # [Note: non-finite check]: the shard's sum test here
            vector[c.nonfinite] = self._nonfinite(self.storage.maybe_nonfinite(),
                                                  host_nonfinite).to(_I64)
            vector[c.presence] = self.window_presence
            vector[c.binding] = torch.tensor(self.bindings.problems(), dtype=_I64,
                                             device=self.comm.device)
            if self.frozen:
                vector[c.unfrozen] = torch.tensor(
                    [int(e.param.requires_grad or e.param.grad is not None) for e in self.frozen],
                    dtype=_I64, device=self.comm.device)
        host = [0] * (c.late.stop - c.late.start + 2 * len(self.units.names))
        for t in self.late_grads:
            host[t] = 1
        units = len(self.units.names)
        base = c.late.stop - c.late.start
        for u in range(units):
            host[base + u] = int(self.unit_passed[u])
        if r == 0:  # [Note: launch order]: rank 0's view of this micro-step's units
            for u in self.unfirable:
                host[base + units + u] = _UNIT_CANNOT_FIRE
            for position, u in enumerate(self.pass_order):
                host[base + units + u] = position + 1
        vector[c.late.start:c.order.stop] = torch.tensor(host, dtype=_I64, device=self.comm.device)
        self.comm.what = "the reduction point's agreement (presence, weight, launch units)"
        try:
            self.comm.all_reduce(vector)
        finally:
            self.comm.what = ""
        values = vector.tolist()  # the one device-to-host read of a reduction point
        # freed here, on the training thread: gloo's work object, which still references the
        # vector, may otherwise drop the last reference on its worker thread ([Note: buffer pool])
        vector.untyped_storage().resize_(0)
        if values[c.nonfinite.start] > 0:  # agreed: every rank confirms, whatever it called
            # (a rank at end_microstep beside one at a reduction point adds nothing; every
            # rank then raises that they disagree: review finding)
            values[c.nonfinite.start] = self._confirm_nonfinite(
                host_nonfinite, mine=phase == _PHASE_REDUCE)
        return values

    def _nonfinite(self, shard: torch.Tensor, host_nonfinite: torch.Tensor | None
                   ) -> torch.Tensor:
        """This rank's non-finite flag from the shard's (``shard``), the late gradients' and
        the host's (a GradScaler's unscale)."""
        for grad in self.late_grads.values():  # reduced after the agreement: see _reduce_late
            shard = shard | holds_nonfinite(grad)
        if host_nonfinite is not None:
            shard = shard | (host_nonfinite.reshape(()) != 0)
        return shard

    def _confirm_nonfinite(self, host_nonfinite: torch.Tensor | None, *, mine: bool) -> int:
        """[Note: non-finite check] Some rank's sum test was positive: the exact check on
        every rank of the group (``mine``: this rank is at a reduction point and has a shard
        to check), agreed in the group; the number of ranks that hold an inf or NaN."""
        flag = torch.zeros(1, dtype=_I64, device=self.comm.device)
        if mine:
            flag += self._nonfinite(self.storage.nonfinite(), host_nonfinite).to(
                device=self.comm.device, dtype=_I64).reshape(1)
        self.comm.what = "the reduction point's non-finite check"
        try:
            self.comm.all_reduce(flag)
        finally:
            self.comm.what = ""
        return int(flag)

    def _after_agreement(self, values: list[int]) -> None:
        """What every rank does once a reduction point agreed without an error."""
        self._reduce_late(values)
        self._follow_launch_order(values)

    def _reduce_late(self, values: list[int]) -> list[int]:
        """[Note: late gradients]: one more reduction of each bucket that got gradients after
        its launch on any rank, in bucket order; those buckets launch at the end of backward
        from now on. Returns those buckets (agreed: the same on every rank)."""
        late = [t for t, n in enumerate(values[self.control.late]) if n]
        if not late:
            return []
        buckets = sorted({self.layout.entry_bucket[t] for t in late})
        for b in buckets:
            self.collectives.reduce_late(b, {t: self.late_grads.pop(t)
                                             for t in self.layout.buckets[b].entries
                                             if t in self.late_grads})
        assert not self.late_grads, "every late gradient is in an agreed bucket"
        new = [b for b in buckets if b not in self.deferred]
        self.deferred.update(buckets)
        if new and self.comm.rank == 0:
            names = [self.trainable[t].name for t in late]
            logger.warning(
                "selzero %r: %d selected parameter(s) got gradients after their bucket was "
                "launched (used outside their launch unit, in a reentrant activation "
                "checkpoint, or in a module applied twice), e.g. %s; they were reduced with one "
                "more collective per bucket, and bucket(s) %s launch at the end of backward from "
                "now on (their full FP32 gradients are held until then).",
                self.config.name, len(names), names[:3], new)
        return buckets

    def _check_late_sums(self, values: list[int], buckets: list[int]) -> None:
        """The agreement checked each rank's late gradients, not their sums: finite on every
        rank, they may overflow summed (review finding). At the reduction point every rank
        checks its share of the late ``buckets`` (agreed) and all agree; at end_microstep the
        reduction point's check of the whole shard covers them."""
        if not buckets:
            return
        shard = self.storage.grad_shard
        found = torch.zeros(1, dtype=_I64, device=self.comm.device)
        for b in buckets:
            for _, offset, numel in self.storage.runs[b]:
                found |= holds_nonfinite(shard[offset:offset + numel]).reshape(1).to(_I64)
        self.comm.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        if int(found) and not values[self.control.nonfinite.start]:
            values[self.control.nonfinite.start] = 1

    def _follow_launch_order(self, values: list[int]) -> None:
        """[Note: launch order]: the next micro-step launches buckets in the order group rank
        0's backward made them ready, keeping the places of buckets whose units did not run;
        buckets that cannot fire or got late gradients last. DDP rebuilds its buckets from
        rank 0's order the same way, once; this follows every reduction point."""
        if not self.launches_in_backward:
            return
        state = values[self.control.order]
        current = self.collectives.order
        units = self.bucket_units
        last = self.deferred | {b for b in current
                                if any(state[u] == _UNIT_CANNOT_FIRE for u in units[b])}
        ready = {b: max(state[u] for u in units[b]) for b in current
                 if b not in last and all(state[u] > 0 for u in units[b])}
        in_order = iter(sorted(ready, key=lambda b: (ready[b], b)))
        order = [next(in_order) if b in ready else b for b in current if b not in last] + \
            [b for b in current if b in last]
        if order == current:
            return
        self.collectives.set_order(order)
        if self.comm.rank == 0:
            log = logger.debug if self.order_logged else logger.warning
            self.order_logged = True
            log("selzero %r: buckets now launch in the order the backward reached them "
                "(launch units passed in another order than the buckets were planned in, or "
                "cannot fire): %s.", self.config.name, order[:16])

    def _disagreement(self, values: list[int]) -> Exception | None:
        """The error every rank raises for this reduction point, decided from the agreed
        values alone (so it is the same on every rank), or None."""
        c, me = self.control, f"[rank {self.comm.rank}/{self.comm.size}]"
        mode = self.config.reduction
        codes = values[c.signature]
        if any(code != codes[0] for code in codes):
            described = ", ".join(f"rank {r}: {_describe_code(code, mode)}"
                                  for r, code in enumerate(codes))
            return UsageError(
                f"{me} the ranks of selzero's group did not make the same reduction call "
                f"({described}). Every rank must call end_microstep()/reduce_gradients()/step() "
                f"together, with the arguments reduction={mode!r} takes.")
        if codes[0] // 16 == _ERR_SCALED:
            return UsageError(
                f"{me} the gradients were scaled by a torch.amp.GradScaler (scaler.scale(loss)) "
                "and reduced without the scaler's unscale: selzero would update the subset with "
                "gradients `scale` times too large and never report their inf/NaN to the "
                "scaler. Call scaler.step(optimizer) (or scaler.unscale_(optimizer)) for the host "
                "optimizer before sz.step(); selzero unscales its shards there and skips when "
                "the scaler skips. The window was dropped on every rank.")
        if codes[0] >= 16:
            return UsageError(
                f"{me} {_describe_code(codes[0], mode)}. The window was dropped on every rank.")
        dropped = values[c.dropped]
        if any(d != dropped[0] for d in dropped):
            return UsageError(
                f"{me} the ranks dropped different numbers of windows whose backward raised "
                f"(per group rank: {dropped}): when a backward fails, every rank must skip that "
                "batch, or none. Call sz.zero_grad() on every rank when skipping a batch (it "
                "also reconciles ranks whose backward failed before reaching selzero). The "
                "window was dropped on every rank.")
        second = [r for r, flag in enumerate(values[c.second_backward]) if flag]
        if second:
            return UsageError(
                f"{me} a second backward reached selzero's parameters before the previous "
                f"reduced micro-step was closed (seen on group rank(s) {second}). Call "
                "sz.end_microstep() between backward passes, or run the earlier micro-steps "
                "inside `with sz.no_sync():` (or your DDP model's no_sync()). The window was "
                "dropped on every rank.")
        unfrozen = [e.name for e, n in zip(self.frozen, values[c.unfrozen]) if n]
        if unfrozen:
            return UsageError(_unfrozen_text(me, unfrozen) + " The window was dropped on every "
                              "rank.")
        binding = values[c.binding]
        for kind, fix in _BINDING_TEXT.items():
            names = [self.trainable[t].name for t in range(len(self.trainable))
                     if binding[KINDS * t + kind]]
            if names:
                when = "" if kind == STRAY_GRAD else " after SelectedZero2 was built"
                return UsageError(
                    f"{me} {len(names)} selected parameter(s) {fix[0]}{when}: {names[:5]}. "
                    f"{fix[1]} The window was dropped on every rank.")
        opened = sum(values[c.opened])
        partial = [self.units.names[u] for u, n in enumerate(values[c.passed])
                   if 0 < n < opened] if self.launches_in_backward else []
        if partial:
            return UsageError(
                f"{me} launch unit(s) {partial[:3]} ran their backward on some of the {opened} "
                "rank(s) that ran one, not on all: a launch unit must run on every rank whatever "
                "the routing (selzero launches a bucket when the backward passes its unit). Set "
                "launch_modules to modules that do (the MoE block that holds the experts), or "
                "overlap=False. The window was dropped on every rank.")
        return None

    def _raise_agreed(self, error: Exception | None) -> None:
        if error is not None:
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        self.dropped = 0
        self._reset()
        raise error

    def _validate_args(self, phase: int, weight: Any, active: Any
                       ) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(argument kind, host error code, active 0/1, weight, device-side bad flag); tensors
        are checked on the device so that nothing is read here."""
        device = self.comm.device
        one = torch.ones((), dtype=_I64, device=device)
        zero = torch.zeros((), dtype=_I64, device=device)
        mode = self.config.reduction
        if mode == "sum":
            if weight is not None:
                return _ARG_WEIGHT, _ERR_ARG_NOT_ACCEPTED, one, zero, zero
            if active is None:
                return _ARG_ACTIVE, _ERR_NONE, one, zero, zero
            if isinstance(active, torch.Tensor) and active.numel() == 1:
                flag = active.detach().reshape(()).to(device=device).ne(0).to(_I64)
                return _ARG_ACTIVE, _ERR_NONE, flag, zero, zero
            if isinstance(active, (bool, numbers.Integral)) and active in (0, 1):
                return _ARG_ACTIVE, _ERR_NONE, one if active else zero, zero, zero
            return _ARG_ACTIVE, _ERR_BAD_VALUE, one, zero, zero
        if active is not None:
            return _ARG_ACTIVE, _ERR_ARG_NOT_ACCEPTED, one, zero, zero
        if mode == "mean" or phase == _PHASE_END_MICROSTEP:
            if weight is not None:
                return _ARG_WEIGHT, _ERR_ARG_NOT_ACCEPTED, one, zero, zero
            return _ARG_NONE, _ERR_NONE, one, zero, zero
        if weight is None:
            return _ARG_NONE, _ERR_WEIGHT_MISSING, one, zero, zero
        if isinstance(weight, torch.Tensor):
            if weight.numel() != 1 or weight.dtype == torch.bool or weight.is_complex():
                return _ARG_WEIGHT, _ERR_BAD_VALUE, one, zero, zero
            w = weight.detach().reshape(()).to(device=device)
            bad = w < 0
            if w.is_floating_point():
                bad = bad | (w != w.floor())
            return _ARG_WEIGHT, _ERR_NONE, one, w.to(_I64), bad.to(_I64)
        value = _as_int_weight(weight)
        if value is None:
            return _ARG_WEIGHT, _ERR_BAD_VALUE, one, zero, zero
        return _ARG_WEIGHT, _ERR_NONE, one, torch.tensor(value, dtype=_I64, device=device), zero

    # ---- the decision ----------------------------------------------------------------------

    def _decide_would_raise(self, values: list[int], skip_nonfinite: bool = False) -> bool:
        """Whether _decide raises for these values, given a positive global weight."""
        c = self.control
        expected = values[c.active.start] if self.config.reduction == "sum" else self.comm.size
        missing = any(0 < p < expected for p in values[c.presence])
        return (self.config.missing_grad == "error" and missing) or \
            (self.config.nonfinite == "error" and not skip_nonfinite and
             values[c.nonfinite.start] > 0)

    def _decide(self, global_weight: int, presence: list[int], nonfinite: int,
                expected: int, *, skip_nonfinite: bool = False) -> Decision:
        """Which virtual parameters update; raises the same error on every rank where asked."""
        v = len(presence)
        present = [p > 0 for p in presence]
        # missing_grad governs parameters present on some ranks only; one absent on every rank
        # (an expert no rank routed to) simply gets no update under every policy.
        missing = [0 < p < expected for p in presence]
        policy = self.config.missing_grad
        if policy == "error" and any(missing) and global_weight > 0:
            self._raise_missing(missing)
        update = [p and not m for p, m in zip(present, missing)] if policy == "skip" \
            else list(present)
        if global_weight == 0:
            update = [False] * v
        skipped_nonfinite = 0
        if nonfinite > 0 and global_weight > 0:
            if self.config.nonfinite == "error" and not skip_nonfinite:
                self._raise_nonfinite()
            skipped_nonfinite = sum(update)
            update = [False] * v
        updated = sum(update)
        return Decision(update, global_weight, updated, v - updated - skipped_nonfinite,
                        skipped_nonfinite, nonfinite > 0, tuple(presence))

    def _raise_missing(self, missing: list[bool]) -> None:
        mine = self.window_presence.to(torch.uint8)
        gathered = torch.zeros(mine.numel() * self.comm.size, dtype=torch.uint8,
                               device=self.comm.device)
        self.comm.all_gather(gathered, mine)
        rows = gathered.view(self.comm.size, -1).tolist()
        lines = []
        ids = [i for i, m in enumerate(missing) if m]
        for i in ids[:10]:
            ranks = [r for r in range(self.comm.size) if rows[r][i] == 0]
            lines.append(f"{self.virtual_name(i)} (no gradient on group rank(s) {ranks})")
        self._fail(MissingGradientError(
            f"[rank {self.comm.rank}/{self.comm.size}] missing_grad='error': {len(ids)} "
            f"selected parameter(s) got no gradient on some rank: {'; '.join(lines)}. Nothing was "
            "updated. Use missing_grad='zero' (absent ranks contribute zeros) or 'skip'."))

    def _raise_nonfinite(self) -> None:
        flags = torch.zeros(len(self.layout.virtuals), dtype=_I64, device=self.comm.device)
        for i in self.storage.nonfinite_virtuals():
            flags[i] = 1
        self.comm.all_reduce(flags)
        bad = [self.virtual_name(i) for i, f in enumerate(flags.tolist()) if f]
        self._fail(NonFiniteGradientError(
            f"[rank {self.comm.rank}/{self.comm.size}] non-finite (inf/NaN) reduced gradients "
            f"in {len(bad)} selected parameter(s): {bad[:10]}. Nothing was updated. Lower "
            "the learning rate or loss scale, or set nonfinite='skip' to skip such steps."))

    def virtual_name(self, i: int) -> str:
        spec = self.layout.virtuals[i]
        name = self.trainable[spec.entry].name
        return name if spec.expert is None else f"{name}[expert {spec.expert}]"

    def skip_update(self) -> None:
        """After a non-finite clipping coefficient under nonfinite='skip': update nothing."""
        d = self.decision
        assert d is not None
        d.skipped_nonfinite += d.updated
        d.updated = 0
        d.update = [False] * len(d.update)

    def finish_step(self) -> None:
        self._reset()
        self._unit_inputs.prune()  # the step's forwards whose outputs are gone

    def fail(self, error: Exception) -> None:
        """Forget the window and raise ``error`` (the caller made sure every rank does)."""
        self._fail(error)


# [Note: row presence from a sample]
# On the CPU a fused tensor's rows are first looked at through a sample: PRESENCE_BLOCKS blocks
# of PRESENCE_BLOCK elements spread over each row. A row whose sample holds anything but +-0
# is present, whatever the rest holds; only the rows whose sample is all +-0 (absent experts,
# or a gradient that happens to be zero there) are read whole, for their max and min. The
# result is the full rule's, exactly (tests/test_row_presence.py puts the only non-zero
# value outside the sample); the read is 1/32 of a row of 8,192: 0.035 against 0.27 ms on
# 256 x 8,192 (hot), about 1.5 ms of a 195 ms step on workload f at world 2 (in-process A/B).
PRESENCE_BLOCKS = 4
PRESENCE_BLOCK = 64


def _row_sample(rows: torch.Tensor) -> torch.Tensor:
    """(rows, blocks, block) view of the sampled elements of each row of ``rows`` (2-D); a
    short row whole."""
    n, length = rows.shape
    span = length // PRESENCE_BLOCKS
    if span < 4 * PRESENCE_BLOCK:
        return rows.unsqueeze(1)
    return rows[:, :PRESENCE_BLOCKS * span].reshape(n, PRESENCE_BLOCKS, span)[:, :, :PRESENCE_BLOCK]


def _accumulate_into(grads: dict[int, torch.Tensor], t: int, flat: torch.Tensor) -> None:
    """Add entry t's gradient into its full-size FP32 accumulator (1D), made at the first."""
    if t in grads:
        grads[t].add_(flat.view(-1))
    else:
        grads[t] = flat.to(_FP32, copy=True).view(-1)


def _unfrozen_text(me: str, names: list[str]) -> str:
    return (f"{me} {len(names)} selected parameter(s) were frozen (requires_grad=False) when "
            f"SelectedZero2 was built and now train: {names[:5]}. selzero gave them no gradient "
            "slot and no optimizer state, so their gradients would reach no one (a host "
            "optimizer over model.parameters() would step each rank's own, un-averaged "
            "gradient). To unfreeze selected parameters during training, build SelectedZero2 "
            "while they require grad, then freeze them with p.requires_grad_(False): a frozen "
            "selected parameter gets no gradient, so no update and no weight decay, and "
            "p.requires_grad_(True) later joins it to selzero's training. Or leave them out of "
            "`params`.")


def _as_int_weight(weight: Any) -> int | None:
    """A non-negative integer given as any integral or integer-valued real (numpy included)."""
    if isinstance(weight, bool):
        return None
    if isinstance(weight, numbers.Integral):
        weight = int(weight)
    elif isinstance(weight, numbers.Real) and float(weight).is_integer():
        weight = int(weight)
    else:
        return None
    return weight if weight >= 0 else None


_BINDING_TEXT = {
    REPLACED: ("are no longer the model's parameter objects (load_state_dict(assign=True), "
               "swap_tensors, a move that overwrites module parameters)",
               "selzero's hooks and state sit on the old tensors: build SelectedZero2 after "
               "replacing parameters (load in place, then sz.sync_from_params()), or call "
               "sz.remove_hooks() and build a new instance."),
    RECAST: ("changed dtype (model.to(dtype), .half(), .bfloat16())",
             "Cast the model before building SelectedZero2."),
    MOVED: ("have new storage (param.data = ..., a move to another device)",
            "Call sz.sync_from_params() after moving or loading the parameters."),
    EDITED: ("were changed in place (an in-place load into bf16/fp16 parameters)",
             "Their FP32 masters would overwrite the change at the next step: call "
             "sz.sync_from_params() after loading weights."),
    STRAY_GRAD: ("hold a .grad at the reduction point, though selzero's hook takes every selected "
                 "gradient and sets .grad to None: something else writes them, most likely a "
                 "DistributedDataParallel (or another data-parallel wrapper) built before "
                 "SelectedZero2",
                 "It all-reduces the subset's gradients a second time, and a host optimizer over "
                 "model.parameters() would step the subset twice. Build SelectedZero2 first and "
                 "wrap with selzero_plugin.wrap_ddp(model, sz) (or give the host the selected "
                 "names to ignore); do not set .grad of selected parameters."),
}


def _describe_code(code: int, mode: str) -> str:
    phase, arg, err = code % 4, (code // 4) % 4, code // 16
    call = {_PHASE_END_MICROSTEP: "end_microstep", _PHASE_REDUCE: "reduce_gradients"}.get(
        phase, "?")
    args = {_ARG_NONE: "", _ARG_WEIGHT: "weight=...", _ARG_ACTIVE: "active=..."}[arg]
    text = f"{call}({args})"
    return f"{text} [{_ERR_TEXT.get(err, 'an invalid argument')} under reduction={mode!r}]" \
        if err else text
