"""selzero's checkpoint: one safetensors shard per group rank plus a JSON manifest.

[Note: checkpoint format]
A checkpoint folder (DESIGN.md section 2) holds

- ``shard-{rank:05d}-of-{world:05d}.safetensors`` per group rank. For every selected trainable
  *virtual* parameter of which the rank holds a non-empty chunk, in virtual-parameter order:
  ``{key}/value``, the FP32 chunk (the master for bf16/fp16 parameters, the parameter's own
  elements for fp32 ones), then, if the optimizer has state for it, every state tensor in
  sorted key order: ``{key}/exp_avg``, ``{key}/step``, ... Elementwise state is the chunk's 1-D
  slice; scalar state (``step``, NAdam's ``mu_product``) is a 0-dim tensor repeated in every
  shard that holds a chunk (the step count therefore travels with the parameter: torch keeps it
  per parameter, and presence makes it differ between experts).
- ``manifest.json``, written last (see [Note: atomic save] in atomic.py).

``key`` is the canonical parameter name; a fused expert tensor split with ``expert_dim=0`` gives
one virtual parameter per expert, keyed ``{name}[expert {e}]`` (the spelling selzero's error
messages use), e.g. ``mlp.experts.gate_up_proj[expert 3]/exp_avg``. Chunking: a virtual
parameter of ``numel`` elements is cut into ``chunk = ceil(numel / group_size)`` elements per
rank; rank r holds ``[r * chunk, min((r + 1) * chunk, numel))`` (nothing when that is empty).
Padding is never saved. Frozen parameters are described in the contract but hold no state and no
value (they do not change). A virtual parameter the optimizer never stepped (an expert that
never got a token) has a value and no state (``"stateful": false`` in the manifest), exactly as
in the live optimizer.

Under whole-tensor ownership (``partition="tensors"``, format version 2) a virtual parameter is
not chunked: its owner's shard holds it whole, ``{key}/value`` in the virtual parameter's shape
and every state tensor in its own shape (Adafactor's ``row_var`` is ``(rows, 1)``). The manifest
records ``"partition": "tensors"``, each virtual parameter's ``owner`` (the plan, [Note:
ownership plan] in core/ownership.py) and, for a stepped one, its ``state``: each key's dtype and
shape; each optimizer group records its class. A reshard to another group size re-plans the
owners with the plan function; a load reads each of its tensors from the shard of the rank
that owned it when saved (the same rank unless the plan changed, e.g. ``bucket_mb`` did not
matter but the optimizer's ``ns_steps`` did), so a changed plan never refuses a load.

Loading checks, in this order and on every rank (DESIGN.md section 2): manifest present and
readable, format version, group size, contract (names, aliases, shapes, dtypes, frozen flags,
expert split), optimizer class and state keys, then this rank's shard (present, byte size,
sha256, the tensors the manifest implies). The ranks agree on the verdict (the first failing
rank's error is raised on every rank) *and on the sha256 of the manifest they read* (ranks
pointed at different complete checkpoints all raise) before anything changes. Then each rank
streams its values into its segments and state into its optimizer's tensors, one at a time, the
ranks agree that all did, and one all-gather rebuilds the full parameters, so every rank holds
the saved values ([Note: streaming load] in load.py). Runtime settings (lr and the other
hyperparameters, ``bucket_mb``, ``reduction``, ``timeout_s``) are this run's, not the saved
ones: the manifest records them for reference, and for one exception, the lr of groups an LR
scheduler drives through ``sz.optimizer`` ([Note: scheduled lr] in core/zero2.py).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.layout import ceil_div
from ..core.optim import probe_state_shapes, qualified_name
from ..core.ownership import optimizer_cost, plan_tensor_owners
from ..core.view import ShardView
from ..errors import CheckpointError, OptimizerNotSupportedError
from .atomic import MANIFEST_NAME, fsync_file, is_staging, leftover_stagings, previous_folder
from .safetensors_io import (DTYPE_CODES, LazyShard, TensorPlan, dtype_from_name, dtype_name,
                             read_header, sha256_file)

__all__ = ["FORMAT", "FORMAT_VERSION", "VALUE", "ELEMENTWISE", "SCALAR", "TENSOR", "CHUNKING",
           "OWNERSHIP", "piece_range", "state_specs", "tensor_shape", "replan",
           "shard_file_name", "virtual_key", "tensor_key", "chunk_range", "StateSpec",
           "VirtualRecord", "Manifest", "read_manifest", "write_manifest", "resolve_folder",
           "shard_plan", "consolidated_plan", "whats", "check_shard", "open_shard", "RunSchema",
           "describe_run",
           "entry_record", "probe_state", "check_against_run"]

FORMAT = "selzero-checkpoint"
FORMAT_VERSION = 1  # partition="chunks"; whole-tensor ownership writes version 2
READABLE_VERSIONS = (1, 2)
VALUE = "value"
ELEMENTWISE, SCALAR, TENSOR = "elementwise", "scalar", "tensor"
CHUNKING = ("flat; chunk = ceil(numel / group_size); group rank r holds elements "
            "[r * chunk, min((r + 1) * chunk, numel)); padding is not saved")
OWNERSHIP = ("whole tensors; each virtual parameter lies, in its own shape, in the shard of its "
             "owner (virtuals[i].owner), its state tensors in their own shapes")


def shard_file_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def virtual_key(name: str, expert: int | None) -> str:
    return name if expert is None else f"{name}[expert {expert}]"


def tensor_key(key: str, what: str) -> str:
    return f"{key}/{what}"


def chunk_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s real chunk of a ``numel``-element virtual parameter."""
    chunk = ceil_div(numel, world)
    start = rank * chunk
    return start, max(0, min(chunk, numel - start))


