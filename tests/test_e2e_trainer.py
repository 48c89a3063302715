"""HF Trainer + SelectedZero2Callback, 2 CPU processes (DDP host), tiny Qwen3-MoE and Mixtral
from configs: the same training as the Trainer without selzero (weights, logged losses and
grad norms), resume parity, checkpoint contents and rotation, routing that differs by rank.

Each launch runs several Trainers one after another (tests/_trainer_runs.py) for suite time."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from selzero_plugin.ports import free_port as _free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.e2e, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "tests" / "_trainer_runs.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1",
       "PYTHONPATH": str(ROOT)}


def _launch(out: Path, model: str, *variants: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), str(RUNS), str(out), model, *variants]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=ENV)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc.stderr


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_qwen3")
    return out, _launch(out, "qwen3", "plain", "sz", "sz0", "sz-norms", "sz0-tensors")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_mixtral")
    return out, _launch(out, "mixtral", "plain", "sz0", "fresh", "refusals", "rotation")


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def _assert_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, float((a[k] - b[k]).abs().max()))


def _steps(history: list[dict]) -> list[dict]:
    return [h for h in history if "loss" in h]


CASES = [("qwen3", "sz"), ("qwen3", "sz0"), ("mixtral", "sz0"), ("qwen3", "sz0-tensors")]


@pytest.mark.parametrize("model,variant", CASES)
def test_callback_matches_the_trainer_without_selzero(request, model, variant):
    """6 steps, gradient accumulation 2, clipping active (norm ~1 > 0.05): weights within
    1e-6, the same logged losses and true global grad norms, selzero's figures in the log."""
    out, _ = request.getfixturevalue(model)
    _assert_close(_load(out / f"{variant}.safetensors"), _load(out / "plain.safetensors"))
    mine = _steps(json.loads((out / f"{variant}.json").read_text())["full"])
    plain = _steps(json.loads((out / "plain.json").read_text())["full"])
    assert len(mine) == len(plain) == 6
    for a, b in zip(mine, plain):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0)
        assert a["grad_norm"] > 0.05  # the clip (max_grad_norm=0.05) was active
        assert a["learning_rate"] == b["learning_rate"]
        # 2 layers x 2 fused tensors (x 8 experts)
        experts = 4 * 8 if variant.startswith("sz0") else 4
        assert a["selzero/updated"] == experts, a
        assert a["selzero/skipped_absent"] == 0 and a["selzero/skipped_nonfinite"] == 0
    assert all(not k.startswith("selzero/") for h in plain for k in h)


@pytest.mark.parametrize("model,variant", CASES)
def test_resume_matches_the_trainer_resumed_without_selzero(request, model, variant):
    """Resumed from checkpoint-4 (steps 5-6 rerun): equal to the Trainer's own resume without
    selzero, and bitwise equal to the uninterrupted selzero run."""
    out, _ = request.getfixturevalue(model)
    resumed = _load(out / f"{variant}.resumed.safetensors")
    _assert_close(resumed, _load(out / "plain.resumed.safetensors"))
    full = _load(out / f"{variant}.safetensors")
    for k in full:
        assert torch.equal(resumed[k], full[k]), (k, float((resumed[k] - full[k]).abs().max()))
    log = json.loads((out / f"{variant}.json").read_text())
    assert [h["grad_norm"] for h in _steps(log["resumed"])] == \
        [h["grad_norm"] for h in _steps(log["full"])]


def test_parameters_of_the_no_decay_group_get_no_weight_decay(qwen3):
    """Selected RMSNorm weights sit in the Trainer's no-decay group: selzero mirrors that group
    (weight decay 0.1 on them would move them away from the plain Trainer's)."""
    out, _ = qwen3
    _assert_close(_load(out / "sz-norms.safetensors"), _load(out / "plain.safetensors"))
    _assert_close(_load(out / "sz-norms.resumed.safetensors"),
                  _load(out / "plain.resumed.safetensors"))
    steps = _steps(json.loads((out / "sz-norms.json").read_text())["full"])
    assert all(s["selzero/updated"] == 4 + 2 * 2 for s in steps), steps  # + 2 norms per layer


