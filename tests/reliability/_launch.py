"""torchrun launches for the simulated multi-node tests: free ports, a launch per "node" with its
own log, and a wait that kills every launch at the first failure or at the deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from selzero_plugin.ports import free_port

__all__ = ["free_port", "start", "wait_all"]

_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
             "LOCAL_WORLD_SIZE")


def start(tmp: Path, tag: str, script: Path, *, nnodes: int, node_rank: int, nproc: int,
          port: int, args: list[str], env: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen, Path]:
    """One torchrun "node" (static rendezvous on 127.0.0.1), output in ``tmp/<tag>.log``."""
    log = tmp / f"{tag}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
           "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port",
           str(port), "--max-restarts", "0", str(script), *args]
    full = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    full["OMP_NUM_THREADS"] = "1"
    full.update(env or {})
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=tmp, env=full,
                                start_new_session=True)
    return proc, log


def wait_all(launches: list[tuple[subprocess.Popen, Path]], timeout: float) -> None:
    """Every launch exits 0 within ``timeout``; at the first failure or at the deadline every
    launch still running is killed (its process group) and the logs are shown."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc, _ in launches]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    codes = [proc.poll() for proc, _ in launches]
    if all(c == 0 for c in codes):
        return
    for proc, _ in launches:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = "\n".join(f"--- {log.name} (exit {'timeout' if c is None else c}) ---\n"
                     f"{log.read_text()[-6000:]}" for (_, log), c in zip(launches, codes))
    pytest.fail(f"a launch failed or ran past {timeout} s:\n{text}")
