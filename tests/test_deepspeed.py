"""The DeepSpeed "selected_zero2" entry: real DeepSpeed 0.19.8, 2 gloo ranks on CPU.

Ranks route to different experts (expert 2 of each block gets no token anywhere): stock
DeepSpeed crashes at ZeRO-2 and trains wrong at ZeRO-1 on this (research/deepspeed-mechanics.md).
With the entry, every stage and dtype matches one process running plain torch AdamW +
clip_grad_norm_ over the global batch, and DeepSpeed's reported norm is the true global norm.
"""

from __future__ import annotations

import math

import pytest
import torch

from ._deepspeed import (LR, MUON_ENTRY, TENSORS_ENTRY, build_model, ds_config, reference,
                         reference_muon, train_deepspeed)
from .dist_utils import all_values, run_ranks

pytest.importorskip("deepspeed")

ENV = {"DS_ACCELERATOR": "cpu"}
STEPS = 6
SELECTED_COUNT = sum(".experts." in n for n, _ in build_model().named_parameters())
SELECTED_NUMEL = sum(p.numel() for n, p in build_model().named_parameters() if ".experts." in n)
TOTAL_NUMEL = sum(p.numel() for p in build_model().parameters())


@pytest.fixture(scope="module")
def ref():
    return reference(2, STEPS)


SCHEDULER = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                 "warmup_num_steps": 2, "total_num_steps": 5,
                                                 "warmup_type": "linear"}}


def _batched_calls(save_dir: str) -> dict[str, tuple[tuple, dict]]:
    calls = {f"parity-{stage}-{bf16}": ((stage, bf16), {"steps": STEPS})
             for stage in (0, 1, 2) for bf16 in (False, True)}
    calls.update({
        "client-0": ((0, False), {"steps": STEPS, "client_optimizer": True}),
        "client-0-bf16-save": ((0, True), {"steps": 2, "client_optimizer": True, "save_at": 2,
                                           "save_dir": save_dir}),
        "client-experts_group": ((2, False), {"steps": 4, "client_optimizer": "experts_group"}),
        "client-mixed_groups": ((2, False), {"steps": 4, "client_optimizer": "mixed_groups"}),
        "lr-schedule": ((2, False), {"steps": 5, "scheduler": SCHEDULER}),
        "bf16-optimizer": ((1, True), {"steps": STEPS, "config_changes": {
            "data_types": {"grad_accum_dtype": "fp32"}}}),
        "fused-adam": ((2, False), {"steps": 3, "config_changes": {
            "optimizer": {"type": "Adam", "params": {"lr": LR}}}}),
        "no-clip": ((0, False), {"steps": 3, "clip": 0.0}),
        "style-torch": ((2, False), {"steps": STEPS, "style": "torch"}),
        "style-boundary": ((2, False), {"steps": STEPS, "style": "boundary"}),
        "nonfinite": ((2, False), {"steps": 3, "poison_step": 1}),
        # whole-tensor ownership through the entry (issue 12)
        "tensors-adamw": ((2, False), {"steps": STEPS, "config_changes": {
            "selected_zero2": TENSORS_ENTRY}}),
        "tensors-muon": ((1, False), {"steps": 5, "scheduler": SCHEDULER, "config_changes": {
            "selected_zero2": MUON_ENTRY}}),
        "tensors-muon-fused-adam": ((2, False), {"steps": 4, "config_changes": {
            "selected_zero2": MUON_ENTRY,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.1}}}}),
    })
    return calls


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """The runs below that only train: all in one 2-process launch (train_many), by key."""
    from ._deepspeed import train_many

    save_dir = tmp_path_factory.mktemp("ds_batch")
    calls = _batched_calls(str(save_dir))
    per_rank = all_values(run_ranks(train_many, 2, list(calls.values()), timeout=900, env=ENV))
    out = {key: [per_rank[r][i] for r in range(2)] for i, key in enumerate(calls)}
    out["save_dir"] = save_dir
    return out


