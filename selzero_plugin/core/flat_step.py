"""One optimizer step over runs of segments: many small segments, few optimizer tensors.

[Note: flat step]
Under ``partition="chunks"`` every rank holds a chunk of every selected parameter, so on a model
of many small experts a rank's share is thousands of small segments, and torch's single-tensor
optimizers (the CPU default) spend ~40 us of Python per tensor per step whatever its size: the
update cost does not shrink with the group size. An elementwise optimizer computes the same
value for each element whether the elements form one tensor or many, provided the scalar state
its update reads (Adam's ``step``, NAdam's ``mu_product``) is the same; on this machine the
results are bitwise equal for every class of ``ELEMENTWISE`` (tests/test_flat_step.py).

So at each step, consecutive segments that are updated, belong to one optimizer group, hold
equal scalar state (or none yet) and lie next to each other in memory are handed to the
optimizer as one 1-D tensor, a *run*:
- values: the FP32 masters (``master_flat``) of bf16/fp16 parameters; an fp32 parameter's
  segment views the parameter itself: a run of one fp32 segment (a segment of at least
  ``RUN_NUMEL`` elements, or one that joins no neighbour) is that segment, stepped in place,
  and the segments of a longer fp32 run are copied into a scratch (packed) before the update
  and back after it, one foreach copy each way, unless they lie at equal distances in one
  storage (*strided runs*: the chunks of consecutive experts of a fused tensor, each expert's
  chunk at the same place in its expert): such a run is stepped in place as one 2-D view
  ``(segments, chunk)`` of the parameter, its gradient and state viewed in that shape (no copy;
  elementwise results are the same per element; not while step hooks are registered, which see
  the runs and may flatten them). [Note: scratch bound]: the scratch holds at
  most one bucket block of elements (``scratch_numel``: the largest bucket's buffer) and is
  the buffer pool's idle block (on the CPU the pool keeps two; none is in use during the
  step), so the step allocates nothing new and its transient memory stays within ZeRO-2's
  "about two buckets"; when a rank's fp32 runs hold more, they are stepped in batches that
  fit, one optimizer step each (splitting them into one-segment runs instead made the step
  slower than the per-segment path on 4,096 experts: 63.8 against 41.5 us per tensor);
- gradients: ``grad_shard``;
- state: one flat buffer per optimizer group and state key, the group's slots packed;
  scalar state (0-dim) one element per slot. Each segment's public state
  (``sz.optimizer.state[seg]``) holds views of these buffers, so ``state_dict``, checkpoints,
  the memory report and a user's reads see per-segment state in the segment's shape, as before.

The public optimizer runs the update itself: during its ``step()`` its groups' ``params`` and
its ``state`` are the runs' and are restored afterwards (also when a step hook raises after the
update: what the update did is kept), so an LR scheduler's step counter and the groups' live
hyperparameters apply; step hooks run then and see the runs (once per batch, [Note: scratch
bound]: a rank whose fp32 share exceeds a bucket block steps in several). State that is not
held in the flat buffers (a ``load_state_dict``, ``state.clear()``, a tensor or dict a user
put in, the state Adagrad makes at construction) is copied in before the step (*adopted*):
each slot's dict and its values are checked by identity at every step. An update that makes state other than what
one step made at construction (a hyperparameter changed since: SGD's momentum turned on) ends
the path for that optimizer for good: its slots get tensors of their own, cut from the runs',
the flat buffers are freed, and the per-segment path runs from then on. A deep copy of one
segment's state copies the whole buffer it views.

Not used (the per-segment path runs): whole-tensor ownership, a class outside torch's
elementwise allowlist (``ELEMENTWISE``; not ``extra_elementwise_optimizers``), ``fused=True``
(torch's fused CPU kernels round the tail of each tensor in scalar code: not bitwise when the
boundaries move), ``differentiable=True``, and
state one step of the class makes that is neither 0-dim nor of the parameter's shape.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any, Sequence

import torch
from .optim import SegmentOptimizer, probe_state_shapes
from .rowcopy import coalesce_copies
from .storage import ShardStorage

__all__ = ["FlatStep"]

_FP32 = torch.float32

# [Note: run size] torch's single-tensor optimizers make one pass over the whole tensor per
# operation (~12 for AdamW): over a run of millions of elements each pass streams its four
# arrays through memory, where per-segment passes of a few thousand elements stay in cache (a
# 4.2M-element run took 141 ms, the same elements as 512 segments 98 ms). Runs are therefore
# cut at slot boundaries once they pass this many elements (4 FP32 arrays of 512 KiB); a
# segment larger than that is one run, as it is one tensor in the per-segment path.
RUN_NUMEL = 131072
SCRATCH_NUMEL = 1 << 22  # the scratch bound without a buffer pool ([Note: scratch bound])

ENABLED = True  # read when an instance is built (tests compare both paths)


def _fingerprint(state: Any) -> tuple[Any, tuple[list[int], ...]] | None:
    """[Note: state fingerprint] ``_adopt`` checks every slot's state dict and values by
    identity at every step: ~3 us per slot in Python, 34 ms a step for the 12,288 slots a rank
    holds under ``partition="chunks"`` at any N (``benchmarks/scale.py``). Where an optimizer's
    whole ``state`` is the one the last step left (the same keys, dicts, lengths and values, in
    order, compared by ``id`` in C loops, and the values' ``data_ptr``: new storage under a view,
    ``t.data = ...`` or ``t.set_(...)``), each slot's check would pass again, so it is skipped.
    The objects are kept with their ids (no id is reused while the fingerprint lives); any
    change (a load, a clear, a dict or tensor put in, a key added or removed) makes it differ
    and the per-slot check runs. None for a state that is not a mapping of dicts.
    It is taken at the end of a step, except where the step's adoption found it unchanged and
    the step gave no slot a dict (``_install``, ``_own_state``): the step changed values in
    place only, so taking it again would give the same lists (1.3 ms a step on workload f)."""
    try:
        keys = list(state)
        dicts = list(state.values())
        values = list(itertools.chain.from_iterable(map(dict.values, dicts)))
        places = list(map(torch.Tensor.data_ptr, values))  # (new storage under a view)
    except (TypeError, AttributeError):  # (not a dict, not a tensor: the per-slot check)
        return None
    return ((keys, dicts, values), (list(map(id, keys)), list(map(id, dicts)),
                                    list(map(len, dicts)), list(map(id, values)), places))


def _copy_all(pending: list[tuple[torch.Tensor, torch.Tensor]], buffers: Any) -> None:
    """``view.copy_(value)`` for each pair, the values that are themselves views of the flat
    buffers read first: state exchanged between two slots (a permutation of experts) would
    otherwise read one side after it was overwritten (review finding)."""
    if not pending:
        return
    stores = {b.untyped_storage().data_ptr() for b in buffers}
    sources = [v.detach().clone() if v.untyped_storage().data_ptr() in stores else v.detach()
               for _, v in pending]
    for (view, _), source in zip(pending, sources):
        view.copy_(source.view(view.shape))


class FlatStep:
    """Steps this rank's segments through the segment optimizer ([Note: flat step])."""

    def __init__(self, storage: ShardStorage, optimizer: SegmentOptimizer,
                 entry_of_slot: list[int], *, eligible_classes: Sequence[type],
                 partition: str, device: torch.device, pool: Any = None) -> None:
        self.storage = storage
        self.pool = pool  # collectives.BufferPool: the scratch is its idle block when it fits
        # one pool block exactly: a larger scratch is a fresh allocation at every batch, whose
        # page faults cost more than the batches it saves (workload f with 8 MiB buckets:
        # 1.19x DDP's step time and 150 MB more peak RSS with a 16 MiB floor)
        self.scratch_numel = pool.block_bytes // 4 if pool is not None and pool.block_bytes \
            else SCRATCH_NUMEL
        self.seg_opt = optimizer
        slots = storage.slots
        self.n = len(slots)
        self.group_of_slot = [optimizer.group_of_entry[t] for t in entry_of_slot]
        self.member_of_group = [m for m, _ in optimizer.order]
        members = optimizer.members
        # per member: the state keys one step makes, by kind, or None (per-segment path)
        self.keys: list[dict[str, str] | None] = []
        for m, member in enumerate(members):
            self.keys.append(self._probe(member, partition, eligible_classes, device)
                             if ENABLED else None)
        self.on = [k is not None for k in self.keys]
        # layouts: values (masters, or fp32 slots packed as in a scratch), state (per
        # group, packed)
        self.is_master = [off is not None for off in storage.master_offset]
        self.value_off: list[int] = []
        fp32 = 0
        for i, s in enumerate(slots):
            if self.is_master[i]:
                self.value_off.append(storage.master_offset[i] or 0)
            else:
                self.value_off.append(fp32)
                fp32 += s.numel
        self.state_off: list[int] = []
        self.pos: list[int] = []  # index among the group's slots (scalar state)
        group_numel: dict[int, int] = defaultdict(int)
        group_count: dict[int, int] = defaultdict(int)
        for i, s in enumerate(slots):
            g = self.group_of_slot[i]
            self.state_off.append(group_numel[g])
            self.pos.append(group_count[g])
            group_numel[g] += s.numel
            group_count[g] += 1
        self.group_numel, self.group_count = dict(group_numel), dict(group_count)
        joinable = [False] * self.n
        for i in range(1, self.n):
            a, b = slots[i - 1], slots[i]
            joinable[i] = (self.group_of_slot[i] == self.group_of_slot[i - 1]
                           and self.is_master[i] == self.is_master[i - 1]
                           and self.value_off[i - 1] + a.numel == self.value_off[i]
                           and a.shard_offset + a.numel == b.shard_offset)
        self.joinable = torch.tensor(joinable, dtype=torch.bool)
        self.virtual_of_slot = torch.tensor([s.virtual for s in slots], dtype=torch.long)
        self.slots_of_member = [[i for i in range(self.n)
                                 if self.member_of_group[self.group_of_slot[i]] == m]
                                for m in range(len(members))]
        self.scalar_keys = list(dict.fromkeys(key for k in self.keys for key, kind in
                                              (k or {}).items() if kind == "scalar"))
        self.eligible_slot = self._eligible()
        # flat state: (group, key) -> buffer; per slot the public state dict it was given
        # (None: it holds no state in the flat buffers) and that dict's values then
        self.flat: dict[tuple[int, str], torch.Tensor] = {}
        self.public: list[dict[str, Any] | None] = [None] * self.n
        self.runs_last_step = 0
        self.strided_last_step = 0  # of them, strided runs stepped in place
        self._strided_ok = True  # no step hooks at this step (``_step_hooks``)
        self._stride_of: dict[tuple[int, int], int | None] = {}  # this step's, per run
        self.numel_of_slot = [s.numel for s in slots]
        self.run_numel = RUN_NUMEL
        self._slots_of_group = {g: torch.tensor([i for i in range(self.n)
                                                 if self.group_of_slot[i] == g], dtype=torch.long)
                                for g in self.group_count}
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        # scratch views per (block, segment generation, runs): kept while they recur
        self._scratch_cache: dict[Any, tuple[list[torch.Tensor],
                                             list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        self._grads_clear = False
        self._held: list[tuple[tuple[str, torch.Tensor, int], ...]] = [()] * self.n
        # per member, its state as the last step left it ([Note: state fingerprint])
        self._snapshot: list[tuple[Any, tuple[list[int], ...]] | None] = [None] * len(members)
        # per member: does its snapshot still describe its state (adopted on the fast path,
        # and nothing this step did gave a slot a dict)? Then it is not taken again
        self._fresh = [False] * len(members)
        # strided runs: per storage generation, each slot's (storage, offset, numel)
        self._places: tuple[int, list[tuple[int, int, int]]] = (-1, [])

    # ---- eligibility -----------------------------------------------------------------------

    @staticmethod
    def _probe(member: torch.optim.Optimizer, partition: str, eligible: Sequence[type],
               device: torch.device) -> dict[str, str] | None:
        cls = type(member)
        if partition == "tensors" or cls not in eligible:
            return None
        keys: dict[str, str] | None = None
        for group in member.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            if hyper.get("differentiable") or hyper.get("fused"):
                return None  # fused kernels round tail elements differently: not bitwise
            try:
                shapes = probe_state_shapes(cls, hyper, {}, device, (5,))
            except Exception:  # noqa: BLE001 - the per-segment path makes no such assumption
                return None
            kinds = {k: kind for k, (kind, _, _) in shapes.items()}
            if any(kind not in ("scalar", "elementwise") for kind in kinds.values()):
                return None
            if keys is None:
                keys = kinds
            elif keys != kinds:  # groups of one class with different state (SGD momentum 0)
                return None
        return keys if keys is not None else {}

    def _eligible(self) -> torch.Tensor:
        return torch.tensor([self.on[self.member_of_group[g]] for g in self.group_of_slot],
                            dtype=torch.bool)

    def _turn_off(self, m: int) -> None:
        """The per-segment path for member ``m`` from now on: its slots' state becomes tensors
        of their own (clones of the views) and its flat buffers are freed."""
        self.on[m] = False
        self.eligible_slot = self._eligible()
        state = self.seg_opt.members[m].state
        segments = self.storage.segments
        with torch.no_grad():
            for i in self.slots_of_member[m]:
                if segments[i] in state:
                    state[segments[i]] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                          for k, v in state[segments[i]].items()}
                self.public[i] = None
        for key in [k for k in self.flat if self.member_of_group[k[0]] == m]:
            del self.flat[key]

    # ---- the step --------------------------------------------------------------------------

    def step(self, update: Sequence[bool]) -> None:
        """One update of every segment whose virtual parameter ``update`` marks."""
        storage = self.storage
        members = self.seg_opt.members
        self.runs_last_step = self.strided_last_step = 0
        self._strided_ok = not self._step_hooks()
        self._stride_of: dict[tuple[int, int], int | None] = {}  # this step's, per run
        self._fresh = [False] * len(members)
        with torch.no_grad():
            for m, member in enumerate(members):
                if self.on[m]:
                    self._adopt(m, member)
            if not all(self.on) or not self._grads_clear:
                for i, (slot, seg, grad) in enumerate(zip(storage.slots, storage.segments,
                                                          storage.grad_views)):
                    if not self.on[self.member_of_group[self.group_of_slot[i]]]:
                        seg.grad = grad if update[slot.virtual] else None
                    elif seg.grad is not None:
                        seg.grad = None
                self._grads_clear = all(self.on)  # the runs carry the gradients from now on
            if not any(self.on):
                self.seg_opt.optimizer.step()
                return
            stepping = torch.tensor(list(update), dtype=torch.bool)[self.virtual_of_slot] & \
                self.eligible_slot
            runs = self._runs(stepping)
            self.runs_last_step = len(runs)
            for batch in self._batches(runs):  # [Note: scratch bound]
                scratch, values = self._copy_in(batch)
                try:
                    self._step_runs(batch, values)
                finally:
                    self._copy_out(scratch)
        for m, member in enumerate(members):
            if not self.on[m]:
                self._snapshot[m] = None
            elif not self._fresh[m]:
                self._snapshot[m] = _fingerprint(member.state)

    def _runs(self, stepping: torch.Tensor) -> list[tuple[int, int]]:
        """(first, end) slot ranges to step as one tensor each: maximal, then capped."""
        if self.n == 0 or not bool(stepping.any()):
            return []
        has = torch.tensor([p is not None for p in self.public], dtype=torch.bool)
        join = self.joinable.clone()
        join[1:] &= stepping[1:] & stepping[:-1] & (has[1:] == has[:-1])
        both = has[1:] & has[:-1]
        for key in self.scalar_keys:
            values = self._slot_scalars(key)
            join[1:] &= ~both | (values[1:] == values[:-1])
        join[0] = False
        starts = (stepping & ~join).nonzero().flatten().tolist()
        join_next = torch.zeros(self.n, dtype=torch.bool)
        join_next[:-1] = join[1:]
        ends = (stepping & ~join_next).nonzero().flatten().add_(1).tolist()
        return self._capped(list(zip(starts, ends)))

    def _capped(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Runs cut at slot boundaries to about ``run_numel`` elements ([Note: run size])."""
        cap = self.run_numel
        if cap <= 0:
            return runs
        numel = self.numel_of_slot
        out: list[tuple[int, int]] = []
        for a, b in runs:
            start, size = a, 0
            for i in range(a, b):
                if size and size + numel[i] > cap:
                    out.append((start, i))
                    start, size = i, 0
                size += numel[i]
            out.append((start, b))
        return out

    def _scratch_run(self, run: tuple[int, int]) -> bool:
        """Does ``run`` step through the scratch (several fp32 segments, not strided)?"""
        return run[1] - run[0] > 1 and not self.is_master[run[0]] and \
            self._stride(run) is None

    def _step_hooks(self) -> bool:
        """Are step hooks registered (torch's global ones, or on the optimizers)? They see the
        runs, and a hook may flatten its parameters (``parameters_to_vector``): strided runs
        (2-D, not contiguous) are then not used (review finding)."""
        from torch.optim import optimizer as torch_optimizer

        if torch_optimizer._global_optimizer_pre_hooks or \
                torch_optimizer._global_optimizer_post_hooks:
            return True
        return any(getattr(o, "_optimizer_step_pre_hooks", None) or
                   getattr(o, "_optimizer_step_post_hooks", None)
                   for o in (self.seg_opt.optimizer, *self.seg_opt.members))

    def _stride(self, run: tuple[int, int]) -> int | None:
        """The distance in elements between consecutive segments of fp32 ``run`` when they all
        have one size and lie at that one distance in one storage (a strided run), else None
        (also while step hooks are registered: ``_step_hooks``)."""
        if not self._strided_ok:
            return None
        if run not in self._stride_of:  # asked up to three times per run (batches, copy-in)
            self._stride_of[run] = self._find_stride(run)
        return self._stride_of[run]

    def _find_stride(self, run: tuple[int, int]) -> int | None:
        a, b = run
        generation = self.storage.generation
        if self._places[0] != generation:
            self._places = (generation, [(seg.untyped_storage().data_ptr(), seg.storage_offset(),
                                          seg.numel()) for seg in self.storage.segments])
        places = self._places[1]
        storage, first, numel = places[a]
        stride = places[a + 1][1] - first
        if stride < numel:
            return None
        for i in range(a + 1, b):
            p = places[i]
            if p[0] != storage or p[2] != numel or p[1] != first + (i - a) * stride:
                return None
        return stride

    def _batches(self, runs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """The runs in order, cut into batches whose scratch runs hold at most
        ``scratch_numel`` elements ([Note: scratch bound]); one optimizer step each."""
        batches: list[list[tuple[int, int]]] = [[]]
        room = self.scratch_numel
        for a, b in runs:
            if self._scratch_run((a, b)):
                numel = self.value_off[b - 1] + self.numel_of_slot[b - 1] - self.value_off[a]
                if numel > room and room < self.scratch_numel:
                    batches.append([])
                    room = self.scratch_numel
                room -= numel
            batches[-1].append((a, b))
        return batches

    def _slot_scalars(self, key: str) -> torch.Tensor:
        """Per slot: the scalar state ``key`` as float64 (NaN where none is held)."""
        out = torch.full((self.n,), float("nan"), dtype=torch.float64)
        for g in self.group_count:
            buf = self.flat.get((g, key))
            if buf is not None:
                out[self._slots_of_group[g]] = buf.detach().to("cpu", torch.float64)
        return out

    def _step_runs(self, runs: list[tuple[int, int]], values: list[torch.Tensor]) -> None:
        members = self.seg_opt.members
        groups = self.seg_opt.optimizer.param_groups
        slots, public = self.storage.slots, self.public
        numels = [self.value_off[b - 1] + slots[b - 1].numel - self.value_off[a] for a, b in runs]
        # gradients: all runs, in shard order
        grads = _pieces(self.storage.grad_shard,
                        [(slots[a].shard_offset, n) for (a, _), n in zip(runs, numels)])
        # state: per group and key, the stateful runs' pieces; a scalar per run
        states: list[dict[str, Any]] = [{} for _ in runs]
        scalars: list[tuple[int, str, list[int], list[torch.Tensor]]] = []
        by_group: dict[int, list[int]] = defaultdict(list)
        for j, (a, _) in enumerate(runs):
            if public[a] is not None:
                by_group[self.group_of_slot[a]].append(j)
        for g, js in by_group.items():
            for key, kind in (self.keys[self.member_of_group[g]] or {}).items():
                buf = self.flat[(g, key)]
                if kind == "elementwise":
                    for j, view in zip(js, _pieces(buf, [(self.state_off[runs[j][0]], numels[j])
                                                         for j in js])):
                        states[j][key] = view
                else:
                    index = torch.tensor([self.pos[runs[j][0]] for j in js], device=buf.device)
                    views = list(buf.index_select(0, index).unbind(0))
                    for j, view in zip(js, views):
                        states[j][key] = view
                    scalars.append((g, key, js, views))
        for j, value in enumerate(values):
            if value.dim() == 2:  # a strided run: its gradient and state in its shape
                grads[j] = grads[j].view(value.shape)
                for key, view in states[j].items():
                    if view.numel() == numels[j] and numels[j] > 1:
                        states[j][key] = view.view(value.shape)
        passed = [dict(st) for st in states]
        params_of: list[list[torch.Tensor]] = [[] for _ in groups]
        run_states: dict[int, defaultdict[Any, dict[str, Any]]] = {
            m: defaultdict(dict) for m in range(len(members)) if self.on[m]}
        for j, (a, _) in enumerate(runs):
            values[j].grad = grads[j]
            g = self.group_of_slot[a]
            params_of[g].append(values[j])
            if states[j]:
                run_states[self.member_of_group[g]][values[j]] = states[j]
        saved_params = [(group, group["params"]) for g, group in enumerate(groups)
                        if self.on[self.member_of_group[g]]]
        saved_states = {m: members[m].state for m in run_states}
        try:
            for g, group in enumerate(groups):
                if self.on[self.member_of_group[g]]:
                    group["params"] = params_of[g]
            for m, st in run_states.items():
                members[m].state = st
            self.seg_opt.optimizer.step()
        finally:  # also when a step hook raised after the update: what it did is kept
            for group, params in saved_params:
                group["params"] = params
            for m, st in saved_states.items():
                members[m].state = st
            after: list[dict[str, Any]] = []
            for j, (a, _) in enumerate(runs):
                values[j].grad = None
                after.append(run_states[self.member_of_group[self.group_of_slot[a]]]
                             .get(values[j], {}))
            self._keep(runs, numels, after, passed, scalars)

    def _copy_in(self, runs: list[tuple[int, int]]
                 ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """(scratch, each run's values): masters' views, a one-segment fp32 run's segment, the
        scratch's pieces for the longer fp32 runs, whose segments' values are copied in here
        ([Note: scratch bound])."""
        storage = self.storage
        segments = storage.segments  # 1-D under chunks, like the scratch views
        values: list[torch.Tensor] = [segments[a] for a, _ in runs]  # one fp32 segment: itself
        for j, (a, b) in enumerate(runs):
            if b - a > 1 and not self.is_master[a]:
                stride = self._stride((a, b))
                if stride is not None:  # a strided run: a 2-D view of the parameter, in place
                    values[j] = segments[a].detach().as_strided(
                        (b - a, self.numel_of_slot[a]), (stride, 1))
                    self.strided_last_step += 1
        masters = [j for j, (a, _) in enumerate(runs) if self.is_master[a]]
        for j, view in zip(masters, _pieces(storage.master_flat, [
                (self.value_off[runs[j][0]], self.value_off[runs[j][1] - 1] +
                 self.numel_of_slot[runs[j][1] - 1] - self.value_off[runs[j][0]])
                for j in masters])):
            values[j] = view
        packed = [j for j, run in enumerate(runs) if self._scratch_run(run)]
        if not packed:
            return None, values
        sizes = [self.numel_of_slot[i] for j in packed for i in range(*runs[j])]
        total = sum(sizes)
        scratch = self.pool.take(total, _FP32) if self.pool is not None else \
            torch.empty(total, dtype=_FP32, device=storage.grad_shard.device)
        key = (scratch.data_ptr(), storage.generation, tuple(runs[j] for j in packed))
        cache = self._scratch_cache.get(key)
        if cache is not None:
            run_views, self._copied = cache
        else:
            slot_views = torch.split(scratch[:total], sizes)
            self._copied = list(zip(*coalesce_copies(
                list(slot_views), [segments[i].detach() for j in packed
                                   for i in range(*runs[j])])))
            run_views = _pieces(scratch, _runs_in(sizes, [runs[j][1] - runs[j][0]
                                                          for j in packed]))
            if self.pool is not None and self.pool.persistent(scratch):
                if len(self._scratch_cache) >= 64:  # routing changed the runs: start over
                    self._scratch_cache.clear()
                self._scratch_cache[key] = (run_views, self._copied)
        for j, view in zip(packed, run_views):
            values[j] = view
        torch._foreach_copy_([d for d, _ in self._copied], [s for _, s in self._copied])
        return scratch, values

    def _copy_out(self, scratch: torch.Tensor | None) -> None:
        if scratch is None:
            return
        try:
            torch._foreach_copy_([s for _, s in self._copied], [d for d, _ in self._copied])
        finally:
            self._copied = []
            if self.pool is not None:
                self.pool.give(scratch)

    # ---- flat state ------------------------------------------------------------------------

    def _buffer(self, g: int, key: str, kind: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.flat.get((g, key))
        if buf is None:
            size = self.group_numel[g] if kind == "elementwise" else self.group_count[g]
            buf = torch.zeros(size, dtype=like.dtype, device=like.device)
            self.flat[(g, key)] = buf
        return buf

    def _slot_state(self, g: int, i: int, keys: dict[str, str],
                    order: Any) -> dict[str, torch.Tensor]:
        """Slot i's public state: views of the flat buffers, in the segment's shape."""
        s, shape, off = self.storage.slots[i], self.storage.shapes[i], self.state_off[i]
        out = {}
        for key in order:
            buf = self.flat[(g, key)]
            out[key] = buf[off:off + s.numel].view(shape) if keys[key] == "elementwise" else \
                buf[self.pos[i]]
        return out

    def _adopt(self, m: int, member: torch.optim.Optimizer) -> None:
        """Copy state the flat buffers do not hold into them (a load, a clear, a tensor or dict
        a user put in, Adagrad's initial state); its public state becomes views of them. Each
        slot's dict and values are checked by identity at every step."""
        state = member.state
        snapshot, self._snapshot[m] = self._snapshot[m], None
        if snapshot is not None:
            now = _fingerprint(state)
            if now is not None and now[1] == snapshot[1]:
                self._snapshot[m] = snapshot
                self._fresh[m] = True  # (until a slot gets a dict: _install, _own_state)
                return  # every slot as the last step left it ([Note: state fingerprint])
        keys = self.keys[m]
        assert keys is not None
        segments = self.storage.segments
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (view, what it takes in)
        installs: list[tuple[int, Any, dict[str, torch.Tensor]]] = []  # after every copy
        for i in self.slots_of_member[m]:
            g, seg = self.group_of_slot[i], segments[i]
            held = state.get(seg)
            mine = self.public[i]
            if held is not None and held is mine and len(held) == len(self._held[i]) and \
                    all(held.get(k) is v and v.data_ptr() == at for k, v, at in self._held[i]):
                continue  # still ours (the same views, on the same storage)
            if not held:
                self.public[i] = None
                continue
            if set(held) != set(keys) or any(
                    not isinstance(held[k], torch.Tensor) or
                    (kind == "elementwise" and held[k].numel() != self.storage.slots[i].numel)
                    or ((g, k) in self.flat and self.flat[g, k].dtype != held[k].dtype)
                    for k, kind in keys.items()):
                # (a dtype other than the buffer's: a user's bf16 moments beside FP32 ones, a
                # load's FP32 state beside a bf16 buffer; the per-segment path keeps each as
                # torch would, where a copy into the buffer would round it: review finding)
                self._turn_off(m)  # (from the dicts as found: nothing copied or installed yet)
                return
            for key, kind in keys.items():
                self._buffer(g, key, kind, held[key])
            views = self._slot_state(g, i, keys, held)
            for key, view in views.items():
                value = held[key]
                if value is not view and not (value.data_ptr() == view.data_ptr() and
                                              value.shape == view.shape):  # (a load in place)
                    pending.append((view, value))
            installs.append((i, seg, views))
        _copy_all(pending, self.flat.values())
        for i, seg, views in installs:
            self._install(i, seg, state, views)

    def place(self, i: int, read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Slot i's loaded state written straight into the flat buffers: the views the slot
        will hold (a load into an instance without state then needs no per-segment copy that
        the next step's adoption would double), or None where the per-segment path keeps it."""
        g = self.group_of_slot[i]
        m = self.member_of_group[g]
        keys = self.keys[m]
        numel = self.numel_of_slot[i]
        if not self.on[m] or keys is None or set(read) != set(keys) or any(
                read[k].numel() != (numel if kind == "elementwise" else 1) or
                ((g, k) in self.flat and self.flat[g, k].dtype != read[k].dtype)
                for k, kind in keys.items()):
            return None  # (a buffer of another dtype: the values torch's load would keep)
        for key, kind in keys.items():
            self._buffer(g, key, kind, read[key])
        views = self._slot_state(g, i, keys, read)
        for key, view in views.items():
            view.copy_(read[key].reshape(view.shape))
        return views

    def _install(self, i: int, seg: Any, state: Any, views: dict[str, torch.Tensor]) -> None:
        self._fresh[self.member_of_group[self.group_of_slot[i]]] = False
        state[seg] = views
        self.public[i] = views
        self._held[i] = tuple((k, v, v.data_ptr()) for k, v in views.items())

    def _keep(self, runs: list[tuple[int, int]], numels: list[int], after: list[dict[str, Any]],
              passed: list[dict[str, Any]],
              scalars: list[tuple[int, str, list[int], list[torch.Tensor]]]) -> None:
        """After the update: each run's state into the flat buffers. Scalars are written to
        every slot of their runs; a run that had no state gets it, and its slots their
        public state. State other than what one step made at construction (a hyperparameter
        changed since: SGD's momentum turned on) ends the flat path for that optimizer: the
        slots get their own tensors, cut from the run's."""
        off_members: set[int] = set()
        for j, (a, b) in enumerate(runs):
            m = self.member_of_group[self.group_of_slot[a]]
            keys = self.keys[m] or {}
            if after[j] and (set(after[j]) != set(keys) or any(
                    not isinstance(v, torch.Tensor) or
                    v.numel() not in (1, numels[j]) for v in after[j].values())):
                off_members.add(m)
        for g, key, js, views in scalars:  # runs that held state: the common case, batched
            buf = self.flat[(g, key)]
            new = [after[j].get(key, views[n]) for n, j in enumerate(js)]
            counts = [self.pos[runs[j][1] - 1] - self.pos[runs[j][0]] + 1 for j in js]
            starts = [self.pos[runs[j][0]] for j in js]
            index = torch.tensor([p for st, c in zip(starts, counts) for p in range(st, st + c)],
                                 device=buf.device)
            buf.index_copy_(0, index, torch.stack([v.detach().reshape(()) for v in new])
                            .to(buf.device, buf.dtype).repeat_interleave(
                                torch.tensor(counts, device=buf.device)))
        for j, (a, b) in enumerate(runs):
            g = self.group_of_slot[a]
            m = self.member_of_group[g]
            keys = self.keys[m]
            if m in off_members:
                self._own_state(a, b, numels[j], after[j])
                continue
            if not keys or not after[j]:
                continue
            if passed[j]:
                for key, view in passed[j].items():
                    if keys[key] == "elementwise" and after[j][key] is not view:
                        view.copy_(after[j][key].detach().reshape(view.shape))
                continue
            off = self.state_off[a]
            for key, kind in keys.items():  # the run's first state: made by the optimizer
                value = after[j][key].detach()
                buf = self._buffer(g, key, kind, value)
                if kind == "elementwise":
                    buf[off:off + numels[j]].copy_(value.reshape(-1))
                else:
                    buf[self.pos[a]:self.pos[b - 1] + 1].fill_(value)
            state = self.seg_opt.members[m].state
            for i in range(a, b):
                self._install(i, self.storage.segments[i], state,
                              self._slot_state(g, i, keys, after[j]))
        for m in off_members:
            self._turn_off(m)

    def _own_state(self, a: int, b: int, numel: int, after: dict[str, Any]) -> None:
        """The state of the run over slots [a, b), cut into tensors of each of its slots (the
        flat path ends)."""
        g = self.group_of_slot[a]
        self._fresh[self.member_of_group[g]] = False
        state = self.seg_opt.members[self.member_of_group[g]].state
        at = 0
        for i in range(a, b):
            s, shape = self.storage.slots[i], self.storage.shapes[i]
            own: dict[str, Any] = {}
            for key, value in after.items():
                if isinstance(value, torch.Tensor) and value.numel() == numel and numel > 1:
                    own[key] = value.detach().reshape(-1)[at:at + s.numel].clone().view(shape)
                elif isinstance(value, torch.Tensor):
                    own[key] = value.detach().clone()
                else:
                    own[key] = value
            state[self.storage.segments[i]] = own
            self.public[i] = None
            at += s.numel


def _runs_in(sizes: list[int], counts: list[int]) -> list[tuple[int, int]]:
    """(start, numel) of consecutive groups of ``counts`` items of ``sizes``, packed."""
    out, at, i = [], 0, 0
    for count in counts:
        numel = sum(sizes[i:i + count])
        out.append((at, numel))
        at += numel
        i += count
    return out


def _pieces(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``tensor`` (1-D) at the sorted, disjoint (start, numel) ``ranges``: one split."""
    sizes: list[int] = []
    at = 0
    for start, numel in ranges:
        sizes += [start - at, numel]
        at = start + numel
    sizes.append(tensor.numel() - at)
    return list(torch.split(tensor, sizes)[1::2])
