"""selzero's folder inside a host's checkpoint: ``<host checkpoint>/selected_zero2/``.

One sub-folder per instance (``<name>/``, DESIGN.md section 2) and ``index.json``:
``{"format": 1, "instances": [{"name": ..., "ranks": [global ranks of its group]}]}``, written
by global rank 0 after every instance's folder is complete. Integrations (DeepSpeed, Accelerate,
the HF Trainer) save and load through these two functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from ..core.zero2 import SelectedZero2
from ..errors import CheckpointError, UsageError
from .atomic import fsync_dir

__all__ = ["FOLDER", "INDEX", "save_into", "load_from", "has_folder", "read_index"]

FOLDER = "selected_zero2"
INDEX = "index.json"
INDEX_FORMAT = 1


def _check_names(instances: Sequence[SelectedZero2]) -> None:
    names = [sz.config.name for sz in instances]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"two selzero instances are both named {dup[0]!r}; their checkpoint "
                         "folders would collide. Give each a distinct `name` in its config.")


def save_into(host_dir: str | os.PathLike[str], instances: Sequence[SelectedZero2], *,
              rank: int, index_instances: Sequence[dict] | None = None) -> Path:
    """Every rank calls it: each instance saves into ``<host_dir>/selected_zero2/<name>/``;
    then ``rank`` 0 writes ``index.json``, listing ``index_instances`` (every instance of the
    job, ``{"name", "ranks"}``, when ranks hold different ones: expert parallelism) or this
    rank's. Returns the selzero folder."""
    _check_names(instances)
    root = Path(host_dir) / FOLDER
    for sz in instances:
        sz.save_checkpoint(root / sz.config.name)
    if rank == 0:
        listed = list(index_instances) if index_instances is not None else [
            {"name": sz.config.name, "ranks": list(sz.comm.global_ranks)} for sz in instances]
        index = {"format": INDEX_FORMAT, "instances": listed}
        tmp = root / (INDEX + ".tmp")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / INDEX)
        fsync_dir(root)
    return root


def has_folder(host_dir: str | os.PathLike[str]) -> bool:
    return (Path(host_dir) / FOLDER).is_dir()


def read_index(host_dir: str | os.PathLike[str]) -> dict:
    path = Path(host_dir) / FOLDER / INDEX
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r}: selzero's index of the checkpoint is missing or "
                              f"unreadable ({e}); the save did not complete. Load an earlier "
                              "checkpoint.") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise CheckpointError(f"{str(path)!r}: format {index.get('format') if isinstance(index, dict) else index!r}, "
                              f"expected {INDEX_FORMAT}; upgrade selzero_plugin to read it.")
    return index


def load_from(host_dir: str | os.PathLike[str], instances: Sequence[SelectedZero2]) -> None:
    """Every rank calls it: each instance loads ``<host_dir>/selected_zero2/<name>/`` (all
    ranks of its group load, or all raise the same CheckpointError and keep their state)."""
    _check_names(instances)
    root = Path(host_dir) / FOLDER
    for sz in instances:
        sz.load_checkpoint(root / sz.config.name)
