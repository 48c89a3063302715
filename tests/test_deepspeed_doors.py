"""The DeepSpeed door without silent bypass (issue 21, items 1-8): every way a DeepSpeed
program reaches the experts either goes through selzero or fails on every rank before
training, and DeepSpeed's own converters see the experts. 2 gloo ranks (3 for a load on
another world size), ranks routing to different experts (tests/_blocks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from . import _deepspeed_doors as doors
from .dist_utils import all_values, run_ranks

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.multiproc

ENV = {"DS_ACCELERATOR": "cpu"}


def _forms(rank: int, world: int, folder: str) -> dict[str, object]:
    from ._state import capture

    out: dict[str, object] = {form: capture(lambda f=form: doors.config_forms(rank, world, f,
                                                                              folder))
                              for form in ("dict", "json", "hjson", "base64")}
    out["early"] = capture(lambda: doors.early_bound(rank, world))
    for key in ("selected_zero_2", "selectedZero2"):
        out[key] = capture(lambda k=key: doors.near_miss(rank, world, k))
    for key in ("bf16", "bfloat16"):
        out[key] = capture(lambda k=key: doors.precision_key(rank, world, k))
    out["coalesce"] = capture(lambda: doors.coalesced(rank, world))
    out["moe"] = capture(lambda: doors.deepspeed_moe(rank, world))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("ds_forms"))
    return all_values(run_ranks(_forms, 2, folder, timeout=600, env=ENV))


def _each(runs, key):
    """Each rank's result ({"error", "message"} where it raised)."""
    return [r[key]["value"] if "value" in r[key] else r[key] for r in runs]


@pytest.mark.parametrize("form", ["json", "hjson", "base64"])
def test_every_config_form_deepspeed_reads_runs_the_entry(runs, form):
    """Before: an hjson file (one comment line) or a base64 string dropped the entry silently;
    stock ZeRO trained the experts (checksums 0.688 against 5.097)."""
    for ref, run in zip(_each(runs, "dict"), _each(runs, form)):
        assert "error" not in run, run
        assert run["selzero"]
        for name, value in ref["params"].items():
            assert torch.equal(run["params"][name], value), (form, name)


def test_initialize_bound_before_registration_is_refused_on_every_rank(runs):
    for run in _each(runs, "early"):
        assert run.get("error") == "ConfigError", run
        assert "import selzero_plugin.deepspeed" in run["message"]


@pytest.mark.parametrize("key", ["selected_zero_2", "selectedZero2"])
def test_a_near_miss_of_the_entry_key_is_refused_naming_it(runs, key):
    for run in _each(runs, key):
        assert run.get("error") == "ConfigError", run
        assert repr(key) in run["message"] and "\"selected_zero2\"" in run["message"]


def test_the_legacy_bfloat16_key_is_bf16_for_selzero_too(runs):
    """Before: selzero took it as fp32 and built no FP32 masters (they were the bf16-rounded
    module values)."""
    for ref, run in zip(_each(runs, "bf16"), _each(runs, "bfloat16")):
        assert "error" not in run, run
        assert run["bf16_module"] and run["masters"].numel() > 0
        assert torch.equal(run["masters"], ref["masters"])
        for name, value in ref["params"].items():
            assert torch.equal(run["params"][name], value), name


def test_coalesce_grad_reduction_trains_like_torch(runs):
    """Before: a UsageError asking for sz.end_microstep() at the second backward."""
    ref = doors.coalesced_reference(2)
    for run in _each(runs, "coalesce"):
        assert "error" not in run, run
        for name, value in ref.items():
            assert torch.allclose(run["params"][name], value, atol=1e-6, rtol=0), \
                (name, float((run["params"][name] - value).abs().max()))


def test_deepspeeds_own_moe_layer_is_refused_with_the_reason(runs):
    """Before: DeepSpeed's assertion "None of the param groups are marked as MoE"."""
    for run in _each(runs, "moe"):
        assert run.get("error") == "ConfigError", run
        assert "deepspeed.moe.layer.MoE" in run["message"] and "ModuleList" in run["message"]


