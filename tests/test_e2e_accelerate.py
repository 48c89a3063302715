"""`selzero-accelerate launch --selzero_config ...` on an unmodified Accelerate script (DDP host,
2 CPU processes): the same training as the script without selzero, save_state/load_state
resume, and a bad config refused before any process starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.e2e, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integrations" / "accelerate" / "train.py"
CONFIG = ROOT / "configs" / "selzero.yaml"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp: Path, *script_args: str, selzero: bool = True) -> str:
    launcher = [str(BIN / "selzero-accelerate"), "launch"] if selzero else \
        [str(BIN / "accelerate"), "launch"]
    cmd = [*launcher, "--multi_gpu", "--num_processes", "2", "--main_process_port",
           str(_free_port()), *(["--selzero_config", str(CONFIG)] if selzero else []),
           str(TRAIN), *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp, env=ENV)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def test_launcher_matches_the_script_without_selzero(tmp_path):
    out = _launch(tmp_path, "--out", "with.safetensors")
    assert "selzero: 16 parameters" in out, out  # 4 experts x 4 tensors, taken over
    assert "selzero: off" in _launch(tmp_path, "--out", "without.safetensors", selzero=False)
    a, b = _weights(tmp_path / "with.safetensors"), _weights(tmp_path / "without.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (k, float((a[k] - b[k]).abs().max()))


def test_save_state_and_load_state_resume(tmp_path):
    _launch(tmp_path, "--out", "full.safetensors", "--save-state", "state", "--save-at", "3")
    assert (tmp_path / "state" / "selected_zero2" / "index.json").is_file()
    assert (tmp_path / "state" / "selected_zero2" / "selected_zero2" / "manifest.json").is_file()
    _launch(tmp_path, "--out", "resumed.safetensors", "--resume", "state", "--start", "3")
    a, b = _weights(tmp_path / "full.safetensors"), _weights(tmp_path / "resumed.safetensors")
    for k in a:
        assert torch.equal(a[k], b[k]), (k, float((a[k] - b[k]).abs().max()))


def test_bad_config_is_refused_before_any_process_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("params: ['*.experts.*']\nbucket_mbb: 3\n")
    proc = subprocess.run([str(BIN / "selzero-accelerate"), "launch", "--selzero_config",
                           str(bad), str(TRAIN)], capture_output=True, text=True, timeout=120,
                          env=ENV)
    assert proc.returncode == 2
    assert "bucket_mbb" in proc.stderr and "bucket_mb" in proc.stderr, proc.stderr
    proc = subprocess.run([str(BIN / "selzero-accelerate"), "launch", "--selzero_config",
                           str(tmp_path / "missing.yaml"), str(TRAIN)], capture_output=True,
                          text=True, timeout=120, env=ENV)
    assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
