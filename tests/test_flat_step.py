"""The flat step ([Note: flat step] in core/flat_step.py): runs of segments stepped as one
tensor train bitwise like the per-segment step, at world 2-3 with routing that differs by rank
and experts that get no tokens, for every elementwise optimizer; state round trips, clears and
an LR scheduler on ``sz.optimizer`` behave the same; and the optimizer is really given fewer
tensors."""

import pytest
import torch

from .dist_utils import all_values, run_ranks
from ._flat import OPTIMIZERS, flat_and_segments, scratch_memory_run

pytestmark = pytest.mark.multiproc


def _same(flat, segments):
    assert len(flat["snaps"]) == len(segments["snaps"])
    for step, (a, b) in enumerate(zip(flat["snaps"], segments["snaps"])):
        assert a["updated"] == b["updated"], step
        for name in b["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), (step, name)
        assert a["state"].keys() == b["state"].keys(), step
        for k in b["state"]:
            assert a["state"][k].keys() == b["state"][k].keys(), (step, k)
            for key, value in b["state"][k].items():
                assert a["state"][k][key].shape == value.shape, (step, k, key)
                assert a["state"][k][key].dtype == value.dtype, (step, k, key)
                assert torch.equal(a["state"][k][key], value), (step, k, key)
    # state of the segments never stepped is held too (one buffer per group and key)
    a, b = flat["memory"], segments["memory"]
    assert (a.grad_shard, a.master) == (b.grad_shard, b.master)
    assert a.optimizer_state >= b.optimizer_state and a.total == a.ideal_total


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_flat_step_trains_bitwise_like_the_per_segment_step(opt):
    for r, out in enumerate(all_values(run_ranks(flat_and_segments, 2, opt, 5))):
        _same(out["flat"], out["segments"])
        if opt.endswith("fused"):  # torch's fused CPU kernels: per segment (not bitwise else)
            assert max(out["flat"]["tensors_per_step"]) == out["flat"]["segments"], r
            continue
        # fewer tensors than segments reach the optimizer (the path is taken)
        assert max(out["flat"]["tensors_per_step"]) < out["flat"]["segments"], r
        assert max(out["segments"]["tensors_per_step"]) == out["segments"]["segments"], r


@pytest.mark.parametrize("dtype,groups", [(torch.bfloat16, "lr"), (torch.float32, "lr"),
                                          (torch.float32, "class")])
def test_flat_step_with_param_groups_masters_and_a_scheduler_at_world_3(dtype, groups):
    outs = all_values(run_ranks(flat_and_segments, 3, "AdamW", 6, dtype=dtype, groups=groups,
                                scheduler=True, pattern="uneven"))
    for out in outs:
        _same(out["flat"], out["segments"])
        assert out["flat"]["warnings"] == out["segments"]["warnings"] == []
        assert max(out["flat"]["tensors_per_step"]) < out["flat"]["segments"]
    # the never-routed expert: not stepped on any rank, in either arm
    last = outs[0]["flat"]["snaps"][-1]["params"]
    first = outs[0]["flat"]["snaps"][0]["params"]
    assert torch.equal(last["experts.5.w1.weight"], first["experts.5.w1.weight"])


def test_flat_step_after_a_state_dict_round_trip_and_a_state_clear():
    outs = all_values(run_ranks(flat_and_segments, 2, "AdamW", 6, reload_at=2, clear_at=4))
    for out in outs:
        _same(out["flat"], out["segments"])


@pytest.mark.parametrize("opt,twist", [("AdamW", "replace"), ("SGD-plain", "momentum"),
                                       ("AdamW", "posthook"), ("AdamW", "bound"),
                                       ("NAdam", "bound"), ("AdamW", "storage"),
                                       ("AdamW", "swap"), ("AdamW", "swap_off"),
                                       ("AdamW", "drop_new")])
def test_flat_step_under_a_users_changes_to_state_and_hyperparameters(opt, twist):
    """Review findings: a state tensor a user replaced was ignored (the step went on from the
    flat buffer); SGD's momentum turned on after construction lost its buffers at every step;
    a step post-hook that raised after the update lost the step counts; new storage under a
    state tensor (``.data =``, ``set_``) was not seen; state exchanged between two slots was
    read after half of it was overwritten, also where a slot between them ended the flat path
    in the same step; state deleted right after the step that made it (experts stepped for the
    first time) must restart, not go on from the flat buffers ([Note: state fingerprint])."""
    for out in all_values(run_ranks(flat_and_segments, 2, opt, 5, twist=twist)):
        _same(out["flat"], out["segments"])
        if twist == "drop_new":
            assert out["flat"]["dropped"] == out["segments"]["dropped"] > 0
        if twist == "posthook":
            assert out["flat"]["raised"] == out["segments"]["raised"] == [2]
        if twist == "momentum":  # the flat path ends after step 2's update; its counter says
            runs = [s["runs"] for s in out["flat"]["snaps"]]  # so from then on (review finding)
            assert runs[0] > 0 and runs[3:] == [0] * (len(runs) - 3), runs
        if twist == "bound":  # [Note: scratch bound]: batches, each of runs
            flat = out["flat"]
            assert len(flat["tensors_per_step"]) > len(flat["snaps"]), flat["tensors_per_step"]
            assert max(flat["tensors_per_step"]) < flat["segments"]


def test_the_step_allocates_no_scratch_beyond_its_bound():
    """[Note: scratch bound]: fp32 values were copied into a scratch of the rank's whole share
    at every step (15 GB transient at 30B experts over 8 ranks); now the scratch is at most one
    bucket block, the pool's idle block when it fits, and the rest steps in place."""
    for out in all_values(run_ranks(scratch_memory_run, 2)):
        assert out["scratch_numel"] * 4 < out["share"] / 3, out  # the bound binds here
        assert max(out["peaks"][1:]) < out["share"] / 3, out
        assert max(out["runs"]) < out["segments"], out  # runs still formed within the bound


def _one_vector_run(rank: int, world: int, flat: bool, views: bool) -> dict:
    """Mixtral-style experts (w1, w3, w2, no biases), routing that differs by rank; with
    ``views`` the parameters are views of one vector (torch's vector_to_parameters)."""
    from torch import nn

    from selzero_plugin import SelectedZero2, SelZeroConfig
    from selzero_plugin.core import flat_step

    class Expert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w3 = nn.Linear(5, 3, bias=False), nn.Linear(5, 3, bias=False)
            self.w2 = nn.Linear(3, 5, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))

    torch.manual_seed(0)
    experts = nn.ModuleList(Expert() for _ in range(4))
    model = nn.ModuleDict({"experts": experts})
    if views:
        vector = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
        torch.nn.utils.vector_to_parameters(vector, model.parameters())
    flat_step.ENABLED = flat
    try:
        sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], name="v"),
                           torch.optim.AdamW, {"lr": 0.1})
    finally:
        flat_step.ENABLED = True
    for step in range(3):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(step * 10 + rank))
        sum(e(x) for k, e in enumerate(experts) if (k + rank + step) % 3).pow(2).sum().backward()
        sz.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("flat", [True, False])
