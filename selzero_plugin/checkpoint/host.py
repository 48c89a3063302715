"""selzero's folder inside a host's checkpoint: ``<host checkpoint>/selected_zero2/``.

[Note: checkpoint index]
One sub-folder per instance (``<name>/``, DESIGN.md section 2; an expert-parallel instance is
``<name>-ep{ep_rank}``) and ``index.json``, written by global rank 0 once every instance's
folder is complete::

    {"format": 1, "world_size": W,
     "instances": [{"name": "experts-ep0", "ranks": [0, 2], "family": "experts",
                    "ep_rank": 0, "ep_size": 2, "experts": {"moe.experts": [[0, 4]]},
                    "unplaced": 0}, ...],
     "families": {"experts": {"ep_size": 2, "by_global_expert": true}}}

``experts`` lists, per expert container, the global experts the instance holds as half-open
ranges; ``unplaced`` counts its selected tensors without a global expert index. A family is the
instances of one config name: one per expert-parallel rank, or a single one without expert
parallelism. ``by_global_expert`` says whether its keys are global ([Note: global expert names]):
then ``selzero reshard --ep-size`` can move experts to another layout.

Before anything is written, every rank gathers what each instance holds (from group rank 0 of
each) and checks the layout the same way, so every rank raises the same error: two groups that
would write one folder, expert-parallel ranks missing or twice, a global expert held by two
expert-parallel ranks. Loading reads the index first and refuses, on every rank, a layout other
than the saved one, naming the ``selzero reshard`` command that converts it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..core.comm import Communicator
from ..core.contract import agree_on_local_errors
from ..core.zero2 import SelectedZero2
from ..errors import CheckpointError, SelZeroError, UsageError
from .atomic import fsync_dir, leftover_stagings, previous_folder
from .load import close_reads, finish_loads, install_read, read_checkpoint
from .save import discard_staged, local_phase, place_staged, stage_checkpoint

__all__ = ["FOLDER", "INDEX", "save_into", "load_from", "has_folder", "read_index",
           "describe_instance", "instance_record", "check_layout", "family_of", "ranges"]

FOLDER = "selected_zero2"
INDEX = "index.json"
INDEX_FORMAT = 1


def _check_names(instances: Sequence[SelectedZero2]) -> None:
    names = [sz.config.name for sz in instances]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"two selzero instances are both named {dup[0]!r}; their checkpoint "
                         "folders would collide. Give each a distinct `name` in its config.")


def family_of(name: str, ep: tuple[int, int] | None) -> str:
    suffix = f"-ep{ep[0]}" if ep is not None else ""
    return name[:-len(suffix)] if suffix and name.endswith(suffix) else name


def ranges(indices: Sequence[int]) -> list[list[int]]:
    """Sorted distinct ints as half-open ``[start, stop)`` runs."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def instance_record(name: str, ranks: list[int], ep: tuple[int, int] | None,
                    placements: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """What the index lists of one instance ([Note: checkpoint index]); ``placements``: one
    per selected tensor (``Placement.to_json()``, or None)."""
    experts: dict[str, list[int]] = {}
    for p in placements:
        if p is not None:
            experts.setdefault(p["container"], []).extend(
                range(int(p["first"]), int(p["first"]) + int(p["count"])))
    return {"name": name, "ranks": list(ranks), "family": family_of(name, ep),
            "ep_rank": None if ep is None else ep[0], "ep_size": None if ep is None else ep[1],
            "experts": {c: ranges(v) for c, v in experts.items()},
            "unplaced": sum(p is None for p in placements)}


def describe_instance(sz: SelectedZero2) -> dict[str, Any]:
    return instance_record(sz.config.name, sz.comm.global_ranks, sz.expert_parallel,
                           [e.placement.to_json() if e.placement else None for e in sz.entries])


