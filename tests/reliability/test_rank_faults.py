"""Reliability 2: a rank that dies, stalls or raises mid-step ([Note: failed collectives]).

Every rank trains one step of a 3-block MoE (routing differs by rank, four buckets that launch
inside backward) and saves a checkpoint. In the second step one rank (the victim)
is killed with SIGKILL, sleeps past ``timeout_s`` or raises a simulated OOM out of its backward,
at one of three points: before its backward, in the middle of it (after the last block's bucket
was launched), or between backward and ``step()``. Each survivor must raise selzero's
``CollectiveError`` naming the collective and ``timeout_s``, within ``timeout_s`` plus spawn
slack, never hang; afterwards a fresh launch loads the checkpoint of every faulted run and gets
exactly the state that was saved. (Every rank catching the same exception and skipping the batch
is tests/test_backward_exceptions.py: training equals a run without that batch.)
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from selzero_plugin import SelectedZero2, SelZeroConfig

from .._blocks import Block, BlockMoE, block_loss
from .._state import snapshot
from ..dist_utils import all_values, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

TIMEOUT_S = 3.0
CONCURRENT = 3
LAYERS = 3
FAULTS = ["kill", "stall", "raise"]
POINTS = ["before_backward", "mid_backward", "before_step"]
# world 3: every (fault, point), the victim cycling over the ranks; world 2: one point per fault
CASES = [(3, f, p, (i + j) % 3) for i, f in enumerate(FAULTS) for j, p in enumerate(POINTS)] + \
    [(2, f, POINTS[i], 1 - i % 2) for i, f in enumerate(FAULTS)]


class SimulatedOOM(RuntimeError):
    pass


def _fault(kind: str) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stall":
        time.sleep(TIMEOUT_S + 4)
        os._exit(0)  # a rank that wakes up too late is gone before it can do harm
    raise SimulatedOOM("CUDA out of memory (simulated, one rank only)")


class _Trap(torch.autograd.Function):
    """Identity whose backward runs the fault (in the first block: after the later blocks'
    buckets were launched)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kind: str | None) -> torch.Tensor:
        ctx.kind = kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.kind is not None:
            _fault(ctx.kind)
        return grad, None


class TrapBlock(Block):
    kind: str | None = None

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return super().forward(_Trap.apply(h, self.kind), routes)


def _engine() -> tuple[BlockMoE, SelectedZero2]:
    torch.manual_seed(0)
    model = BlockMoE(layers=LAYERS, block=TrapBlock)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=2e-3,
                                            timeout_s=TIMEOUT_S),
                       torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
    return model, sz


def _selzero_state(model: BlockMoE, sz: SelectedZero2) -> dict[str, Any]:
    return {k: v for k, v in snapshot(model, sz).items() if "experts" in k or k.startswith("optim")}


def fault_run(rank: int, world: int, fault: str, point: str, victim: int, folder: str
              ) -> dict[str, Any]:
    model, sz = _engine()
    assert len(sz.layout.buckets) > 2  # some launch inside backward
    block_loss(model, 0, rank, layers=LAYERS).backward()
    sz.step()
    sz.save_checkpoint(folder)
    saved = _selzero_state(model, sz)
    torch.save(saved, f"{folder}.rank{rank}.pt")  # what this rank saved, even if it dies
    model.zero_grad(set_to_none=True)
    me = rank == victim
    model.blocks[0].kind = fault if me and point == "mid_backward" else None
    start = time.monotonic()
    try:
        loss = block_loss(model, 1, rank, layers=LAYERS)
        if me and point == "before_backward":
            _fault(fault)
        loss.backward()
        if me and point == "before_step":
            _fault(fault)
        sz.step()
    except Exception as e:  # noqa: BLE001 - the outcome is the test's
        return {"error": type(e).__name__, "message": str(e),
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def load_run(rank: int, world: int, folders: list[str]) -> list[dict[str, Any]]:
    out = []
    for folder in folders:
        model, sz = _engine()
        sz.load_checkpoint(folder)
        out.append(_selzero_state(model, sz))
    return out


@pytest.fixture(scope="module")
def faulted() -> Any:
    root = Path(tempfile.mkdtemp(prefix="selzero-faults-"))

    def one(case: tuple[int, str, str, int]) -> tuple[Any, float, str]:
        world, fault, point, victim = case
        folder = str(root / f"w{world}-{fault}-{point}-{victim}")
        started = time.monotonic()
        outcomes = run_ranks(fault_run, world, fault, point, victim, folder, timeout=90,
                             allow_dead=True)
        return outcomes, time.monotonic() - started, folder

    # the runs mostly wait (for a timeout, a stalled rank): CONCURRENT launches at a time, each
    # its own process group; a survivor's seconds are still measured inside its own step
    with ThreadPoolExecutor(CONCURRENT) as pool:
        runs = dict(zip(CASES, pool.map(one, CASES)))
    loads = {}
    for world in (2, 3):
        folders = [runs[c][2] for c in CASES if c[0] == world]
        loads[world] = all_values(run_ranks(load_run, world, folders, timeout=120))
    yield runs, loads


@pytest.mark.parametrize("case", CASES, ids=[f"w{c[0]}-{c[1]}-{c[2]}-victim{c[3]}" for c in CASES])
def test_survivors_raise_a_collective_error_within_the_timeout(faulted, case):
    runs, _ = faulted
    world, fault, point, victim = case
    outcomes, _, _ = runs[case]
    for o in outcomes:
        if o.rank == victim:
            if fault == "raise":  # its own exception, reported
                assert o.value["error"] == "SimulatedOOM", o
            else:
                assert o.error_type == "died", o
            continue
        assert o.error_type is None, f"rank {o.rank}: {o.traceback}"
        got = o.value
        assert got["error"] == "CollectiveError", f"rank {o.rank}: {got}"
        message = got["message"]
        assert message.startswith(f"[rank {o.rank}/{world}] selzero collective "), message
        assert f"timeout_s={TIMEOUT_S:g}" in message, message
        assert f"over global ranks {list(range(world))}" in message, message
        # a survivor waits for a dead peer not at all and for a stalled one up to timeout_s
        assert got["seconds"] < TIMEOUT_S + 3.0, f"rank {o.rank}: {got['seconds']:.1f} s"


def test_the_last_complete_checkpoint_loads_after_every_fault(faulted):
    runs, loads = faulted
    for world in (2, 3):
        cases = [c for c in CASES if c[0] == world]
        for i, case in enumerate(cases):
            folder = runs[case][2]
            for rank in range(world):
                loaded = loads[world][rank][i]
                reference = torch.load(f"{folder}.rank{rank}.pt")
                assert loaded.keys() == reference.keys() and len(reference) > 10
                for key in reference:
                    assert torch.equal(loaded[key], reference[key]), (case, rank, key)
