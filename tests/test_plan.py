"""`selzero plan` predicts the per-rank bytes that memory_report() then measures, exactly:
world 3, shapes that do not divide by 3, fp32 ModuleList experts beside bf16 fused experts
(FP32 masters), AdamW and SGD with momentum; and the command on a transformers config."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2
from selzero_plugin.cli import main as cli
from selzero_plugin.plan import plan_memory

from .dist_utils import all_values, run_ranks

CONFIG = {"params": ["experts.*", "fused.*"], "expert_dim": 0, "bucket_mb": 0.001}


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.w = nn.Parameter(torch.randn(4, 5, 7))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 7)
        self.experts = nn.ModuleList(nn.Linear(7, 5) for _ in range(3))
        self.fused = Fused()
        self.fused.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        out = sum(e(h) for e in self.experts)
        return out + torch.einsum("td,eod->to", h.bfloat16(), self.fused.w).float()


OPTIMIZERS = {"adamw": (torch.optim.AdamW, {"lr": 1e-3}),
              "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              # param groups change the state of some slots (amsgrad: one more tensor)
              "adamw-groups": (torch.optim.AdamW, {"lr": 1e-3}),
              # whole-tensor ownership: Muon on the matrices (bf16 fused experts: masters),
              # AdamW on the biases; Adafactor's factored state
              "muon-tensors": (torch.optim.Muon, {"lr": 0.02}),
              "adafactor-tensors": (torch.optim.Adafactor, {"lr": 1e-2})}


def _config(optimizer: str) -> dict:
    if optimizer == "adamw-groups":
        return {**CONFIG, "param_groups": [{"params": ["*.bias"], "amsgrad": True}]}
    if optimizer == "muon-tensors":
        return {**CONFIG, "partition": "tensors", "param_groups": [
            {"params": ["*.bias"], "optimizer": "torch.optim.AdamW"}]}
    if optimizer == "adafactor-tensors":
        return {**CONFIG, "partition": "tensors"}
    return CONFIG


def _measured(rank: int, world: int, optimizer: str) -> dict:
    cls, kwargs = OPTIMIZERS[optimizer]
    net = Net()
    sz = SelectedZero2(net, _config(optimizer), cls, kwargs)
    net(torch.randn(6, 7)).pow(2).mean().backward()  # every expert gets a gradient
    sz.step()
    report = sz.memory_report()
    sz.remove_hooks()
    return {"grad_shard": report.grad_shard, "optimizer_state": report.optimizer_state,
            "master": report.master}


@pytest.mark.multiproc
@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adamw-groups", "muon-tensors",
                                       "adafactor-tensors"])
def test_plan_equals_the_measured_report_on_every_rank(optimizer):
    cls, kwargs = OPTIMIZERS[optimizer]
    with torch.device("meta"):
        model = Net()
    plan = plan_memory(model, _config(optimizer), 3, cls, kwargs)
    got = all_values(run_ranks(_measured, 3, optimizer, timeout=120))
    assert len({r["grad_shard"] for r in got}) > 1  # the ranks differ: uneven chunks
    for rank, measured in enumerate(got):
        predicted = plan.ranks[rank]
        assert measured == {"grad_shard": predicted.grad_shard,
                            "optimizer_state": predicted.optimizer_state,
                            "master": predicted.master}, (rank, measured, predicted)
    assert plan.virtual == 3 * 2 + 4 and plan.selected == 7


def test_plan_command_on_a_transformers_config(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = tmp_path / "qwen3.json"
    config.write_text(json.dumps({
        "model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 32,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 8,
        "num_experts_per_tok": 2}))
    assert cli(["plan", str(config), "--params", "*.mlp.experts.*", "--world-size", "4",
                "--dtype", "bf16", "--expert-dim", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 tensor(s), 32 virtual parameter(s)" in out and "vs mixed-precision DDP" in out
    assert cli(["plan", str(config), "--params", "nothing.*", "--world-size", "2"]) == 1
    assert "select no parameter of the model" in capsys.readouterr().err


def test_the_ddp_baseline_does_not_depend_on_the_partition():
    """Review finding: under partition='tensors' it counted FP32 state per expert."""
    with torch.device("meta"):
        model = Net()
    plans = [plan_memory(model, {**CONFIG, "partition": p}, 3, torch.optim.AdamW, {"lr": 1e-3})
             for p in ("chunks", "tensors")]
    assert plans[0].ddp_subset == plans[1].ddp_subset
    # the fp32 experts: FP32 grad + 2 moments; the bf16 fused tensor like for like (mixed-
    # precision DDP): FP32 grad, master and 2 moments; a step count per tensor
    fp32 = 3 * (7 * 5 + 5) * 4 * 3 + 3 * 2 * 4
    bf16 = 4 * 5 * 7 * 4 * 4 + 4
    assert plans[0].ddp_subset == fp32 + bf16
    assert "mixed-precision DDP" in plans[0].ddp_label and "bfloat16" in plans[0].ddp_label


def test_the_ddp_baseline_is_never_below_selzero_at_world_one():
    """Review finding: bf16 experts at world 1 read "DDP 144 KiB ... 0.75x selzero" beside
    selzero's 192 KiB: DDP was counted with bf16 gradients and state and no masters."""
    with torch.device("meta"):
        model = Net().to(torch.bfloat16)
    plan = plan_memory(model, CONFIG, 1, torch.optim.AdamW, {"lr": 1e-3})
    # equal but for the step counts: selzero keeps one per expert of the fused tensor (4),
    # DDP one per tensor
    assert plan.ranks[0].total - plan.ddp_subset == 4 * (4 - 1)