# ---- the manifest, parsed -------------------------------------------------------------------


@dataclass(frozen=True)
class StateSpec:
    """One optimizer state key: per element (``elementwise``), one value (``scalar``), or under
    whole-tensor ownership any other shape (``tensor``, with ``shape``)."""

    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None  # whole-tensor ownership: the tensor's shape

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "dtype": dtype_name(self.dtype)}
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "StateSpec":
        shape = raw.get("shape")
        return cls(str(raw["kind"]), dtype_from_name(raw["dtype"]),
                   None if shape is None else tuple(int(d) for d in shape))


@dataclass(frozen=True)
class VirtualRecord:
    """One selected trainable (virtual) parameter as the checkpoint stores it."""

    key: str
    entry: str  # canonical name of the selected tensor
    expert: int | None
    numel: int
    shape: tuple[int, ...]
    group: int  # optimizer param group
    stateful: bool
    owner: int | None = None  # whole-tensor ownership: the group rank whose shard holds it
    state: dict[str, StateSpec] | None = None  # whole-tensor ownership, when stateful

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "entry": self.entry, "expert": self.expert,
                               "numel": self.numel, "group": self.group,
                               "stateful": self.stateful}
        if self.owner is not None:
            out["owner"] = self.owner
            if self.stateful and self.state is not None:
                out["state"] = {k: s.to_json() for k, s in sorted(self.state.items())}
        return out


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest.json, checked for shape; ``raw`` is the JSON object itself."""

    raw: dict[str, Any]
    group_size: int
    entries: list[dict[str, Any]]
    virtuals: list[VirtualRecord]
    optimizer_class: str
    group_state: list[dict[str, StateSpec]]
    group_hyper: list[dict[str, Any]]
    shards: list[dict[str, Any]]

    @classmethod
    def from_json(cls, raw: Any, *, where: str) -> "Manifest":
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a selzero checkpoint manifest (expected "
                                  f"\"format\": \"{FORMAT}\").")
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{where}: checkpoint format version {version!r}; this selzero reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}. Load it with the selzero version "
                f"that wrote it (package_version {raw.get('package_version')!r}).")
        try:
            return cls._parse(raw)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); the "
                                  "file was edited or damaged. Restore it from the save.") from None

    @classmethod
    def _parse(cls, raw: dict[str, Any]) -> "Manifest":
        entries = list(raw["contract"]["entries"])
        shapes = {e["name"]: [int(d) for d in e["shape"]] for e in entries}
        groups = raw["optimizer"]["param_groups"]
        group_state = [{k: StateSpec.from_json(s) for k, s in g["state"].items()} for g in groups]
        owned = raw.get("partition", "chunks") == "tensors"
        if owned != (raw.get("format_version") == 2):
            raise ValueError("partition 'tensors' is format version 2, 'chunks' version 1")
        size = int(raw["group_size"])
        virtuals = []
        for v in raw["virtuals"]:
            shape = shapes[v["entry"]] if v["expert"] is None else shapes[v["entry"]][1:]
            group = int(v["group"])
            if not 0 <= group < len(groups):
                raise IndexError(f"virtual {v['key']!r} names optimizer group {group}")
            owner = state = None
            if owned:
                owner = int(v["owner"])
                if not 0 <= owner < size:
                    raise IndexError(f"virtual {v['key']!r} names owner {owner} of {size}")
                if bool(v["stateful"]):
                    state = {k: StateSpec.from_json(s) for k, s in v["state"].items()}
            virtuals.append(VirtualRecord(str(v["key"]), str(v["entry"]), v["expert"],
                                          int(v["numel"]), tuple(shape), group,
                                          bool(v["stateful"]), owner, state))
        return cls(raw, int(raw["group_size"]), entries, virtuals, str(raw["optimizer"]["class"]),
                   group_state, [dict(g["hyperparameters"]) for g in groups],
                   list(raw["shards"]))

    @property
    def virtual_by_key(self) -> dict[str, VirtualRecord]:
        return {v.key: v for v in self.virtuals}

    @property
    def partition(self) -> str:
        return str(self.raw.get("partition", "chunks"))

    @property
    def group_classes(self) -> list[str]:
        """Each optimizer group's class (a group of its own, or the main one)."""
        main = self.optimizer_class
        return [str(g.get("class") or main) for g in self.raw["optimizer"]["param_groups"]]

    @property
    def expert_parallel(self) -> tuple[int, int] | None:
        """(ep_rank, ep_size) of the instance that saved it, or None."""
        ep = self.raw.get("expert_parallel")
        return None if ep is None else (int(ep["ep_rank"]), int(ep["ep_size"]))

    def shard_record(self, rank: int) -> dict[str, Any] | None:
        return next((s for s in self.shards if s.get("rank") == rank), None)

    def with_group_size(self, world: int, shards: list[dict[str, Any]]) -> "Manifest":
        """This manifest for a group of ``world`` ranks (whole-tensor ownership: re-planned)."""
        raw = copy.deepcopy(self.raw)
        raw["group_size"] = world
        raw["shards"] = shards
        return Manifest.from_json(replan(raw), where="resharded manifest")


