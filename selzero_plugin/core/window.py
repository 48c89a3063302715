"""The reduction window: hooks, launch points, WindowState, presence, agreement, reset.

[Note: the reduction schedule]
Ranks of an MoE do not receive the same gradients, so "launch a collective when its gradients
are ready" would issue collectives at different moments on different ranks. selzero's schedule
is the same on every rank whatever the routing:

- every reduced micro-step issues exactly one reduce-scatter per bucket, in bucket order;
- bucket b is launched when the backward has passed every launch unit of its parameters
  ([Note: launch units]), detected the FSDP2 way: the unit's forward inputs go through an
  identity autograd function whose backward runs once the unit's input gradients are computed.
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

[Note: a backward that raised]
An exception inside backward (an OOM on one batch) leaves the micro-step open: its
end-of-backward callback never runs. The next forward of the model (outside backward), the next
reduction point, or ``zero_grad()`` sees that and drops the window: when buckets launch during
backward, the rest of that micro-step's buckets are launched and finished first (every rank that
skipped the batch does the same, so the collective schedule stays whole), then every gradient,
shard value and presence record of the window is forgotten. The next reduction point checks
that every rank dropped the same number of windows.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..config import SelZeroConfig
from ..errors import MissingGradientError, NonFiniteGradientError, UsageError
from .collectives import BucketCollectives
from .comm import Communicator
from .layout import Layout
from .selection import SelectedEntry
from .storage import ShardStorage
from .units import Units

__all__ = ["WindowState", "Decision", "ReductionWindow"]

logger = logging.getLogger("selzero_plugin")

_FP32, _I64 = torch.float32, torch.int64
_PHASE_END_MICROSTEP, _PHASE_REDUCE = 1, 2
_ARG_NONE, _ARG_WEIGHT, _ARG_ACTIVE = 0, 1, 2
_ERR_NONE, _ERR_ARG_NOT_ACCEPTED, _ERR_WEIGHT_MISSING, _ERR_BAD_VALUE = 0, 1, 2, 3
_ERR_TEXT = {
    _ERR_ARG_NOT_ACCEPTED: "passed an argument its reduction mode does not take",
    _ERR_WEIGHT_MISSING: "called reduce_gradients/step without weight= under reduction='weighted'",
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


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _UnitPassed(torch.autograd.Function):
    """Identity over a unit's forward inputs; its backward runs once their gradients are done."""

    @staticmethod
    def forward(ctx: Any, window: "ReductionWindow", unit: int, *inputs: torch.Tensor) -> Any:
        ctx.window, ctx.unit = window, unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.window._on_unit_passed(ctx.unit)
        return (None, None, *grads)


class _Control:
    """Offsets in the control vector (int64) all-reduced at every reduction point. Its length
    does not depend on the phase, so ranks that make different calls still pair one all-reduce
    and then all raise."""

    def __init__(self, ranks: int, entries: int, units: int, virtuals: int) -> None:
        self.size = 0
        self.signature = self._take(ranks)  # one code per rank: phase, argument kind, error
        self.second_backward = self._take(ranks)
        self.dropped = self._take(ranks)
        self.opened = self._take(ranks)
        self.active = self._take(1)
        self.weight = self._take(1)
        self.nonfinite = self._take(1)
        self.late = self._take(entries)
        self.passed = self._take(units)
        self.presence = self._take(virtuals)

    def _take(self, n: int) -> slice:
        s = slice(self.size, self.size + n)
        self.size += n
        return s