def test_parameters_that_are_views_of_one_vector_train_like_separate_ones(world, flat):
    """Review finding: parameters laid out in model order in one buffer lie at a negative
    stride in bucket order; the coalesced copies raised at every step (at world 2 one rank
    raised and the other, whose padding broke its run, hung in the all-gather)."""
    separate = all_values(run_ranks(_one_vector_run, world, flat, False, timeout=120))
    views = all_values(run_ranks(_one_vector_run, world, flat, True, timeout=120))
    for a, b in zip(separate, views):
        assert all(torch.equal(a[n], b[n]) for n in a)


def _fused_run(rank: int, world: int, flat: bool, opt_name: str, hook: bool = False) -> dict:
    """Fused experts (one tensor per weight, expert_dim=0), fp32: the chunks of consecutive
    experts lie at equal distances in the tensor and are stepped in place as one 2-D view
    ([Note: flat step], strided runs). Routing differs by rank and leaves experts unrouted."""
    from torch import nn

    from selzero_plugin import SelectedZero2, SelZeroConfig
    from selzero_plugin.core import flat_step

    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 6
            self.w1 = nn.Parameter(torch.randn(6, 5, 7) / 3)
            self.w2 = nn.Parameter(torch.randn(6, 7, 5) / 3)

        def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
            h = torch.bmm(x.unsqueeze(1), self.w1[routes]).relu()
            return torch.bmm(h, self.w2[routes]).squeeze(1)

    torch.manual_seed(0)
    model = nn.ModuleDict({"experts": Fused()})
    cls, kwargs = OPTIMIZERS[opt_name]
    flat_step.ENABLED = flat
    try:
        sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], expert_dim=0, name="f"),
                           cls, kwargs)
    finally:
        flat_step.ENABLED = True
    if hook:  # a user's step hook that flattens what it is given (runs, under the flat step)
        sz.optimizer.register_step_post_hook(lambda opt, args, kwargs: torch.nn.utils.
                                             parameters_to_vector([p for g in opt.param_groups
                                                                   for p in g["params"]]))
    strided = []
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x = torch.randn(5, 5, generator=g)
        routes = torch.tensor([(k * (rank + 2) + step) % 5 for k in range(5)])  # expert 5: none
        model["experts"](x, routes).pow(2).sum().backward()
        sz.step()
        strided.append(sz.flat_step.strided_last_step if flat else 0)
    state = {k: {n: v.clone() for n, v in s.items() if isinstance(v, torch.Tensor)}
             for k, s in sz.optimizer.state_dict()["state"].items()}
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": state, "strided": strided}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("opt", ["AdamW", "SGD-nesterov", "Adagrad"])
def test_fused_experts_step_in_place_as_strided_runs_bitwise(world, opt):
    """The strided runs (no copy into a scratch) train bitwise like the per-segment step."""
    flat = all_values(run_ranks(_fused_run, world, True, opt, timeout=120))
    per_segment = all_values(run_ranks(_fused_run, world, False, opt, timeout=120))
    for a, b in zip(flat, per_segment):
        assert all(s > 0 for s in a["strided"][1:]), a["strided"]  # the path under test ran
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            assert all(torch.equal(a["state"][k][n], b["state"][k][n]) for n in a["state"][k])


@pytest.mark.parametrize("world", [2])
def test_step_hooks_see_contiguous_runs(world):
    """Review finding: a step hook that flattens its parameters (parameters_to_vector) failed
    on the strided runs' 2-D views; while step hooks are registered the runs are not strided
    (copied through the scratch, as before), and the result is the same."""
    hooked = all_values(run_ranks(_fused_run, world, True, "AdamW", True, timeout=120))
    per_segment = all_values(run_ranks(_fused_run, world, False, "AdamW", timeout=120))
    for a, b in zip(hooked, per_segment):
        assert a["strided"] == [0, 0, 0, 0], a["strided"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