def test_the_per_rank_total_adds_weights_and_the_host_share(capsys):
    with torch.device("meta"):
        model = Net()
    plan = plan_memory(model, CONFIG, 3, torch.optim.AdamW, {"lr": 1e-3})
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.weights == weights
    # the host keeps inp (7x7 + 7, fp32) under DDP: FP32 grad + 2 moments + a step count each
    assert plan.dense_ddp == (7 * 7 + 7) * 12 + 2 * 4


def _factories():
    import types
    import sys as _sys

    mod = types.ModuleType("_plan_factories")
    mod.net = Net
    mod.needs = lambda width: Net()
    _sys.modules["_plan_factories"] = mod


def test_plan_command_messages(capsys):
    _factories()
    assert cli(["plan", "_plan_factories:net", "--modules", "Fused", "--world-size", "2"]) == 0
    assert "selected: 1 tensor(s), 1 virtual parameter(s)" in capsys.readouterr().out
    assert cli(["plan", "_plan_factories:net", "--world-size", "2"]) == 2
    assert "--params GLOB" in capsys.readouterr().err
    assert cli(["plan", "_plan_factories:needs", "--params", "experts.*", "--world-size", "2"]) == 1
    err = capsys.readouterr().err
    assert "needs argument(s) ['width']" in err and "Traceback" not in err
    assert cli(["plan", "_plan_factories:net", "--params", "expert.*", "--world-size", "2"]) == 1
    assert "Closest names: ['experts." in capsys.readouterr().err


def _rank_plans_slot_by_slot(layout, trainable, specs):
    """The plan as the engine's shard_slots lay each rank out (O(N x virtual parameters))."""
    from selzero_plugin.plan import RankPlan, _slot_state_bytes

    out = []
    for r in range(layout.world_size):
        slots = layout.shard_slots(r)
        entry = [layout.virtuals[s.virtual].entry for s in slots]
        low = sum(s.numel for s, t in zip(slots, entry)
                  if trainable[t].param.dtype != torch.float32)
        out.append(RankPlan(r, 4 * sum(s.numel for s in slots),
                            sum(_slot_state_bytes(specs[t], s.numel) for s, t in zip(slots, entry)),
                            4 * low))
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-groups", "muon-tensors"])
@pytest.mark.parametrize("world", [1, 2, 5, 16, 37, 300])
def test_rank_plans_equal_the_slot_by_slot_sum_at_any_world_size(optimizer, world, monkeypatch):
    """rank_plans sums each (entry, size) over ranks at once: the same figures as summing
    every rank's slots, also where ranks outnumber a virtual parameter's elements (37, 300:
    empty chunks) and where the last chunk is short."""
    import selzero_plugin.plan as plan_module

    seen = []
    real = plan_module.rank_plans

    def spy(layout, trainable, specs):
        seen.append((layout, trainable, specs))
        return real(layout, trainable, specs)

    monkeypatch.setattr(plan_module, "rank_plans", spy)
    cls, kwargs = OPTIMIZERS[optimizer]
    with torch.device("meta"):
        model = Net()
    plan = plan_memory(model, _config(optimizer), world, cls, kwargs)
    (layout, trainable, specs), = seen
    assert plan.ranks == _rank_plans_slot_by_slot(layout, trainable, specs)
