"""integrations/deepspeed/train.py with configs/deepspeed_zero2_experts.json, under torchrun and
under the deepspeed launcher: the same run, and (within bf16 rounding) the same training as one
process of plain torch AdamW + clip_grad_norm_ on the mean of the ranks' losses."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from selzero_plugin.ports import free_port as _free_port

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.e2e, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "integrations" / "deepspeed" / "train.py"
CONFIG = ROOT / "configs" / "deepspeed_zero2_experts.json"
WORLD, STEPS, SEED = 2, 6, 3
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}


def _run(cmd: list[str], tmp: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    args = [str(TRAIN), "--deepspeed_config", str(CONFIG), "--steps", str(STEPS),
            "--seed", str(SEED), "--out", str(tmp / "result.json"),
            "--save-model", str(tmp / "model.safetensors")]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, cwd=tmp,
                          env=ENV)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return json.loads((tmp / "result.json").read_text()), load_file(tmp / "model.safetensors")


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds_torchrun")
    return _run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
                 "--master-addr=127.0.0.1", f"--master-port={_free_port()}"], tmp)


def _reference() -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "integrations/ddp/train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    config = json.loads(CONFIG.read_text())
    gas, clip = config["gradient_accumulation_steps"], config["gradient_clipping"]
    lr, wd = config["optimizer"]["params"]["lr"], config["optimizer"]["params"]["weight_decay"]
    model = train.build_model(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(gas):
            per_rank = [train.loss_fn(model, *train.make_batch(SEED, step * gas + micro, r))
                        for r in range(WORLD)]
            loss = torch.stack(per_rank).mean() / gas
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def test_deepspeed_program_matches_plain_torch(torchrun_run):
    result, weights = torchrun_run
    assert result["zero_stage"] == 2 and result["dtype"] == "torch.bfloat16"
    assert len(set(result["rank_checksums"])) == 1, result["rank_checksums"]
    assert result["selected"] and all(".experts." in n for n in result["selected"])
    ref_losses, ref, ref_norms = _reference()
    # bf16 forward, gradients and weights: AdamW's update of an element whose gradient is near
    # zero can take either sign under bf16 noise, so an element may differ by up to lr per step
    # (the fp32 runs of tests/test_deepspeed.py match to 1e-6)
    lr = json.loads(CONFIG.read_text())["optimizer"]["params"]["lr"]
    for k in ref:
        assert torch.allclose(weights[k], ref[k], rtol=0, atol=lr * STEPS / 2), \
            (k, float((weights[k] - ref[k]).abs().max()))
    assert max(abs(a - b) / b for a, b in zip(result["norms"], ref_norms)) <= 2e-2
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) <= 2e-2
    assert torch.equal(weights["moe.experts.3.w_in.weight"],  # never routed: untouched
                       ref["moe.experts.3.w_in.weight"].bfloat16().float())


@pytest.mark.skipif(shutil.which("deepspeed", path=os.path.dirname(sys.executable)) is None,
                    reason="the deepspeed launcher is not installed beside this python")
def test_deepspeed_launcher_runs_the_same(torchrun_run, tmp_path):
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    result, weights = _run([launcher, f"--num_gpus={WORLD}", f"--master_port={_free_port()}"],
                           tmp_path)
    expected, expected_weights = torchrun_run
    assert result["losses"] == expected["losses"]
    assert result["rank_checksums"] == expected["rank_checksums"]
    assert all(torch.equal(weights[k], expected_weights[k]) for k in weights)


GAS_ACC = 2


def test_accelerate_deepspeed_path(tmp_path):
    """`accelerate launch --use_deepspeed --deepspeed_config_file ...` starts on this CPU machine
    (without ACCELERATE_USE_CPU, which turns it into plain DDP): Accelerate's own
    deepspeed.initialize call picks the entry up; fp32 ZeRO-2 with a client optimizer and
    clipping matches plain torch."""
    from safetensors.torch import load_file

    steps, seed, clip = 4, 5, 0.5
    config = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": GAS_ACC,
              "gradient_clipping": clip, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9,
              "selected_zero2": {"params": ["*.experts.*"]}}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    env = {k: v for k, v in ENV.items() if k != "ACCELERATE_USE_CPU"}
    proc = subprocess.run(
        [launcher, "launch", "--use_deepspeed", "--deepspeed_config_file",
         str(tmp_path / "ds.json"), "--num_processes", "2", "--main_process_port",
         str(_free_port()), str(ROOT / "tests" / "_accelerate_deepspeed_script.py"),
         str(tmp_path / "w.safetensors"), str(steps), str(seed)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    weights = load_file(tmp_path / "w.safetensors")
    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "integrations/ddp/train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    model = train.build_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=train.LR, weight_decay=train.WEIGHT_DECAY)
    for step in range(steps):
        for micro in range(GAS_ACC):
            per_rank = [train.loss_fn(model, *train.make_batch(seed, step * GAS_ACC + micro, r))
                        for r in range(WORLD)]
            (torch.stack(per_rank).mean() / GAS_ACC).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for k, v in model.state_dict().items():
        assert torch.allclose(weights[k], v, atol=1e-6, rtol=0), (k, float((weights[k] - v).abs().max()))
