"""selzero_plugin.groups.expert_data_parallel(ep_size): DeepSpeed's layout, validated on every
rank; and the warning for ``mean`` over an expert-data-parallel group smaller than the world."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from selzero_plugin import SelectedZero2
from selzero_plugin.groups import expert_data_parallel

from .dist_utils import all_errors, all_values, run_ranks
from .models import ToyMoE


def _layout(rank: int, world: int, ep: int) -> dict:
    g = expert_data_parallel(ep)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.expert_parallel)  # the groups work
    u = torch.tensor([float(rank)])
    dist.all_reduce(u, group=g.expert_data_parallel)
    return {"ep": dist.get_process_group_ranks(g.expert_parallel),
            "edp": dist.get_process_group_ranks(g.expert_data_parallel),
            "ep_rank": g.ep_rank, "edp_rank": g.edp_rank, "ep_size": g.ep_size,
            "edp_size": g.edp_size, "sums": (float(t), float(u)), "all": g.all_ranks}


def test_expert_parallel_layout_at_world_4():
    got = all_values(run_ranks(_layout, 4, 2, timeout=120))
    assert [v["ep"] for v in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [v["edp"] for v in got] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(v["ep_rank"], v["edp_rank"]) for v in got] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(v["ep_size"] == 2 and v["edp_size"] == 2 for v in got)
    assert [v["sums"] for v in got] == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]
    assert all(v["all"] == [[0, 2], [1, 3]] for v in got)


def _bad(rank: int, world: int, kind: str) -> None:
    expert_data_parallel(3 if kind == "indivisible" else 1 + rank % 2)


def test_bad_or_inconsistent_ep_size_is_refused_on_every_rank():
    errors = all_errors(run_ranks(_bad, 2, "indivisible", timeout=120), "ConfigError")
    assert all("positive divisor of the world size 2" in e for e in errors), errors
    errors = all_errors(run_ranks(_bad, 2, "differs", timeout=120), "ConfigError")
    assert all("the ranks passed different values (from 1 to 2" in e for e in errors), errors


def _build(rank: int, world: int) -> dict[str, list[str]]:
    g = expert_data_parallel(2)
    seen_by: dict[str, list[str]] = {}
    for normalize_over in ("group", "world"):
        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            SelectedZero2(ToyMoE(), {"params": ["experts.*"], "normalize_over": normalize_over},
                          torch.optim.SGD, {"lr": 0.1}, group=g.expert_data_parallel
                          ).remove_hooks()
        seen_by[normalize_over] = [str(w.message) for w in seen
                                   if "normalize_over" in str(w.message)]
    return seen_by


def test_mean_over_a_group_smaller_than_the_world_warns_naming_the_factor():
    got = all_values(run_ranks(_build, 4, timeout=120))
    assert [len(v["group"]) for v in got] == [1, 1, 0, 0]  # group rank 0 of each group
    assert "2x too large: set normalize_over='world'" in got[0]["group"][0]
    assert all(v["world"] == [] for v in got)
