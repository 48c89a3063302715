"""Reliability 3: ``kill -9`` of any rank at any point of ``save_checkpoint``.

tests/test_checkpoint_atomic.py stops a save at the four named points of [Note: atomic save].
This module does not trust the names: it counts every file-system operation a 2-rank save
performs on each rank (every chunk written into a shard, every fsync, mkdir, rename, rmdir,
rmtree, the manifest's write) and sends SIGKILL to one rank just before or just after one of
them, over many trials (every operation of rank 0, which puts the folder in place, but the
writes of tensor bytes, plus a seeded sample of those on both ranks), for a save over an existing checkpoint and a save into a new
folder. After each kill one more launch loads every trial's folders:

- the previous checkpoint always loads and equals what was saved (over an existing one:
  ``load_checkpoint(folder)`` gives the old state, or the new one once the new folder is in
  place; into a new folder: the old folder loads and is untouched);
- the interrupted save is refused as incomplete (its folder is absent or holds the old
  checkpoint; a staging folder left behind is refused by ``load_checkpoint``), never a mixture;
- the offline verifier finds no problem in the folder that loads.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from selzero_plugin.checkpoint import atomic
from selzero_plugin.checkpoint import safetensors_io
from selzero_plugin.checkpoint.tools import inspect

from .. import _ckpt
from ..dist_utils import all_values, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

KIND, OPT = "fused", "AdamW"
SAMPLE_WRITES = 6  # trials in the middle of a shard write, over both ranks


def _instrument(rank: int, kill_at: tuple[int, int, str] | None, ops: list[str]) -> None:
    """Count file-system operations of this rank; SIGKILL at ``kill_at`` = (rank, index,
    "before" | "after")."""
    def wrap(name: str, fn: Any) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            index = len(ops)
            ops.append(name)
            doomed = kill_at is not None and kill_at[0] == rank and kill_at[1] == index
            if doomed and kill_at[2] == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = fn(*args, **kwargs)
            if doomed:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return op

    for name in ("rename", "replace", "fsync", "mkdir", "rmdir"):
        setattr(os, name, wrap(f"os.{name}", getattr(os, name)))
    shutil.rmtree = wrap("shutil.rmtree", shutil.rmtree)
    Path.write_text = wrap("Path.write_text", Path.write_text)
    emit = safetensors_io.StreamingWriter._emit
    safetensors_io.StreamingWriter._emit = wrap("shard.write", emit)


def save_run(rank: int, world: int, old: str, new: str, kill_at: tuple[int, int, str] | None
             ) -> dict[str, Any]:
    """Train 3 steps (newer than the checkpoint in ``old``), then save into ``new`` with a
    kill at ``kill_at``; returns the operations counted and the state saved."""
    model, sz = _ckpt.make(KIND, OPT, seed=0, config_overrides={"timeout_s": 5.0})
    _ckpt.train(model, sz, rank, range(3), 3)
    ops: list[str] = []
    _instrument(rank, kill_at, ops)
    sz.save_checkpoint(new)
    return {"ops": ops, "params": _ckpt.params_of(model), "state": _ckpt.state_of(sz)}


def _assigned(ops: dict[int, list[str]], rng: random.Random) -> list[tuple[int, int, str]]:
    """Before each of rank 0's operations but the shard writes (and after its last), before a
    sample of the shard writes of both ranks. Just after operation i is just before i + 1 on
    the same rank (nothing else touches the disk in between)."""
    trials = [(0, i, "before") for i, op in enumerate(ops[0]) if op != "shard.write"]
    trials.append((0, len(ops[0]) - 1, "after"))
    writes = [(r, i, "before") for r in range(2) for i, op in enumerate(ops[r])
              if op == "shard.write"]
    return trials + sorted(rng.sample(writes, min(SAMPLE_WRITES, len(writes))))


@pytest.fixture(scope="module")
def trials(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("kill9")
    base = root / "base"
    old_state = all_values(run_ranks(_ckpt.save_only, 2, str(base), kind=KIND, opt=OPT, k=2,
                                     timeout=120))
    plan, ops, new_state = [], {}, []
    for mode in ("over", "fresh"):
        dry = root / f"dry-{mode}"
        shutil.copytree(base, dry)
        counted = all_values(run_ranks(save_run, 2, str(dry),
                                       str(dry if mode == "over" else root / "dry-new"), None,
                                       timeout=120))
        ops[mode] = {r: counted[r]["ops"] for r in range(2)}
        new_state = [{"params": c["params"], "state": c["state"]} for c in counted]
        for kill_at in _assigned(ops[mode], random.Random(mode)):
            trial = root / f"{mode}-r{kill_at[0]}-{kill_at[1]:03d}-{kill_at[2]}"
            trial.mkdir()
            old = trial / "ckpt"
            shutil.copytree(base, old)
            new = old if mode == "over" else trial / "new"
            exits = _ckpt.run_ranks_with_crash(save_run, 2, str(old), str(new), kill_at,
                                               timeout=60)
            plan.append({"mode": mode, "kill_at": kill_at, "old": old, "new": new,
                         "exits": exits})
    folders = []
    for t in plan:
        folders.append(str(t["old"]))
        if t["mode"] == "fresh":
            folders.append(str(t["new"]))
        t["stagings"] = atomic.leftover_stagings(t["new"])
        folders += [str(s) for s in t["stagings"]]
    loads = all_values(run_ranks(_ckpt.load_many, 2, folders, kind=KIND, opt=OPT, timeout=300))
    by_folder = {f: [loads[r][i] for r in range(2)] for i, f in enumerate(folders)}
    yield {"ops": ops, "plan": plan, "loads": by_folder, "old": old_state, "new": new_state}


def _equals(loaded: list[dict[str, Any]], saved: list[dict[str, Any]]) -> bool:
    return all(res["error"] is None and _ckpt.same(res["params"], saved[r]["params"])
               and _ckpt.same(res["state"], saved[r]["state"]) for r, res in enumerate(loaded))


def test_the_save_performs_enough_operations_to_be_interesting(trials):
    over, fresh = trials["ops"]["over"], trials["ops"]["fresh"]
    assert over[0].count("os.rename") == 2 and "shutil.rmtree" in over[0], over[0]
    assert fresh[0].count("os.rename") == 1, fresh[0]
    assert over[1].count("shard.write") >= 3, over[1]
    assert len(trials["plan"]) == sum(len(_assigned(o, random.Random(0))) for o in (over, fresh))


def test_every_killed_rank_died(trials):
    for t in trials["plan"]:
        assert t["exits"][t["kill_at"][0]] == -signal.SIGKILL, t


def test_the_previous_checkpoint_always_loads_and_the_interrupted_one_is_refused(trials):
    outcomes = {"old": 0, "new": 0, "refused": 0, "stagings_refused": 0}
    for t in trials["plan"]:
        loads = trials["loads"]
        old_loaded = loads[str(t["old"])]
        if t["mode"] == "over":
            # the folder holds the old checkpoint until the new one is in place, never a mixture
            is_old, is_new = _equals(old_loaded, trials["old"]), _equals(old_loaded, trials["new"])
            assert is_old or is_new, (t, [r["error"] for r in old_loaded])
            outcomes["old" if is_old else "new"] += 1
        else:
            assert _equals(old_loaded, trials["old"]), (t, [r["error"] for r in old_loaded])
            new_loaded = loads[str(t["new"])]
            if _equals(new_loaded, trials["new"]):
                outcomes["new"] += 1
            else:
                for res in new_loaded:
                    assert res["error"] and res["error"].startswith("CheckpointError"), (t, res)
                outcomes["refused"] += 1
        for staging in t["stagings"]:
            for res in loads[str(staging)]:
                assert res["error"] and res["error"].startswith("CheckpointError"), (t, res)
            outcomes["stagings_refused"] += 1
        for folder in {t["old"], t["new"]}:
            if Path(folder, atomic.MANIFEST_NAME).is_file():
                assert inspect(folder, verify_shards=True).problems == [], (t, folder)
    # the kills hit both sides of the put-in-place
    assert outcomes["old"] > 0 and outcomes["new"] > 0 and outcomes["refused"] > 0, outcomes