def check_layout(described: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Check the job's instances (one record each) and return the index; raises CheckpointError."""
    by_name: dict[str, dict[str, Any]] = {}
    for d in described:
        seen = by_name.setdefault(d["name"], d)
        if seen["ranks"] != d["ranks"]:
            raise CheckpointError(
                f"two selzero instances named {d['name']!r} run on different ranks ({seen['ranks']}"
                f" and {d['ranks']}) and would write the same checkpoint folder. Give each group's "
                "instance its own `name`, or build it with group=ExpertGroups (named "
                "<name>-ep{ep_rank}).")
    instances = sorted(by_name.values(), key=lambda d: (d["family"], d["ep_rank"] or 0, d["name"]))
    families: dict[str, Any] = {}
    for family in sorted({d["family"] for d in instances}):
        members = [d for d in instances if d["family"] == family]
        sizes = {d["ep_size"] for d in members}
        if len(sizes) != 1:
            raise CheckpointError(f"selzero instances of config name {family!r} disagree on the "
                                  f"expert-parallel size ({sorted(map(str, sizes))}); build every "
                                  "rank's instance with the same ExpertGroups.")
        ep_size = sizes.pop()
        if ep_size is None:
            # one instance (its name is the family); keyed by global expert when every tensor
            # has a place: `selzero reshard --ep-size` can then split it over expert ranks
            families[family] = {"ep_size": None, "by_global_expert": all(
                d["unplaced"] == 0 and d["experts"] for d in members)}
            continue
        positions = sorted(d["ep_rank"] for d in members)
        if positions != list(range(ep_size)):
            raise CheckpointError(
                f"selzero instances {family!r}: expert-parallel ranks {positions} are present, "
                f"expected 0..{ep_size - 1} (one instance per expert-parallel rank); every rank "
                "must build its instance with group=ExpertGroups and save.")
        owner: dict[tuple[str, int], int] = {}
        for d in members:
            for container, runs in d["experts"].items():
                for a, b in runs:
                    for g in range(a, b):
                        other = owner.setdefault((container, g), d["ep_rank"])
                        if other != d["ep_rank"]:
                            raise CheckpointError(
                                f"global expert {g} of {container!r} is held by expert-parallel "
                                f"ranks {other} and {d['ep_rank']}; each global expert must be "
                                "held by exactly one. Check expert_offset on each rank (local "
                                "expert i is global expert expert_offset + i; e.g. "
                                "ep_rank * num_local_experts).")
        placed = all(d["unplaced"] == 0 for d in members)
        families[family] = {"ep_size": ep_size, "by_global_expert": placed}
    return {"format": INDEX_FORMAT, "world_size": world,
            "instances": [{k: d[k] for k in ("name", "ranks", "family", "ep_rank", "ep_size",
                                               "experts", "unplaced")} for d in instances],
            "families": families}


_TIMEOUT_S = 3600.0
"""Of the job-wide checkpoint collectives: the same on every rank whatever the instances'
``timeout_s`` (it names the communicator), and long enough for the slowest group's writes."""


def _world(instances: Sequence[SelectedZero2]) -> Communicator:
    if not (dist.is_available() and dist.is_initialized()):
        if not instances:
            raise UsageError("save_into / load_from: no selzero instance given.")
        return Communicator.single(instances[0].comm.device)
    if instances:
        device = instances[0].comm.device
    elif dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return Communicator.create(list(range(dist.get_world_size())), timeout_s=_TIMEOUT_S,
                               device=device, shared=True)


def _gather_layout(instances: Sequence[SelectedZero2], world: Communicator,
                   error: SelZeroError | None, what: str) -> dict[str, Any]:
    mine = [] if error is not None else \
        [describe_instance(sz) for sz in instances if sz.comm.rank == 0]
    gathered = world.all_gather_bytes(json.dumps(mine).encode())  # every rank, always
    agree_on_local_errors(world, error, what=what)
    described = [d for blob in gathered for d in json.loads(blob.decode())]
    return check_layout(described, world.size)  # the same input on every rank: the same verdict


def save_into(host_dir: str | os.PathLike[str], instances: Sequence[SelectedZero2],
              **_: Any) -> Path:
    """Every rank of the job calls it with its instances ([Note: checkpoint index]): the layout
    is checked on every rank; every instance stages its folder; only once every rank's stagings
    are complete are they put in place (the old folders kept aside), then global rank 0 writes
    ``index.json`` naming this save, then the old folders go. A failure anywhere raises the
    same error on every rank, and a save interrupted at any point leaves a checkpoint that
    loads as one save: the new one, or the previous one. Returns the selzero folder."""
    what = f"save into {host_dir}"
    world = _world(instances)
    _, error = local_phase(_check_names, instances)
    index = _gather_layout(instances, world, error, what)
    root = Path(host_dir) / FOLDER
    # this save's id, and the id of the save the current index names (kept until replaced)
    ids = world.broadcast_bytes(json.dumps(_ids(root)).encode() if world.rank == 0 else None)
    save_id, committed = json.loads(ids.decode())
    index["save_id"] = save_id
    staged: list[tuple[SelectedZero2, Path | None]] = []
    error = None
    for sz in instances:  # every instance, also after a failure: its group waits for this rank
        try:
            staged.append((sz, stage_checkpoint(sz.checkpoint_view(), root / sz.config.name,
                                                save_id=save_id)))
        except SelZeroError as e:
            staged.append((sz, None))
            error = error or e
    try:
        agree_on_local_errors(world, error, what=what)
    except SelZeroError:
        for sz, staging in staged:
            discard_staged(sz.checkpoint_view(), staging)
        raise
    error = None
    for sz, staging in staged:
        try:
            place_staged(sz.checkpoint_view(), staging, root / sz.config.name,
                         keep_previous=True, committed=committed)
        except SelZeroError as e:
            error = error or e
    agree_on_local_errors(world, error, what=what)
    error = None
    if world.rank == 0:
        _, error = local_phase(_write_index, root, index)
    agree_on_local_errors(world, error, what=what)  # the index names this save: old ones go
    for sz in instances:
        if sz.comm.rank == 0:
            folder = root / sz.config.name
            for stale in [previous_folder(folder), *leftover_stagings(folder)]:
                shutil.rmtree(stale, ignore_errors=True)
    return root


def _ids(root: Path) -> list[Any]:
    """[new save_id, the save_id of the current index: None for an index without one, False
    without an index]."""
    committed: Any = False
    if (root / INDEX).is_file():
        try:
            committed = json.loads((root / INDEX).read_text()).get("save_id")
        except (OSError, ValueError, AttributeError):
            committed = False
    return [secrets.token_hex(8), committed]


def _write_index(root: Path, index: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (INDEX + ".tmp")
    with open(tmp, "w") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / INDEX)
    fsync_dir(root)


def has_folder(host_dir: str | os.PathLike[str]) -> bool:
    return (Path(host_dir) / FOLDER).is_dir()


def read_index(host_dir: str | os.PathLike[str], *, root: bool = False) -> dict:
    """``<host_dir>/selected_zero2/index.json`` (``root``: ``<host_dir>/index.json``)."""
    path = Path(host_dir) / INDEX if root else Path(host_dir) / FOLDER / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r}: selzero's index of the checkpoint is missing or "
                              f"unreadable ({e}); the save did not complete. Load an earlier "
                              "checkpoint.") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        seen = index.get("format") if isinstance(index, dict) else index
        raise CheckpointError(f"{str(path)!r}: format {seen!r}, expected {INDEX_FORMAT}; "
                              "upgrade selzero_plugin to read it.")
    try:
        return _completed(index)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r}: malformed ({type(e).__name__}: {e}); the file was "
                              "edited or damaged.") from None