def _check(runs, ref, *, bf16: bool) -> None:
    ref_params, ref_norms = ref
    init = build_model()
    for rank, run in enumerate(runs):
        params = run["params"]
        tol = 1.5e-2 if bf16 else 1e-6
        for name, value in ref_params.items():
            assert torch.allclose(params[name], value, atol=tol, rtol=0), \
                (rank, name, (params[name] - value).abs().max().item())
        norm_tol = 2e-2 if bf16 else 1e-6
        for got, want in zip(run["norms"], ref_norms):
            assert abs(got - want) <= norm_tol * max(1.0, want), (rank, run["norms"], ref_norms)
        for name, p in init.named_parameters():
            if ".experts.2." in name:  # no rank routes to it: bit-identical
                start = p.detach().bfloat16().float() if bf16 else p.detach()
                assert torch.equal(params[name], start), (rank, name)
        assert run["ds_state_on_selected"] == 0 and run["ds_groups_hold_selected"] == 0
        assert run["selected_grads_left"] == []
        assert run["ds_grad_numel"] == TOTAL_NUMEL - SELECTED_NUMEL, run["ds_grad_numel"]
        assert run["state"] == "idle"
    assert torch.equal(runs[0]["params"]["blocks.0.experts.0.w1.weight"],
                       runs[1]["params"]["blocks.0.experts.0.w1.weight"])


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_parity_with_one_process_torch(stage, bf16, ref, batch):
    _check(batch[f"parity-{stage}-{bf16}"], ref, bf16=bf16)


@pytest.mark.parametrize("stage", [0])  # stage 2: test_client_optimizer_groups
def test_client_optimizer_object(stage, ref, batch):
    _check(batch[f"client-{stage}"], ref, bf16=False)


def test_client_optimizer_at_stage_0_bf16_saves(batch):
    """What the HF Trainer passes (a client optimizer) at ZeRO-0 bf16: DeepSpeed's
    FP16_UnfusedOptimizer shares the groups' lists as its fp32_groups; they never hold a
    selected parameter, so save_checkpoint works (before: cannot pickle a weakref)."""
    runs = batch["client-0-bf16-save"]
    assert all(r["wrapper"] == "FP16_UnfusedOptimizer" for r in runs)
    assert all(r["ds_groups_hold_selected"] == 0 for r in runs)
    assert (batch["save_dir"] / "global_step2" / "selected_zero2" / "index.json").is_file()


@pytest.mark.parametrize("groups", ["experts_group", "mixed_groups"])
def test_client_optimizer_groups(groups, batch):
    """A client optimizer whose groups give the experts another lr and no weight decay: each
    selected parameter follows the group that held it, also when DeepSpeed drops that group
    because it held only experts."""
    ref = reference(2, 4, groups=groups)
    for run in batch[f"client-{groups}"]:
        for name, value in ref[0].items():
            assert torch.allclose(run["params"][name], value, atol=1e-6, rtol=0), name


def test_lr_schedule_from_the_config(batch):
    """DeepSpeed's WarmupDecayLR moves the experts' lr exactly as DeepSpeed's own: the subset
    steps with the lr DeepSpeed used for that step (before its scheduler moves on)."""
    runs = batch["lr-schedule"]
    lrs = runs[0]["lrs"]
    assert len(set(lrs)) >= 3, lrs  # the schedule moved
    ref = reference(2, 5, lrs=lrs)
    for run in runs:
        for name, value in ref[0].items():
            assert torch.allclose(run["params"][name], value, atol=1e-6, rtol=0), name


def test_bf16_optimizer_path_reports_the_true_norm(ref, batch):
    """ZeRO-1 + bf16 with fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer: the
    subset's norm goes into DeepSpeed's norm once (reported and clipped with)."""
    runs = batch["bf16-optimizer"]
    assert {r["wrapper"] for r in runs} == {"BF16_Optimizer"}
    _check(runs, ref, bf16=True)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_broadcast_false_keeps_per_rank_values(bf16):
    from ._deepspeed import per_rank_values_run

    for run in all_values(run_ranks(per_rank_values_run, 2, bf16, timeout=240, env=ENV)):
        assert run == {"kept": True, "dense_rank0": True, "masters_exact": True}, run