def replan(raw: dict[str, Any]) -> dict[str, Any]:
    """A manifest's JSON with its virtual parameters' owners planned for its group size, as the
    engine plans them ([Note: ownership plan]); unchanged under ``chunks``."""
    if raw.get("partition", "chunks") != "tensors":
        return raw
    groups = raw["optimizer"]["param_groups"]
    main = raw["optimizer"]["class"]
    shapes = {e["name"]: [int(d) for d in e["shape"]] for e in raw["contract"]["entries"]}
    costs = []
    for v in raw["virtuals"]:
        shape = shapes[v["entry"]] if v["expert"] is None else shapes[v["entry"]][1:]
        group = groups[int(v["group"])]
        costs.append(optimizer_cost(str(group.get("class") or main), group["hyperparameters"],
                                    shape))
    fused = [v["entry"] if v["expert"] is not None else None for v in raw["virtuals"]]
    owners = plan_tensor_owners(costs, fused, int(raw["group_size"]))
    for v, owner in zip(raw["virtuals"], owners):
        v["owner"] = owner
    return raw


def piece_range(manifest: Manifest, v: VirtualRecord, rank: int) -> tuple[int, int]:
    """(start, length) of ``v``'s elements in group rank ``rank``'s shard."""
    if v.owner is not None:
        return (0, v.numel) if rank == v.owner else (0, 0)
    return chunk_range(v.numel, manifest.group_size, rank)


def state_specs(manifest: Manifest, v: VirtualRecord) -> dict[str, StateSpec]:
    """The state tensors stored for ``v`` (when stateful)."""
    if v.owner is not None:
        return v.state or {}
    return manifest.group_state[v.group]


