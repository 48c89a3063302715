"""Saving: every rank writes its shard into a staging folder; one rank writes the manifest last
and puts the folder in place ([Note: checkpoint format] in format.py, [Note: atomic save] in
atomic.py). A failure on any rank is raised on every rank, and the staging folder removed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch

from ..core.contract import agree_on_local_errors
from ..core.optim import jsonable
from ..core.view import ShardView
from ..errors import CheckpointError, SelZeroError
from .atomic import (MANIFEST_NAME, crash_point, fsync_dir, make_staging, previous_folder,
                     put_in_place, refuse_to_replace)
from .format import (CHUNKING, ELEMENTWISE, FORMAT, FORMAT_VERSION, OWNERSHIP, VALUE, Manifest,
                     RunSchema, VirtualRecord, describe_run, shard_file_name, tensor_key,
                     write_manifest)
from .safetensors_io import StreamingWriter, TensorPlan

__all__ = ["save_checkpoint", "stage_checkpoint", "place_staged", "discard_staged",
           "manifest_save_id", "keep_committed_aside", "local_phase"]

_T = TypeVar("_T")


def local_phase(fn: Callable[..., _T], *args: Any) -> tuple[_T | None, SelZeroError | None]:
    """Run a rank-local phase; any failure becomes an error to agree on (never a hang)."""
    try:
        return fn(*args), None
    except SelZeroError as e:
        return None, e
    except Exception as e:  # noqa: BLE001 - I/O and decode failures of any kind
        return None, CheckpointError(f"{type(e).__name__}: {e}")


def save_checkpoint(view: ShardView, folder: str | Path) -> None:
    """Every rank of the group calls this."""
    folder = Path(folder)
    staging = stage_checkpoint(view, folder)
    place_staged(view, staging, folder)


def stage_checkpoint(view: ShardView, folder: str | Path, *, save_id: str | None = None) -> Path:
    """Every rank of the group: write every shard and the manifest into a staging folder beside
    ``folder`` and return it (the same path on every rank); nothing is put in place. A failure
    on any rank of the group raises on every rank of the group, the staging folder removed.
    ``save_id`` (a save of several instances) is recorded in the manifest."""
    folder = Path(folder)
    comm = view.comm
    what = f"save_checkpoint({folder})"
    run, error = local_phase(describe_run, view)
    if view.refused is not None:  # the same on every rank of the group ([Note: streaming load])
        error = CheckpointError(
            f"[rank {comm.rank}/{comm.size}] {what}: the last load_checkpoint failed after it "
            f"began writing the loaded state in place ({view.refused}); the subset's "
            "parameters and optimizer state are a mixture, which a save would keep as a "
            "checkpoint. Nothing was written: load a checkpoint again before saving.")
    staging: Path | None = None
    if comm.rank == 0 and error is None:
        staging, error = local_phase(_prepare_staging, folder)
    try:
        agree_on_local_errors(comm, error, what=what)
        staging = Path(comm.broadcast_bytes(str(staging).encode() if comm.rank == 0 else None)
                       .decode())
        record, error = local_phase(_write_shard, view, run, staging)
        agree_on_local_errors(comm, error, what=what)
        records = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(record).encode())]
        if comm.rank == 0:
            _, error = local_phase(_finish, view, run, records, staging, save_id)
        agree_on_local_errors(comm, error, what=what)
    except SelZeroError:
        if comm.rank == 0 and staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


def place_staged(view: ShardView, staging: Path, folder: str | Path, *,
                 keep_previous: bool = False, committed: Any = False) -> None:
    """Every rank of the group: group rank 0 puts ``staging`` in place ([Note: atomic save]);
    a failure raises on every rank of the group. ``committed`` (a save of several instances:
    the ``save_id`` the current index names, None for an index without one; False: no index):
    the folder holding that save is the one kept aside, never deleted."""
    comm = view.comm
    error = None

    def place() -> None:
        if committed is not False:
            keep_committed_aside(Path(folder), committed)
        put_in_place(staging, Path(folder), keep_previous=keep_previous)

    if comm.rank == 0:
        _, error = local_phase(place)
    try:
        agree_on_local_errors(comm, error, what=f"save_checkpoint({folder})")
    except SelZeroError:
        discard_staged(view, staging)
        raise


def manifest_save_id(folder: Path) -> Any:
    """The ``save_id`` in ``folder``'s manifest (None: written without one); False when the
    folder holds no readable manifest."""
    try:
        raw = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return raw.get("save_id") if isinstance(raw, dict) else False


def keep_committed_aside(folder: Path, committed: Any) -> None:
    """Before ``folder`` is renamed aside for a new save: when an earlier save of several
    instances was interrupted after this folder was replaced, ``folder`` holds that unnamed
    save and ``<folder>.previous`` the one the index names; put the named one back, so that it
    is the one kept (put_in_place deletes a stale ``.previous``)."""
    previous = previous_folder(folder)
    if manifest_save_id(folder) != committed and manifest_save_id(previous) == committed:
        shutil.rmtree(folder)
        os.rename(previous, folder)
        fsync_dir(folder.parent)


def discard_staged(view: ShardView, staging: Path | None) -> None:
    """Group rank 0 removes a staging folder that will not be put in place."""
    if view.comm.rank == 0 and staging is not None and staging.exists():
        shutil.rmtree(staging, ignore_errors=True)


def _prepare_staging(folder: Path) -> Path:
    reason = refuse_to_replace(folder)
    if reason is not None:
        raise CheckpointError(reason)
    return make_staging(folder)


def _write_shard(view: ShardView, run: RunSchema, staging: Path) -> dict[str, Any]:
    rank, world = view.comm.rank, view.comm.size
    items: list[tuple[str, torch.Tensor]] = []
    stateful: list[int] = []
    owned = run.virtual_state is not None
    for chunk in sorted(view.chunks(), key=lambda c: c.slot.virtual):
        v = run.virtuals[chunk.slot.virtual]
        items.append((tensor_key(v.key, VALUE), chunk.segment.detach()))
        if not chunk.state:
            continue
        specs = run.virtual_state[chunk.slot.virtual] if run.virtual_state is not None else \
            run.group_state[v.group]
        if set(chunk.state) != set(specs):
            raise CheckpointError(f"optimizer state of {v.key!r} has keys {sorted(chunk.state)}, "
                                  f"expected {sorted(specs)} from one step of "
                                  f"{run.group_classes[v.group]}.")
        stateful.append(chunk.slot.virtual)
        for key in sorted(specs):
            tensor = chunk.state[key].detach()
            if owned and (tuple(tensor.shape) != (specs[key].shape or ()) or
                          tensor.dtype != specs[key].dtype):
                raise CheckpointError(
                    f"optimizer state {key!r} of {v.key!r} is {list(tensor.shape)} "
                    f"{tensor.dtype}; one step of the optimizer makes {list(specs[key].shape or ())}"
                    f" {specs[key].dtype}.")
            if specs[key].kind == ELEMENTWISE and not owned:
                tensor = tensor.reshape(-1)
            items.append((tensor_key(v.key, key), tensor))
    name = shard_file_name(rank, world)
    plan = [TensorPlan(k, t.dtype, tuple(t.shape)) for k, t in items]
    with StreamingWriter(staging / name, plan, {"format": "pt"}) as writer:
        for n, (key, tensor) in enumerate(items):
            writer.write(key, tensor)
            if n == 0:
                writer.flush()
                crash_point("mid_shard")
        if not items:
            crash_point("mid_shard")
        size, digest = writer.close()
    return {"rank": rank, "file": name, "bytes": size, "sha256": digest, "stateful": stateful}


def _finish(view: ShardView, run: RunSchema, records: list[dict[str, Any]], staging: Path,
            save_id: str | None) -> None:
    stateful = {v for r in records for v in r["stateful"]}
    virtuals = [VirtualRecord(v.key, v.entry, v.expert, v.numel, v.shape, v.group,
                              i in stateful, v.owner,
                              run.virtual_state[i] if run.virtual_state is not None else None
                              ).to_json() for i, v in enumerate(run.virtuals)]
    owned = run.virtual_state is not None
    classes = run.group_classes
    cfg = view.config
    from .. import __version__

    raw = {
        "format": FORMAT,
        "format_version": 2 if owned else FORMAT_VERSION,
        "package_version": __version__,
        "name": cfg.name,
        "group_size": view.comm.size,
        "contract": {"entries": run.entries, "chunking": OWNERSHIP if owned else CHUNKING},
        "virtuals": virtuals,
        # hyperparameters as the optimizer used them last (defaults filled in, scheduled lr)
        # a group with an optimizer class of its own records it ("class")
        "optimizer": {"class": run.optimizer_class, "param_groups": [
            {**({"class": cls} if cls != run.optimizer_class else {}),
             "hyperparameters": jsonable({k: v for k, v in group.items() if k != "params"}),
             "state": {k: s.to_json() for k, s in sorted(state.items())}}
            for group, state, cls in zip(view.optimizer.param_groups,
                                         run.group_state or [{}] * len(classes), classes)]},
        "expert_parallel": None if view.expert_parallel is None else {
            "ep_rank": view.expert_parallel[0], "ep_size": view.expert_parallel[1]},
        "normalization": {"reduction": cfg.reduction, "normalize_over": cfg.normalize_over,
                          "missing_grad": cfg.missing_grad, "nonfinite": cfg.nonfinite},
        "config": cfg.to_dict(),
        "shards": [{k: r[k] for k in ("rank", "file", "bytes", "sha256")}
                   for r in sorted(records, key=lambda r: r["rank"])],
    }
    if owned:
        raw["partition"] = "tensors"
    if save_id is not None:
        raw["save_id"] = save_id  # the index.json of the same save holds it too
    Manifest.from_json(raw, where="manifest being written")  # the writer checks its own output
    write_manifest(staging, raw)
