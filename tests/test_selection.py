"""Selection semantics (issue #2, rule 6): tied aliases, crossing ties, frozen parameters, empty
selection. The distributed cases run in one spawn per world size (tests/_selection.py); the
resolver itself is pure and is also tested in-process.
"""

import pytest
import torch
from torch import nn

from selzero_plugin import SelectionError
from selzero_plugin.core.layout import ceil_div
from selzero_plugin.core.selection import resolve_selection

from ._selection import FROZEN, freeze, reference, selection_rank, tie
from ._state import moved, strip_rank_prefix, value_of
from .dist_utils import run_ranks
from .models import ToyMoE
from .parity import max_diff


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def runs(request):
    world = request.param
    return world, run_ranks(selection_rank, world, timeout=90)


# ---- tied aliases --------------------------------------------------------------------------


@pytest.mark.multiproc
def test_tied_aliases_both_selected_stay_tied_and_train_with_parity(runs):
    world, outcomes = runs
    results = value_of(outcomes, "tied")
    ref = reference(world, tie)
    assert moved(ref, _initial(tie)) > 1e-3  # it trained
    for r, res in enumerate(results):
        assert res["still_tied"] == [True, True]
        assert res["aliases"] == {"experts.0.w1.weight": ["experts.1.w1.weight"],
                                  "experts.0.w1.bias": ["experts.1.w1.bias"],
                                  "experts.2.gain": ["experts.3.gain"]}
        assert not {"experts.1.w1.weight", "experts.3.gain"} & set(res["selected"])
        assert max_diff(res["state"], ref) <= 1e-6, f"rank {r}"
        assert torch.equal(res["state"]["experts.0.w1.weight"], res["state"]["experts.1.w1.weight"])


@pytest.mark.multiproc
def test_cannot_select_a_tie_crossing_the_selection_boundary(runs):
    _, outcomes = runs
    messages = []
    for o in outcomes:
        got = o.value["crossing"]
        assert got.get("error") == "SelectionError", got
        assert "experts.0.w1.weight" in got["message"] and "experts.1.w1.weight" in got["message"]
        messages.append(strip_rank_prefix(got["message"]))
    assert len(set(messages)) == 1


def test_cannot_resolve_a_crossing_tie_names_both_names():
    model = tie(ToyMoE(4))
    with pytest.raises(SelectionError, match=r"experts\.2\.gain.*experts\.3\.gain"):
        resolve_selection(model, params=["experts.2.*"], modules=[], expert_dim=None)
    with pytest.raises(SelectionError, match=r"experts\.3\.gain.*experts\.2\.gain"):
        resolve_selection(model, params=["experts.3.gain"], modules=[], expert_dim=None)


def test_a_tie_selected_by_both_names_is_one_entry_with_aliases():
    model = tie(ToyMoE(4))
    entries = resolve_selection(model, params=["experts.0.w1.*", "re:experts\\.1\\.w1\\..*"],
                                modules=[], expert_dim=None)
    assert [(e.name, e.aliases) for e in entries] == [
        ("experts.0.w1.weight", ("experts.1.w1.weight",)),
        ("experts.0.w1.bias", ("experts.1.w1.bias",))]


def test_modules_selects_every_parameter_of_a_module_class():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = ToyMoE(2)
    entries = resolve_selection(Wrapper(), params=[], modules=["Expert"], expert_dim=None)
    assert [e.name for e in entries] == [f"moe.experts.{i}.{n}" for i in range(2)
                                         for n in ("gain", "w1.weight", "w1.bias", "w2.weight",
                                                   "w2.bias")]


# ---- frozen --------------------------------------------------------------------------------


@pytest.mark.multiproc
def test_frozen_selected_parameters_get_no_state_and_stay_selected(runs):
    world, outcomes = runs
    ref = reference(world, freeze)
    for r, res in enumerate(value_of(outcomes, "frozen")):
        for name in FROZEN:
            assert name in res["selected"] and name not in res["trainable"]
            assert name not in res["virtual_entries"]
            assert torch.equal(res["state"][name], res["before"][name])
        assert len(res["selected"]) == 20 and len(res["trainable"]) == 18
        assert res["segments_on_frozen"] == []
        assert res["state_tensors"] == res["segments"] == res["state_parameter_count"]
        assert res["state_parameter_count"] == _expected_segments(res["trainable"], r, world)
        assert max_diff(res["state"], ref) <= 1e-6, f"rank {r}"


def _expected_segments(trainable: list[str], rank: int, world: int) -> int:
    """Trainable parameters whose chunk on ``rank`` is non-empty (real length > 0)."""
    shapes = {n: p.numel() for n, p in ToyMoE(4).named_parameters()}
    return sum(shapes[n] - rank * ceil_div(shapes[n], world) > 0 for n in trainable)


def _initial(prepare):
    torch.manual_seed(0)
    return {k: v.clone() for k, v in prepare(ToyMoE(4)).state_dict().items()}


# ---- empty selection -----------------------------------------------------------------------


@pytest.mark.multiproc
def test_cannot_build_an_instance_that_selects_nothing(runs):
    """Every rank raises the same SelectionError, naming the closest parameter names."""
    world, outcomes = runs
    for res in value_of(outcomes, "empty"):
        assert res["error"] is not None and res["unchanged"]
        assert "params=['expert.*.w1.*'] select no parameter" in res["error"]
        assert "'experts." in res["error"].split("Closest names:")[1]