def _completed(index: dict[str, Any]) -> dict[str, Any]:
    """An index written before the layout was recorded (only name and ranks per instance),
    completed: world size from the ranks, expert-parallel families from the ``-ep{k}`` names
    (keyed by local names: such a save knew no global experts)."""
    if "families" in index:
        return index
    instances = [dict(d) for d in index["instances"]]
    world = max((max(d["ranks"]) + 1 for d in instances if d["ranks"]), default=1)
    by_base: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for d in instances:
        m = re.fullmatch(r"(.*)-ep(\d+)", d["name"])
        if m is not None:
            by_base.setdefault(m.group(1), []).append((int(m.group(2)), d))
    families: dict[str, Any] = {}
    for base, members in by_base.items():
        if sorted(k for k, _ in members) == list(range(len(members))) and len(members) > 1:
            for k, d in members:
                d.update(family=base, ep_rank=k, ep_size=len(members))
            families[base] = {"ep_size": len(members), "by_global_expert": False}
    for d in instances:
        d.setdefault("family", d["name"])
        d.setdefault("ep_rank", None)
        d.setdefault("ep_size", None)
        d.setdefault("experts", {})
        d.setdefault("unplaced", None)
        families.setdefault(d["family"], {"ep_size": None, "by_global_expert": False})
    return {**index, "world_size": index.get("world_size", world), "instances": instances,
            "families": families}


