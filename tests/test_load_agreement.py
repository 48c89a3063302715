"""Loads are atomic and agreed (DESIGN.md section 2): every tensor is read into fresh memory
first, the ranks agree on the verdict *and on the manifest's sha256*, and only then is state
swapped in. A rank that fails to read its shard after the checks, or ranks pointed at different
complete checkpoints, make every rank raise and keep its parameters, FP32 masters and optimizer
state bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ._ckpt import make, train
from ._state import differences, snapshot
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc


def _full_snapshot(model: Any, sz: Any) -> dict[str, Any]:
    return {**snapshot(model, sz),
            **{f"segment{i}": s.detach().clone() for i, s in enumerate(sz.segments)}}


def _fail_reads_on(rank_to_fail: int, rank: int) -> None:
    from selzero_plugin.checkpoint.safetensors_io import LazyShard

    read = LazyShard.read

    def failing(self: Any, key: str) -> torch.Tensor:
        if rank == rank_to_fail:
            raise OSError(5, "Input/output error (injected)")
        return read(self, key)

    LazyShard.read = failing


def refused_load_run(rank: int, world: int, root: str, scenario: str) -> dict[str, Any]:
    model, sz = make("toy", "AdamW", seed=0, dtype=torch.bfloat16)
    train(model, sz, rank, range(0, 2), save_at=2)
    sz.save_checkpoint(f"{root}/a")
    train(model, sz, rank, range(2, 3), save_at=2)
    sz.save_checkpoint(f"{root}/b")
    train(model, sz, rank, range(3, 4), save_at=2)
    before = _full_snapshot(model, sz)
    if scenario == "read_fails_on_rank_1":
        _fail_reads_on(1, rank)
        folder = f"{root}/a"
    else:  # each rank sees a complete checkpoint, but not the same one
        folder = f"{root}/a" if rank == 0 else f"{root}/b"
    error = None
    try:
        sz.load_checkpoint(folder)
    except Exception as e:  # noqa: BLE001 - the test checks the class
        error = (type(e).__name__, str(e))
    after = _full_snapshot(model, sz)
    # and the instance still trains (nothing half-swapped)
    train(model, sz, rank, range(4, 5), save_at=2)
    return {"error": error, "changed": differences(before, after)}


@pytest.mark.parametrize("scenario", ["read_fails_on_rank_1", "different_checkpoints"])
def test_a_refused_load_changes_nothing_on_any_rank(tmp_path, scenario):
    runs = all_values(run_ranks(refused_load_run, 2, str(tmp_path), scenario, timeout=120))
    for rank, run in enumerate(runs):
        assert run["error"] is not None and run["error"][0] == "CheckpointError", (rank, run)
        assert run["changed"] == [], (rank, run["changed"][:5])
    if scenario == "different_checkpoints":
        assert all("different checkpoint" in r["error"][1] for r in runs), runs
    else:
        assert all("group rank 1" in r["error"][1] for r in runs), runs
