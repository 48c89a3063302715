"""Launch units ([Note: launch units]): which module launches a parameter's bucket, the
``launch_modules`` override, the log line for units that cannot fire, and the agreed error for
a unit that ran its backward on some ranks only."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig
from selzero_plugin.core.selection import resolve_selection
from selzero_plugin.core.units import ROOT_NAME, resolve_units

from ._blocks import BlockMoE, SkippingMoE, block_loss
from .dist_utils import all_values, run_ranks
from .models import ToyMoE


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 3
        self.w = nn.Parameter(torch.randn(3, 4, 5))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.fused = Fused()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": Mlp()}) for _ in range(2))


def _units(model: nn.Module, params: list[str], launch_modules: list[str] = ()) -> dict[str, str]:
    entries = resolve_selection(model, params=params, modules=[], expert_dim=None)
    units = resolve_units(model, entries, list(launch_modules))
    return {e.name: units.names[u] for e, u in zip(entries, units.of_entry)}


def test_experts_in_a_container_launch_at_the_block_that_holds_them():
    units = _units(Stack(), ["*.experts.*"])
    assert set(units.values()) == {"layers.0.mlp", "layers.1.mlp"}
    assert units["layers.1.mlp.experts.2.weight"] == "layers.1.mlp"


def test_a_fused_experts_module_and_other_parameters_launch_at_their_own_module():
    units = _units(Stack(), ["*.fused.*", "*.gate.*"])
    assert units["layers.0.mlp.fused.w"] == "layers.0.mlp.fused"
    assert units["layers.1.mlp.gate.weight"] == "layers.1.mlp.gate"


def test_launch_modules_choose_the_outermost_matching_module():
    units = _units(Stack(), ["*.experts.*", "*.gate.*"], ["layers.*"])
    assert set(units.values()) == {"layers.0", "layers.1"}
    assert _units(ToyMoE(), ["experts.*"]) == {n: ROOT_NAME for n in _units(ToyMoE(), ["experts.*"])}


class _Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = ToyMoE(3)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.moe(x, route)


@pytest.mark.parametrize("wrapped", [False, True], ids=["root-unit", "inner-unit"])
def test_buckets_whose_unit_cannot_fire_are_logged_once_and_still_reduced(caplog, wrapped):
    """A unit fed raw data cannot fire: its buckets launch at the end of backward. For a unit
    inside the model that holds gradients longer than needed (a warning); for the model itself
    (a model that is one MoE block) its backward ends with the backward anyway (INFO only)."""
    torch.manual_seed(0)
    model = _Wrapped() if wrapped else ToyMoE(3)
    glob = "moe.experts.*" if wrapped else "experts.*"
    sz = SelectedZero2(model, SelZeroConfig(params=[glob], bucket_mb=1e-4),
                       torch.optim.SGD, {"lr": 0.1})
    x = torch.randn(6, 7)
    with caplog.at_level(logging.INFO, logger="selzero_plugin"):
        for _ in range(2):
            model(x, torch.arange(6) % 3).sum().backward()
            assert sz.step().updated > 0
    lines = [r for r in caplog.records if r.name == "selzero_plugin"
             and "launch at the end of backward" in r.getMessage()]
    unit = "moe" if wrapped else ROOT_NAME
    assert len(lines) == 1 and f"['{unit}']" in lines[0].getMessage()
    assert lines[0].levelno == (logging.WARNING if wrapped else logging.INFO)


def _unit_skipped_on_one_rank(rank: int, world: int) -> list[int]:
    torch.manual_seed(0)
    model = SkippingMoE(layers=2)
    sz = SelectedZero2(model, SelZeroConfig(params=["blocks.*.experts.*"], bucket_mb=1e-4),
                       torch.optim.SGD, {"lr": 0.1})
    updated = []
    for step in range(3):
        model.skip = step == 1 and rank == 1
        block_loss(model, step, rank, layers=2).backward()
        try:
            updated.append(sz.step().updated)
        except ValueError as e:
            updated.append(-1)
            if step != 1:
                raise
            assert "launch unit(s) ['blocks.1']" in str(e) and "launch_modules" in str(e), e
    return updated


def test_a_unit_that_ran_on_some_ranks_only_is_an_agreed_error_and_training_goes_on():
    runs = all_values(run_ranks(_unit_skipped_on_one_rank, 2, timeout=60))
    for updated in runs:
        assert updated[1] == -1 and updated[0] > 0 and updated[2] > 0, runs


def _meta_first(rank: int, world: int) -> str:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Parameter(torch.empty(3, device="meta"))  # not selected, first
            self.experts = nn.Linear(5, 4)

    torch.manual_seed(rank)
    model = Model()
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"]), torch.optim.SGD, {"lr": 0.1})
    model.experts(torch.ones(2, 5)).sum().backward()
    sz.step()
    devices = {str(t.device) for t in (sz.grad_shard, sz.master_flat,
                                       sz.window.micro_presence)} | {sz.comm.device.type}
    return ",".join(sorted(devices))


def test_shards_and_control_tensors_live_on_the_selected_parameters_device():
    assert all_values(run_ranks(_meta_first, 2, timeout=60)) == ["cpu", "cpu"]


def _broadcasts_at_construction(rank: int, world: int) -> int:
    from selzero_plugin.core.comm import Communicator

    calls = []
    broadcast = Communicator.broadcast

    def counting(self, tensor, *, src=0):  # noqa: ANN001
        calls.append(tensor.numel())
        return broadcast(self, tensor, src=src)

    Communicator.broadcast = counting
    torch.manual_seed(rank)
    SelectedZero2(BlockMoE(layers=3), SelZeroConfig(params=["blocks.*.experts.*"]),
                  torch.optim.SGD, {"lr": 0.1})
    return len(calls)


def test_the_constructor_broadcast_is_coalesced_into_buckets():
    # 3 blocks x 3 experts x 5 tensors = 45 parameters, one fp32 bucket at the default size
    assert all_values(run_ranks(_broadcasts_at_construction, 2, timeout=60)) == [1, 1]


def test_the_core_never_imports_a_host_adapter_or_the_checkpoint_code():
    import ast
    import pathlib

    import selzero_plugin.core as core

    for path in pathlib.Path(core.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                names = [node.module] if node.module else [a.name for a in node.names]
                assert set(names) <= {"config", "errors"}, (path.name, names)
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("selzero_plugin"), (path.name, node.module)