def _check_against_index(host_dir: Path, index: dict[str, Any],
                         instances: Sequence[SelectedZero2], world: int) -> None:
    saved = {d["name"]: d for d in index.get("instances", [])}
    families = index.get("families", {})
    for sz in instances:
        ep = sz.expert_parallel
        family = family_of(sz.config.name, ep)
        ep_size = None if ep is None else ep[1]
        saved_family = families.get(family)
        saved_ep = saved_family.get("ep_size") if saved_family else \
            next((d.get("ep_size") for d in saved.values() if d.get("family") == family), None)
        record = saved.get(sz.config.name)
        where = (f", put the host's own files beside it (`find {host_dir} -maxdepth 1 -type f "
                 "-exec cp {} NEW/ \\;`) and resume from NEW (HF Trainer: "
                 "resume_from_checkpoint=NEW; DeepSpeed: NEW is a tag folder inside the save "
                 "folder, and DeepSpeed's own ZeRO files are DeepSpeed's to convert; Accelerate: "
                 "accelerator.load_state(NEW)).")
        fix = (f"Run `selzero reshard {host_dir / FOLDER} --world-size {world}"
               + (f" --ep-size {ep_size}" if ep_size else "") + " --out NEW/selected_zero2`"
               + where)
        if ep_size is None and saved_ep is not None:
            fix = (f"Build SelectedZero2 with group=expert_data_parallel(1) (one expert-parallel "
                   f"rank holding every expert), run `selzero reshard {host_dir / FOLDER} "
                   f"--world-size {world} --ep-size 1 --out NEW/selected_zero2`" + where)
        if saved_ep != ep_size and (record is not None or saved_family is not None):
            raise CheckpointError(
                f"{host_dir / FOLDER}: {family!r} was saved with expert-parallel size "
                f"{saved_ep} over {index.get('world_size')} rank(s); this run has {ep_size} over "
                f"{world}. selzero does not reshard implicitly. {fix}")
        if record is None:
            listed = sorted(saved)
            raise CheckpointError(
                f"{host_dir / FOLDER}: no selzero instance {sz.config.name!r} in this checkpoint "
                f"(it holds {listed[:6]}); select and name the subset as the saving run did, or "
                "start without it (fresh_start).")
        if len(record["ranks"]) != sz.comm.size:
            raise CheckpointError(
                f"{host_dir / FOLDER}: {sz.config.name!r} was saved by a group of "
                f"{len(record['ranks'])} rank(s) ({index.get('world_size')} in all); this group "
                f"has {sz.comm.size} ({world} in all). {fix}")


def load_from(host_dir: str | os.PathLike[str], instances: Sequence[SelectedZero2]) -> None:
    """Every rank of the job calls it: the index is checked against this run's layout, every
    instance's part is checked (no tensor read), then the ranks agree (on the verdict, on the
    index each read, and within each group on the manifest) and only then does any rank write
    state, in place ([Note: streaming load] in load.py): every rank of the job loads, or every
    rank raises the same error (a failed check changes nothing)."""
    host_dir = Path(host_dir)
    what = f"load from {host_dir}"
    root = host_dir / FOLDER
    world = _world(instances)
    reads, index_bytes, error = [], b"", None
    try:
        _check_names(instances)
        save_id, indexed = None, False
        if (root / INDEX).is_file() or any(sz.expert_parallel for sz in instances):
            index_bytes = (root / INDEX).read_bytes() if (root / INDEX).is_file() else b""
            index = read_index(host_dir)
            _check_against_index(host_dir, index, instances, world.size)
            save_id, indexed = index.get("save_id"), True
        for sz in instances:
            reads.append(read_checkpoint(sz.checkpoint_view(), root / sz.config.name,
                                         save_id=save_id, indexed=indexed))
    except SelZeroError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - I/O and decode failures of any kind
        error = CheckpointError(f"{type(e).__name__}: {e}")
    try:
        _agree_on_reads(world, instances, reads, error, index_bytes, what)
    except BaseException:
        close_reads(reads)
        raise
    views = [sz.checkpoint_view() for sz in instances]
    error = None
    for view, read in zip(views, reads):  # [Note: streaming load]: every instance, then agree
        error = install_read(view, read, what=what) or error
    finish_loads(world, views, error, what=what)


def _agree_on_reads(world: Communicator, instances: Sequence[SelectedZero2], reads: list[Any],
                    error: SelZeroError | None, index_bytes: bytes, what: str) -> None:
    agree_on_local_errors(world, error, what=what, token=index_bytes,
                          token_error=CheckpointError,
                          token_what="checkpoint (its selected_zero2/index.json differs)")
    shas = {sz.config.name: read.manifest_sha256.hex() for sz, read in zip(instances, reads)}
    seen: dict[str, str] = {}
    for blob in world.all_gather_bytes(json.dumps(shas).encode()):
        for name, sha in json.loads(blob.decode()).items():
            if seen.setdefault(name, sha) != sha:
                raise CheckpointError(
                    f"[rank {world.rank}/{world.size}] {what}: the ranks of instance {name!r} "
                    "read different manifest.json files (ranks pointed at different "
                    "checkpoints, or node-local copies that differ); every rank must load the "
                    "same checkpoint. Nothing was loaded.")
