"""Putting a finished checkpoint folder in place without ever leaving a mixture.

[Note: atomic save]
A save never writes into the destination ``folder``. It writes into a sibling
``<folder>.staging-<8 hex>`` (same parent, so renames are atomic), fsyncs every file, and writes
``manifest.json`` last: a folder without a manifest is an interrupted write. Then one process
puts it in place:

1. if ``folder`` exists (complete, by the invariant below): remove a stale
   ``<folder>.previous`` and rename ``folder`` -> ``<folder>.previous``;
2. rename the staging folder -> ``folder``;
3. delete ``<folder>.previous`` and any other staging folder of ``folder`` left by a crash.

Invariant: ``folder``, whenever it exists, is a complete checkpoint. A crash before step 1 leaves
the old ``folder`` untouched; between steps 1 and 2 only ``<folder>.previous`` is complete, and
``load_checkpoint(folder)`` loads it with a warning; after step 2 the new checkpoint is in place.
A staging folder is never loaded: it is an unfinished save whatever it holds.

Tests stop a save at a precise point with ``set_crash_hook`` (the hook may ``os._exit``); the
points are listed in ``CRASH_POINTS``.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Callable

__all__ = ["MANIFEST_NAME", "CRASH_POINTS", "staging_folder", "previous_folder", "is_staging",
           "leftover_stagings", "refuse_to_replace", "make_staging", "put_in_place", "fsync_dir",
           "fsync_file", "set_crash_hook", "crash_point"]

MANIFEST_NAME = "manifest.json"
_STAGING = ".staging-"
_STAGING_RE = re.compile(r"\.staging-[0-9a-f]{8}$")
CRASH_POINTS = (
    "mid_shard",  # a rank wrote part of its shard (called by the checkpoint writer)
    "before_place",  # the manifest is in the staging folder; nothing renamed yet
    "between_renames",  # the old folder is at <folder>.previous; the new one not yet in place
    "before_delete_previous",  # the new folder is in place; <folder>.previous not yet deleted
)
_crash_hook: Callable[[str], None] | None = None


def set_crash_hook(hook: Callable[[str], None] | None) -> None:
    """Test hook: ``hook(point)`` runs at each point of ``CRASH_POINTS`` (None removes it)."""
    global _crash_hook
    _crash_hook = hook


def crash_point(point: str) -> None:
    assert point in CRASH_POINTS, point
    if _crash_hook is not None:
        _crash_hook(point)


def staging_folder(folder: Path, token: str) -> Path:
    return folder.with_name(f"{folder.name}{_STAGING}{token}")


def previous_folder(folder: Path) -> Path:
    return folder.with_name(f"{folder.name}.previous")


def is_staging(path: Path) -> bool:
    return bool(_STAGING_RE.search(path.name))


def leftover_stagings(folder: Path) -> list[Path]:
    """Staging folders of ``folder`` that a crashed save left behind."""
    if not folder.parent.is_dir():
        return []
    prefix = folder.name + _STAGING
    return sorted(p for p in folder.parent.iterdir()
                  if p.name.startswith(prefix) and is_staging(p) and p.is_dir())


def refuse_to_replace(folder: Path) -> str | None:
    """Why ``folder`` must not be replaced by a save, or None when it may be."""
    if is_staging(folder) or folder.name.endswith(".previous"):
        return (f"{folder.name!r} ends like a name selzero gives its own sibling folders "
                "('.staging-' and 8 hex digits, '.previous'): a later save of the folder it "
                "seems to belong to would delete it, and a load refuses it. Choose another name.")
    if folder.exists() and not folder.is_dir():
        return f"{folder} exists and is not a folder; choose another checkpoint folder."
    if folder.is_dir() and not (folder / MANIFEST_NAME).is_file() and any(folder.iterdir()):
        return (f"{folder} exists and holds files but no {MANIFEST_NAME}, so it is not a selzero "
                "checkpoint; refusing to replace it. Remove it or save into another folder.")
    return None


def make_staging(folder: Path) -> Path:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(folder, secrets.token_hex(4))
    staging.mkdir()
    return staging


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where directories cannot sync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def put_in_place(staging: Path, folder: Path, *, keep_previous: bool = False) -> None:
    """Steps 1-3 of [Note: atomic save]; ``staging`` must already hold its manifest. With
    ``keep_previous`` step 3 is left to the caller (a save of several instances keeps every old
    folder until the index naming the new ones is in place: [Note: checkpoint index])."""
    parent = folder.parent
    previous = previous_folder(folder)
    fsync_dir(staging)
    crash_point("before_place")
    if folder.exists():
        if (folder / MANIFEST_NAME).is_file():
            if previous.exists():
                shutil.rmtree(previous)  # older than `folder`, which is complete
            os.rename(folder, previous)
            fsync_dir(parent)
            crash_point("between_renames")
        else:
            folder.rmdir()  # empty (refuse_to_replace allows nothing else); keep `previous`
    os.rename(staging, folder)
    fsync_dir(parent)
    if keep_previous:
        return
    crash_point("before_delete_previous")
    if previous.exists():
        shutil.rmtree(previous)
    for leftover in leftover_stagings(folder):
        shutil.rmtree(leftover, ignore_errors=True)
    fsync_dir(parent)
