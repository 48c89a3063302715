"""Which checkpoint an offline tool was pointed at.

``selzero inspect`` / ``reshard`` / ``consolidate`` take an instance folder (``manifest.json``),
a selzero folder (``index.json``) or the host checkpoint holding one (``checkpoint-N``, a
DeepSpeed tag folder: ``selected_zero2/index.json`` inside). A parent folder that holds exactly
one of these below it (``selzero demo --out DIR``, a Trainer output folder with one
``checkpoint-N``, a DeepSpeed save folder with one tag) stands for it; one that holds several
is an error listing them. Staging and ``.previous`` folders are never candidates.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError
from .atomic import MANIFEST_NAME, is_staging
from .host import FOLDER, INDEX

__all__ = ["locate"]

_DEPTH = 4  # DIR/checkpoint-N/selected_zero2/<instance>: the deepest a tool's folder sits


def _is_checkpoint(folder: Path) -> bool:
    return (folder / MANIFEST_NAME).is_file() or (folder / INDEX).is_file() or \
        (folder / FOLDER / INDEX).is_file()


def _candidates(folder: Path, depth: int) -> list[Path]:
    if depth == 0:
        return []
    found = []
    for child in sorted(p for p in folder.iterdir() if p.is_dir()):
        if is_staging(child) or child.name.endswith(".previous") or ".replaced-" in child.name:
            continue
        found += [child] if _is_checkpoint(child) else _candidates(child, depth - 1)
    return found


def locate(folder: str | Path, *, tool: str) -> Path:
    """``folder`` itself when it is a checkpoint (or not a folder: the tool's own error then
    says why), else the one checkpoint below it."""
    path = Path(folder)
    if not path.is_dir() or is_staging(path) or _is_checkpoint(path):
        return path
    for name in (FOLDER, ""):  # an interrupted replacement left only the previous one
        previous = path / f"{name}.previous" if name else path.with_name(f"{path.name}.previous")
        if (previous / INDEX).is_file() or (previous / MANIFEST_NAME).is_file():
            raise CheckpointError(
                f"{path} holds no complete checkpoint, but {previous} does: a replacement (a "
                "save over it, `selzero reshard --force`) was interrupted. Rename it to "
                f"{previous.name[:-len('.previous')]} to use it.")
    found = sorted(_candidates(path, _DEPTH), key=_natural)
    if len(found) > 1:
        listed = "\n  ".join(str(p) for p in found[:20])
        latest = path / "latest"  # DeepSpeed names its newest tag there
        tag = latest.read_text().strip() if latest.is_file() else ""
        pick = next((p for p in found if tag and p.name == tag), found[-1])
        raise CheckpointError(
            f"{path} holds {len(found)} checkpoints; name the one you mean, e.g. `selzero {tool} "
            f"{pick}`{' (the `latest` tag)' if pick.name == tag else ' (the last)'}:\n  {listed}")
    return found[0] if found else path


def _natural(p: Path) -> list[object]:
    """checkpoint-9 before checkpoint-10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]