def tensor_shape(v: VirtualRecord, spec: StateSpec) -> tuple[int, ...]:
    """A stored tensor's full (consolidated) shape."""
    if spec.kind == SCALAR:
        return ()
    if spec.kind == TENSOR:
        assert spec.shape is not None
        return spec.shape
    return v.shape


def read_manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: no {MANIFEST_NAME}. It is written last, so this is an incomplete save (a "
            "crash or a partial copy) or not a selzero checkpoint; use a complete checkpoint.")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e}); the manifest is "
                              "damaged. Restore it from the save.") from None
    return Manifest.from_json(raw, where=str(path))


def write_manifest(folder: Path, raw: dict[str, Any]) -> None:
    path = folder / MANIFEST_NAME
    path.write_text(json.dumps(raw, indent=1) + "\n")
    fsync_file(path)


def resolve_folder(folder: Path) -> tuple[Path, list[str]]:
    """The folder to load (``folder``, or ``<folder>.previous`` after an interrupted replace)
    and the warnings to give. Raises CheckpointError when neither is complete, and for a
    staging folder ([Note: atomic save]: never loaded, whatever it holds)."""
    if is_staging(folder):
        raise CheckpointError(
            f"{folder} is the staging folder of a save that was never put in place (interrupted "
            "or still running); it is not a checkpoint, even with a manifest inside. Load the "
            "checkpoint folder itself; the next save of it deletes this one.")
    notes = []
    leftovers = leftover_stagings(folder)
    if leftovers:
        notes.append(f"unfinished save(s) beside {folder}: {', '.join(p.name for p in leftovers)}."
                     " They were never put in place (a save was interrupted) and are ignored; the "
                     "next save of this folder deletes them.")
    if (folder / MANIFEST_NAME).is_file():
        return folder, notes
    previous = previous_folder(folder)
    if (previous / MANIFEST_NAME).is_file():
        notes.append(f"{folder} holds no complete checkpoint: a save was interrupted while "
                     f"replacing it. Loading the previous complete checkpoint, {previous}.")
        return previous, notes
    if folder.is_dir():
        read_manifest(folder)  # raises: incomplete save
    raise CheckpointError(f"no checkpoint at {folder}: the folder does not exist. Check the path "
                          "(every rank must see the same folder).")


# ---- what a shard / a consolidated file holds -----------------------------------------------


def whats(manifest: Manifest, v: VirtualRecord) -> list[str]:
    """The tensors stored for virtual parameter ``v``, in file order."""
    return [VALUE] + (sorted(state_specs(manifest, v)) if v.stateful else [])


def spec_of(manifest: Manifest, v: VirtualRecord, what: str) -> StateSpec:
    return StateSpec(ELEMENTWISE, torch.float32) if what == VALUE else \
        state_specs(manifest, v)[what]


def shard_plan(manifest: Manifest, rank: int) -> list[tuple[TensorPlan, VirtualRecord, str]]:
    """The tensors of group rank ``rank``'s shard, in file order."""
    plan = []
    for v in manifest.virtuals:
        _, length = piece_range(manifest, v, rank)
        if length == 0:
            continue
        for what in whats(manifest, v):
            spec = spec_of(manifest, v, what)
            if v.owner is not None:  # whole, in its own shape
                shape = tensor_shape(v, spec)
            else:
                shape = (length,) if spec.kind == ELEMENTWISE else ()
            plan.append((TensorPlan(tensor_key(v.key, what), spec.dtype, shape), v, what))
    return plan


def consolidated_plan(manifest: Manifest) -> list[tuple[TensorPlan, VirtualRecord, str]]:
    """Full per-parameter tensors (virtual shape), in file order."""
    plan = []
    for v in manifest.virtuals:
        for what in whats(manifest, v):
            spec = spec_of(manifest, v, what)
            plan.append((TensorPlan(tensor_key(v.key, what), spec.dtype, tensor_shape(v, spec)),
                         v, what))
    return plan


