"""`selzero-accelerate launch` on what real scripts and environments hold (issue 21, items 12,
14, 15): a DeepSpeed file whose own "selected_zero2" block differs from --selzero_config,
another tool's SELZERO_* variable, a config that selects every parameter, a malformed file.
Each is selzero's own message, never a silent choice or a third-party traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from .test_e2e_accelerate import BIN, ENV, ROOT, TRAIN, _free_port

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.e2e, pytest.mark.multiproc]


def _launch(args: list[str], *, env: dict[str, str], cwd: Path, timeout: int = 300
            ) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "selzero-accelerate"), "launch", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_a_config_selecting_every_parameter_is_refused_naming_the_file(tmp_path):
    """Before: torch's "DistributedDataParallel is not needed when a module doesn't have any
    parameter that requires a gradient"."""
    config = tmp_path / "all.yaml"
    config.write_text('params: ["*"]\n')
    proc = _launch(["--multi_gpu", "--num_processes", "2", "--main_process_port",
                    str(_free_port()), "--selzero_config", str(config), str(TRAIN), "--out",
                    str(tmp_path / "w.safetensors")], env=ENV, cwd=tmp_path)
    assert proc.returncode != 0
    assert "selects every trainable parameter" in proc.stderr, proc.stderr[-3000:]
    assert str(config) in proc.stderr and "FSDP2" in proc.stderr


def test_a_malformed_yaml_is_refused_before_any_process_starts(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("params: [*.experts.*\nbucket_mb: 3\n")
    proc = _launch(["--selzero_config", str(config), str(TRAIN)], env=ENV, cwd=tmp_path,
                   timeout=120)
    assert proc.returncode == 2
    assert "is not valid YAML at line 1" in proc.stderr and str(config) in proc.stderr, \
        proc.stderr[-2000:]
    assert "<unicode string>" not in proc.stderr


def test_another_tools_selzero_variable_only_warns(tmp_path):
    """Before: "environment variable SELZERO_CLUSTER: not a selzero field", exit 2."""
    config = tmp_path / "c.yaml"
    config.write_text('params: ["*.experts.*"]\n')
    env = {**ENV, "SELZERO_CLUSTER": "blue"}
    proc = _launch(["--num_processes", "1", "--selzero_config", str(config), str(TRAIN),
                    "--steps", "1", "--out", str(tmp_path / "w.safetensors")], env=env,
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SELZERO_CLUSTER" in proc.stderr and "ignored" in proc.stderr


def _deepspeed_launch(tmp_path: Path, block: dict, config_text: str
                      ) -> tuple[subprocess.CompletedProcess, Path]:
    """`--use_deepspeed` with a DeepSpeed file holding ``block`` and --selzero_config."""
    ds = {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10 ** 9, "selected_zero2": block}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config = tmp_path / "c.yaml"
    config.write_text(config_text)
    env = {k: v for k, v in ENV.items() if k != "ACCELERATE_USE_CPU"}
    proc = _launch(["--use_deepspeed", "--deepspeed_config_file", str(tmp_path / "ds.json"),
                    "--num_processes", "2", "--main_process_port", str(_free_port()),
                    "--selzero_config", str(config),
                    str(ROOT / "tests" / "_accelerate_deepspeed_script.py"),
                    str(tmp_path / "w.safetensors"), "1", "0"], env=env, cwd=tmp_path)
    return proc, config


def test_a_deepspeed_file_block_that_agrees_takes_the_configs_other_fields(tmp_path):
    """Review: the file's block silently dropped every field --selzero_config set and the
    block left out (they fell back to the defaults)."""
    proc, _ = _deepspeed_launch(tmp_path, {"params": ["*.experts.*"]},
                                'params: ["*.experts.*"]\nbucket_mb: 4\nname: moe\n')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "selzero config bucket_mb=4 name=moe" in proc.stdout, proc.stdout[-2000:]


def test_a_deepspeed_file_with_a_different_block_is_refused(tmp_path):
    """Before: the DeepSpeed file's block silently won over --selzero_config."""
    proc, config = _deepspeed_launch(tmp_path, {"params": ["*.experts.*"], "bucket_mb": 1},
                                     'params: ["*.experts.*"]\nbucket_mb: 4\n')
    assert proc.returncode != 0
    assert "differs from the selzero config" in proc.stderr, proc.stderr[-3000:]
    assert "bucket_mb" in proc.stderr and str(config) in proc.stderr


_TRAINER_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("hf", {train!r})
hf = importlib.util.module_from_spec(spec); spec.loader.exec_module(hf)
callback = None
if sys.argv[1] == "with":
    from selzero_plugin.trainer import SelectedZero2Callback
    callback = SelectedZero2Callback()  # the launcher's --selzero_config
trainer = hf.build_trainer("qwen3", sys.argv[2], callback, steps=1)
trainer.train()
# one write per line: two ranks print to one pipe (print's pieces interleaved once:
# "trainedtrained  SelectedZero2\\nSelectedZero2")
sys.stdout.write("trained " + type(trainer.accelerator.selzero).__name__ + "\\n")
sys.stdout.flush()
hf.finish()
"""


@pytest.mark.parametrize("callback", ["without", "with"])
def test_a_trainer_script_under_the_launcher_needs_the_callback(tmp_path, callback):
    """Before: without the callback it trained with selzero but its checkpoints had no
    selected_zero2/ folder (a resume reset the experts' optimizer state, 1.1e-2 off)."""
    script = tmp_path / "trainer_script.py"
    script.write_text(_TRAINER_SCRIPT.format(
        train=str(ROOT / "integrations" / "hf_trainer" / "train.py")))
    config = tmp_path / "c.yaml"
    config.write_text('params: ["*.mlp.experts.*"]\nexpert_dim: 0\n')
    proc = _launch(["--multi_gpu", "--num_processes", "2", "--main_process_port",
                    str(_free_port()), "--selzero_config", str(config), str(script), callback,
                    str(tmp_path / "out")], env=ENV, cwd=tmp_path)
    if callback == "without":
        assert proc.returncode != 0
        assert "without SelectedZero2Callback" in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "trained SelectedZero2" in proc.stdout
