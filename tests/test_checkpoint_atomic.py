"""Atomicity: a save killed at any point leaves the previous checkpoint loadable by
``load_checkpoint(folder)`` and the interrupted one detected as incomplete ([Note: atomic save]).

A 2-rank save over an existing checkpoint is killed (``os._exit``) at each point of
``selzero_plugin.checkpoint.atomic.CRASH_POINTS``: rank 1 while writing its shard, and rank 0 (the rank that
puts the folder in place) before the renames, between them, and before deleting the old folder.
One more 2-rank launch then loads every folder. The unit tests at the end drive the same
protocol in one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from selzero_plugin.checkpoint import atomic
from selzero_plugin.checkpoint import resolve_folder
from selzero_plugin.checkpoint.tools import inspect
from selzero_plugin.errors import CheckpointError

from . import _ckpt
from .dist_utils import all_values, run_ranks

CRASHES = [("mid_shard", 1), ("before_place", 0), ("between_renames", 0),
           ("before_delete_previous", 0)]
_state: dict[str, Any] = {}


def _crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _state:
        root = tmp_path_factory.mktemp("atomic")
        old = root / "old"
        saved = all_values(run_ranks(_ckpt.save_only, 2, str(old), kind="fused", opt="AdamW",
                                     k=2, timeout=240))
        exits = {}
        for point, crash_rank in CRASHES:
            folder = root / point / "ckpt"
            folder.parent.mkdir()
            shutil.copytree(old, folder)
            exits[point] = _ckpt.run_ranks_with_crash(
                _ckpt.crash_while_saving, 2, str(folder), kind="fused", opt="AdamW", k=3,
                point=point, crash_rank=crash_rank)
        snapshot = {p: _tree(root / p) for p, _ in CRASHES}
        inspect_between = inspect(root / "between_renames" / "ckpt").problems
        resave = root / "between_renames" / "ckpt"
        loads = all_values(run_ranks(_ckpt.load_many, 2,
                                     [str(root / p / "ckpt") for p, _ in CRASHES]
                                     + [str(root / "before_delete_previous" / "ckpt.previous")],
                                     kind="fused", opt="AdamW", then_save=str(resave),
                                     timeout=240))
        _state.update(root=root, old=old, saved=saved, exits=exits, snapshot=snapshot,
                      inspect_between=inspect_between,
                      loads={p: [loads[r][i] for r in range(2)]
                             for i, p in enumerate([p for p, _ in CRASHES] + ["previous"])})
    return _state


def _tree(folder: Path) -> dict[str, list[str]]:
    """Sibling folders after the crash, with their file names."""
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(folder.iterdir())}


def _loaded_old(s: dict[str, Any], point: str) -> None:
    for r, res in enumerate(s["loads"][point]):
        assert res["error"] is None, res["error"]
        assert _ckpt.same(res["params"], s["saved"][r]["params"]), f"rank {r}"
        assert _ckpt.same(res["state"], s["saved"][r]["state"]), f"rank {r}"


@pytest.mark.multiproc
@pytest.mark.parametrize("point,crash_rank", CRASHES)
def test_the_killed_rank_died_at_the_crash_point(point, crash_rank, tmp_path_factory):
    assert _crashed(tmp_path_factory)["exits"][point][crash_rank] == 17


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["mid_shard", "before_place"])
def test_a_save_killed_before_the_renames_leaves_the_old_folder_in_place(point, tmp_path_factory):
    s = _crashed(tmp_path_factory)
    tree = s["snapshot"][point]
    assert tree["ckpt"] == sorted(p.name for p in s["old"].iterdir())
    staging = [name for name in tree if ".staging-" in name]
    if point == "mid_shard":
        # rank 1 died while writing: rank 0's agreement raised CollectiveError and rank 0
        # removed the staging folder (a crash of rank 0 itself would leave it: before_place)
        assert staging == [], tree
        _loaded_old(s, point)
        return
    assert len(staging) == 1, tree
    _loaded_old(s, point)
    for res in s["loads"][point]:
        assert any("unfinished save" in w and staging[0] in w for w in res["warnings"])
    report = inspect(s["root"] / point / staging[0], verify_shards=True)
    assert report.problems and "unfinished save" in report.problems[0]


@pytest.mark.multiproc
def test_a_save_killed_between_the_renames_loads_the_previous_folder_with_a_warning(
        tmp_path_factory):
    s = _crashed(tmp_path_factory)
    tree = s["snapshot"]["between_renames"]
    assert "ckpt" not in tree and "ckpt.previous" in tree
    _loaded_old(s, "between_renames")
    for res in s["loads"]["between_renames"]:
        assert any("interrupted while replacing" in w and "ckpt.previous" in w
                   for w in res["warnings"])
    # an offline tool does not fall back silently: it says where the complete checkpoint is
    assert "ckpt.previous holds the last complete checkpoint" in s["inspect_between"][0]


@pytest.mark.multiproc
def test_a_save_killed_before_deleting_the_old_folder_has_both_complete(tmp_path_factory):
    s = _crashed(tmp_path_factory)
    tree = s["snapshot"]["before_delete_previous"]
    assert "manifest.json" in tree["ckpt"] and "manifest.json" in tree["ckpt.previous"]
    for r, res in enumerate(s["loads"]["before_delete_previous"]):
        assert res["error"] is None and res["warnings"] == []
        assert not _ckpt.same(res["params"], s["saved"][r]["params"])  # the new save
    _loaded_old(s, "previous")


@pytest.mark.multiproc
def test_the_next_save_after_a_crash_cleans_up(tmp_path_factory):
    s = _crashed(tmp_path_factory)
    folder = s["root"] / "between_renames"
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt"]
    assert not inspect(folder / "ckpt", verify_shards=True).problems


# ---- the protocol in one process ------------------------------------------------------------


def _fake_checkpoint(folder: Path, tag: str) -> None:
    folder.mkdir(parents=True)
    (folder / "shard-00000-of-00001.safetensors").write_text(tag)
    (folder / atomic.MANIFEST_NAME).write_text(tag)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("point", atomic.CRASH_POINTS[1:])
def test_put_in_place_interrupted_at_any_point_leaves_a_complete_checkpoint(point, tmp_path):
    folder = tmp_path / "ckpt"
    _fake_checkpoint(folder, "old")
    staging = atomic.make_staging(folder)
    (staging / "shard-00000-of-00001.safetensors").write_text("new")
    (staging / atomic.MANIFEST_NAME).write_text("new")

    def hook(at: str) -> None:
        if at == point:
            raise _Crash(at)

    atomic.set_crash_hook(hook)
    try:
        with pytest.raises(_Crash):
            atomic.put_in_place(staging, folder)
    finally:
        atomic.set_crash_hook(None)
    found, notes = resolve_folder(folder)
    expected = "new" if point == "before_delete_previous" else "old"
    assert (found / atomic.MANIFEST_NAME).read_text() == expected
    assert bool(notes) == (point != "before_delete_previous")


def test_put_in_place_replaces_and_cleans_up(tmp_path):
    folder = tmp_path / "ckpt"
    _fake_checkpoint(folder, "old")
    crashed = atomic.make_staging(folder)  # a leftover of an earlier crash
    staging = atomic.make_staging(folder)
    (staging / atomic.MANIFEST_NAME).write_text("new")
    atomic.put_in_place(staging, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (folder / atomic.MANIFEST_NAME).read_text() == "new"
    assert not crashed.exists()


def test_cannot_save_over_a_folder_that_is_not_a_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    assert "not a selzero checkpoint" in atomic.refuse_to_replace(folder)
    (folder / "notes.txt").unlink()
    assert atomic.refuse_to_replace(folder) is None  # an empty folder may be used


def test_cannot_resolve_a_folder_without_a_complete_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_folder(tmp_path / "nothing")
    (tmp_path / "partial").mkdir()
    with pytest.raises(CheckpointError, match="incomplete save"):
        resolve_folder(tmp_path / "partial")


@pytest.mark.parametrize("name", ["ckpt.staging-20240101", "ckpt.previous"])
def test_a_folder_named_like_selzero_sibling_folders_is_refused(tmp_path, name):
    """A save into ``ckpt.staging-20240101`` (a date) was accepted, refused at load as a staging
    folder, and deleted by the next save of ``ckpt`` (review finding)."""
    import torch

    from selzero_plugin import SelectedZero2, SelZeroConfig

    from .models import ToyMoE

    sz = SelectedZero2(ToyMoE(), SelZeroConfig(params=["experts.*"]), torch.optim.SGD,
                       {"lr": 0.1})
    with pytest.raises(CheckpointError, match="Choose another name"):
        sz.save_checkpoint(tmp_path / name)
    assert not (tmp_path / name).exists()