def check_shard(folder: Path, manifest: Manifest, rank: int, *, checksum: bool = True) -> Path:
    """Present, full size, matching sha256, and holding exactly the planned tensors."""
    path = _shard_path(folder, manifest, rank)
    _check_size(path, path.stat().st_size, manifest.shard_record(rank))
    if checksum:
        _check_sha256(path, sha256_file(path), manifest.shard_record(rank))
    try:
        header, _ = read_header(path)
    except Exception as e:  # noqa: BLE001 - any decode failure means a damaged file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}).") from None
    _check_header(path, header, manifest, rank)
    return path


def open_shard(folder: Path, manifest: Manifest, rank: int) -> LazyShard:
    """``check_shard`` through one open descriptor, returned as the reader of the load that
    follows: what is read later is the file that was checked, even if another is renamed
    over its path meanwhile ([Note: streaming load] in load.py). The caller closes it."""
    path = _shard_path(folder, manifest, rank)
    record = manifest.shard_record(rank)
    f = open(path, "rb")
    try:
        _check_size(path, os.fstat(f.fileno()).st_size, record)
        _check_sha256(path, sha256_file(f), record)
        reader = LazyShard(path, file=f)
        try:
            header = reader.header()
        except Exception as e:  # noqa: BLE001 - any decode failure means a damaged file
            raise CheckpointError(f"{path}: not a readable safetensors file ({e}).") from None
        _check_header(path, header, manifest, rank)
    except BaseException:
        f.close()
        raise
    return reader


def _shard_path(folder: Path, manifest: Manifest, rank: int) -> Path:
    name = shard_file_name(rank, manifest.group_size)
    record = manifest.shard_record(rank)
    if record is None or record.get("file") != name:
        raise CheckpointError(f"{folder}/{MANIFEST_NAME}: no record of shard {name} for group "
                              f"rank {rank}; the manifest is damaged.")
    path = folder / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete (group rank {rank}'s "
                              "shard). Copy the checkpoint folder whole, or save again.")
    return path


def _check_size(path: Path, size: int, record: dict[str, Any]) -> None:
    if size != record["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes, the manifest records {record['bytes']}; the "
                              "file is truncated or was replaced. Restore it from the save.")


def _check_sha256(path: Path, digest: str, record: dict[str, Any]) -> None:
    if digest != record["sha256"]:
        raise CheckpointError(f"{path}: sha256 differs from the manifest's ({record['sha256'][:16]}"
                              "...); the file is corrupt. Restore it from the save.")


def _check_header(path: Path, header: dict[str, Any], manifest: Manifest, rank: int) -> None:
    expected = {p.name: (DTYPE_CODES[p.dtype], p.shape) for p, _, _ in shard_plan(manifest, rank)}
    if header != expected:
        missing = sorted(set(expected) - set(header))
        extra = sorted(set(header) - set(expected))
        wrong = sorted(k for k in set(expected) & set(header) if expected[k] != header[k])
        raise CheckpointError(f"{path}: does not hold the tensors its manifest describes (missing "
                              f"{missing[:3]}, unexpected {extra[:3]}, wrong dtype/shape "
                              f"{wrong[:3]}); the folder mixes files of different saves.")


# ---- this run, described like a manifest -----------------------------------------------------


@dataclass(frozen=True)
class RunSchema:
    """What a SelectedZero2 instance would write: compared against a manifest on load."""

    entries: list[dict[str, Any]]
    virtuals: list[VirtualRecord]  # stateful=False: the live state decides at save time
    optimizer_class: str
    group_state: list[dict[str, StateSpec]]  # chunks: per group; tensors: empty
    partition: str
    group_classes: list[str]  # each group's class (its own, or the main one)
    virtual_state: list[dict[str, StateSpec]] | None  # tensors: predicted, per virtual