class ReductionWindow:
    """Micro-steps, reduction points and the decision of one accumulation window."""

    def __init__(self, *, config: SelZeroConfig, comm: Communicator, layout: Layout,
                 storage: ShardStorage, collectives: BucketCollectives,
                 trainable: list[SelectedEntry], units: Units, model: nn.Module,
                 normalize_size: int,
                 normalize_weight: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.config = config
        self.comm = comm
        self.layout = layout
        self.storage = storage
        self.collectives = collectives
        self.trainable = trainable
        self.units = units
        self.model = model
        self.normalize_size = normalize_size  # size of the normalize_over rank set
        self.normalize_weight = normalize_weight  # sums a weight over it, when not the group
        self.launches_in_backward = config.overlap and config.reduction != "sum"
        self.bucket_units = [sorted({units.of_entry[t] for t in spec.entries})
                             for spec in layout.buckets]
        device = comm.device
        v = len(layout.virtuals)
        self.control = _Control(comm.size, len(trainable), len(units.names), v)
        self.micro_presence = torch.zeros(v, dtype=_I64, device=device)
        self.window_presence = torch.zeros(v, dtype=_I64, device=device)
        self.window_active = torch.zeros((), dtype=_I64, device=device)
        self.local: dict[int, torch.Tensor] = {}  # no_sync accumulation, full size FP32 (1D)
        self.sync = True
        self.logged_first_backward = False
        self.dropped = 0  # windows dropped because their backward raised (since last agreement)
        self.decision: Decision | None = None
        self._hooks: list[Any] = []
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
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not idx:
                self.unfirable.add(u)
                return None
            # A forward during backward is an activation-checkpoint recompute: it may fire (a
            # reentrant checkpoint's inner backward) or never (a non-reentrant one), so it is
            # not waited for.
            if not _in_backward():
                self.unit_expected[u] += 1
            outs = _UnitPassed.apply(self, u, *[flat[i] for i in idx])
            for i, x in zip(idx, outs):
                flat[i] = x
            return tree_unflatten(flat, spec)
        return hook

    def _on_model_forward_start(self, module: nn.Module, args: Any) -> None:
        if not _in_backward():
            self._drop_if_backward_died()

    def _on_model_forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, self._on_pre_backward,
                                                          mode="any")

    def _on_pre_backward(self, grad: torch.Tensor) -> None:
        self._enter_backward()

    # ---- backward --------------------------------------------------------------------------

    def _enter_backward(self) -> bool:
        """A backward reached selzero (model outputs, a hook, a unit). False: a second backward
        into an unclosed reduced micro-step, whose gradients are not taken."""
        if self.state is WindowState.REDUCED:
            raise UsageError(
                f"[rank {self.comm.rank}/{self.comm.size}] a backward reached selzero's "
                "parameters after reduce_gradients() and before step(); call sz.step() first.")
        if not self.sync:
            if self.state is not WindowState.IDLE:
                raise UsageError(
                    f"[rank {self.comm.rank}/{self.comm.size}] a no_sync() backward followed a "
                    "reduced backward whose micro-step was not closed; call sz.end_microstep() "
                    "first, or run the earlier micro-steps inside no_sync() too.")
            self._queue_callback()
            self.local_open = True
            return True
        if self.state is WindowState.AWAITING_CLOSE:
            self._queue_callback()
            self.second_backward = True
            return False
        self._queue_callback()
        if self.state is WindowState.IDLE:
            self.state = WindowState.OPEN
            self.opened = True
        return True

    def _queue_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _on_grad(self, t: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise UsageError(f"parameter {self.trainable[t].name!r} got a sparse gradient; selzero "
                             "reduces dense gradients. Use a dense embedding (sparse=False) or leave "
                             "this parameter out of `params`.")
        if not self._enter_backward():
            return
        self._record_presence(t, grad)
        flat = grad.detach().reshape(-1)
        if not self.sync:
            if t in self.local:
                self.local[t].add_(flat)
            else:
                self.local[t] = flat.to(_FP32, copy=True)
            return
        if self.collectives.launched(self.layout.entry_bucket[t]):
            self.late.add(t)  # reported, agreed, at the reduction point
            return
        self.collectives.fill(t, flat)
        local = self.local.pop(t, None)
        if local is not None:
            self.collectives.fill(t, local)

    def _record_presence(self, t: int, grad: torch.Tensor) -> None:
        ids = self.layout.entry_virtuals[t]
        if len(ids) == 1:
            self.micro_presence[ids[0]] = 1
        else:
            rows = grad.detach().reshape(len(ids), -1).ne(0).any(dim=1)
            self.micro_presence[ids[0]:ids[-1] + 1] |= rows.to(_I64)

    def _on_unit_passed(self, u: int) -> None:
        if not self._enter_backward():
            return
        self.unit_fired[u] += 1
        if not self.sync or self.unit_passed[u] or self.unit_fired[u] < self.unit_expected[u]:
            return
        self.unit_passed[u] = True
        if self.launches_in_backward:
            self._launch_ready()

    def _launch_ready(self) -> None:
        c = self.collectives
        while c.next_launch < len(self.layout.buckets) and \
                all(self.unit_passed[u] for u in self.bucket_units[c.next_launch]):
            self._launch_one(None)

    def _launch_one(self, zero_if: torch.Tensor | None) -> None:
        b = self.collectives.next_launch
        for t in self.layout.buckets[b].entries:
            local = self.local.pop(t, None)
            if local is not None:
                self.collectives.fill(t, local)
        self.collectives.launch_next(zero_if)

    def _backward_done(self) -> None:
        """End of the graph task the first hook of this backward ran in."""
        self.callback_queued = False
        self.local_open = False
        if self.state is WindowState.OPEN:
            self.state = WindowState.AWAITING_CLOSE
            if self.launches_in_backward:
                first = self.collectives.next_launch
                while self.collectives.next_launch < len(self.layout.buckets):
                    self._launch_one(None)
                self.collectives.finish_all()
                self._log_first_backward(first)
        self.unit_expected = [0] * len(self.units.names)
        self.unit_fired = [0] * len(self.units.names)

    def _log_first_backward(self, first: int) -> None:
        if self.logged_first_backward:
            return
        self.logged_first_backward = True
        late = [b for b in range(first, len(self.layout.buckets))
                if not all(self.unit_passed[u] for u in self.bucket_units[b])]
        units = sorted({self.units.names[u] for b in late for u in self.bucket_units[b]
                        if not self.unit_passed[u]})
        if late and self.comm.rank == 0:
            logger.warning(
                "selzero %r: %d of %d bucket(s) launch at the end of backward, their full FP32 "
                "gradients held until then: launch unit(s) %s did not fire (inputs that need no "
                "gradient?); set launch_modules to modules whose inputs need one.",
                self.config.name, len(late), len(self.layout.buckets), units[:5])

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

    def _drop_if_backward_died(self) -> bool:
        """Outside backward: drop the window if the backward that opened a micro-step raised."""
        self.callback_queued = False  # no callback can be pending outside a backward
        if self.state is not WindowState.OPEN and not self.local_open:
            return False
        if self.state is WindowState.OPEN and self.launches_in_backward:
            self.collectives.launch_rest()  # the other ranks launch the rest of this micro-step
            self.collectives.finish_all()
        self.dropped += 1
        self._reset()
        return True

    def zero_grad(self) -> None:
        """Forget the window (every rank calls it): gradients, presence, reduced shard."""
        if _in_backward():
            raise UsageError(f"[rank {self.comm.rank}/{self.comm.size}] sz.zero_grad() was called "
                             "inside backward; call it between steps.")
        if not self._drop_if_backward_died():
            self.collectives.finish_all()
            self._reset()

    def _reset(self) -> None:
        """Forget the window: after step(), a raised agreement, zero_grad() or a died backward."""
        assert not self.collectives.pending, "launched reductions are finished before a reset"
        self.collectives.discard()
        self.storage.stale = True
        for seg in self.storage.segments:
            seg.grad = None
        self.micro_presence.zero_()
        self.window_presence.zero_()
        self.window_active.zero_()
        self.local.clear()
        self.state = WindowState.IDLE
        self.local_open = False
        self.callback_queued = False
        self._reset_microstep()
        self.decision = None

    def _reset_microstep(self) -> None:
        self.opened = False
        self.second_backward = False
        self.late: set[int] = set()
        self.unfirable: set[int] = set()
        self.unit_expected = [0] * len(self.units.names)
        self.unit_fired = [0] * len(self.units.names)
        self.unit_passed = [False] * len(self.units.names)

    # ---- reduction points ------------------------------------------------------------------

    def end_microstep(self, active: Any) -> None:
        self._close(_PHASE_END_MICROSTEP, None, active)

    def reduce(self, weight: Any, active: Any) -> Decision:
        values, local_weight = self._close(_PHASE_REDUCE, weight, active)
        c = self.control
        mode = self.config.reduction
        if mode == "mean":
            global_weight = self.normalize_size
        elif mode == "weighted":
            global_weight = values[c.weight.start] if self.normalize_weight is None else \
                int(self.normalize_weight(local_weight).item())
        else:
            global_weight = values[c.active.start]
        expected = values[c.active.start] if mode == "sum" else self.comm.size
        decision = self._decide(global_weight, values[c.presence], values[c.nonfinite.start],
                                expected)
        if global_weight > 0 and mode != "sum":
            self.storage.grad_shard.div_(global_weight)
        self.decision = decision
        self.state = WindowState.REDUCED
        return decision

    def _close(self, phase: int, weight: Any, active: Any) -> tuple[list[int], torch.Tensor]:
        """Flush the micro-step, all-reduce the control vector, raise agreed errors."""
        me = f"[rank {self.comm.rank}/{self.comm.size}]"
        if self.state is WindowState.REDUCED:
            raise UsageError(f"{me} gradients were already reduced for this step; call sz.step() "
                             "(or drop the extra reduce_gradients()).")
        if _in_backward():
            raise UsageError(f"{me} a reduction point was called from inside backward; call it "
                             "after loss.backward() returns.")
        self._drop_if_backward_died()
        arg_kind, error, active_t, weight_t, bad_t = self._validate_args(phase, weight, active)
        inactive = None if self.config.reduction != "sum" else active_t == 0
        while self.collectives.next_launch < len(self.layout.buckets):
            self._launch_one(inactive)
        self.collectives.finish_all()
        assert not self.local, "every local gradient joins a bucket at its launch"
        self.collectives.end_microstep()
        self.window_presence |= self.micro_presence * active_t
        self.window_active |= active_t
        self.micro_presence.zero_()
        values = self._agree(phase, arg_kind, error, bad_t, weight_t)
        self._raise_disagreements(values)
        self.dropped = 0
        self._reset_microstep()
        self.state = WindowState.IDLE
        return values, weight_t

    def _agree(self, phase: int, arg_kind: int, error: int, bad: torch.Tensor,
               weight: torch.Tensor) -> list[int]:
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
        if phase == _PHASE_REDUCE:
            vector[c.nonfinite] = self.storage.nonfinite().to(_I64)
            vector[c.presence] = self.window_presence
        for t in self.late:
            vector[c.late.start + t] = 1
        vector[c.passed] = torch.tensor(self.unit_passed, dtype=_I64, device=self.comm.device)
        self.comm.all_reduce(vector)
        return vector.tolist()  # the one device-to-host read of a reduction point

    def _raise_disagreements(self, values: list[int]) -> None:
        c, me = self.control, f"[rank {self.comm.rank}/{self.comm.size}]"
        codes = values[c.signature]
        if any(code != codes[0] for code in codes) or codes[0] >= 16:
            described = ", ".join(f"rank {r}: {_describe_code(code, self.config.reduction)}"
                                  for r, code in enumerate(codes))
            self._fail(UsageError(
                f"{me} the ranks of selzero's group did not make the same reduction call "
                f"({described}). Every rank must call end_microstep()/reduce_gradients()/step() "
                f"together, with the arguments reduction={self.config.reduction!r} takes."))
        dropped = values[c.dropped]
        if any(d != dropped[0] for d in dropped):
            self._fail(UsageError(
                f"{me} the ranks dropped different numbers of windows whose backward raised "
                f"(per group rank: {dropped}): when a backward fails, every rank must skip that "
                "batch (catch the error, zero the gradients, go on) or none. The window was "
                "dropped on every rank."))
        second = [r for r, flag in enumerate(values[c.second_backward]) if flag]
        if second:
            self._fail(UsageError(
                f"{me} a second backward reached selzero's parameters before the previous "
                f"reduced micro-step was closed (seen on group rank(s) {second}). Call "
                "sz.end_microstep() between backward passes, or run the earlier micro-steps "
                "inside `with sz.no_sync():` (or your DDP model's no_sync()). The window was "
                "dropped on every rank."))
        late = [self.trainable[t].name for t, flag in enumerate(values[c.late]) if flag]
        if late:
            units = sorted({self.units.names[self.units.of_entry[t]]
                            for t, flag in enumerate(values[c.late]) if flag})
            self._fail(UsageError(
                f"{me} {len(late)} selected parameter(s) got a gradient after their bucket was "
                f"launched at the post-backward of its launch unit(s) {units[:3]}: "
                f"{late[:5]}. A parameter used outside its unit (or a unit called again inside "
                "a checkpoint) needs a unit that contains every use: set launch_modules to such "
                "a module, or overlap=False. The window was dropped on every rank."))
        opened = sum(values[c.opened])
        partial = [self.units.names[u] for u, n in enumerate(values[c.passed])
                   if 0 < n < opened] if self.launches_in_backward else []
        if partial:
            self._fail(UsageError(
                f"{me} launch unit(s) {partial[:3]} ran their backward on some of the {opened} "
                "rank(s) that ran one, not on all: a launch unit must run on every rank whatever "
                "the routing (selzero launches a bucket when the backward passes its unit). Set "
                "launch_modules to modules that do (the MoE block that holds the experts), or "
                "overlap=False. The window was dropped on every rank."))

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
            if isinstance(active, bool):
                return _ARG_ACTIVE, _ERR_NONE, one if active else zero, zero, zero
            if isinstance(active, torch.Tensor) and active.numel() == 1:
                flag = active.detach().reshape(()).to(device=device).ne(0).to(_I64)
                return _ARG_ACTIVE, _ERR_NONE, flag, zero, zero
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

    def _decide(self, global_weight: int, presence: list[int], nonfinite: int,
                expected: int) -> Decision:
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
            if self.config.nonfinite == "error":
                self._raise_nonfinite()
            skipped_nonfinite = sum(update)
            update = [False] * v
        updated = sum(update)
        return Decision(update, global_weight, updated, v - updated - skipped_nonfinite,
                        skipped_nonfinite)

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

    def fail(self, error: Exception) -> None:
        """Forget the window and raise ``error`` (the caller made sure every rank does)."""
        self._fail(error)


def _as_int_weight(weight: Any) -> int | None:
    if isinstance(weight, float) and weight.is_integer():
        weight = int(weight)
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
        return None
    return weight


def _describe_code(code: int, mode: str) -> str:
    phase, arg, err = code % 4, (code // 4) % 4, code // 16
    call = {_PHASE_END_MICROSTEP: "end_microstep", _PHASE_REDUCE: "reduce_gradients"}.get(
        phase, "?")
    args = {_ARG_NONE: "", _ARG_WEIGHT: "weight=...", _ARG_ACTIVE: "active=..."}[arg]
    text = f"{call}({args})"
    return f"{text} [{_ERR_TEXT.get(err, 'an invalid argument')} under reduction={mode!r}]" \
        if err else text