def test_routing_differs_by_rank(qwen3, mixtral):
    """The runs above are meaningful: some expert got no token on one rank in a micro-step
    while the other rank's routing differed (and no expert went without tokens everywhere:
    skipped_absent is 0 above)."""
    for out, _ in (qwen3, mixtral):
        r0 = json.loads((out / "sz0.routing0.json").read_text())
        r1 = json.loads((out / "sz0.routing1.json").read_text())
        assert len(r0) == len(r1) == 24  # 2 layers x 12 micro-steps
        assert any(absent for _, absent in r0) and any(absent for _, absent in r1)
        assert [a for _, a in r0] != [a for _, a in r1]


def test_checkpoints_hold_selzero_folder_and_rotate_with_it(qwen3):
    """save_total_limit=2 with saves at 2, 4, 6: checkpoint-2 is gone with its selzero folder;
    the kept ones hold selected_zero2/; the Trainer's optimizer.pt holds no state for the
    selected parameters."""
    out, _ = qwen3
    for variant in ("sz", "sz0"):
        work = Path(json.loads((out / f"{variant}.json").read_text())["work"])
        assert sorted(p.name for p in work.iterdir() if p.name.startswith("checkpoint-")) == \
            ["checkpoint-4", "checkpoint-6"]
        for n in (4, 6):
            folder = work / f"checkpoint-{n}" / "selected_zero2"
            assert (folder / "index.json").is_file()
            assert (folder / "selected_zero2" / "manifest.json").is_file()
        mine = torch.load(work / "checkpoint-4" / "optimizer.pt", weights_only=True)
        plain = torch.load(out / "qwen3-plain" / "checkpoint-4" / "optimizer.pt",
                           weights_only=True)
        assert len(plain["state"]) == 25 and len(mine["state"]) == 25 - 4


def test_fused_experts_without_expert_dim_warn(qwen3):
    import warnings

    from selzero_plugin.trainer import _warn_fused_experts

    _, stderr = qwen3
    assert "Set expert_dim: 0" in stderr  # the sz runs warned
    spec = importlib.util.spec_from_file_location(
        "hf_train", ROOT / "integrations" / "hf_trainer" / "train.py")
    hf_train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hf_train)
    from selzero_plugin import SelZeroConfig

    for kind in ("qwen3", "mixtral"):
        model = hf_train.build_model(kind)
        with pytest.warns(UserWarning, match=r"4 selected parameters are fused expert tensors "
                          r"\(e.g. 'model.layers.0.mlp.experts.gate_up_proj', 8 experts\)"):
            _warn_fused_experts(model, SelZeroConfig(params=["*.mlp.experts.*"]))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _warn_fused_experts(model, SelZeroConfig(params=["*.mlp.experts.*"], expert_dim=0))
            _warn_fused_experts(model, SelZeroConfig(params=["*.self_attn.*"]))


def test_resume_from_a_checkpoint_without_selzero(mixtral):
    """Refused on every rank unless fresh_start=True, which then trains on, and drops the
    host optimizer's stale state for the selected parameters (loaded from the plain
    checkpoint's optimizer.pt: nothing would read it again)."""
    out, _ = mixtral
    for rank in (0, 1):
        got = json.loads((out / f"fresh{rank}.json").read_text())
        assert "no selected_zero2/ folder" in got["error"] and "fresh_start=True" in got["error"]
        assert got["steps"] == 6
        assert got["host_state_on_selected"] == 0


def test_setups_that_would_train_wrong_are_refused_on_every_rank(mixtral):
    """An optimizer without the selected parameters (without selzero they are not trained),
    two callbacks in one Trainer, a Trainer that builds a second model (model_init)."""
    out, _ = mixtral
    for rank in (0, 1):
        seen = json.loads((out / f"refusals{rank}.json").read_text())
        assert "are not in the optimizer given to prepare" in seen["optimizer without experts"]
        assert "the Trainer has 2 of them" in seen["two callbacks"]
        assert "prepares a new model (model_init" in seen["model_init twice"]