def describe_run(view: ShardView) -> RunSchema:
    entries = [entry_record(e) for e in view.entries]
    owned = view.partition == "tensors"
    defaults = view.optimizer.defaults
    classes = list(view.group_classes)
    virtuals = []
    predicted: list[dict[str, StateSpec]] = []
    probes: dict[tuple[int, tuple[int, ...]], dict[str, StateSpec]] = {}
    for spec in view.virtuals:
        e = view.trainable[spec.entry]
        shape = e.virtual_shape
        expert = spec.expert if spec.expert is None or e.placement is None else \
            e.placement.first + spec.expert  # the global expert ([Note: global expert names])
        group = view.group_of_entry[spec.entry]
        virtuals.append(VirtualRecord(virtual_key(e.global_name, expert), e.global_name, expert,
                                      spec.numel, shape, group, False, spec.owner))
        if owned:
            if (group, shape) not in probes:
                cls = classes[group]
                probes[group, shape] = probe_state_shaped(
                    cls, view.group_hyperparameters[group],
                    defaults if cls is view.optimizer_class else {}, view.comm.device, shape)
            predicted.append(probes[group, shape])
    state = [] if owned else [
        probe_state(cls, hyper, defaults if cls is view.optimizer_class else {}, view.comm.device)
        for cls, hyper in zip(classes, view.group_hyperparameters)]
    return RunSchema(entries, virtuals, qualified_name(view.optimizer_class), state,
                     view.partition, [qualified_name(c) for c in classes],
                     predicted if owned else None)


def entry_record(e: Any) -> dict[str, Any]:
    """A selected tensor as the manifest's contract lists it: under its global name, with its
    name in the saving model (``local_name``) and its place among the global experts."""
    return {"name": e.global_name, "local_name": e.name, "aliases": list(e.global_aliases),
            "shape": list(e.param.shape), "dtype": dtype_name(e.param.dtype), "frozen": e.frozen,
            "experts": e.num_experts,
            "placement": e.placement.to_json() if e.placement is not None else None}


def probe_state(cls: type[torch.optim.Optimizer], hyper: dict[str, Any],
                defaults: dict[str, Any], device: torch.device) -> dict[str, StateSpec]:
    """Chunks: the state keys one step of ``cls`` creates (each elementwise or a scalar)."""
    specs = {}
    for key, spec in probe_state_shaped(cls, hyper, defaults, device, (3,)).items():
        if spec.kind == TENSOR:
            raise CheckpointError(f"optimizer {qualified_name(cls)} keeps state {key!r} of shape "
                                  f"{list(spec.shape or ())} for a parameter of shape [3]: it is "
                                  "not elementwise and cannot be sharded.")
        specs[key] = StateSpec(spec.kind, spec.dtype)
    return specs


def probe_state_shaped(cls: type[torch.optim.Optimizer], hyper: dict[str, Any],
                       defaults: dict[str, Any], device: torch.device,
                       shape: tuple[int, ...]) -> dict[str, StateSpec]:
    """Whole-tensor ownership: the state one step of ``cls`` creates for a parameter of
    ``shape`` (``core.optim.probe_state_shapes``), as the manifest describes it."""
    try:
        found = probe_state_shapes(cls, hyper, defaults, device, shape)
    except OptimizerNotSupportedError as e:
        raise CheckpointError(str(e)) from None
    for key, (_, dtype, _) in found.items():
        if dtype not in DTYPE_CODES:
            raise CheckpointError(f"optimizer {qualified_name(cls)} keeps state {key!r} as "
                                  f"{dtype}, which safetensors does not store.")
    kinds = {"scalar": SCALAR, "elementwise": ELEMENTWISE, "tensor": TENSOR}
    return {key: StateSpec(kinds[kind], dtype, shape_)
            for key, (kind, dtype, shape_) in found.items()}


