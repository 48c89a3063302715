"""Run a function on N gloo ranks in fresh processes; every run has a timeout, so a hang fails."""

from __future__ import annotations

import io
import os
import queue as queue_module
import time
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankOutcome", "all_values", "all_errors"]


@dataclass
class RankOutcome:
    rank: int
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None


def _child(fn: Callable, rank: int, world: int, init_file: str, queue: Any, args: tuple,
           env: dict[str, str], kwargs: dict[str, Any]) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    outcome = RankOutcome(rank)
    try:
        outcome.value = fn(rank, world, *args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        outcome.error_type = type(e).__name__
        outcome.error_message = str(e)
        outcome.traceback = traceback.format_exc()
    buf = io.BytesIO()
    torch.save(outcome, buf)
    queue.put(buf.getvalue())
    try:
        if outcome.error_type is None:
            t = torch.zeros(1)
            dist.all_reduce(t)  # a tiny collective is safer than a gloo barrier at exit
    finally:
        dist.destroy_process_group()


_CTX: Any = None


def _context() -> Any:
    """A forkserver that imported torch and selzero once: each rank forks from it instead of
    starting a fresh interpreter and importing them again (suite time); a fresh process all
    the same (no state of the test process is inherited)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: torch imports it on the first manual_seed or optimizer step (~1 s of
        # CPU per rank process when each child did it)
        _CTX.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed",
                                     "selzero_plugin"])
    return _CTX


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0,
              env: dict[str, str] | None = None, allow_dead: bool = False,
              **kwargs: Any) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args, **kwargs)`` on ``world`` spawned gloo ranks; raise on a hang.

    With ``allow_dead``, a rank whose process ended without reporting (killed) is returned as
    ``error_type == "died"`` instead of failing the run."""
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, init_file, queue, args, env or {}, kwargs),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        outcomes: dict[int, RankOutcome] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(outcomes) < world:
                try:
                    data = queue.get(timeout=0.5 if allow_dead else timeout)
                except queue_module.Empty:
                    if time.monotonic() > deadline:
                        raise
                    dead = [r for r, p in enumerate(procs)
                            if r not in outcomes and p.exitcode is not None]
                    if allow_dead and dead and all(
                            r in outcomes or procs[r].exitcode is not None for r in range(world)):
                        try:  # a report may still be in the pipe
                            data = queue.get(timeout=1.0)
                        except queue_module.Empty:
                            for r in dead:
                                outcomes[r] = RankOutcome(r, error_type="died", error_message=(
                                    f"exit code {procs[r].exitcode}"))
                            continue
                    else:
                        continue
                o = torch.load(io.BytesIO(data), weights_only=False)
                outcomes[o.rank] = o
        except Exception:
            for p in procs:
                p.kill()
            raise TimeoutError(f"ranks {sorted(set(range(world)) - set(outcomes))} did not finish "
                               f"within {timeout}s (hang?); finished: "
                               f"{[(o.rank, o.error_type) for o in outcomes.values()]}") from None
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [outcomes[r] for r in range(world)]


def all_values(outcomes: list[RankOutcome]) -> list[Any]:
    """Values of every rank; fail with the first rank's traceback if any rank raised."""
    for o in outcomes:
        if o.error_type is not None:
            raise AssertionError(f"rank {o.rank} raised {o.error_type}:\n{o.traceback}")
    return [o.value for o in outcomes]


def all_errors(outcomes: list[RankOutcome], expected: str) -> list[str]:
    """Messages of every rank; fail unless every rank raised ``expected``."""
    for o in outcomes:
        assert o.error_type == expected, (
            f"rank {o.rank}: expected {expected}, got {o.error_type}: {o.error_message}\n"
            f"{o.traceback or ''}")
    return [o.error_message for o in outcomes]