def test_deepspeed_fused_adam_defaults(ref, batch):
    """Config "Adam" without torch_adam builds DeepSpeed's FusedAdam (weight_decay 0 by
    default, AdamW mode): the subset runs torch AdamW with DeepSpeed's resolved values."""
    runs = batch["fused-adam"]
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    from ._deepspeed import CLIP, GAS, LAYERS
    from ._blocks import block_loss
    for step in range(3):
        loss = sum(block_loss(model, step * GAS + m, r, layers=LAYERS)
                   for m in range(GAS) for r in range(2)) / (GAS * 2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for run in runs:
        assert run["subset_optimizer"] == "AdamW"
        assert run["subset_hyper"] == [{"lr": LR, "weight_decay": 0.0}]
        for name, value in model.named_parameters():
            # FusedAdam's CPU kernel differs from torch's in the last bits (dense: ~5e-6)
            assert torch.allclose(run["params"][name], value.detach(), atol=2e-5, rtol=0), name


def test_no_clipping_reports_the_true_norm(batch):
    ref_params, ref_norms = reference(2, 3, clip=0.0)
    for run in batch["no-clip"]:
        assert max(abs(a - b) for a, b in zip(run["norms"], ref_norms)) < 1e-6
        for name, value in ref_params.items():
            assert torch.allclose(run["params"][name], value, atol=1e-6, rtol=0), name


@pytest.mark.parametrize("style", ["torch", "boundary"])
def test_plain_backward_and_manual_boundary(style, ref, batch):
    """``loss.backward()`` (micro-steps end in engine.step) and DeepSpeed's manual pattern
    (``set_gradient_accumulation_boundary``, one step(): micro-steps end in engine.backward)."""
    _check(batch[f"style-{style}"], ref, bf16=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Saves, then loads of them, each phase in one 2-process launch (fresh processes, as a
    restart): ``a`` saved at step 3 (ZeRO-2); ``noentry`` saved at step 1 without the entry
    (ZeRO-0); ``b`` a copy of ``a`` without selzero's folder (node-local disks)."""
    import shutil

    from ._deepspeed import train_many

    work = tmp_path_factory.mktemp("ds_checkpoints")
    a, b, noentry = str(work / "a"), str(work / "b"), str(work / "noentry")
    all_values(run_ranks(train_many, 2, [
        ((2, False), {"steps": 3, "save_at": 3, "save_dir": a}),
        ((0, False), {"steps": 1, "save_at": 1, "with_entry": False, "save_dir": noentry}),
    ], timeout=600, env=ENV))
    shutil.copytree(work / "a", work / "b")
    shutil.rmtree(work / "b" / "global_step3" / "selected_zero2")
    loads = {
        "resume": ((2, False), {"steps": STEPS, "load_dir": a}),
        "no-optimizer-states": ((2, False), {"steps": 4, "load_dir": a, "load_options": {
            "load_optimizer_states": False}}),
        "noentry-refused": ((0, False), {"steps": 2, "load_dir": noentry}),
        "noentry-fresh": ((0, False), {"steps": 2, "load_dir": noentry, "fresh_start": True}),
        "missing-on-one": ((2, False), {"steps": 2, "load_dir": [a, b]}),
    }
    per_rank = all_values(run_ranks(train_many, 2, list(loads.values()), timeout=600, env=ENV))
    out = {key: [per_rank[r][i] for r in range(2)] for i, key in enumerate(loads)}
    out["work"] = work
    return out


def _errors(runs: list[dict], expected: str) -> list[str]:
    for run in runs:
        assert run.get("error_type") == expected, run.get("error_message", run.keys())
    return [run["error_message"] for run in runs]


def test_resume_from_engine_checkpoint(checkpoints, batch):
    """Save at step 3 through engine.save_checkpoint, resume in fresh processes through
    engine.load_checkpoint (tag from `latest`), train on: the same as never stopping."""
    import json
    import subprocess
    import sys

    full = batch["parity-2-False"]
    tmp_path = checkpoints["work"] / "a"
    root = tmp_path / "global_step3" / "selected_zero2"
    assert (tmp_path / "latest").read_text().strip() == "global_step3"
    index = json.loads((root / "index.json").read_text())
    assert len(index.pop("save_id")) == 16
    assert index == {"format": 1, "world_size": 2, "instances": [
        {"name": "selected_zero2", "ranks": [0, 1], "family": "selected_zero2", "ep_rank": None,
         "ep_size": None, "experts": {}, "unplaced": SELECTED_COUNT}],
        "families": {"selected_zero2": {"ep_size": None, "by_global_expert": False}}}
    assert sorted(p.name for p in (root / "selected_zero2").iterdir()) == [
        "manifest.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    resumed = checkpoints["resume"]
    for a, b in zip(full, resumed):
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert a["norms"][3:] == b["norms"]
    # the offline tools read the folder
    cli = [sys.executable, "-m", "selzero_plugin.cli"]
    out = subprocess.run(cli + ["inspect", str(root / "selected_zero2"), "--verify"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r3 = checkpoints["work"] / "r3"
    out = subprocess.run(cli + ["reshard", str(root / "selected_zero2"), "--world-size", "3",
                                "--out", str(r3)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (r3 / "shard-00002-of-00003.safetensors").is_file()


def test_load_without_optimizer_states(checkpoints):
    """load_optimizer_states=False: DeepSpeed's state and selzero's both start fresh (the
    subset's FP32 values still come from the checkpoint)."""
    runs = checkpoints["no-optimizer-states"]
    assert all(r["selzero_steps"] == [1.0] for r in runs), [r["selzero_steps"] for r in runs]


def test_checkpoint_saved_without_the_entry(checkpoints):
    """Loading a DeepSpeed checkpoint that has no selzero folder: the same CheckpointError on
    every rank, naming the fix; with selzero_fresh_start=True the subset starts fresh."""
    errors = _errors(checkpoints["noentry-refused"], "CheckpointError")
    assert all("selzero_fresh_start=True" in e for e in errors), errors
    assert [r["global_steps"] for r in checkpoints["noentry-fresh"]] == [2, 2]


def test_checkpoint_folder_missing_on_one_rank(checkpoints):
    """selzero's folder visible on rank 0 only (node-local disks): the same CheckpointError on
    every rank, none left waiting."""
    errors = _errors(checkpoints["missing-on-one"], "CheckpointError")
    assert all("visible on 1 rank(s) and missing on 1" in e for e in errors), errors


@pytest.mark.parametrize("change, expected", [
    ({"zero_optimization": {"stage": 3}}, "stage=3"),
    ({"fp16": {"enabled": True}}, "Use bf16"),
    ({"expert_parallel": {"enabled": True}}, "AutoEP"),
    ({"selected_zero2": {"params": ["*.experts.*"], "bucket_mbb": 1}}, "bucket_mb"),
    ({"selected_zero2": {"params": ["nothing.*"]}}, "select no parameter"),
])
def test_refused_at_initialize(change, expected):
    import selzero_plugin.deepspeed as sd
    from selzero_plugin.errors import SelZeroError

    config = ds_config(2, False)
    config.update(change)
    with pytest.raises(SelZeroError, match=expected.replace("(", r"\(")):
        if expected == "select no parameter":
            run = run_ranks(_initialize_only, 2, config, timeout=120, env=ENV)
            raise SelZeroError([o.error_message for o in run if o.error_message][0])
        sd.initialize(model=build_model(), config=config)


def _initialize_only(rank, world, config):
    import os

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import selzero_plugin.deepspeed  # noqa: F401
    import deepspeed

    if isinstance(config, list):  # one config per rank
        config = config[rank]
    deepspeed.initialize(model=build_model(), config=config)


def test_selection_failing_on_one_rank_raises_on_every_rank():
    """Rank 1's selection matches nothing: every rank raises before DeepSpeed's initialize
    (whose broadcast would leave rank 0 waiting)."""
    from .dist_utils import all_errors

    good, bad = ds_config(2, False), ds_config(2, False)
    bad["selected_zero2"] = {"params": ["nomatch.*"]}
    errors = all_errors(run_ranks(_initialize_only, 2, [good, bad], timeout=120, env=ENV),
                        "SelectionError")
    assert all("select no parameter" in e or "rank 1" in e for e in errors), errors


def test_without_the_entry_nothing_changes():
    """No "selected_zero2" block: deepspeed.initialize is called with exactly what it got."""
    import deepspeed
    import selzero_plugin.deepspeed as sd

    assert deepspeed.initialize._selzero_wrapped
    calls = []

    def fake(args=None, model=None, optimizer=None, model_parameters=None, config=None,
             config_params=None):
        calls.append((model, optimizer, model_parameters, config))
        return "engine"

    config, model, params = ds_config(2, False, entry=False), build_model(), []
    assert sd._initialize(fake, model=model, model_parameters=params, config=config) == "engine"
    assert len(calls) == 1 and calls[0][0] is model and calls[0][2] is params \
        and calls[0][3] is config


def test_memory_against_stock_deepspeed():
    """Per rank, after a backward with optimizer state alive: DeepSpeed's optimizer-side bytes
    with the entry equal DeepSpeed's without the experts, selzero holds its ideal, and the sum
    is below stock DeepSpeed ZeRO-2 over the whole model (routing reaches every expert on every
    rank, or stock DeepSpeed would not run)."""
    from ._deepspeed import memory_run

    got = {mode: all_values(run_ranks(memory_run, 2, mode, timeout=240, env=ENV))
           for mode in ("entry", "dense", "stock")}
    for rank in range(2):
        entry, dense, stock = (got[m][rank] for m in ("entry", "dense", "stock"))
        assert entry["deepspeed"] == dense["deepspeed"], (rank, got)
        assert entry["selzero"] == entry["selzero_ideal"], (rank, got)
        total = entry["deepspeed"] + entry["selzero"]
        assert total < stock["deepspeed"], (rank, got)
    print("per-rank bytes:", got)


def test_expert_parallel_groups(tmp_path):
    """4 ranks, "group": {"expert_parallel_size": 2}: each rank keeps its own experts through
    DeepSpeed's broadcast, selzero reduces them over the expert-data-parallel group {r % 2,
    r % 2 + 2} and divides by the world; parity with one process holding every expert, the
    true global norm, and a checkpoint index naming both instances."""
    import json

    from ._deepspeed_ep import ep_reference, ep_run, local_name

    steps = 4
    runs = all_values(run_ranks(ep_run, 4, steps, str(tmp_path), timeout=300, env=ENV))
    ref, ref_norms = ep_reference(steps)
    for rank, run in enumerate(runs):
        assert run["name"] == f"selected_zero2-ep{rank % 2}"
        assert run["group"] == [rank % 2, rank % 2 + 2] and run["normalize_over"] == "world"
        for full, value in ref.items():
            name = local_name(full, rank)
            if name is not None:
                assert torch.allclose(run["params"][name], value, atol=1e-6, rtol=0), \
                    (rank, name, float((run["params"][name] - value).abs().max()))
        assert max(abs(a - b) for a, b in zip(run["norms"], ref_norms)) < 1e-6, \
            (run["norms"], ref_norms)
    index = json.loads((tmp_path / "ep" / "selected_zero2" / "index.json").read_text())
    assert [{k: d[k] for k in ("name", "ranks", "ep_rank", "ep_size", "experts")}
            for d in index["instances"]] == [
        {"name": "selected_zero2-ep0", "ranks": [0, 2], "ep_rank": 0, "ep_size": 2,
         "experts": {"block.experts": [[0, 2]]}},
        {"name": "selected_zero2-ep1", "ranks": [1, 3], "ep_rank": 1, "ep_size": 2,
         "experts": {"block.experts": [[2, 4]]}}]
    assert index["families"] == {"selected_zero2": {"ep_size": 2, "by_global_expert": True}}
    for k in range(2):
        assert (tmp_path / "ep" / "selected_zero2" / f"selected_zero2-ep{k}" /
                "manifest.json").is_file()


def test_follows_deepspeeds_skip_on_a_non_finite_gradient(batch):
    """An inf in one expert's gradient on rank 1 only: the subset's norm is part of
    DeepSpeed's, DeepSpeed (ZeRO-2 fp32) sees the overflow and skips the step, selzero skips
    too on every rank (no error by default under DeepSpeed), and training goes on."""
    runs = batch["nonfinite"]
    for run in runs:
        assert run["applied"] == [True, False, True], run["applied"]
        assert run["moved"] == [True, False, True], run["moved"]
        assert all(math.isfinite(float(v.abs().max())) for v in run["params"].values())
    assert torch.equal(runs[0]["params"]["blocks.0.experts.0.w1.weight"],
                       runs[1]["params"]["blocks.0.experts.0.w1.weight"])


def test_partition_tensors_through_the_entry_equals_plain_adamw(ref, batch):
    """The same math as chunks for an elementwise optimizer: whole tensors, one owner each."""
    _check(batch["tensors-adamw"], ref, bf16=False)


# Muon's Newton-Schulz iteration runs in bf16, so a last-bit difference in a gradient can flip
# a bf16 rounding and move a weight by up to ~lr * 2^-8 per step. With DeepSpeed's own Adam
# kernel on the host's parameters (its FusedAdam on CPU, replaced by torch's AdamW for the
# subset only) the host's weights differ from torch AdamW's by ~1e-7, and that reaches the
# expert gradients; there the Muon matrices get this tolerance. With a mirrored torch optimizer
# the arithmetic is the reference's and everything holds 1e-6 (measured 3e-8).
MUON_TOLERANCE = 5e-3


@pytest.mark.parametrize("case", ["tensors-muon", "tensors-muon-fused-adam"])
def test_muon_on_the_expert_matrices_through_the_entry(batch, case):
    """A param group naming torch.optim.Muon in the selected_zero2 block: Muon on the experts'
    matrices, DeepSpeed's AdamW (mirrored, or its FusedAdam replaced by torch's) on the rest;
    the Muon group's lr follows DeepSpeed's LR schedule (warm-up from 0) by the same factor."""
    runs = batch[case]
    lrs = runs[0]["lrs"]
    ref, norms = reference_muon(2, len(lrs), lrs=lrs if case == "tensors-muon" else None)
    if case == "tensors-muon":
        assert len(set(lrs)) >= 3 and lrs[0] == 0.0, lrs
    for run in runs:
        assert run["subset_optimizer"] == "MultiOptimizer"
        muon_group = run["subset_hyper"][-1]
        assert muon_group["lr"] == pytest.approx(0.02 * run["lrs"][-1] / LR, rel=1e-12)
        assert muon_group["weight_decay"] == 0.05
        for name, value in ref.items():
            muon = ".experts." in name and name.endswith(".weight")
            tol = MUON_TOLERANCE if muon and case == "tensors-muon-fused-adam" else 1e-6
            assert torch.allclose(run["params"][name], value, atol=tol, rtol=0), \
                (case, name, (run["params"][name] - value).abs().max().item())
        for got, want in zip(run["norms"], norms):
            assert abs(got - want) <= (1e-6 if case == "tensors-muon" else 1e-3) * max(1.0, want)


def test_deepspeeds_own_muon_is_refused_naming_the_torch_muon_param_group():
    """DeepSpeed's "muon" optimizer type (MuonWithAuxAdam: its own Newton-Schulz variant) has
    no torch equivalent: refused on every rank, saying how to give the experts torch Muon."""
    from .dist_utils import all_errors

    config = ds_config(2, False)
    config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02}}
    config["selected_zero2"] = {"params": ["blocks.*.experts.*"], "partition": "tensors"}
    messages = all_errors(run_ranks(_initialize_only, 2, config, timeout=240, env=ENV),
                          "ConfigError")
    assert all("DeepSpeed's own Muon" in m and "torch.optim.Muon" in m for m in messages)
