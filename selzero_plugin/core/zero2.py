"""SelectedZero2: ZeRO-2 for a selected parameter subset inside a process group.

The facade over four parts, FSDP2-style (``_fsdp_param.py``, ``_fsdp_param_group.py``,
``_fsdp_collectives.py``):

- ``storage.ShardStorage``: slots, the gradient shard, FP32 masters, segment parameters;
- ``collectives.BucketCollectives``: bucket reduce-scatters (bounded in flight), the all-gather;
- ``window.ReductionWindow``: hooks, launch points, WindowState, presence, agreement, resets;
- ``optim.SegmentOptimizer``: the unmodified torch optimizer over the segments.

Construction does only local work until every rank agreed (selection, layout, launch units,
optimizer plan), then checks the contract, broadcasts the selected parameters from group rank 0
and builds the parts. See DESIGN.md section 1 and the Notes in each part.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..config import SelZeroConfig
from ..errors import (CheckpointError, CollectiveError, ConfigError, NonFiniteGradientError,
                      OptimizerNotSupportedError, SelectionError, SelZeroError, UsageError)
from .binding import KINDS, REPLACED, Bindings
from .collectives import BucketCollectives
from .comm import Communicator, group_ranks
from . import p2p
from .contract import Field, agree_on_local_errors, check_contract
from .experts import index_experts
from .flat_step import FlatStep
from .layout import EntrySpec, Layout, ShardSlot, plan_layout
from .optim import (ELEMENTWISE, GroupPlan, SegmentOptimizer, build_optimizer, check_admitted,
                    check_hyperparameters, jsonable, override_class, plan_groups,
                    plan_groups_from_host, probe_state_shapes, qualified_name,
                    resolve_optimizer_class, stepped_state)
from .ownership import optimizer_cost, plan_tensor_owners
from .report import MemoryReport, StepResult
from .selection import SelectedEntry, resolve_selection
from .storage import ShardStorage, holds_nonfinite
from .units import Units, resolve_units
from .view import Chunk, ShardView
from .window import ReductionWindow, WindowState

__all__ = ["SelectedZero2", "WindowState", "CheckpointIO", "register_checkpoint_io",
           "owning_instance", "live_instances", "plan_virtual_owners", "probe_groups",
           "virtual_costs"]


class CheckpointIO(Protocol):
    def save(self, view: ShardView, folder: str | os.PathLike[str]) -> None: ...

    def load(self, view: ShardView, folder: str | os.PathLike[str]) -> None: ...


logger = logging.getLogger("selzero_plugin")
_checkpoint_io: CheckpointIO | None = None
_LIVE: "weakref.WeakSet[SelectedZero2]" = weakref.WeakSet()


_BUILT = itertools.count()  # construction order: the same on every rank of a group


def live_instances() -> list["SelectedZero2"]:
    """The instances of this process whose hooks are installed (built, not removed), in the
    order they were built. Callers issue collectives per instance (a GradScaler's unscale, a
    failed backward), so the order must be the same on every rank: a WeakSet iterates in
    address order, which differs between processes (review finding: two instances under one
    scaler waited for each other's all-reduce until the timeout)."""
    return sorted((sz for sz in list(_LIVE) if sz.window.installed), key=lambda sz: sz._built)


def register_checkpoint_io(io: CheckpointIO) -> None:
    """Called by ``selzero_plugin.checkpoint`` when it is imported (the package's ``__init__``
    imports it), so the engine saves and loads without importing the checkpoint code."""
    global _checkpoint_io
    _checkpoint_io = io


class SelectedZero2:
    """ZeRO-2 (sharded FP32 gradients and elementwise optimizer state) for selected parameters.

    Every other parameter stays with its host strategy. See DESIGN.md section 1.

    ``group``: the process group to shard over (None: the world), or the
    ``selzero_plugin.groups.ExpertGroups`` of an expert-parallel run: the instance then shards
    over this rank's expert-data-parallel group, is named ``<name>-ep{ep_rank}``, and its
    checkpoint is placed by global expert (``expert_offset``, [Note: global expert names]).
    """

    def __init__(self, model: nn.Module, config: SelZeroConfig, optimizer: Any = torch.optim.AdamW,
                 optimizer_kwargs: dict[str, Any] | None = None, *,
                 group: Any = None) -> None:
        if isinstance(config, Mapping):
            config = SelZeroConfig.from_dict(config)
        if not isinstance(config, SelZeroConfig):
            raise ConfigError(f"config: expected a SelZeroConfig or a dict of its fields, got "
                              f"{type(config).__name__}; e.g. SelZeroConfig(params=['*.experts.*']).")
        self._load_failed: str | None = None  # [Note: streaming load]: steps are refused
        self.expert_parallel: tuple[int, int] | None = None
        """(ep_rank, ep_size) when built over an expert-data-parallel group (``group`` given as
        ``selzero_plugin.groups.ExpertGroups``); None otherwise."""
        if _is_expert_groups(group):
            self.expert_parallel = (int(group.ep_rank), int(group.ep_size))
            config = dataclasses.replace(config, name=f"{config.name}-ep{group.ep_rank}")
            group = group.expert_data_parallel
        self.config = config
        self.model = model
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed and group is not None:
            raise UsageError("SelectedZero2(group=...) needs torch.distributed to be initialized; "
                             "call dist.init_process_group(...) first.")
        ranks = group_ranks(group) if distributed else [0]
        error: SelZeroError | None = None
        try:
            self._build_local(ranks, optimizer, optimizer_kwargs or {})
        except SelZeroError as e:
            error = e
        device = self.entries[0].param.device if getattr(self, "entries", None) else \
            _default_device()
        # Only the group's ranks take part from here on (use_local_synchronization).
        self.comm = Communicator.create(ranks, timeout_s=config.timeout_s, device=device) \
            if distributed else Communicator.single(device)
        self.comm.label = f"group of instance {config.name!r}"
        agree_on_local_errors(self.comm, error, what="SelectedZero2 construction")
        check_contract(self.comm, self._contract_fields(), what="SelectedZero2 contract")
        self._build_parts(optimizer_kwargs or {})
        for e in self.entries:
            e.param._selzero_owner = weakref.ref(self)
        self.window.bindings.record()
        self._built = next(_BUILT)
        _LIVE.add(self)
        if distributed:
            _warn_group_mean(config, self.normalize_ranks, ranks, self.comm.rank)
        for observer in _BUILD_OBSERVERS:  # reports only: never part of the agreed outcome
            try:
                observer(self)
            except Exception as e:  # noqa: BLE001 - a report must not fail one rank alone
                logger.warning("selzero %r: could not describe the instance (%s: %s); "
                               "training is not affected.", config.name, type(e).__name__, e)

    # ---- construction ----------------------------------------------------------------------

    def _build_local(self, ranks: list[int], optimizer: Any, kwargs: dict[str, Any]) -> None:
        """Selection, layout, units, optimizer plan: local work that may fail on one rank only."""
        config = self.config
        p2p.chosen(strict=True)  # SELZERO_GLOO_REDUCE ([Note: p2p reduce-scatter])
        entries = resolve_selection(self.model, params=list(config.params),
                                    modules=list(config.modules), expert_dim=config.expert_dim)
        for e in entries:
            owner = owning_instance(e.param)
            if owner is not None:
                raise UsageError(
                    f"parameter {e.name!r} already belongs to another SelectedZero2 (name "
                    f"{owner.config.name!r}), whose hooks would take its gradients. Call "
                    "old.remove_hooks() before building a new instance on the same parameters.")
        trainable = [e for e in entries if not e.frozen]
        _take_stale_grads(trainable)
        for e in trainable:
            if e.param.numel() == 0 or not e.param.is_contiguous():
                raise SelectionError(f"parameter {e.name!r} (shape {tuple(e.param.shape)}) must be a "
                                     "non-empty contiguous tensor; call .contiguous() on it or leave "
                                     "it out of `params`.")
        self.normalize_ranks = _normalize_ranks(config.normalize_over, ranks)
        self.host_optimizer, self._opt_cls, self._defaults, self._plans = \
            self._resolve_optimizer(trainable, optimizer, kwargs)
        self.owners: list[int] | None = None
        """Whole-tensor ownership: the owning group rank of each virtual parameter."""
        if config.partition == "tensors":
            probe_groups(trainable, self._plans, self._opt_cls, self._defaults)
            self.owners = plan_virtual_owners(trainable, self._plans, self._opt_cls, len(ranks))
        self.layout: Layout = plan_layout(
            [EntrySpec(e.param.numel(), str(e.param.dtype), e.num_experts or 1,
                      e.num_experts is not None) for e in trainable],
            len(ranks), int(config.bucket_mb * 2 ** 20), owners=self.owners)
        self.units: Units = resolve_units(self.model, trainable, list(config.launch_modules))
        self.experts = index_experts(trainable, self.layout)
        self.entries, self.trainable = entries, trainable
        self._dtypes = {e.name: e.param.dtype for e in entries}

    def _resolve_optimizer(self, trainable: list[SelectedEntry], optimizer: Any,
                           kwargs: dict[str, Any]
                           ) -> tuple[torch.optim.Optimizer | None, type, dict[str, Any],
                                      list[GroupPlan]]:
        config = self.config
        overrides = list(config.param_groups)
        for i, group in enumerate(overrides):
            own = override_class(group)
            if own is not None:
                self._check_admitted(own)
                check_hyperparameters(own, [k for k in group if k not in ("params", "optimizer")],
                                      where=f"config.param_groups[{i}] ({own.__name__})")
        if isinstance(optimizer, torch.optim.Optimizer):
            mirrored = [i for i, g in enumerate(overrides) if "optimizer" not in g]
            if kwargs or mirrored:
                raise UsageError(
                    "optimizer is an instance: its groups give the hyperparameters, so "
                    "optimizer_kwargs must be empty and config.param_groups may only hold groups "
                    f"that name an optimizer class of their own (param_groups{mirrored[:3]} "
                    "name none); move those hyperparameters into the host optimizer's groups.")
            cls = type(optimizer)
            self._check_admitted(cls)
            held = [e for e in trainable if stepped_state(optimizer.state.get(e.param))]
            if held:
                raise UsageError(
                    f"the host optimizer ({cls.__name__}) holds state "
                    f"({sorted(optimizer.state[held[0].param])}) for {len(held)} selected "
                    f"parameter(s): {[e.name for e in held[:5]]}. selzero keeps the subset's optimizer "
                    "state itself, sharded; the host's copy would never be read or updated again "
                    "and holds full-size memory. Build SelectedZero2 before the host's first "
                    "step, or drop that state first (host.state.pop(p) for each selected "
                    "parameter), and resume the subset from a selzero checkpoint "
                    "(sz.load_checkpoint). Keeping the parameters in the host's groups is fine.")
            return optimizer, cls, dict(optimizer.defaults), plan_groups_from_host(
                trainable, optimizer, overrides)
        cls = resolve_optimizer_class(optimizer)
        self._check_admitted(cls)
        check_hyperparameters(cls, list(kwargs), where="optimizer_kwargs")
        for i, group in enumerate(overrides):
            if override_class(group) is None:  # (groups of their own: checked above)
                check_hyperparameters(cls, [k for k in group if k not in ("params", "optimizer")],
                                      where=f"config.param_groups[{i}]")
        return None, cls, dict(kwargs), plan_groups(trainable, dict(kwargs), overrides, cls)

    def _check_admitted(self, cls: type) -> None:
        config = self.config
        check_admitted(cls, partition=config.partition,
                       extra_elementwise=list(config.extra_elementwise_optimizers),
                       extra_matrix=list(config.extra_matrix_optimizers))

    def _contract_fields(self) -> list[Field]:
        fields: list[Field] = [(f"config.{k}", v) for k, v in self.config.to_dict().items()]
        fields.append(("group.size", self.comm.size))
        fields.append(("env.SELZERO_GLOO_REDUCE", p2p.chosen()))  # one way on every rank
        for i, e in enumerate(self.entries):
            fields.append((f"selected[{i}]", {
                "name": e.name, "aliases": list(e.aliases), "shape": list(e.param.shape),
                "dtype": str(e.param.dtype), "frozen": e.frozen, "experts": e.num_experts,
                "global_name": e.global_name,
                "placement": e.placement.to_json() if e.placement else None}))
        # after the entries, so that a tie on one rank is named by its parameter and aliases
        fields.append(("selected.count", len(self.entries)))
        fields.append(("expert_parallel", list(self.expert_parallel)
                       if self.expert_parallel else None))
        fields.append(("launch_units", {"names": list(self.units.names),
                                        "of_entry": list(self.units.of_entry)}))
        fields.append(("optimizer.class", qualified_name(self._opt_cls)))
        for g, plan in enumerate(self._plans):
            fields.append((f"optimizer.groups[{g}]", {
                "class": qualified_name(plan.cls) if plan.cls is not None else None,
                "hyperparameters": jsonable(plan.hyper), "members": plan.members}))
        fields.append(("ownership", self.owners))
        return fields

    def _build_parts(self, kwargs: dict[str, Any]) -> None:
        config, comm = self.config, self.comm
        self.storage = ShardStorage(self.layout, self.trainable, comm.rank, comm.device)
        self.collectives = BucketCollectives(comm, self.layout, self.storage,
                                             own_rows=config.launches_in_backward)
        if config.broadcast:
            self.collectives.broadcast([e.param.data for e in self.entries],
                                       int(config.bucket_mb * 2 ** 20))
            self.storage.load_masters()
        entry_of_slot = [self.layout.virtuals[s.virtual].entry for s in self.storage.slots]
        self.segment_optimizer = SegmentOptimizer(self._opt_cls, self._defaults, self._plans,
                                                  self.storage.segments, entry_of_slot,
                                                  self.host_optimizer)
        self.flat_step = FlatStep(self.storage, self.segment_optimizer, entry_of_slot,
                                  eligible_classes=ELEMENTWISE, partition=config.partition,
                                  device=comm.device, pool=self.collectives.pool)
        self._normalize_comm: Communicator | None = None
        self._world_comm: Communicator | None = None
        self._control_comm: Communicator | None = None
        self.window = ReductionWindow(
            config=config, comm=comm, layout=self.layout, storage=self.storage,
            collectives=self.collectives, trainable=self.trainable,
            frozen=[e for e in self.entries if e.frozen], units=self.units,
            model=self.model, normalize_ranks=self.normalize_ranks,
            normalize_weight=self._sum_over_normalize_ranks if self.normalizes_beyond_group
            else None,
            control_comm=self._control_communicator,
            bindings=Bindings(self.model, self.trainable, self))
        self.window.install()

    # ---- communicators beyond the group (created at first use) --------------------------------

    def _sum_over_normalize_ranks(self, weight: torch.Tensor, failed: bool, invalid: bool
                                  ) -> tuple[int, bool, bool]:
        """(token count summed over the normalize_over ranks, whether another group failed,
        whether another group's call was invalid)."""
        total = torch.stack([weight.reshape(()), torch.tensor(int(failed), device=weight.device),
                             torch.tensor(int(invalid), device=weight.device)])
        self.normalize_communicator().all_reduce(total)
        count, failures, invalids = total.tolist()
        # a failure is agreed within the group: a failed rank's group counts its size
        # (review finding: counting one made every rank of a failed group of 2+ blame another)
        return (count, failures > (self.comm.size if failed else 0),
                invalids > (self.comm.size if invalid else 0))

    def normalize_communicator(self) -> Communicator:
        """The communicator over the ``normalize_over`` ranks (the group's own when they are
        the group), made at first use."""
        if not self.normalizes_beyond_group:
            return self.comm
        if self._normalize_comm is None:
            self._normalize_comm = Communicator.create(self.normalize_ranks,
                                                       timeout_s=self.config.timeout_s,
                                                       device=self.comm.device, shared=True)
        return self._normalize_comm

    def _control_communicator(self) -> Communicator:
        """A second communicator over the group, for agreements while bucket collectives may
        still be pending on the first (zero_grad after a failed backward)."""
        if self._control_comm is None:
            self._control_comm = Communicator.create(self.comm.global_ranks,
                                                     timeout_s=self.config.timeout_s,
                                                     device=self.comm.device,
                                                     purpose="control") \
                if dist.is_available() and dist.is_initialized() else self.comm
        return self._control_comm

    @property
    def normalizes_beyond_group(self) -> bool:
        """Whether the ``normalize_over`` ranks extend beyond the group (expert groups under
        ``normalize_over="world"``): their agreements then run over those ranks."""
        return self.normalize_ranks != self.comm.global_ranks

    @property
    def spans_world(self) -> bool:
        """Whether the group is every rank (else it holds parameters no other group holds)."""
        return not (dist.is_available() and dist.is_initialized()) or \
            self.comm.size == dist.get_world_size()

    def world_communicator(self) -> Communicator:
        """A communicator over every rank (the global norm of expert groups), made at first use."""
        if self.spans_world:
            return self.comm
        if self._world_comm is None:
            self._world_comm = Communicator.create(list(range(dist.get_world_size())),
                                                   timeout_s=self.config.timeout_s,
                                                   device=self.comm.device, shared=True)
        return self._world_comm

    # ---- public attributes -----------------------------------------------------------------

    @property
    def state(self) -> WindowState:
        return self.window.state

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's segments."""
        return self.segment_optimizer.optimizer

    @property
    def segments(self) -> list[nn.Parameter]:
        return self.storage.segments

    @property
    def slots(self) -> tuple[ShardSlot, ...]:
        return self.storage.slots

    @property
    def grad_shard(self) -> torch.Tensor:
        return self.storage.grad_shard

    @property
    def master_flat(self) -> torch.Tensor:
        return self.storage.master_flat

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
        return len(self.storage.segments)

    def set_schedule_base(self, lr: float) -> None:
        """Param groups that name an optimizer class of their own follow the main lr's schedule
        by its factor, the main lr now over ``lr`` ([Note: param groups with their own
        optimizer]); by default ``lr`` is the main lr at construction, or the host group's
        ``initial_lr`` once a torch LR scheduler set it. Integrations whose scheduler starts
        below its peak (DeepSpeed's warm-up) pass the peak here."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ConfigError(f"set_schedule_base(lr={lr!r}): expected a positive learning rate "
                              "(the main groups' peak).")
        self.segment_optimizer.set_schedule_base(lr)

    def virtual_name(self, i: int) -> str:
        """``name`` or ``name[expert e]`` of virtual parameter i (as messages spell it)."""
        return self.window.virtual_name(i)

    # ---- the phases of a step ----------------------------------------------------------------

    def no_sync(self) -> Iterator[None]:
        """Local micro-steps: accumulate full-size FP32 gradients, communicate nothing."""
        return self.window.no_sync()

    def end_microstep(self, active: bool | None = None) -> None:
        """Close a reduced micro-step on every rank (between backward passes of one step)."""
        self.window.end_microstep(active)

    def reduce_gradients(self, weight: Any = None, active: bool | None = None) -> None:
        """Finish the window: reduce, agree on presence / weight / non-finite, normalize."""
        self._check_loaded("reduce_gradients()")
        self.window.reduce(weight, active)

    def _require_reduced(self, what: str) -> None:
        if self.window.state is not WindowState.REDUCED:
            raise UsageError(f"[rank {self.rank}/{self.world_size}] {what} needs reduced gradients: "
                             "call sz.reduce_gradients(...) first.")

    def local_grad_norm_squared(self) -> torch.Tensor:
        """Squared norm of this rank's reduced shard only (no communication)."""
        self._require_reduced("local_grad_norm_squared()")
        if self.window.decision.global_weight > 0:
            return self.storage.grad_shard.pow(2).sum()
        return torch.zeros((), dtype=torch.float32, device=self.comm.device)

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
            if self.config.nonfinite == "error" and not self.window.scaled:  # (a GradScaler's
                # window: an overflow is the scaler's to skip)
                self.window.fail(NonFiniteGradientError(
                    f"[rank {self.rank}/{self.world_size}] scale_gradients_ got coef={float(coef)} "
                    "(the global gradient norm is not finite, so some host gradient holds inf/NaN). "
                    "Nothing was updated. Set nonfinite='skip' to skip such steps."))
            self.window.skip_update()
            return
        self.storage.grad_shard.mul_(coef)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp the reduced gradient shards to ``[-clip_value, clip_value]`` (elementwise, so
        the same as clamping the full reduced gradient: ``torch.nn.utils.clip_grad_value_``)."""
        self._require_reduced("clip_grad_value_()")
        value = float(clip_value)
        self.storage.grad_shard.clamp_(-value, value)

    def step(self, lr: float | None = None, weight: Any = None,
             active: bool | None = None) -> StepResult:
        """Reduce (unless done), update this rank's segments, all-gather the subset."""
        self._check_loaded("step()")
        window = self.window
        if not window.reduced():  # (a window whose backward raised since is dropped there)
            window.reduce(weight, active, from_step=True)
        elif weight is not None or active is not None:
            raise UsageError(f"[rank {self.rank}/{self.world_size}] step(weight=/active=) after "
                             "reduce_gradients(): the arguments belong to reduce_gradients().")
        elif window.scaled and not window.unscaled:
            window.fail(UsageError(
                f"[rank {self.rank}/{self.world_size}] step() after reduce_gradients() of "
                "gradients a torch.amp.GradScaler scaled, without the scaler's unscale: call "
                "scaler.step(optimizer) (or scaler.unscale_(optimizer)) for the host optimizer "
                "before sz.step(). Nothing was updated."))
        decision = self.window.decision
        self.segment_optimizer.prepare(lr)
        if decision.updated:
            self.flat_step.step(decision.update)
            self.collectives.all_gather_updated(decision.update)
            self.window.bindings.record()
        result = StepResult(decision.global_weight, decision.updated, decision.skipped_absent,
                            decision.skipped_nonfinite, decision.presence).naming(self.experts)
        if self.comm.rank == 0 and logger.isEnabledFor(logging.DEBUG):
            self._log_step(result)
        self.window.finish_step()
        return result

    def _log_step(self, result: StepResult) -> None:
        launched = self.window.launched_in_backward
        self.window.launched_in_backward = None
        dead = [n for n, k in result.expert_presence.items() if k == 0]
        logger.debug(
            "selzero %r step: %s; updated %d, skipped %d absent (%d dead expert(s)%s), %d "
            "non-finite; divided by %d.", self.config.name,
            f"{launched[0]} of {launched[1]} bucket(s) launched during backward, the rest at "
            "its end" if launched else "every bucket launched at the reduction point",
            result.updated, result.skipped_absent, len(dead),
            f": {dead[:5]}" if dead else "", result.skipped_nonfinite, result.global_weight)

    @property
    def virtual_names(self) -> list[str]:
        """The (virtual) parameters in ``StepResult.presence`` order: each selected tensor, a
        fused one (``expert_dim=0``) as ``name[expert i]`` per row."""
        return [self.window.virtual_name(i) for i in range(len(self.layout.virtuals))]

    def unscale_(self, inv_scale: torch.Tensor,
                 host_found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """Loss scaling (called by a GradScaler's ``unscale_``, [Note: loss scaling] in
        selzero_plugin/amp.py; every rank of the group calls it): reduce the window if not done
        yet, multiply the reduced shards by ``inv_scale`` (0-dim), and agree across the group
        whether the subset or ``host_found_inf`` (the host optimizer's flag, which the ranks of
        a sharded host may see differently) holds inf/NaN; if so step() updates nothing. An
        instance whose ``normalize_over`` ranks extend beyond its group (expert groups) agrees
        the flag over them: the host's replicas must all skip or all step. Returns that agreed
        flag, 0-dim float32 on the device (as GradScaler's found_inf)."""
        window, device = self.window, self.comm.device
        host = torch.zeros((), dtype=torch.float32, device=device) if host_found_inf is None \
            else host_found_inf.detach().reshape(()).to(device=device, dtype=torch.float32)
        error: SelZeroError | None = None
        if not window.reduced():
            try:
                window.reduce(None, None, host_nonfinite=host)  # (the host's flag agreed in it)
            except SelZeroError as e:  # agreed in the group; the other groups must learn it
                if not self.normalizes_beyond_group or isinstance(e, CollectiveError):
                    raise
                error = e
            host = torch.zeros((), dtype=torch.float32, device=device)
        # else reduced explicitly before (reduce_gradients(weight=...)): the host's flag is
        # agreed below, with the check after unscaling, in one all-reduce
        flag = torch.stack([host, torch.zeros_like(host)]).reshape(2)
        if error is None:
            window.unscaled = True
            inv_scale = inv_scale.to(device)
            self.storage.grad_shard.mul_(inv_scale)
            # a scale backed off below 1 multiplies: a finite gradient may overflow only now
            # (review finding). torch's scaler does not see that (it checks each value before
            # it multiplies) and would write the inf; selzero skips instead. Every rank
            # all-reduces (a rank's own inv_scale decides only whether it looks)
            if float(inv_scale) > 1.0:
                flag[0] = torch.maximum(flag[0], holds_nonfinite(self.storage.grad_shard)
                                        .to(torch.float32))
        # over the normalize_over ranks (the group's, unless expert groups extend them): the
        # host's replicas span them, so the scaler must skip (and back off) on every one of them
        # or none; the group's own decision and a group's error are agreed with the flag
        # (review findings: one group skipped the host's step while another took it, and the
        # replicas diverged; a group that raised left the others waiting in this all-reduce).
        # Pipeline stages (normalize_over="group") need not meet another stage here
        flag[0] = torch.maximum(flag[0], torch.tensor(
            float(error is None and window.decision.nonfinite), device=device))
        flag[1] = float(error is not None)
        self.normalize_communicator().all_reduce(flag, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if float(flag[1]) > 0:
            window.fail(UsageError(
                f"[rank {self.comm.rank}/{self.comm.size}] GradScaler.unscale_: selzero's "
                "reduction failed on another group of the normalize_over ranks "
                f"{self.normalize_ranks} (its ranks raised the reason); this group's window was "
                "dropped too. Fix what that error names; every rank then goes on together."))
        if float(flag[0]) > 0 and not window.decision.nonfinite:
            window.decision.nonfinite = True
            window.skip_update()
        return torch.full((), float(window.decision.nonfinite), dtype=torch.float32,
                          device=device)

    def zero_grad(self) -> None:
        """Drop the current window on every rank (every rank of the group calls it: it is a
        small collective): its gradients, presence and reduced shard. After a backward that
        raised, the next forward or reduction point drops the window by itself when every rank's
        backward reached selzero; call this on every rank that skips a batch to also reconcile
        ranks whose backward failed before (in the loss's own backward)."""
        self.window.zero_grad()

    # ---- host interplay -------------------------------------------------------------------

    def sync_from_params(self, values: Mapping[str, torch.Tensor] | None = None, *,
                         broadcast: bool = False) -> None:
        """Re-read masters (and re-bind fp32 segment views) after the host loaded new weights.

        ``values`` maps canonical names of trainable selected parameters to full-precision
        values (e.g. taken before a host cast the module to bf16): the masters are read from
        them and the parameters set to their cast, so no rounding is lost. With ``broadcast``
        (a collective of the group) the values are first broadcast from group rank 0.
        """
        error: SelZeroError | None = None
        try:
            self._check_dtypes()
        except SelZeroError as e:
            if not broadcast:
                raise
            error = e
        if broadcast:  # a collective: a rank that cannot follow must not leave the others
            self.window.settle_outside_backward()
            agree_on_local_errors(self.comm, error, what="sync_from_params(broadcast=True)")
        self.storage.rebind()
        if values is None:
            self.storage.load_masters()
            self.window.bindings.record()
            return
        missing = [e.name for e in self.trainable if e.name not in values]
        wrong = [e.name for e in self.trainable if e.name in values
                 and tuple(values[e.name].shape) != tuple(e.param.shape)]
        if missing or wrong:
            raise UsageError(f"sync_from_params(values=...): missing values for {missing[:3]} / "
                             f"wrong shapes for {wrong[:3]}; pass one full tensor per trainable "
                             "selected parameter, keyed by its canonical name (sz.trainable_names).")
        full = [values[e.name].detach().to(device=self.comm.device, dtype=torch.float32)
                for e in self.trainable]
        if broadcast:
            full = [t.clone() for t in full]
            self.collectives.broadcast(full, int(self.config.bucket_mb * 2 ** 20))
        with torch.no_grad():
            for e, value in zip(self.trainable, full):
                e.param.data.copy_(value.view_as(e.param))
        self.storage.load_masters({e.name: v for e, v in zip(self.trainable, full)})
        self.window.bindings.record()

    def _check_dtypes(self) -> None:
        flags = self.window.bindings.problems()
        replaced = [e.name for t, e in enumerate(self.trainable) if flags[KINDS * t + REPLACED]]
        if replaced:
            raise UsageError(f"parameters {replaced[:5]} are no longer the model's parameter "
                             "objects (load_state_dict(assign=True), swap_tensors, ...): "
                             "selzero cannot follow them. Load in place (then call "
                             "sz.sync_from_params()), or call sz.remove_hooks() and build a new "
                             "SelectedZero2.")
        for e in self.entries:
            if e.param.dtype != self._dtypes[e.name]:
                raise UsageError(f"parameter {e.name!r} changed dtype to {e.param.dtype} after "
                                 "SelectedZero2 was built; build it after casting the model.")

    # ---- checkpoints (selzero_plugin.checkpoint, through ShardView) --------------------------

    def checkpoint_view(self) -> ShardView:
        """The engine as the checkpoint code sees it (see core/view.py). Every rank of the group
        calls it (a save or a load): a window whose backward raised is dropped first."""
        window = self.window
        window.settle_outside_backward()
        return ShardView(
            comm=self.comm, config=self.config, entries=self.entries, trainable=self.trainable,
            virtuals=self.layout.virtuals, group_of_entry=dict(self.segment_optimizer.group_of_entry),
            group_hyperparameters=[dict(p.hyper) for p in self._plans],
            optimizer_class=self._opt_cls,
            group_classes=[p.cls or self._opt_cls for p in self._plans], optimizer=self.optimizer,
            idle=window.state is WindowState.IDLE, window_state=window.state.value,
            expert_parallel=self.expert_parallel, partition=self.config.partition,
            _chunks=self._chunks, _install=self._install, _gather=self._gather_installed,
            _refuse=self._refuse_steps, _check=self._check_dtypes,
            refused=self._load_failed)

    def _chunks(self) -> list[Chunk]:
        return [Chunk(slot, seg, self.optimizer.state.get(seg) or {})
                for slot, seg in zip(self.storage.slots, self.storage.segments)]

    def _install(self, source: Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor] | None]],
                 scheduled: list[dict[str, Any] | None] | None = None) -> None:
        """The local phase of a load ([Note: streaming load] in checkpoint/load.py), slot by
        slot: ``source(i)`` reads slot i's value and optimizer state (None: never stepped);
        the value is copied into the segment, the state into the flat step's buffers (the
        views the slot holds; never tensors a user put in the optimizer, which torch's own
        load would not write either), else the read tensors are taken. Communicates nothing: the
        caller agrees on the outcome, then calls ``_gather_installed``. From here until then
        the instance refuses to step (a failure part way leaves mixed state)."""
        self._load_failed = "the load was interrupted while it wrote the loaded state in place"
        self._check_dtypes()
        self.storage.rebind()
        optimizer = self.optimizer
        index = {id(p): n for n, p in enumerate(p for g in optimizer.param_groups
                                                for p in g["params"])}
        by_index: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for i, seg in enumerate(self.storage.segments):
                value, state = source(i)
                seg.detach().copy_(value)
                if state is not None:  # the flat step's buffers, written in place; else the
                    # read tensors themselves (new memory, as torch's load_state_dict gives)
                    state = _as_torch_loads(state, seg, optimizer.param_groups[
                        self.flat_step.group_of_slot[i]])
                    placed = self.flat_step.place(i, state)
                    by_index[index[id(seg)]] = placed if placed is not None else state
        # This run's hyperparameters stay (runtime settings); only the state is replaced.
        optimizer.load_state_dict({"state": by_index,
                                   "param_groups": optimizer.state_dict()["param_groups"]})
        self._restore_scheduled(scheduled or [])

    def _gather_installed(self) -> None:
        """Every rank of the group, once every rank installed: rebuild the full parameters."""
        self.collectives.all_gather_updated([True] * len(self.layout.virtuals))
        self.window.bindings.record()
        self.window.finish_step()  # an idle window (checked before reading): nothing launched
        self._load_failed = None

    def _refuse_steps(self, reason: str) -> None:
        """A load failed on some rank after it began writing in place (every rank calls it)."""
        self._load_failed = reason

    def _check_loaded(self, what: str) -> None:
        if self._load_failed is not None:
            self.zero_grad()  # every rank holds the same flag: every rank drops the window
            raise CheckpointError(
                f"[rank {self.rank}/{self.world_size}] {what}: the last load_checkpoint failed "
                f"after it began writing the loaded state in place ({self._load_failed}); the "
                "subset's parameters and optimizer state are a mixture. Nothing was done: load "
                "a checkpoint again (sz.load_checkpoint, or the host's load) before training.")

    def _restore_scheduled(self, saved: list[dict[str, Any] | None]) -> None:
        """[Note: scheduled lr] Hyperparameters are this run's (runtime settings), with one
        exception: a group an LR scheduler drives through ``sz.optimizer`` itself (it, or the
        saved group, holds ``initial_lr``; no host is mirrored) takes the saved ``lr`` and
        ``initial_lr``, as torch's own ``optimizer.load_state_dict`` would give it. Otherwise a
        chainable scheduler (StepLR, ExponentialLR) resumed with ``scheduler.load_state_dict``,
        or built after the load with ``last_epoch=k``, would go on from this run's starting lr
        (review findings). ``saved`` is matched by the parameters' keys, not by position.
        ``step(lr=)`` and a mirrored host still set the lr at every step."""
        if self.host_optimizer is not None:
            return
        for group, hyper in zip(self.optimizer.param_groups, saved):
            if hyper is None or not isinstance(hyper.get("lr"), (int, float)):
                continue
            if "initial_lr" in group or "initial_lr" in hyper:
                group["lr"] = float(hyper["lr"])
                if isinstance(hyper.get("initial_lr"), (int, float)):
                    group["initial_lr"] = float(hyper["initial_lr"])

    def save_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Every rank of the group calls it: one safetensors shard per rank plus manifest.json,
        staged beside ``folder`` and put in place by one rank once complete."""
        _io().save(self.checkpoint_view(), folder)  # (refused after a failed load: save.py)

    def load_checkpoint(self, folder: str | os.PathLike[str]) -> None:
        """Every rank calls it: restores optimizer state and the subset's parameter values; all
        ranks load, or all raise the same CheckpointError and keep their state."""
        _io().load(self.checkpoint_view(), folder)

    def memory_report(self) -> MemoryReport:
        """Per-rank bytes of gradient shard, optimizer state and masters, from live storages."""
        return self.storage.memory_report(self.optimizer, self.flat_step.flat.values())

    def remove_hooks(self) -> None:
        """Detach selzero from the model (its parameters' gradients flow normally again)."""
        self.window.remove()
        _LIVE.discard(self)
        for e in self.entries:
            owner = getattr(e.param, "_selzero_owner", None)
            if owner is not None and owner() is self:
                del e.param._selzero_owner


_BUILD_OBSERVERS: list[Callable[["SelectedZero2"], None]] = []


def add_build_observer(fn: Callable[["SelectedZero2"], None]) -> None:
    """``fn(sz)`` after every construction (the package's log summary, selzero_plugin/log.py;
    local work only: it must not communicate)."""
    if fn not in _BUILD_OBSERVERS:
        _BUILD_OBSERVERS.append(fn)


def _io() -> CheckpointIO:
    if _checkpoint_io is None:
        raise UsageError("selzero's checkpoint code is not loaded; import selzero_plugin (the "
                         "package) rather than its core module alone.")
    return _checkpoint_io


def _warn_group_mean(config: SelZeroConfig, normalize: list[int], ranks: list[int],
                     group_rank: int) -> None:
    """Once, on group rank 0: ``mean`` over a group smaller than the world is the expert-
    parallel mistake the peers made (expert gradients scaled by the EP size)."""
    world = dist.get_world_size()
    if config.reduction != "mean" or config.normalize_over != "group" or normalize != ranks \
            or len(ranks) >= world or group_rank != 0:
        return
    factor = world / len(ranks)
    warnings.warn(
        f"selzero {config.name!r}: reduction='mean' with normalize_over='group' divides the "
        f"gradients by this group's size {len(ranks)}, not by the world's {world}. Under expert "
        f"parallelism (experts sharded over expert-parallel ranks, the loss averaged over all "
        f"{world} data-parallel ranks) expert gradients arrive summed over the expert-parallel "
        f"ranks, so that is {factor:g}x too large: set normalize_over='world' (or the "
        "data-parallel ranks' list). Ignore this only if the loss is averaged over this group "
        "alone.", UserWarning, stacklevel=3)


def _normalize_ranks(normalize_over: Any, group: list[int]) -> list[int]:
    """The global ranks the loss is averaged over; they must include the whole group."""
    if normalize_over == "group":
        return list(group)
    if normalize_over == "world":
        return list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    ranks = list(normalize_over)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not set(group) <= set(ranks) or max(ranks) >= world:
        raise ConfigError(f"normalize_over={ranks}: expected global ranks of this world (size "
                          f"{world}) that include every rank of selzero's group {group}; pass the "
                          "data-parallel ranks the loss is averaged over (a list or process group).")
    return ranks


def _default_device() -> torch.device:
    """Where control tensors live when nothing is selected: the current GPU under NCCL."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def owning_instance(param: torch.Tensor) -> "SelectedZero2 | None":
    """The live SelectedZero2 whose hooks take ``param``'s gradients, or None."""
    owner = getattr(param, "_selzero_owner", None)
    live = owner() if owner is not None else None
    return live if live is not None and live.window.installed else None


def _as_torch_loads(state: dict[str, torch.Tensor], seg: torch.Tensor,
                    group: dict[str, Any]) -> dict[str, torch.Tensor]:
    """State values as ``torch.optim.Optimizer.load_state_dict`` makes them for ``seg``
    (``_process_value_according_to_param_policy``): ``step`` as given, or FP32 on the
    parameter's device for a fused or capturable group; the rest in the parameter's dtype and
    on its device."""
    step_on_device = bool(group.get("fused") or group.get("capturable"))
    return {k: (v.to(dtype=torch.float32, device=seg.device) if step_on_device else v)
            if k == "step" else v.to(dtype=seg.dtype, device=seg.device)
            for k, v in state.items()}


def _take_stale_grads(trainable: list[SelectedEntry]) -> None:
    """A ``.grad`` a selected parameter already holds at construction would be added into its
    first gradient by autograd and reach the update unseen (review finding). Zeros (a
    ``zero_grad(set_to_none=False)``) are dropped; anything else is refused."""
    stale = []
    for e in trainable:
        grad = e.param.grad
        if grad is None:
            continue
        if grad.count_nonzero() == 0:
            e.param.grad = None
        else:
            stale.append(e.name)
    if stale:
        raise UsageError(
            f"{len(stale)} selected parameter(s) already hold a non-zero .grad: {stale[:5]} (a "
            "backward before SelectedZero2 was built?). autograd would add it into their first "
            "gradient. Call model.zero_grad(set_to_none=True) before building SelectedZero2.")


def _is_expert_groups(group: Any) -> bool:
    """``selzero_plugin.groups.ExpertGroups`` by its fields (the core imports no top-level module)."""
    return all(hasattr(group, a) for a in ("expert_data_parallel", "ep_rank", "ep_size"))


def virtual_costs(trainable: list[SelectedEntry], plans: list[GroupPlan], cls: type
                  ) -> list[float]:
    """Each virtual parameter's cost ([Note: ownership plan]) under its group's class."""
    group_of = {t: g for g, plan in enumerate(plans) for t in plan.members}
    costs: list[float] = []
    for t, entry in enumerate(trainable):
        plan = plans[group_of[t]]
        cost = optimizer_cost(qualified_name(plan.cls or cls), plan.hyper, entry.virtual_shape)
        costs += [cost] * (entry.num_experts or 1)
    return costs


def plan_virtual_owners(trainable: list[SelectedEntry], plans: list[GroupPlan], cls: type,
                        world: int) -> list[int]:
    """The owning group rank of each virtual parameter ([Note: ownership plan], ownership.py)."""
    fused = [t if entry.num_experts else None
             for t, entry in enumerate(trainable) for _ in range(entry.num_experts or 1)]
    return plan_tensor_owners(virtual_costs(trainable, plans, cls), fused, world)


_DEVICE_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def probe_groups(trainable: list[SelectedEntry], plans: list[GroupPlan], cls: type,
                  defaults: dict[str, Any]) -> None:
    """Under whole-tensor ownership each rank builds its optimizers over the tensors it owns
    only, so an optimizer that refuses a tensor (Muon and a 1-D bias) would raise on its owner
    alone: build each group's optimizer here, on every rank, over storage-free tensors of every
    member's shape, and name the parameter."""
    for g, plan in enumerate(plans):
        c = plan.cls or cls
        seen: dict[tuple[int, ...], SelectedEntry] = {}
        for t in plan.members:
            seen.setdefault(trainable[t].virtual_shape, trainable[t])
        # device-specific kernels (fused, foreach, capturable) are not what is probed here:
        # a storage-free tensor would fail their device check
        hyper = {k: v for k, v in plan.hyper.items() if k not in _DEVICE_FLAGS}
        base = {k: v for k, v in (defaults if c is cls else {}).items() if k not in _DEVICE_FLAGS}
        for shape, entry in seen.items():
            probe = nn.Parameter(torch.empty(shape, device="meta"))
            try:
                build_optimizer(c, [GroupPlan(hyper, [])], [[probe]], base)
            except OptimizerNotSupportedError:
                raise
            except (ValueError, TypeError, RuntimeError) as e:
                what = f" (each expert of the fused tensor, shape {list(shape)})" \
                    if entry.num_experts else f" (shape {list(shape)})"
                raise ConfigError(
                    f"parameter {entry.name!r}{what} is in optimizer group {g}, run by "
                    f"{qualified_name(c)}, which refuses it: {e}. Give such parameters a param "
                    "group with an optimizer of their own, e.g. param_groups=[{'params': "
                    "['*.bias', '*norm*'], 'optimizer': 'torch.optim.AdamW', 'lr': 3e-4}], or "
                    "leave them out of `params`.") from None
            # the state its owner will keep and save, found on a small tensor: an optimizer
            # whose state selzero cannot describe is refused now, not at the first save
            try:
                probe_state_shapes(c, hyper, base, torch.device("cpu"), shape)
            except OptimizerNotSupportedError as e:
                raise OptimizerNotSupportedError(
                    f"parameter {entry.name!r} (optimizer group {g}): {e}") from None