def test_a_failed_selzero_save_leaves_the_previous_complete_checkpoint(mixtral):
    """save_total_limit=1 and selzero's write into checkpoint-4 fails on every rank. Before:
    the Trainer had rotated checkpoint-2 away before selzero wrote, leaving only checkpoint-4
    without selected_zero2/ (resume failed on every rank)."""
    out, _ = mixtral
    for rank in (0, 1):
        seen = json.loads((out / f"rotation{rank}.json").read_text())
        assert "no space left on device" in (seen["error"] or ""), seen
        assert "checkpoint-2" in seen["complete"], seen
        assert seen["calls"][0].endswith("checkpoint-2"), seen


def test_beside_deepspeed_fresh_start_resumes_a_checkpoint_without_selzero(deepspeed_runs):
    out, _ = deepspeed_runs
    for rank in (0, 1):
        got = json.loads((out / f"ds-fresh{rank}.json").read_text())
        assert "selzero_fresh_start=True" in got["error"], got
        assert got["steps"] == 6


def test_reduction_other_than_mean_is_refused():
    from selzero_plugin.errors import ConfigError
    from selzero_plugin.trainer import SelectedZero2Callback

    with pytest.raises(ConfigError, match="reduction='sum', expected 'mean'"):
        SelectedZero2Callback({"params": ["*.experts.*"], "reduction": "sum"})


def test_callback_outside_a_trainer_is_refused():
    from selzero_plugin.errors import UsageError
    from selzero_plugin.trainer import SelectedZero2Callback

    cb = SelectedZero2Callback({"params": ["*.experts.*"]})
    with pytest.raises(UsageError, match="not called by a transformers.Trainer"):
        cb.on_init_end(None, None, None)


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("trainer_deepspeed")
    return out, _launch(out, "qwen3", "ds", "ds-sz", "ds-sz0", "ds-fresh")


def test_beside_deepspeed_the_entry_does_the_work(deepspeed_runs):
    """TrainingArguments(deepspeed=ZeRO-2 config without an entry) + the callback: the callback
    sets the entry, the registered deepspeed.initialize takes the experts; the same training
    as the Trainer with stock DeepSpeed (fused experts: every expert tensor has a gradient),
    the same logged norms, resume parity, selzero's folder in the engine's tag folder."""
    out, _ = deepspeed_runs
    _assert_close(_load(out / "ds-sz.safetensors"), _load(out / "ds.safetensors"))
    _assert_close(_load(out / "ds-sz.resumed.safetensors"), _load(out / "ds.resumed.safetensors"))
    full = _load(out / "ds-sz.safetensors")
    resumed = _load(out / "ds-sz.resumed.safetensors")
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    mine = _steps(json.loads((out / "ds-sz.json").read_text())["full"])
    stock = _steps(json.loads((out / "ds.json").read_text())["full"])
    assert len(mine) == len(stock) == 6
    for a, b in zip(mine, stock):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=0)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6, abs=0)
        assert a["selzero/updated"] == 4
    work = Path(json.loads((out / "ds-sz.json").read_text())["work"])
    # every checkpoint kept: under DeepSpeed on CPU both ranks are "process zero" to
    # Accelerate and would rotate at once (tests/_trainer_runs.py)
    assert sorted(p.name for p in work.iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (work / "checkpoint-4" / "global_step4" / "selected_zero2" / "index.json").is_file()


def test_beside_deepspeed_the_figures_reach_the_log(deepspeed_runs):
    """expert_dim=0 under DeepSpeed: every step's figures in log_history (the demo's Trainer
    host shows skipped experts counted there: tests/test_demo.py), ranks routing differently."""
    out, _ = deepspeed_runs
    steps = _steps(json.loads((out / "ds-sz0.json").read_text())["full"])
    assert len(steps) == 6
    assert all(s["selzero/updated"] + s["selzero/skipped_absent"] == 32 for s in steps), steps
    # per-expert presence: 2 layers x 8 experts; an expert is dead when both its fused rows
    # (gate_up, down) got no token on any rank, so the dead count is half the skipped rows
    assert all(s["selzero/experts"] == 16 and 2 * s["selzero/dead_experts"] ==
               s["selzero/skipped_absent"] for s in steps), steps
    r0 = json.loads((out / "ds-sz0.routing0.json").read_text())
    r1 = json.loads((out / "ds-sz0.routing1.json").read_text())
    assert [a for _, a in r0] != [a for _, a in r1]  # ranks read and route differently
