"""Loads are agreed (DESIGN.md section 2, [Note: streaming load]): every shard is checked in
full first (size, sha256, header), the ranks agree on the verdict *and on the manifest's
sha256*, and only then is state written, in place. A rank whose check fails (here: an I/O error
while it reads its shard for the checksum), or ranks pointed at different complete checkpoints,
make every rank raise and keep its parameters, FP32 masters and optimizer state bit for bit. A
read that fails after the checks passed makes every rank raise too, and every rank then refuses
to step until a load succeeds."""

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


def _fail_on(rank_to_fail: int, rank: int, where: str) -> Any:
    """An I/O error on one rank: in the checksum read of the check phase (``check``) or in
    the read into place after the checks (``read``). Returns the undo."""
    from selzero_plugin.checkpoint import format as fmt
    from selzero_plugin.checkpoint.safetensors_io import LazyShard

    owner, name = (fmt, "sha256_file") if where == "check" else (LazyShard, "read")
    original = getattr(owner, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        if rank == rank_to_fail:
            raise OSError(5, "Input/output error (injected)")
        return original(*args, **kwargs)

    setattr(owner, name, failing)
    return lambda: setattr(owner, name, original)


def refused_load_run(rank: int, world: int, root: str, scenario: str) -> dict[str, Any]:
    model, sz = make("toy", "AdamW", seed=0, dtype=torch.bfloat16)
    train(model, sz, rank, range(0, 2), save_at=2)
    sz.save_checkpoint(f"{root}/a")
    train(model, sz, rank, range(2, 3), save_at=2)
    sz.save_checkpoint(f"{root}/b")
    train(model, sz, rank, range(3, 4), save_at=2)
    before = _full_snapshot(model, sz)
    if scenario == "check_fails_on_rank_1":
        _fail_on(1, rank, "check")
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


@pytest.mark.parametrize("scenario", ["check_fails_on_rank_1", "different_checkpoints"])
def test_a_refused_load_changes_nothing_on_any_rank(tmp_path, scenario):
    runs = all_values(run_ranks(refused_load_run, 2, str(tmp_path), scenario, timeout=120))
    for rank, run in enumerate(runs):
        assert run["error"] is not None and run["error"][0] == "CheckpointError", (rank, run)
        assert run["changed"] == [], (rank, run["changed"][:5])
    if scenario == "different_checkpoints":
        assert all("different checkpoint" in r["error"][1] for r in runs), runs
    else:
        assert all("group rank 1" in r["error"][1] for r in runs), runs


def read_fails_after_checks_run(rank: int, world: int, root: str) -> dict[str, Any]:
    model, sz = make("toy", "AdamW", seed=0, dtype=torch.bfloat16)
    train(model, sz, rank, range(0, 2), save_at=2)
    sz.save_checkpoint(f"{root}/a")
    sz.load_checkpoint(f"{root}/a")
    loaded = _full_snapshot(model, sz)
    train(model, sz, rank, range(2, 4), save_at=2)
    undo = _fail_on(1, rank, "read")
    errors = []
    try:
        sz.load_checkpoint(f"{root}/a")
    except Exception as e:  # noqa: BLE001 - the test checks the class
        errors.append((type(e).__name__, str(e)))
    undo()
    for attempt in ("step", "save"):  # refused on every rank until a load succeeds
        try:
            if attempt == "step":
                train(model, sz, rank, range(4, 5), save_at=2)
            else:
                sz.save_checkpoint(f"{root}/b")
        except Exception as e:  # noqa: BLE001
            errors.append((type(e).__name__, str(e)))
    sz.load_checkpoint(f"{root}/a")
    reloaded = _full_snapshot(model, sz)
    train(model, sz, rank, range(4, 5), save_at=2)  # trains again
    return {"errors": errors, "changed": differences(loaded, reloaded)}


def test_a_read_failing_after_the_checks_is_raised_everywhere_and_refuses_steps(tmp_path):
    """[Note: streaming load]: the price of loading in place. The mixture it leaves is never
    trained on or saved: every rank raises, refuses step() and save_checkpoint(), and the
    next load brings back exactly the checkpoint."""
    runs = all_values(run_ranks(read_fails_after_checks_run, 2, str(tmp_path), timeout=120))
    for rank, run in enumerate(runs):
        assert [kind for kind, _ in run["errors"]] == ["CheckpointError"] * 3, (rank, run)
        assert "group rank 1" in run["errors"][0][1], run["errors"][0]
        assert all("load a checkpoint again" in text for _, text in run["errors"][1:]), run
        assert run["changed"] == [], (rank, run["changed"][:5])


def _rss_kib(field: str) -> int:
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def load_memory_run(rank: int, world: int, root: str) -> dict[str, Any]:
    from pathlib import Path

    from torch import nn

    from selzero_plugin import SelectedZero2, SelZeroConfig
    from selzero_plugin.memtrace import track_allocations

    torch.manual_seed(0)
    model = nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(1024, 1024) for _ in range(12))})
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], name="mem"),
                       torch.optim.AdamW, {"lr": 1e-2})
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        sum(e(x).pow(2).sum() for e in model["experts"]).backward()
        sz.step()
    sz.save_checkpoint(f"{root}/ck")
    before = _full_snapshot(model, sz)
    sum(e(x).pow(2).sum() for e in model["experts"]).backward()
    sz.step()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from now on
    start = _rss_kib("VmRSS")
    sz.load_checkpoint(f"{root}/ck")
    growth = 1024 * (_rss_kib("VmHWM") - start)
    share = sum(4 * s.numel() + sum(v.numel() * v.element_size()
                                    for v in sz.optimizer.state[s].values())
                for s in sz.segments)
    changed = differences(before, _full_snapshot(model, sz))
    # a fresh process resuming: an instance without state loads, then steps; the step's
    # adoption of the loaded state into the flat step's buffers must not allocate it again
    sz.remove_hooks()
    fresh = SelectedZero2(model, SelZeroConfig(params=["experts.*"], name="mem"),
                          torch.optim.AdamW, {"lr": 1e-2})
    fresh.load_checkpoint(f"{root}/ck")
    sum(e(x).pow(2).sum() for e in model["experts"]).backward()
    with track_allocations() as trace:
        fresh.step()
    state = sum(v.numel() * v.element_size() for s in fresh.segments
                for v in fresh.optimizer.state[s].values())
    return {"growth": growth, "share": share, "changed": changed,
            "first_step_peak": trace.peak, "state": state}


def test_a_load_writes_in_place_without_a_copy_of_the_share(tmp_path):
    """[Note: streaming load]: loading into an instance that already holds state grows the
    resident set by far less than the rank's share (values + moments, 75 MB here); it read
    the whole share into fresh memory first before. Resident memory (VmHWM), the measure of
    what a node's RAM must hold."""
    for run in all_values(run_ranks(load_memory_run, 2, str(tmp_path), timeout=120)):
        assert run["changed"] == [], run["changed"][:5]
        assert run["growth"] < run["share"] / 4, run
        # resuming into a fresh instance: the loaded state is written into the flat step's
        # buffers at the load; the first step allocates none of it again (it did: the
        # adoption made the buffers and copied, 2x the state for a moment)
        assert run["first_step_peak"] < run["state"] / 4, run
