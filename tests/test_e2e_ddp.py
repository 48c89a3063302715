"""integrations/ddp/train.py under torchrun equals the same training on one process, plain torch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from selzero_plugin.ports import free_port as _free_port

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integrations" / "ddp" / "train.py"
CONFIG = ROOT / "configs" / "selzero.yaml"
WORLD, STEPS, ACCUMULATE, CLIP, SEED = 2, 8, 2, 0.5, 3


def _load_train() -> ModuleType:
    spec = importlib.util.spec_from_file_location("selzero_ddp_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(TRAIN),
           "--steps", str(STEPS), "--accumulate", str(ACCUMULATE), "--clip", str(CLIP),
           "--seed", str(SEED), "--config", str(CONFIG),
           "--out", str(tmp / "result.json"), "--save-model", str(tmp / "model.safetensors")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads((tmp / "result.json").read_text()), load_file(tmp / "model.safetensors")


def _reference(train: ModuleType) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain AdamW over all parameters, on the mean of the ranks' losses."""
    model = train.build_model(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=train.LR, weight_decay=train.WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(ACCUMULATE):
            s = step * ACCUMULATE + micro
            per_rank = [train.loss_fn(model, *train.make_batch(SEED, s, r)) for r in range(WORLD)]
            loss = torch.stack(per_rank).mean() / ACCUMULATE
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_ddp_program_trains_and_replicas_agree(torchrun_result):
    result, _ = torchrun_result
    assert result["world_size"] == WORLD
    assert result["final_loss"] < result["first_loss"]
    assert len(set(result["rank_checksums"])) == 1, result["rank_checksums"]
    assert result["selected"] and all(".experts." in n for n in result["selected"])
    assert result["skipped_absent"] > 0  # expert 3 never gets a token


def test_ddp_program_matches_single_process_reference(torchrun_result):
    result, weights = torchrun_result
    train = _load_train()
    ref_losses, ref = _reference(train)
    assert weights.keys() == ref.keys()
    diffs = {k: float((weights[k] - ref[k]).abs().max()) for k in ref}
    assert max(diffs.values()) <= 1e-6, diffs
    moved = {k: float((ref[k] - train.build_model(SEED).state_dict()[k]).abs().max()) for k in ref}
    assert min(v for k, v in moved.items() if ".experts.3." not in k) > 1e-4  # training moved them
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) <= 1e-5
