"""SelectedZero2: ZeRO-2 for a selected parameter subset inside a process group.

[Note: the reduction schedule]
Ranks of an MoE do not receive the same gradients, so "launch a collective when a gradient is
ready" would issue collectives in different orders on different ranks. selzero's schedule is
the same on every rank whatever the routing:
- every reduction point (``end_microstep()`` / ``reduce_gradients()``) issues exactly one
  reduce-scatter per bucket, in bucket order; a bucket is launched during backward once it and
  every lower-numbered bucket are complete, and whatever is left is launched, zero-filled where
  no gradient arrived, at the reduction point;
- then one small all-reduce of a per-rank signature (phase and argument kind), so ranks that
  disagree on the phase or its arguments all raise instead of pairing wrong collectives;
- ``reduce_gradients()`` adds one all-reduce of [weight, presence, non-finite] counts.
Under ``reduction="sum"`` the ``active`` flag of a reduction point decides whether the rank's
gradients count, so buckets wait for the reduction point instead of launching during backward.

[Note: presence]
Each rank records which (virtual) parameters received a gradient in the window; the group sums
the records. A parameter absent on every rank keeps ``grad=None`` on its segment, so torch's
optimizer skips it: no update, no weight decay, no step count.
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import weakref
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .comm import Communicator, group_ranks
from .config import SelZeroConfig
from .contract import Field, agree_on_local_errors, check_contract
from .errors import (ConfigError, MissingGradientError, NonFiniteGradientError, SelectionError,
                     SelZeroError, UsageError)
from .layout import EntrySpec, ShardSlot, plan_layout
from .optim import (GroupPlan, build_optimizer, check_elementwise, check_hyperparameters,
                    jsonable, plan_groups,
                    plan_groups_from_host, qualified_name, refresh_from_host,
                    resolve_optimizer_class)
from .report import MemoryReport, StepResult
from .rowcopy import copy_in, copy_out
from .selection import SelectedEntry, resolve_selection

__all__ = ["SelectedZero2", "WindowState"]

_FP32 = torch.float32
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


class _Bucket:
    """Runtime state of one bucket during a micro-step."""

    __slots__ = ("spec", "buffer", "filled", "runs")

    def __init__(self, spec: Any, runs: list[tuple[int, int, int]]) -> None:
        self.spec = spec
        self.buffer: torch.Tensor | None = None  # (N * row_numel,) FP32, rank-major
        self.filled: set[int] = set()  # trainable entries copied in this micro-step
        self.runs = runs  # (row_offset, shard_offset, numel) contiguous real runs of this rank


class SelectedZero2:
    """ZeRO-2 (sharded FP32 gradients and elementwise optimizer state) for selected parameters.

    Every other parameter stays with its host strategy. See DESIGN.md section 1.
    """

    def __init__(self, model: nn.Module, config: SelZeroConfig, optimizer: Any = torch.optim.AdamW,
                 optimizer_kwargs: dict[str, Any] | None = None, *,
                 group: dist.ProcessGroup | None = None) -> None:
        if isinstance(config, Mapping):
            config = SelZeroConfig.from_dict(config)
        if not isinstance(config, SelZeroConfig):
            raise ConfigError(f"config: expected a SelZeroConfig or a dict of its fields, got "
                              f"{type(config).__name__}; e.g. SelZeroConfig(params=['*.experts.*']).")
        self.config = config
        self.model = model
        device = _model_device(model)
        # The communicator comes first, so that a rank whose local checks fail can tell the
        # others (agree_on_local_errors) instead of leaving them waiting in a collective.
        if dist.is_available() and dist.is_initialized():
            self.comm = Communicator.create(group_ranks(group), timeout_s=config.timeout_s,
                                            device=device)
            world = dist.get_world_size()
            # A proper subgroup holds parameters no other group holds (expert parallelism):
            # the global norm and normalize_over="world" sum over all ranks.
            self.world_comm = (
                self.comm if self.comm.size == world
                else Communicator.create(list(range(world)), timeout_s=config.timeout_s,
                                         device=device))
        elif group is not None:
            raise UsageError("SelectedZero2(group=...) needs torch.distributed to be initialized; "
                             "call dist.init_process_group(...) first.")
        else:  # one process without torch.distributed: a group of one, no collectives
            self.comm = self.world_comm = Communicator.single(device)
        error: SelZeroError | None = None
        try:
            opt_cls, defaults, plans = self._build_local(optimizer, optimizer_kwargs or {})
        except SelZeroError as e:
            error = e
        agree_on_local_errors(self.comm, error, what="SelectedZero2 construction")
        self._opt_cls, self._plans = opt_cls, plans

        check_contract(self.comm, self._contract_fields(opt_cls, plans), what="SelectedZero2 contract")
        if config.broadcast:
            for e in self.entries:
                self._broadcast_param(e.param)

        self._build_shard(plans, opt_cls, defaults)
        self.state = WindowState.IDLE
        self._sync = True
        self._local: dict[int, torch.Tensor] = {}  # no_sync accumulation, full size FP32
        self._micro_presence = torch.zeros(len(self.layout.virtuals), dtype=torch.int64,
                                           device=self.comm.device)
        self._window_presence = torch.zeros_like(self._micro_presence)
        self._active_any = False
        self._shard_stale = True  # grad_shard holds a previous window's values
        self._next_launch = 0
        self._pending: list[tuple[_Bucket, Any, torch.Tensor, torch.Tensor]] = []
        self._reduced: dict[str, Any] | None = None
        self._hooks = [e.param.register_post_accumulate_grad_hook(self._make_hook(t))
                       for t, e in enumerate(self.trainable)]
        for e in self.entries:
            e.param._selzero_owner = weakref.ref(self)

    # ---- construction helpers -------------------------------------------------------------

    def _build_local(self, optimizer: Any, kwargs: dict[str, Any]
                     ) -> tuple[type, dict[str, Any], list[GroupPlan]]:
        """Selection, layout and optimizer plan: local work that may fail on one rank only."""
        config = self.config
        entries = resolve_selection(self.model, params=list(config.params),
                                    modules=list(config.modules), expert_dim=config.expert_dim)
        for e in entries:
            owner = getattr(e.param, "_selzero_owner", None)
            if owner is not None and owner() is not None and owner()._hooks:
                raise UsageError(
                    f"parameter {e.name!r} already belongs to another SelectedZero2 (name "
                    f"{owner().config.name!r}), whose hooks would take its gradients. Call "
                    "old.remove_hooks() before building a new instance on the same parameters.")
        self.entries = entries
        self._dtypes = {e.name: e.param.dtype for e in entries}
        self.trainable = [e for e in entries if not e.frozen]
        for e in self.trainable:
            if e.param.numel() == 0 or not e.param.is_contiguous():
                raise SelectionError(f"parameter {e.name!r} (shape {tuple(e.param.shape)}) must be a "
                                     "non-empty contiguous tensor; call .contiguous() on it or leave "
                                     "it out of `params`.")
        self.layout = plan_layout(
            [EntrySpec(e.param.numel(), str(e.param.dtype), e.num_experts or 1)
             for e in self.trainable],
            self.comm.size, int(config.bucket_mb * 2 ** 20))
        self.host_optimizer, opt_cls, defaults, plans = self._resolve_optimizer(optimizer, kwargs)
        return opt_cls, defaults, plans

    def _resolve_optimizer(self, optimizer: Any, kwargs: dict[str, Any]
                           ) -> tuple[torch.optim.Optimizer | None, type, dict[str, Any],
                                      list[GroupPlan]]:
        if isinstance(optimizer, torch.optim.Optimizer):
            if kwargs or self.config.param_groups:
                raise UsageError("optimizer is an instance: its groups give the hyperparameters, so "
                                 "optimizer_kwargs and config.param_groups must be empty.")
            cls = type(optimizer)
            check_elementwise(cls, list(self.config.extra_elementwise_optimizers))
            return optimizer, cls, dict(optimizer.defaults), plan_groups_from_host(
                self.trainable, optimizer)
        cls = resolve_optimizer_class(optimizer)
        check_elementwise(cls, list(self.config.extra_elementwise_optimizers))
        check_hyperparameters(cls, list(kwargs), where="optimizer_kwargs")
        for i, group in enumerate(self.config.param_groups):
            check_hyperparameters(cls, [k for k in group if k != "params"],
                                  where=f"config.param_groups[{i}]")
        return None, cls, dict(kwargs), plan_groups(self.trainable, dict(kwargs),
                                                    list(self.config.param_groups))

    def _contract_fields(self, opt_cls: type, plans: list[GroupPlan]) -> list[Field]:
        fields: list[Field] = [(f"config.{k}", v) for k, v in self.config.to_dict().items()]
        fields.append(("group.size", self.comm.size))
        fields.append(("selected.count", len(self.entries)))
        for i, e in enumerate(self.entries):
            fields.append((f"selected[{i}]", {
                "name": e.name, "aliases": list(e.aliases), "shape": list(e.param.shape),
                "dtype": str(e.param.dtype), "frozen": e.frozen, "experts": e.num_experts}))
        fields.append(("optimizer.class", qualified_name(opt_cls)))
        for g, plan in enumerate(plans):
            fields.append((f"optimizer.groups[{g}]", {
                "hyperparameters": jsonable(plan.hyper), "members": plan.members}))
        return fields

    def _broadcast_param(self, p: torch.Tensor) -> None:
        with torch.no_grad():
            self.comm.broadcast(p.data, src=0)

    def _build_shard(self, plans: list[GroupPlan], opt_cls: type, defaults: dict[str, Any]) -> None:
        """Segments (this rank's real chunks), FP32 masters, the gradient shard, the optimizer."""
        rank = self.comm.rank
        self.slots: tuple[ShardSlot, ...] = self.layout.shard_slots(rank)
        device = self.comm.device
        self.grad_shard = torch.zeros(sum(s.numel for s in self.slots), dtype=_FP32, device=device)
        master_numel = sum(s.numel for s in self.slots if self._needs_master(s))
        self.master_flat = torch.zeros(master_numel, dtype=_FP32, device=device)
        self.segments: list[nn.Parameter] = []
        self._master_offset: list[int | None] = []
        m = 0
        for s in self.slots:
            if self._needs_master(s):
                self._master_offset.append(m)
                m += s.numel
            else:
                self._master_offset.append(None)
            self.segments.append(nn.Parameter(self._segment_data(len(self.segments))))
        self._load_masters()
        group_of_entry = {t: g for g, plan in enumerate(plans) for t in plan.members}
        per_group: list[list[nn.Parameter]] = [[] for _ in plans]
        for s, seg in zip(self.slots, self.segments):
            per_group[group_of_entry[self.layout.virtuals[s.virtual].entry]].append(seg)
        self.optimizer = build_optimizer(opt_cls, plans, per_group, defaults)
        self._slots_of_bucket: list[list[int]] = [[] for _ in self.layout.buckets]
        for i, s in enumerate(self.slots):
            self._slots_of_bucket[s.bucket].append(i)
        self.buckets = [_Bucket(spec, _runs([self.slots[i] for i in self._slots_of_bucket[b]]))
                        for b, spec in enumerate(self.layout.buckets)]

    def _needs_master(self, slot: ShardSlot) -> bool:
        return self._entry_of(slot).param.dtype != _FP32

    def _entry_of(self, slot: ShardSlot) -> SelectedEntry:
        return self.trainable[self.layout.virtuals[slot.virtual].entry]

    def _param_chunk(self, i: int) -> torch.Tensor:
        """This rank's real chunk of slot i, as a view of the parameter's flat storage."""
        s = self.slots[i]
        start = self.layout.virtuals[s.virtual].chunk_start(self.comm.rank)
        return self._entry_of(s).param.data.view(-1)[start:start + s.numel]

    def _segment_data(self, i: int) -> torch.Tensor:
        offset = self._master_offset[i]
        if offset is None:
            return self._param_chunk(i)
        return self.master_flat[offset:offset + self.slots[i].numel]

    def _load_masters(self) -> None:
        with torch.no_grad():
            for i, seg in enumerate(self.segments):
                if self._master_offset[i] is not None:
                    seg.data.copy_(self._param_chunk(i))

    # ---- public attributes ----------------------------------------------------------------

    @property
    def selected_names(self) -> list[str]:
        """Canonical names of the selected parameters (frozen included, aliases not)."""
        return [e.name for e in self.entries]

    @property
    def trainable_names(self) -> list[str]:
        return [e.name for e in self.trainable]

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    @property
    def state_parameter_count(self) -> int:
        """Segments (selected virtual parameters) with a non-empty chunk on this rank."""
        return len(self.segments)

    # ---- backward: hooks ------------------------------------------------------------------

    def _make_hook(self, t: int):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            param.grad = None
            if grad is not None:
                self._on_grad(t, grad)
        return hook

    def _on_grad(self, t: int, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise UsageError(f"parameter {self.trainable[t].name!r} got a sparse gradient; selzero "
                             "reduces dense gradients. Use a dense embedding (sparse=False) or leave "
                             "this parameter out of `params`.")
        # A bucket that was already reduce-scattered in this micro-step cannot take more.
        launched = self.layout.entry_bucket[t] < self._next_launch
        if not self._sync:
            if self.state is WindowState.REDUCED:
                raise self._backward_after_reduce()
            if launched:
                raise self._second_backward()
            self._record_presence(t, grad)
            flat = grad.detach().reshape(-1)
            if t in self._local:
                self._local[t].add_(flat)
            else:
                self._local[t] = flat.to(_FP32, copy=True)
            return
        self._open_microstep()
        if launched:
            raise self._second_backward()
        self._record_presence(t, grad)
        bucket = self.buckets[self.layout.entry_bucket[t]]
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(self.comm.size * bucket.spec.row_numel, dtype=_FP32,
                                        device=self.comm.device)
        # A gradient arriving twice before its bucket is launched (a parameter used inside and
        # outside a reentrant checkpoint) simply accumulates.
        self._copy_entry_in(bucket, t, grad.detach().reshape(-1), accumulate=t in bucket.filled)
        local = self._local.pop(t, None)
        if local is not None:
            self._copy_entry_in(bucket, t, local, accumulate=True)
        bucket.filled.add(t)
        if self.config.reduction != "sum":
            self._launch_ready()

    def _open_microstep(self) -> None:
        """Mark the reduced micro-step open until the end of the current backward.

        The callback runs at the end of the graph task that is current; under reentrant
        activation checkpointing that can be an inner backward, so a later gradient of the
        outer backward simply reopens (a real second backward is caught by ``_on_grad``).
        """
        if self.state is WindowState.OPEN:
            return
        if self.state is WindowState.REDUCED:
            raise self._backward_after_reduce()
        self.state = WindowState.OPEN
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _second_backward(self) -> UsageError:
        return UsageError(
            f"[rank {self.rank}/{self.world_size}] a second backward reached selzero's parameters "
            "before the previous reduced micro-step was closed (their bucket was already "
            "reduced). Call sz.end_microstep() between backward passes, or run the earlier "
            "micro-steps inside `with sz.no_sync():` (or your DDP model's no_sync()).")

    def _backward_after_reduce(self) -> UsageError:
        return UsageError(
            f"[rank {self.rank}/{self.world_size}] a backward reached selzero's parameters after "
            "reduce_gradients() and before step(); call sz.step() first.")

    def _backward_done(self) -> None:
        if self.state is WindowState.OPEN:
            self.state = WindowState.AWAITING_CLOSE

    def _record_presence(self, t: int, grad: torch.Tensor) -> None:
        ids = self.layout.entry_virtuals[t]
        if len(ids) == 1:
            self._micro_presence[ids[0]] = 1
        else:
            rows = grad.detach().reshape(len(ids), -1).ne(0).any(dim=1)
            self._micro_presence[ids[0]:ids[-1] + 1] |= rows.to(torch.int64)

    def _copy_entry_in(self, bucket: _Bucket, t: int, flat: torch.Tensor, *,
                       accumulate: bool = False) -> None:
        ids = self.layout.entry_virtuals[t]
        first = self.layout.virtuals[ids[0]]
        copy_in(bucket.buffer.view(self.comm.size, bucket.spec.row_numel), flat,
                row_offset=self.layout.entry_row_offset[t], experts=len(ids), per=first.numel,
                chunk=first.chunk_numel, accumulate=accumulate)

    # ---- reduction points -----------------------------------------------------------------

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.filled) < len(bucket.spec.entries):
                return
            self._launch(bucket, active=True)

    def _launch(self, bucket: _Bucket, *, active: bool) -> None:
        """Reduce-scatter one bucket (zero-filled where nothing arrived, zeros if inactive)."""
        n, rows = self.comm.size, bucket.spec.row_numel
        buffer = bucket.buffer
        if buffer is None:
            buffer = torch.zeros(n * rows, dtype=_FP32, device=self.comm.device)
            bucket.buffer = buffer
        for t in bucket.spec.entries:
            local = self._local.pop(t, None)
            if local is not None:
                self._copy_entry_in(bucket, t, local, accumulate=True)
        if not active:
            buffer.zero_()
        output = torch.empty(rows, dtype=_FP32, device=self.comm.device)
        work = self.comm.reduce_scatter(output, buffer, async_op=True)
        self._pending.append((bucket, work, output, buffer))
        bucket.buffer = None
        bucket.filled = set()
        self._next_launch += 1
        # Free the buffers of reductions that already completed. Never block here: a rank
        # waiting inside backward for a bucket that another rank launches only at its reduction
        # point would deadlock against the host's own collectives in backward (DDP).
        waiting = []
        for item in self._pending:
            if item[1].is_completed():
                self._finish_one(*item)
            else:
                waiting.append(item)
        self._pending = waiting

    def _finish_one(self, bucket: _Bucket, work: Any, output: torch.Tensor, _buffer: Any) -> None:
        """Wait for one reduce-scatter and add this rank's real chunks into the shard."""
        if self._shard_stale:
            self.grad_shard.zero_()
            self._shard_stale = False
        work.wait()
        for row_offset, shard_offset, numel in bucket.runs:
            self.grad_shard[shard_offset:shard_offset + numel].add_(
                output[row_offset:row_offset + numel])

    def _finish_pending(self) -> None:
        for item in self._pending:
            self._finish_one(*item)
        self._pending = []

    def _close(self, phase: int, *, weight: Any, active: Any) -> tuple[bool, int]:
        """Flush every bucket, agree on the phase and arguments. Returns (active, weight)."""
        if self.state is WindowState.REDUCED:
            raise UsageError(f"[rank {self.rank}/{self.world_size}] gradients were already reduced "
                             "for this step; call sz.step() (or drop the extra reduce_gradients()).")
        if self.state is WindowState.OPEN:
            raise UsageError(f"[rank {self.rank}/{self.world_size}] a reduction point was called "
                             "from inside backward; call it after loss.backward() returns.")
        arg_kind, error, is_active, local_weight = self._validate_args(phase, weight, active)
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket, active=is_active)
        self._finish_pending()
        assert not self._local, "every local gradient joins a bucket at its launch"
        self._next_launch = 0
        self._agree_on_signature(phase, arg_kind, error)
        if is_active:
            self._window_presence |= self._micro_presence
            self._active_any = True
        self._micro_presence.zero_()
        self.state = WindowState.IDLE
        return is_active, local_weight

    def _validate_args(self, phase: int, weight: Any, active: Any) -> tuple[int, int, bool, int]:
        """(argument kind, local error code, active, local weight); errors raise after agreement."""
        mode = self.config.reduction
        if mode == "sum":
            if weight is not None:
                return _ARG_WEIGHT, _ERR_ARG_NOT_ACCEPTED, True, 0
            if active is None:
                active = True
            if not isinstance(active, (bool, torch.Tensor)):
                return _ARG_ACTIVE, _ERR_BAD_VALUE, True, 0
            return _ARG_ACTIVE, _ERR_NONE, bool(active), 0
        if active is not None:
            return _ARG_ACTIVE, _ERR_ARG_NOT_ACCEPTED, True, 0
        if mode == "mean" or phase == _PHASE_END_MICROSTEP:
            if weight is not None:
                return _ARG_WEIGHT, _ERR_ARG_NOT_ACCEPTED, True, 0
            return _ARG_NONE, _ERR_NONE, True, 0
        if weight is None:
            return _ARG_NONE, _ERR_WEIGHT_MISSING, True, 0
        value = _as_int_weight(weight)
        if value is None:
            return _ARG_WEIGHT, _ERR_BAD_VALUE, True, 0
        return _ARG_WEIGHT, _ERR_NONE, True, value

    def _agree_on_signature(self, phase: int, arg_kind: int, error: int) -> None:
        codes = torch.zeros(self.comm.size, dtype=torch.int64, device=self.comm.device)
        codes[self.comm.rank] = phase + 4 * arg_kind + 16 * error
        self.comm.all_reduce(codes)
        values = codes.tolist()
        if all(c == values[0] for c in values) and values[0] < 16:
            return
        self._discard_window()
        described = ", ".join(f"rank {r}: {_describe_code(c, self.config.reduction)}"
                              for r, c in enumerate(values))
        raise UsageError(f"[rank {self.rank}/{self.world_size}] the ranks of selzero's group did not "
                         f"make the same reduction call ({described}). Every rank must call "
                         "end_microstep()/reduce_gradients()/step() together, with the arguments "
                         f"reduction={self.config.reduction!r} takes.")

    def end_microstep(self, active: bool | None = None) -> None:
        """Close a reduced micro-step on every rank (between backward passes of one step)."""
        self._close(_PHASE_END_MICROSTEP, weight=None, active=active)

    def reduce_gradients(self, weight: Any = None, active: bool | None = None) -> None:
        """Finish the window: reduce, agree on presence / weight / non-finite, normalize."""
        _, local_weight = self._close(_PHASE_REDUCE, weight=weight, active=active)
        v = len(self.layout.virtuals)
        counts = torch.zeros(1 + 2 * v, dtype=torch.int64, device=self.comm.device)
        if self.config.reduction == "weighted":
            counts[0] = local_weight
        elif self.config.reduction == "sum":
            counts[0] = int(self._active_any)
        counts[1:1 + v] = self._window_presence
        counts[1 + v:] = self._local_nonfinite()
        self.comm.all_reduce(counts)
        global_weight = self._global_weight(int(counts[0]), local_weight)
        presence, nonfinite = counts[1:1 + v], counts[1 + v:]
        expected = int(counts[0]) if self.config.reduction == "sum" else self.comm.size
        self._reduced = self._decide(global_weight, presence, nonfinite, expected)
        if global_weight > 0 and self.config.reduction != "sum":
            self.grad_shard.div_(global_weight)
        self.state = WindowState.REDUCED

    def _global_weight(self, group_value: int, local_weight: int) -> int:
        mode = self.config.reduction
        if mode == "mean":
            return self.world_comm.size if self.config.normalize_over == "world" else self.comm.size
        if mode == "weighted" and self.config.normalize_over == "world" \
                and self.world_comm is not self.comm:
            total = torch.tensor([local_weight], dtype=torch.int64,
                                 device=self.comm.device)
            self.world_comm.all_reduce(total)
            return int(total.item())
        return group_value

    def _local_nonfinite(self) -> torch.Tensor:
        flags = torch.zeros(len(self.layout.virtuals), dtype=torch.int64, device=self.comm.device)
        if self.grad_shard.numel() and not bool(torch.isfinite(self.grad_shard).all()):
            for s in self.slots:
                chunk = self.grad_shard[s.shard_offset:s.shard_offset + s.numel]
                flags[s.virtual] = int(not bool(torch.isfinite(chunk).all()))
        return flags

    def _decide(self, global_weight: int, presence: torch.Tensor, nonfinite: torch.Tensor,
                expected: int) -> dict[str, Any]:
        """Which virtual parameters update; raises the same error on every rank where asked."""
        v = len(self.layout.virtuals)
        present = presence > 0
        # missing_grad governs parameters present on some ranks only; one absent on every rank
        # (an expert no rank routed to) simply gets no update under every policy.
        missing = present & (presence < expected)
        policy = self.config.missing_grad
        if policy == "error" and bool(missing.any()) and global_weight > 0:
            self._raise_missing(missing)
        update = present & ~missing if policy == "skip" else present.clone()
        if global_weight == 0:
            update.zero_()
        skipped_nonfinite = 0
        if bool((nonfinite > 0).any()) and global_weight > 0:
            bad = [self._virtual_name(i) for i in range(v) if nonfinite[i] > 0]
            if self.config.nonfinite == "error":
                self._discard_window()
                raise NonFiniteGradientError(
                    f"[rank {self.rank}/{self.world_size}] non-finite (inf/NaN) reduced gradients "
                    f"in {len(bad)} selected parameter(s): {bad[:10]}. Nothing was updated. Lower "
                    "the learning rate or loss scale, or set nonfinite='skip' to skip such steps.")
            skipped_nonfinite = int(update.sum())
            update.zero_()
        updated = int(update.sum())
        return {"update": update.tolist(), "global_weight": global_weight, "updated": updated,
                "skipped_absent": v - updated - skipped_nonfinite,
                "skipped_nonfinite": skipped_nonfinite}

    def _raise_missing(self, missing: torch.Tensor) -> None:
        mine = self._window_presence.to(torch.uint8)
        gathered = torch.zeros(mine.numel() * self.comm.size, dtype=torch.uint8,
                               device=self.comm.device)
        self.comm.all_gather(gathered, mine)
        rows = gathered.view(self.comm.size, -1)
        lines = []
        for i in missing.nonzero().flatten().tolist()[:10]:
            ranks = [r for r in range(self.comm.size) if rows[r, i] == 0]
            lines.append(f"{self._virtual_name(i)} (no gradient on group rank(s) {ranks})")
        self._discard_window()
        raise MissingGradientError(
            f"[rank {self.rank}/{self.world_size}] missing_grad='error': {int(missing.sum())} "
            f"selected parameter(s) got no gradient on some rank: {'; '.join(lines)}. Nothing was "
            "updated. Use missing_grad='zero' (absent ranks contribute zeros) or 'skip'.")

    def _virtual_name(self, i: int) -> str:
        spec = self.layout.virtuals[i]
        name = self.trainable[spec.entry].name
        return name if spec.expert is None else f"{name}[expert {spec.expert}]"

    def _discard_window(self) -> None:
        for seg in self.segments:
            seg.grad = None
        self._window_presence.zero_()
        self._micro_presence.zero_()
        self._local.clear()
        self._active_any = False
        self._shard_stale = True
        self._reduced = None
        self.state = WindowState.IDLE

    # ---- norm, scale, step ----------------------------------------------------------------

    def _require_reduced(self, what: str) -> None:
        if self.state is not WindowState.REDUCED:
            raise UsageError(f"[rank {self.rank}/{self.world_size}] {what} needs reduced gradients: "
                             "call sz.reduce_gradients(...) first.")

    def local_grad_norm_squared(self) -> torch.Tensor:
        """Squared norm of this rank's reduced shard only (no communication)."""
        self._require_reduced("local_grad_norm_squared()")
        return self.grad_shard.pow(2).sum() if self._reduced["global_weight"] > 0 else \
            torch.zeros((), dtype=_FP32, device=self.comm.device)

    def grad_norm_squared(self) -> torch.Tensor:
        """Squared norm of the reduced, normalized subset gradient (each element once per group)."""
        self._require_reduced("grad_norm_squared()")  # name the method the user called
        total = self.local_grad_norm_squared().reshape(1).clone()
        self.comm.all_reduce(total)
        return total[0]

    def scale_gradients_(self, coef: float | torch.Tensor) -> None:
        """Multiply the reduced gradient shards by ``coef`` (clipping).

        A non-finite ``coef`` (a global norm that is inf/NaN because some *host* gradient is)
        is handled like a non-finite gradient of the subset: ``nonfinite="skip"`` skips the
        update, ``"error"`` raises. Every rank sees the same global norm, so they agree.
        """
        self._require_reduced("scale_gradients_()")
        if not math.isfinite(float(coef)):
            decided = self._reduced
            if self.config.nonfinite == "error":
                self._discard_window()
                raise NonFiniteGradientError(
                    f"[rank {self.rank}/{self.world_size}] scale_gradients_ got coef={float(coef)} "
                    "(the global gradient norm is not finite, so some host gradient holds inf/NaN). "
                    "Nothing was updated. Set nonfinite='skip' to skip such steps.")
            decided["skipped_nonfinite"] += decided["updated"]
            decided["updated"] = 0
            decided["update"] = [False] * len(decided["update"])
            return
        self.grad_shard.mul_(coef)

    def step(self, lr: float | None = None, weight: Any = None,
             active: bool | None = None) -> StepResult:
        """Reduce (unless done), update this rank's segments, all-gather the subset."""
        if self.state is not WindowState.REDUCED:
            self.reduce_gradients(weight=weight, active=active)
        elif weight is not None or active is not None:
            raise UsageError(f"[rank {self.rank}/{self.world_size}] step(weight=/active=) after "
                             "reduce_gradients(): the arguments belong to reduce_gradients().")
        decided = self._reduced
        update = decided["update"]
        for i, (s, seg) in enumerate(zip(self.slots, self.segments)):
            seg.grad = (self.grad_shard[s.shard_offset:s.shard_offset + s.numel]
                        if update[s.virtual] else None)
        if self.host_optimizer is not None:
            refresh_from_host(self.optimizer, self._plans, self.host_optimizer)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if decided["updated"]:
            self.optimizer.step()
            self._all_gather(update)
        result = StepResult(decided["global_weight"], decided["updated"],
                            decided["skipped_absent"], decided["skipped_nonfinite"])
        self._discard_window()
        return result

    def _all_gather(self, update: list[bool]) -> None:
        """Cast updated chunks to the parameter dtype and rebuild full parameters in place.

        Two buckets are in flight at a time: bucket b+1's all-gather runs while bucket b is
        copied out, and at most two gathered buffers are alive.
        """
        in_flight: list[tuple[int, Any, torch.Tensor]] = []
        for b, bucket in enumerate(self.buckets):
            if any(update[v] for v in bucket.spec.virtuals):  # else unchanged on every rank
                in_flight.append(self._launch_all_gather(b))
                if len(in_flight) == 2:
                    self._copy_out_bucket(*in_flight.pop(0))
        for item in in_flight:
            self._copy_out_bucket(*item)

    def _launch_all_gather(self, b: int) -> tuple[int, Any, torch.Tensor]:
        spec = self.buckets[b].spec
        dtype = self.trainable[spec.entries[0]].param.dtype
        send = torch.zeros(spec.row_numel, dtype=dtype, device=self.comm.device)
        for i in self._slots_of_bucket[b]:
            s = self.slots[i]
            send[s.row_offset:s.row_offset + s.numel].copy_(self.segments[i].detach())
        gathered = torch.empty(self.comm.size * spec.row_numel, dtype=dtype, device=self.comm.device)
        return b, self.comm.all_gather(gathered, send, async_op=True), gathered

    def _copy_out_bucket(self, b: int, work: Any, gathered: torch.Tensor) -> None:
        spec = self.buckets[b].spec
        work.wait()
        rows = gathered.view(self.comm.size, spec.row_numel)
        with torch.no_grad():
            for t in spec.entries:
                ids = self.layout.entry_virtuals[t]
                first = self.layout.virtuals[ids[0]]
                copy_out(rows, self.trainable[t].param.data.view(-1),
                         row_offset=self.layout.entry_row_offset[t],
                         experts=len(ids), per=first.numel, chunk=first.chunk_numel)

    # ---- gradient accumulation without communication --------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Local micro-steps: accumulate full-size FP32 gradients, communicate nothing."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    # ---- host interplay -------------------------------------------------------------------

    def sync_from_params(self) -> None:
        """Re-read masters (and re-bind fp32 segment views) after the host loaded new weights."""
        for e in self.entries:
            if e.param.dtype != self._dtypes[e.name]:
                raise UsageError(f"parameter {e.name!r} changed dtype to {e.param.dtype} after "
                                 "SelectedZero2 was built; build it after casting the model.")
        with torch.no_grad():
            for i, seg in enumerate(self.segments):
                if self._master_offset[i] is None:
                    view = self._param_chunk(i)
                    if view.data_ptr() != seg.data.data_ptr():
                        seg.data = view
        self._load_masters()

    # ---- checkpoints (format, checks and the atomic swap: checkpoint.py, atomic.py) ----------

    def save_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Every rank of the group calls it: one safetensors shard per rank plus manifest.json,
        staged beside ``folder`` and put in place by one rank once complete."""
        from .checkpoint import save_checkpoint  # imported on use: training never needs it

        save_checkpoint(self, folder)

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Every rank calls it: restores optimizer state and the subset's parameter values; all
        ranks load, or all raise the same CheckpointError and keep their state."""
        from .checkpoint import load_checkpoint

        load_checkpoint(self, folder)

    def memory_report(self) -> MemoryReport:
        """Per-rank bytes of gradient shard, optimizer state and masters, from live storages."""
        grad = _storage_bytes([self.grad_shard])
        master = _storage_bytes([self.master_flat])
        state_tensors = [v for st in self.optimizer.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor)]
        state = _storage_bytes(state_tensors)
        ideal = 0
        for i, (s, seg) in enumerate(zip(self.slots, self.segments)):
            ideal += s.numel * 4 * (1 + (self._master_offset[i] is not None))
            for v in self.optimizer.state.get(seg, {}).values():
                if isinstance(v, torch.Tensor):
                    ideal += (s.numel if v.numel() == seg.numel() else v.numel()) * v.element_size()
        return MemoryReport(grad, state, master, grad + state + master, ideal)

    def remove_hooks(self) -> None:
        """Detach selzero from the model's parameters (their gradients flow normally again)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for e in self.entries:
            owner = getattr(e.param, "_selzero_owner", None)
            if owner is not None and owner() is self:
                del e.param._selzero_owner


def _runs(slots: list[ShardSlot]) -> list[tuple[int, int, int]]:
    """Merge a bucket's slots into contiguous (row_offset, shard_offset, numel) runs."""
    runs: list[list[int]] = []
    for s in slots:
        if runs and runs[-1][0] + runs[-1][2] == s.row_offset and \
                runs[-1][1] + runs[-1][2] == s.shard_offset:
            runs[-1][2] += s.numel
        else:
            runs.append([s.row_offset, s.shard_offset, s.numel])
    return [tuple(r) for r in runs]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _as_int_weight(weight: Any) -> int | None:
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.is_floating_point() and not float(weight).is_integer():
            return None
        weight = int(weight.item())
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
    return f"{text} [{_ERR_TEXT[err]} under reduction={mode!r}]" if err else text


def _model_device(model: nn.Module) -> torch.device:
    """Where control tensors live: the model's device, or the current GPU under NCCL."""
    for p in model.parameters():
        return p.device
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