def check_against_run(manifest: Manifest, run: RunSchema, group_size: int, where: str) -> None:
    """Group size, contract, optimizer class and state keys (the order of DESIGN.md section 2)."""
    if manifest.group_size != group_size:
        raise CheckpointError(
            f"{where} was saved by a group of {manifest.group_size} rank(s); this group has "
            f"{group_size}. selzero does not reshard implicitly: run `selzero reshard {where} "
            f"--world-size {group_size} --out NEW_FOLDER` and load NEW_FOLDER.")
    _check_entries(manifest.entries, run.entries, where)
    saved_keys = {v.key: v.numel for v in manifest.virtuals}
    if saved_keys != {v.key: v.numel for v in run.virtuals}:
        raise CheckpointError(f"{where}: the manifest's virtual parameters do not follow from its "
                              "own contract; the manifest is damaged.")
    if manifest.partition != run.partition:
        raise CheckpointError(
            f"{where} was saved with partition={manifest.partition!r}; this run uses "
            f"partition={run.partition!r}. Build SelectedZero2 with "
            f"partition={manifest.partition!r} to resume (the layout of the state differs).")
    if manifest.optimizer_class != run.optimizer_class:
        raise CheckpointError(
            f"{where} holds state of optimizer {manifest.optimizer_class}; this run uses "
            f"{run.optimizer_class}. Build SelectedZero2 with {manifest.optimizer_class} to "
            "resume, or `selzero consolidate` the checkpoint and convert the state yourself.")
    saved_classes, run_classes = manifest.group_classes, run.group_classes
    by_key = manifest.virtual_by_key
    for current in run.virtuals:
        saved = by_key[current.key]
        if saved_classes[saved.group] != run_classes[current.group]:
            raise CheckpointError(
                f"{where}: parameter {saved.key!r} was saved under optimizer "
                f"{saved_classes[saved.group]} (param group {saved.group}); this run gives it "
                f"{run_classes[current.group]} (group {current.group}). Name the same optimizer "
                "class in its param group as the saving run did.")
    if run.virtual_state is not None:
        for i, current in enumerate(run.virtuals):
            saved = by_key[current.key]
            if saved.stateful and saved.state != run.virtual_state[i]:
                raise CheckpointError(
                    f"{where}: parameter {saved.key!r} was saved with optimizer state "
                    f"{_describe_state(saved.state or {})}; this run's "
                    f"{run_classes[current.group]} makes {_describe_state(run.virtual_state[i])}."
                    " Use the optimizer settings of the saving run.")
        return
    for current in run.virtuals:  # matched by key: a resharded manifest may list another order
        saved = by_key[current.key]
        s, c = manifest.group_state[saved.group], run.group_state[current.group]
        if s != c:
            raise CheckpointError(
                f"{where}: parameter {saved.key!r} was saved with optimizer state "
                f"{_describe_state(s)}; this run's {run.optimizer_class} makes "
                f"{_describe_state(c)}. Use the optimizer settings of the saving run (momentum, "
                "amsgrad, ...).")


_FIX = {
    "shape": "build the model with the configuration of the saving run",
    "dtype": "cast the model as the saving run did, before building SelectedZero2",
    "aliases": "tie the same parameters as the saving run",
    "frozen": "set requires_grad as the saving run did",
    "experts": "use the saving run's expert_dim and number of experts",
    "placement": "declare the global experts as the saving run did (expert_offset), or "
                 "`selzero reshard` the checkpoint for this layout",
}


def _check_entries(saved: list[dict[str, Any]], current: list[dict[str, Any]], where: str) -> None:
    saved_names = [e["name"] for e in saved]
    current_names = [e["name"] for e in current]
    if sorted(saved_names) != sorted(current_names):
        only_saved = [n for n in saved_names if n not in current_names]
        only_here = [n for n in current_names if n not in saved_names]
        detail = f"only in the checkpoint: {only_saved[:5]}; only selected here: {only_here[:5]}"
        raise CheckpointError(f"{where}: the selected parameters differ ({detail}). Select the "
                              "same parameters (config params/modules) as the saving run; under "
                              "expert parallelism, declare the same global experts "
                              "(expert_offset) or `selzero reshard` the checkpoint for this "
                              "layout.")
    by_name = {e["name"]: e for e in saved}
    for c in current:  # by name: a resharded manifest may list them in another order
        s = by_name[c["name"]]
        for field, fix in _FIX.items():
            if s.get(field) != c[field]:
                raise CheckpointError(f"{where}: parameter {c['name']!r}: the checkpoint has "
                                      f"{field} {json.dumps(s.get(field))}, this run has "
                                      f"{json.dumps(c[field])}; {fix}.")


def _describe_state(specs: dict[str, StateSpec]) -> str:
    described = (f"{k}: {s.kind} {dtype_name(s.dtype)}"
                 + (f" {list(s.shape)}" if s.kind == TENSOR and s.shape is not None else "")
                 for k, s in sorted(specs.items()))
    return "{" + ", ".join(described) + "}"
