"""Loading: check, read into fresh memory, agree, then swap ([Note: checkpoint format]).

Every rank checks the checkpoint against its run and reads every tensor of its shard into new
tensors, changing nothing. One exchange then agrees on the verdict and on the sha256 of the
manifest each rank read: a rank whose read failed (an I/O error after the checks), or ranks
pointed at different complete checkpoints (node-local copies, a stale network view, one rank
falling back to ``.previous``), make every rank raise with its state untouched. Only then does
every rank swap the new tensors in (``ShardView.install``).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.contract import agree_on_local_errors
from ..core.view import ShardView
from ..errors import CheckpointError, UsageError
from .atomic import MANIFEST_NAME, previous_folder
from .format import (ELEMENTWISE, VALUE, Manifest, RunSchema, VirtualRecord, check_against_run,
                     check_shard, describe_run, read_manifest, resolve_folder, state_specs,
                     tensor_key)
from .safetensors_io import LazyShard
from .save import local_phase, manifest_save_id

__all__ = ["load_checkpoint", "read_checkpoint", "install_read"]


@dataclass
class _Read:
    notes: list[str]
    manifest_sha256: bytes
    values: list[torch.Tensor]  # one per slot, in slot order
    states: dict[int, dict[str, torch.Tensor]]  # by slot index
    scheduled: list[dict[str, Any] | None]  # by this run's group: its saved hyperparameters


def load_checkpoint(view: ShardView, folder: str | Path) -> None:
    """Every rank calls this: all ranks load, or all raise the same error and keep their state."""
    folder = Path(folder)
    what = f"load_checkpoint({folder})"
    read, error = local_phase(read_checkpoint, view, folder)
    agree_on_local_errors(view.comm, error, what=what,
                          token=b"" if read is None else read.manifest_sha256,
                          token_error=CheckpointError,
                          token_what="checkpoint (the sha256 of its manifest.json differs)")
    install_read(view, read, what=what)


def read_checkpoint(view: ShardView, folder: str | Path, *, save_id: str | None = None,
                    indexed: bool = False) -> _Read:
    """This rank's part, checked and read into fresh memory; no collective, nothing changed.
    ``indexed`` (read through an index.json, whose ``save_id`` is given; None for an index
    written without one) reads the folder whose manifest holds that ``save_id``: ``folder``,
    or ``<folder>.previous`` after a save interrupted between
    putting instances in place ([Note: checkpoint index])."""
    return _check_and_read(view, Path(folder), save_id, indexed)


def install_read(view: ShardView, read: _Read, *, what: str) -> None:
    """Every rank of the group, once every rank agreed: swap the read state in."""
    for note in read.notes:
        warnings.warn(f"[rank {view.comm.rank}/{view.comm.size}] {what}: {note}", stacklevel=3)
    view.install(read.values, read.states, read.scheduled)


def _resolve(folder: Path, save_id: str | None, indexed: bool) -> tuple[Path, list[str]]:
    if not indexed:
        return resolve_folder(folder)
    seen = []
    for candidate in (folder, previous_folder(folder)):
        found = manifest_save_id(candidate)  # False: no readable manifest there
        if found is False:
            continue
        if found == save_id:
            notes = [] if candidate == folder else [
                f"{folder} holds a newer save than its index.json (a save of several instances "
                f"was interrupted before its index was written); loading {candidate}, the "
                "instance's part of the save the index names."]
            return candidate, notes
        seen.append(f"{candidate.name}: save {found}")
    raise CheckpointError(
        f"{folder}: no part of the save its index.json names (save {save_id}; found "
        f"{seen or 'no complete folder'}); the checkpoint mixes saves (a partial copy, or "
        "folders of another save). Load an earlier checkpoint.")


def _check_and_read(view: ShardView, folder: Path, save_id: str | None = None,
                    indexed: bool = False) -> _Read:
    if not view.idle:
        raise UsageError(f"load_checkpoint({folder}) was called in the middle of a step (window "
                         f"state {view.window_state}); call it before training or right after "
                         "step().")
    view.check_installable()
    path, notes = _resolve(folder, save_id, indexed)
    manifest = read_manifest(path)
    sha = hashlib.sha256((path / MANIFEST_NAME).read_bytes()).digest()
    run = describe_run(view)
    check_against_run(manifest, run, view.comm.size, str(path))
    if manifest.partition == "tensors":
        values, states = _read_owned(view, manifest, path, run.virtuals)
    else:
        shard = check_shard(path, manifest, view.comm.rank)
        values, states = _read_shard(view, manifest, shard, run.virtuals)
    return _Read(notes, sha, values, states, _saved_hyper_by_group(manifest, run,
                                                                   len(view.group_hyperparameters)))


def _saved_hyper_by_group(manifest: Manifest, run: RunSchema, groups: int
                          ) -> list[dict[str, Any] | None]:
    """For each of this run's optimizer groups, the hyperparameters of the saved group its
    parameters were in, matched by key (None where they came from several saved groups, or
    none): the groups may be numbered otherwise than in the saving run (review finding: matched
    by position, a parameter took another group's lr)."""
    by_key = manifest.virtual_by_key
    sources: list[set[int]] = [set() for _ in range(groups)]
    for v in run.virtuals:
        sources[v.group].add(by_key[v.key].group)
    return [manifest.group_hyper[next(iter(s))] if len(s) == 1 else None for s in sources]


def _read_shard(view: ShardView, manifest: Manifest, shard: Path, run: list[VirtualRecord]
                ) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    device = view.comm.device
    values: list[torch.Tensor] = []
    states: dict[int, dict[str, torch.Tensor]] = {}
    by_key = manifest.virtual_by_key  # by key: a resharded manifest may list another order
    with LazyShard(shard) as reader:
        for i, chunk in enumerate(view.chunks()):
            v = by_key[run[chunk.slot.virtual].key]
            values.append(_fresh(reader.read(tensor_key(v.key, VALUE)), device))
            if v.stateful:
                shape = chunk.segment.shape
                states[i] = {key: _fresh(reader.read(tensor_key(v.key, key)), device).reshape(
                    shape if spec.kind == ELEMENTWISE else ())
                    for key, spec in manifest.group_state[v.group].items()}
    if len(values) != len(view.chunks()):
        raise CheckpointError(f"{shard}: expected {len(view.chunks())} value tensors")
    return values, states


def _read_owned(view: ShardView, manifest: Manifest, folder: Path, run: list[VirtualRecord]
                ) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """Whole-tensor ownership: each tensor this rank owns, read whole from the shard of the
    rank that owned it when saved (checked first, once per shard read); [Note: checkpoint
    format]."""
    device = view.comm.device
    by_key = manifest.virtual_by_key
    chunks = view.chunks()
    wanted = [by_key[run[c.slot.virtual].key] for c in chunks]
    readers = {r: LazyShard(check_shard(folder, manifest, r))
               for r in sorted({v.owner for v in wanted if v.owner is not None})}
    values: list[torch.Tensor] = []
    states: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for i, (chunk, v) in enumerate(zip(chunks, wanted)):
            assert v.owner is not None
            reader = readers[v.owner]
            value = _fresh(reader.read(tensor_key(v.key, VALUE)), device)
            if tuple(value.shape) != tuple(chunk.segment.shape):
                raise CheckpointError(f"{v.key}: saved value of shape {list(value.shape)}, this "
                                      f"run's parameter is {list(chunk.segment.shape)}")
            values.append(value)
            if v.stateful:
                states[i] = {key: _fresh(reader.read(tensor_key(v.key, key)), device)
                             for key in state_specs(manifest, v)}
    finally:
        for reader in readers.values():
            reader.close()
    return values, states


def _fresh(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy in new memory (never a view of the file's mapping)."""
    return tensor.to(device=device, copy=True)
