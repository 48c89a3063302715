"""Loading: check everything, agree, then stream the state in place ([Note: checkpoint format]).

[Note: streaming load]
Every rank first checks the checkpoint against its run without reading any tensor: manifest,
format, group size, contract, optimizer class and state keys, and each shard it will read in
full (size, sha256, the safetensors header against the manifest's plan), through one open
descriptor per shard. One exchange then agrees on the verdict and on the sha256 of the
manifest each rank read: a failed check on any rank, or ranks pointed at different complete
checkpoints (node-local copies, a stale network view, one rank falling back to
``.previous``), make every rank raise with its state untouched. Only then does each rank read
its tensors one slot at a time, through the descriptors it checked (a checkpoint saved over
the folder meanwhile is never read), straight into place: a value into its segment, optimizer
state into the flat step's own buffers (never into tensors a user put in the optimizer; the
read tensors themselves where the flat step does not hold the state), so a load needs no
memory beyond one slot's tensors. It used to read the rank's whole share into fresh memory
first: +105 MiB on workload a, where ``torch.distributed.checkpoint`` loads in place. A second
exchange agrees that every rank wrote its part; then the full parameters are all-gathered.
What this gives up: a read that fails *after* its file passed the checksum (the disk fails,
or the file is rewritten in place) leaves a mixture. Every rank then raises, and the instance
refuses ``step()``, ``reduce_gradients()`` and every save on every rank until a load succeeds.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.comm import Communicator
from ..core.contract import agree_on_local_errors
from ..core.view import ShardView
from ..errors import CheckpointError, SelZeroError, UsageError
from .atomic import MANIFEST_NAME, previous_folder
from .format import (ELEMENTWISE, VALUE, Manifest, RunSchema, VirtualRecord, check_against_run,
                     describe_run, open_shard, read_manifest, resolve_folder, state_specs,
                     tensor_key, tensor_shape)
from .safetensors_io import LazyShard
from .save import local_phase, manifest_save_id

__all__ = ["load_checkpoint", "read_checkpoint", "install_read", "finish_loads",
           "close_reads"]


@dataclass
class _Read:
    """A checked checkpoint, ready to be streamed in: where each slot's tensors are, through
    the descriptors the checks read (``close()`` them)."""

    notes: list[str]
    manifest_sha256: bytes
    slots: list["_SlotSource"]  # in slot order
    scheduled: list[dict[str, Any] | None]  # by this run's group: its saved hyperparameters
    readers: list[LazyShard]

    def close(self) -> None:
        for reader in self.readers:
            reader.close()


def close_reads(reads: list[_Read | None]) -> None:
    for read in reads:
        if read is not None:
            read.close()


@dataclass(frozen=True)
class _SlotSource:
    shard: LazyShard  # open on the file the checks read
    value: str  # tensor name of the value
    shape: tuple[int, ...]  # this run's segment shape
    state: tuple[tuple[str, str, tuple[int, ...]], ...] | None  # (state key, tensor name, shape)


def load_checkpoint(view: ShardView, folder: str | Path) -> None:
    """Every rank calls this: all ranks load, or all raise the same error; a failed check
    changes nothing ([Note: streaming load])."""
    folder = Path(folder)
    what = f"load_checkpoint({folder})"
    read, error = local_phase(read_checkpoint, view, folder)
    try:
        agree_on_local_errors(view.comm, error, what=what,
                              token=b"" if read is None else read.manifest_sha256,
                              token_error=CheckpointError,
                              token_what="checkpoint (the sha256 of its manifest.json differs)")
    except SelZeroError:
        close_reads([read])
        raise
    assert read is not None
    finish_loads(view.comm, [view], install_read(view, read, what=what), what=what)


def read_checkpoint(view: ShardView, folder: str | Path, *, save_id: str | None = None,
                    indexed: bool = False) -> _Read:
    """This rank's part, checked (every shard it reads: size, sha256, header); no tensor is
    read, no collective, nothing changed. ``indexed`` (read through an index.json, whose
    ``save_id`` is given; None for an index written without one) reads the folder whose
    manifest holds that ``save_id``: ``folder``, or ``<folder>.previous`` after a save
    interrupted between putting instances in place ([Note: checkpoint index])."""
    return _check_and_read(view, Path(folder), save_id, indexed)


def install_read(view: ShardView, read: _Read, *, what: str) -> CheckpointError | None:
    """Local, once every rank agreed on the checks: stream the tensors in place. Returns the
    error to agree on (``finish_loads``), None when this rank wrote its whole part."""
    for note in read.notes:
        warnings.warn(f"[rank {view.comm.rank}/{view.comm.size}] {what}: {note}", stacklevel=3)

    def source(i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        slot = read.slots[i]
        reader = slot.shard
        value = reader.read(slot.value)
        if tuple(value.shape) != slot.shape and value.numel() == math.prod(slot.shape):
            value = value.reshape(slot.shape)
        if tuple(value.shape) != slot.shape:
            raise CheckpointError(f"{slot.value}: saved value of shape {list(value.shape)}, "
                                  f"this run's segment is {list(slot.shape)}")
        if slot.state is None:
            return value, None
        return value, {key: reader.read(name).reshape(shape) for key, name, shape in slot.state}

    try:
        view.install(source, read.scheduled)
    except Exception as e:  # noqa: BLE001 - I/O and decode failures of any kind
        return CheckpointError(
            f"[rank {view.comm.rank}/{view.comm.size}] {what}: reading the checked shard into "
            f"place failed ({type(e).__name__}: {e}); the files passed their sha256 check just "
            "before, so the disk failed or a file was rewritten in place meanwhile.")
    finally:
        read.close()
    return None


def finish_loads(comm: Communicator, views: list[ShardView], error: SelZeroError | None, *,
                 what: str) -> None:
    """Every rank, after ``install_read`` of every instance: agree that every rank wrote its
    part, then all-gather each instance's parameters; if any rank failed, every instance
    refuses to step on every rank and every rank raises ([Note: streaming load])."""
    try:
        agree_on_local_errors(comm, error, what=what)
    except SelZeroError as e:
        for view in views:
            view.refuse_steps(str(e))
        raise
    for view in views:
        view.gather_installed()


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
    readers: list[LazyShard] = []
    try:
        if manifest.partition == "tensors":
            slots = _owned_sources(view, manifest, path, run.virtuals, readers)
        else:
            readers.append(open_shard(path, manifest, view.comm.rank))
            slots = _shard_sources(view, manifest, readers[0], run.virtuals)
    except BaseException:
        for reader in readers:
            reader.close()
        raise
    return _Read(notes, sha, slots, _saved_hyper_by_group(manifest, run,
                                                          len(view.group_hyperparameters)),
                 readers)


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


def _shard_sources(view: ShardView, manifest: Manifest, shard: LazyShard,
                   run: list[VirtualRecord]) -> list[_SlotSource]:
    by_key = manifest.virtual_by_key  # by key: a resharded manifest may list another order
    out = []
    for chunk in view.chunks():
        v = by_key[run[chunk.slot.virtual].key]
        shape = tuple(chunk.segment.shape)
        state = tuple((key, tensor_key(v.key, key), shape if spec.kind == ELEMENTWISE else ())
                      for key, spec in manifest.group_state[v.group].items()) \
            if v.stateful else None
        out.append(_SlotSource(shard, tensor_key(v.key, VALUE), shape, state))
    return out


def _owned_sources(view: ShardView, manifest: Manifest, folder: Path, run: list[VirtualRecord],
                   readers: list[LazyShard]) -> list[_SlotSource]:
    """Whole-tensor ownership: each tensor this rank owns, read whole from the shard of the
    rank that owned it when saved (each such shard checked here, once, and kept open in
    ``readers``); [Note: checkpoint format]."""
    by_key = manifest.virtual_by_key
    chunks = view.chunks()
    wanted = [by_key[run[c.slot.virtual].key] for c in chunks]
    shards: dict[int, LazyShard] = {}
    for r in sorted({v.owner for v in wanted if v.owner is not None}):
        shards[r] = open_shard(folder, manifest, r)
        readers.append(shards[r])
    out = []
    for chunk, v in zip(chunks, wanted):
        assert v.owner is not None
        specs = state_specs(manifest, v)
        state = tuple((key, tensor_key(v.key, key), tensor_shape(v, spec))
                      for key, spec in specs.items()) if v.stateful else None
        out.append(_SlotSource(shards[v.owner], tensor_key(v.key, VALUE),
                               tuple(chunk.segment.shape), state))
    return out
