"""What a run tells you: the ``selzero_plugin`` logger (silent below WARNING unless
``SELZERO_LOG_LEVEL`` or the standard logging config asks), the per-instance INFO line with
bytes equal to what ``memory_report()`` then measures, the DEBUG step line, per-expert presence
on ``StepResult`` at world 2 with routing that differs by rank, ``--version`` and the
launcher's whole help."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig
from selzero_plugin.cli import main as cli
from selzero_plugin.log import describe
from selzero_plugin.plan import rank_plans, state_specs

from .dist_utils import all_values, run_ranks
from .models import ToyMoE, loss_fn, make_batch

SCRIPT = """
import torch
from selzero_plugin import SelectedZero2
from tests.models import ToyMoE, loss_fn, make_batch
model = ToyMoE(4)
sz = SelectedZero2(model, {"params": ["experts.*"], "bucket_mb": 0.001}, torch.optim.AdamW,
                   {"lr": 1e-3})
x, y = make_batch(0, 0)
loss_fn(model, x, y, torch.tensor([0, 1, 1, 2, 0, 1])).backward()
sz.step()
print("trained")
"""


def _run(env_extra: dict[str, str], code: str = SCRIPT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SELZERO_LOG_LEVEL"}
    env.update(env_extra, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_silent_by_default_and_info_or_debug_on_request():
    quiet = _run({})
    assert quiet.returncode == 0, quiet.stderr
    assert "selzero" not in quiet.stderr, quiet.stderr  # nothing below WARNING
    debug = _run({"SELZERO_LOG_LEVEL": "debug"})  # (INFO alone: the standard config below)
    assert debug.returncode == 0, debug.stderr
    lines = [x for x in debug.stderr.splitlines()
             if x.startswith("[selzero rank 0] INFO") and " took " in x]
    assert len(lines) == 1 and "took 20 tensor(s), 812 elements" in lines[0], debug.stderr
    assert "experts.0.w1.weight" in lines[0] and "group of 1 rank(s)" in lines[0]
    assert "DDP (FP32 grads and state) would hold" in lines[0]
    steps = [x for x in debug.stderr.splitlines() if "DEBUG" in x and " step: " in x]
    assert len(steps) == 1, debug.stderr
    # expert 3 got no token: its 5 tensors are skipped, one dead expert, named
    assert "skipped 5 absent (1 dead expert(s): ['experts.3'])" in steps[0], steps[0]
    assert "bucket(s) launched during backward" in steps[0]
    # the variable is not a config field: no "not a selzero field" warning from from_env
    assert "not a selzero field" not in debug.stderr


def test_the_standard_logging_config_works_too():
    code = "import logging\nlogging.basicConfig(level=logging.INFO)\n" + SCRIPT
    result = _run({}, code)
    assert result.returncode == 0, result.stderr
    assert "INFO:selzero_plugin:selzero 'selected_zero2': took 20 tensor(s)" in result.stderr


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 3
        self.w = nn.Parameter(torch.randn(3, 5, 7))


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 3
        self.weight = nn.Parameter(torch.randn(3, 7))


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(7, 5) for _ in range(3))
        self.fused_experts = _Fused().to(torch.bfloat16)
        self.gate = _Router()  # (E, hidden): split by expert_dim=0 too, but not an expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = sum(e(x) for e in self.experts) + (x @ self.gate.weight.t()).sum()
        return h + torch.einsum("td,eod->to", x.bfloat16(), self.fused_experts.w).float()


def test_the_info_line_bytes_are_what_memory_report_measures(caplog):
    torch.manual_seed(0)
    model = _Mixed()
    sz = SelectedZero2(model, {"params": ["experts.*", "fused_experts.*"], "expert_dim": 0,
                               "bucket_mb": 0.0001}, torch.optim.AdamW, {"lr": 1e-3})
    model(torch.randn(4, 7)).pow(2).mean().backward()
    assert sz.step().updated == 9  # every (virtual) parameter stepped: the state is all there
    report = sz.memory_report()
    planned = rank_plans(sz.layout, sz.trainable, state_specs(sz))[0]
    assert (planned.grad_shard, planned.optimizer_state, planned.master) == \
        (report.grad_shard, report.optimizer_state, report.master)
    line = describe(sz)
    assert "mixed-precision DDP (bfloat16 weights; FP32 grads, masters, state)" in line
    sz.remove_hooks()


def test_a_failing_description_does_not_fail_construction(caplog, monkeypatch):
    """Review finding: at INFO the description's optimizer-state probe raised on rank 0 alone
    (an optimizer keeping an int in its state) after the ranks had agreed: a report must never
    change the outcome."""
    from selzero_plugin import log

    def broken(sz):
        raise RuntimeError("probe failed")

    monkeypatch.setattr(log, "describe", broken)
    with caplog.at_level(logging.INFO, logger="selzero_plugin"):
        sz = SelectedZero2(ToyMoE(2), {"params": ["experts.*"]}, torch.optim.SGD, {"lr": 0.1})
    assert any("could not describe the instance (RuntimeError: probe failed)" in r.getMessage()
               for r in caplog.records)
    sz.remove_hooks()


def _presence(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = ToyMoE(4)
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=0.001),
                       torch.optim.AdamW, {"lr": 1e-3})
    # rank 0 routes to experts {0, 1}, rank 1 to {1, 2}; expert 3 gets no token anywhere
    routes = torch.tensor([[0, 1, 0, 1, 0, 1], [1, 2, 1, 2, 1, 2]][rank])
    x, y = make_batch(0, rank)
    loss_fn(model, x, y, routes).backward()
    result = sz.step()
    return {"presence": list(result.presence), "experts": result.expert_presence,
            "dead": result.dead_experts, "names": sz.virtual_names,
            "absent": result.skipped_absent}


@pytest.mark.multiproc
def test_per_expert_presence_on_the_step_result_at_world_two():
    runs = all_values(run_ranks(_presence, 2, timeout=90))
    assert runs[0] == runs[1]  # the agreed counts: the same on every rank
    r = runs[0]
    assert r["experts"] == {"experts.0": 1, "experts.1": 2, "experts.2": 1, "experts.3": 0}
    assert r["dead"] == 1 and r["absent"] == 5  # expert 3's five tensors
    names = r["names"]
    assert len(names) == len(r["presence"]) == 20
    assert r["presence"][names.index("experts.1.w2.bias")] == 2
    assert r["presence"][names.index("experts.3.gain")] == 0


def test_fused_rows_and_module_list_members_are_named_alike():
    """Review finding: a selected router split by expert_dim=0 counted as experts (32 for 16
    in a Qwen3-MoE): only modules named like experts (or declaring expert_offset) hold any."""
    model = _Mixed()
    sz = SelectedZero2(model, {"params": ["experts.*", "fused_experts.*", "gate.*"],
                               "expert_dim": 0}, torch.optim.SGD, {"lr": 0.1})
    assert sz.experts.names == ("experts.0", "experts.1", "experts.2", "fused_experts.0",
                                "fused_experts.1", "fused_experts.2")
    assert "gate.weight[expert 0]" in sz.virtual_names
    sz.remove_hooks()
    # a fused (E, out, in) tensor holds experts whatever its module is called (`ffn`)
    model.ffn = model.fused_experts
    del model.fused_experts
    sz = SelectedZero2(model, {"params": ["ffn.*", "gate.*"], "expert_dim": 0},
                       torch.optim.SGD, {"lr": 0.1})
    assert sz.experts.names == ("ffn.0", "ffn.1", "ffn.2")
    sz.remove_hooks()


def test_version_and_the_launchers_whole_help(capsys, monkeypatch):
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert done.value.code == 0
    from selzero_plugin import __version__

    assert capsys.readouterr().out.strip() == f"selzero {__version__}"
    pytest.importorskip("accelerate")
    from selzero_plugin.accelerate import main as launcher

    # Accelerate's help formatter hides flags by what sys.argv holds: as the console script
    monkeypatch.setattr(sys, "argv", [os.path.join(os.path.dirname(sys.executable),
                                                   "selzero-accelerate"), "--help"])
    assert launcher(["--help"]) == 0
    out = capsys.readouterr().out
    # Accelerate's own flags, and selzero's
    for flag in ("--num_processes", "--use_deepspeed", "--mixed_precision", "--selzero_config"):
        assert flag in out, flag
    assert launcher(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_log_level_is_applied_to_the_package_logger():
    from selzero_plugin import log

    logger = logging.getLogger("selzero_plugin")
    before = (logger.level, list(logger.handlers), logger.propagate)
    try:
        log.install({"SELZERO_LOG_LEVEL": "INFO"})
        assert logger.level == logging.INFO
        log.install({"SELZERO_LOG_LEVEL": "INFO"})  # idempotent: one handler
        assert sum(getattr(h, "_selzero_handler", False) for h in logger.handlers) == 1
        with pytest.warns(UserWarning, match="SELZERO_LOG_LEVEL='LOUD' is not a logging level"):
            log.install({"SELZERO_LOG_LEVEL": "LOUD"})
        assert logger.level == logging.INFO  # unchanged
    finally:
        logger.setLevel(before[0])
        logger.handlers[:] = before[1]
        logger.propagate = before[2]