# ---- checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for stage, bf16 in ((2, False), (1, False), (2, True)):
        folder = str(tmp_path_factory.mktemp(f"ds_save_{stage}_{int(bf16)}"))
        result = all_values(run_ranks(doors.save_run, 2, stage, bf16, folder, timeout=300,
                                      env=ENV))
        out[(stage, bf16)] = folder, result[0]
    return out


def _expected(result) -> dict[str, torch.Tensor]:
    """The trained FP32 values: the module's, the subset's masters where they exist."""
    return {**result["module"], **result["masters"]}


@pytest.mark.parametrize("stage, bf16", [(2, False), (1, False), (2, True)],
                         ids=["zero2", "zero1", "zero2-bf16"])
def test_deepspeeds_converters_hold_every_expert(saved, stage, bf16):
    """Before: zero_to_fp32 exited 0 with 6 of 22 tensors (the experts lost)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder, result = saved[(stage, bf16)]
    expected = _expected(result)
    state = get_fp32_state_dict_from_zero_checkpoint(folder)
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        if bf16 and ".experts." not in name:  # DeepSpeed's own masters of its parameters
            assert torch.equal(state[name].bfloat16().float(), value), name
        else:
            assert torch.equal(state[name].float(), value), name


def test_the_checkpoints_own_zero_to_fp32_script_holds_every_expert(saved, tmp_path):
    folder, result = saved[(2, False)]
    out = tmp_path / "fp32"
    run = subprocess.run([sys.executable, os.path.join(folder, "zero_to_fp32.py"), folder,
                          str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **ENV})
    assert run.returncode == 0, run.stderr[-2000:]
    state = torch.load(out / "pytorch_model.bin", weights_only=True)
    expected = _expected(result)
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


def test_load_state_dict_from_zero_checkpoint_restores_the_experts(saved):
    """Before: the experts kept their fresh-init values (max diff 0.78)."""
    from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint

    from ._deepspeed import build_model

    folder, result = saved[(2, False)]
    model = load_state_dict_from_zero_checkpoint(build_model(seed=5), folder)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), result["module"][name]), name


@pytest.mark.parametrize("options", [{"load_module_only": True},
                                     {"load_optimizer_states": False}],
                         ids=["module_only", "no_optimizer_states"])
def test_module_only_loads_work_on_another_world_size(saved, options):
    """Before: refused (the selzero folder has 2 shards, the job 3 ranks)."""
    folder, result = saved[(2, False)]
    runs = all_values(run_ranks(doors.load_module_only, 3, folder, options, timeout=300,
                                env=ENV))
    for run in runs:
        for name, value in result["module"].items():
            assert torch.equal(run["loaded"][name], value), name
        assert run["moved"]


@pytest.mark.parametrize("options", [{"load_module_only": True},
                                     {"load_optimizer_states": False}],
                         ids=["module_only", "no_optimizer_states"])
def test_module_only_loads_under_expert_parallelism_keep_each_ranks_experts(tmp_path, options):
    """Review: rank 1 got rank 0's experts (0.76 off) from DeepSpeed's module file."""
    runs = all_values(run_ranks(doors.ep_module_only, 2, str(tmp_path), options, timeout=300,
                                env=ENV))
    for rank, diffs in enumerate(runs):
        assert all(d == 0 for d in diffs.values()), (rank, {k: d for k, d in diffs.items() if d})


def test_zero1_module_only_load_into_a_run_that_froze_a_parameter(tmp_path):
    """Review: the embedded frozen-parameter table at ZeRO-1 made DeepSpeed's load look up a
    parameter frozen since the save (KeyError 'inp.weight'); stock loads it."""
    for run in all_values(run_ranks(doors.zero1_newly_frozen, 2, str(tmp_path), timeout=300,
                                    env=ENV)):
        assert run["diff"] == 0
