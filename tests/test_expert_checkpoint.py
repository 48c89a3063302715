"""Expert-parallel checkpoints keyed by global expert: save at one layout, restart at another.

World 4 on gloo, the reference MoE of selzero_plugin.moe (real token exchange, ranks routing
differently, expert 7 never routed). Saved at EP 2 after 3 steps, then continued for 2 steps in
fresh processes: at EP 2 from the folder itself, and, after `selzero reshard`, at EP 4 on 4
ranks and at EP 1 on 2 ranks. Each continuation equals one process that trained all 5 steps
with every expert (the world of each step, mean over it): the parameters, and both Adam
moments and the step count of every expert (read from a final save, consolidated).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from selzero_plugin import CheckpointError, SelectedZero2, clip_grad_norm_, wrap_ddp
from selzero_plugin.checkpoint import tools
from selzero_plugin.checkpoint.host import load_from, save_into
from selzero_plugin.cli import main as cli
from selzero_plugin.groups import expert_data_parallel

from .dist_utils import all_errors, all_values, run_ranks
from .test_expert_parallel import CLIP, DEAD, EXPERTS, EPModel, _batch

pytestmark = [pytest.mark.multiproc]

LR, WD, SAVED_AT, STEPS = 1e-2, 0.1, 3, 5
SELECT = {"params": ["moe.experts.*"], "normalize_over": "world"}


def _build(ep: int):
    groups = expert_data_parallel(ep)
    torch.manual_seed(0)
    start = EPModel()
    model = EPModel(groups.expert_parallel)
    for part in ("inp", "out"):
        getattr(model, part).load_state_dict(getattr(start, part).state_dict())
    model.moe.router.load_state_dict(start.moe.router.state_dict())
    for i, expert in enumerate(model.moe.experts):
        expert.load_state_dict(start.moe.experts[model.moe.global_expert(i)].state_dict())
    sz = SelectedZero2(model, SELECT, torch.optim.AdamW, {"lr": LR, "weight_decay": WD},
                       group=groups)
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    return groups, model, sz, wrap_ddp(model, sz), torch.optim.AdamW(dense, lr=LR,
                                                                    weight_decay=WD)


def _phase(rank: int, world: int, ep: int, first: int, last: int, work: str,
           load: str | None = None, save: str | None = None, wrong: str | None = None) -> dict:
    """Steps [first, last) at expert-parallel size ``ep``; ``load`` / ``save``: selzero's
    folder under ``work`` and the dense part (the host's checkpoint, written here by rank 0)."""
    import torch.distributed as dist

    groups, model, sz, ddp, host = _build(ep)
    refused = None
    if wrong is not None:  # a folder of another layout: refused on every rank, nothing changed
        before = [e.param.detach().clone() for e in sz.entries]
        try:
            load_from(Path(work) / wrong, [sz])
        except CheckpointError as e:
            refused = str(e)
        assert all(torch.equal(a, b) for a, b in zip(before, (e.param for e in sz.entries)))
    if load is not None:
        dense = torch.load(Path(work) / load / "dense.pt", weights_only=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".experts." not in n:
                    p.copy_(dense["params"][n])
        host.load_state_dict(dense["host"])
        load_from(Path(work) / load, [sz])
    for step in range(first, last):
        x, y, routes = _batch(step, rank)
        (ddp(x, routes) - y).pow(2).mean().backward()
        clip_grad_norm_(list(host.param_groups[0]["params"]), CLIP, subsets=[sz])
        host.step()
        sz.step()
        host.zero_grad()
    if save is not None:
        save_into(Path(work) / save, [sz])
        if rank == 0:
            torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()
                                   if ".experts." not in n}, "host": host.state_dict()},
                       Path(work) / save / "dense.pt")
    params = {n: p.detach().clone() for n, p in model.named_parameters()
              if ".experts." not in n}
    for i, expert in enumerate(model.moe.experts):
        for n, p in expert.named_parameters():
            params[f"moe.experts.{model.moe.global_expert(i)}.{n}"] = p.detach().clone()
    sz.remove_hooks()
    t = torch.zeros(1)
    dist.all_reduce(t)
    return {"params": params, "experts": len(model.moe.experts), "refused": refused,
            "group": sz.comm.global_ranks, "name": sz.config.name}


def _reference(worlds: list[int]) -> tuple[EPModel, torch.optim.AdamW]:
    torch.manual_seed(0)
    ref = EPModel()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for step, world in enumerate(worlds):
        batches = [_batch(step, r) for r in range(world)]
        loss = sum((ref(x, routes) - y).pow(2).mean() for x, y, routes in batches) / world
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return ref, opt


def _consolidated(root: Path, out: Path) -> dict[str, torch.Tensor]:
    """Every instance of the selzero folder ``root``, consolidated: key -> tensor."""
    from safetensors.torch import load_file

    index = json.loads((root / "index.json").read_text())
    found: dict[str, torch.Tensor] = {}
    for d in index["instances"]:
        path = tools.consolidate(root / d["name"], out / f"{d['name']}.safetensors")
        tensors = load_file(str(path))
        assert not set(tensors) & set(found), "a key held by two instances"
        found.update(tensors)
    return found


def _check(runs: list[dict], ref: EPModel, opt: torch.optim.AdamW, final: Path, tmp: Path,
           experts_per_rank: int) -> None:
    named = dict(ref.named_parameters())
    for run in runs:
        assert run["experts"] == experts_per_rank
        for n, p in run["params"].items():
            assert float((p - named[n].detach()).abs().max()) <= 1e-6, (n, run["name"])
    state = _consolidated(final, tmp)
    for g in range(EXPERTS):
        for member in ("w_in.weight", "w_in.bias", "w_out.weight", "w_out.bias"):
            key = f"moe.experts.{g}.{member}"
            torch_state = opt.state.get(named[key], {})
            if g == DEAD:  # never routed: no update and no state in either
                assert not torch_state and f"{key}/exp_avg" not in state
                continue
            assert int(state[f"{key}/step"]) == int(torch_state["step"]), key
            for moment in ("exp_avg", "exp_avg_sq"):
                saved = state[f"{key}/{moment}"].view_as(torch_state[moment])
                assert float((saved - torch_state[moment]).abs().max()) <= 1e-6, (key, moment)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """EP 2 on 4 ranks, 3 steps, saved into ``work/ep2``; resharded for EP 4 / 4 ranks and for
    EP 1 / 2 ranks by the command line."""
    work = tmp_path_factory.mktemp("ep_checkpoint")
    all_values(run_ranks(_phase, 4, 2, 0, SAVED_AT, str(work), save="ep2", timeout=240))
    for args, out in ((["--world-size", "4", "--ep-size", "4"], "ep4"),
                      (["--world-size", "2", "--ep-size", "1"], "ep1")):
        assert cli(["reshard", str(work / "ep2"), *args, "--out", str(work / out)]) == 0
        # the host's own file (here dense.pt) is the host's to convert; this one is replicated
        (work / out / "dense.pt").write_bytes((work / "ep2" / "dense.pt").read_bytes())
    return work


def test_index_names_the_layout_and_global_experts(saved, capsys):
    index = json.loads((saved / "ep2" / "selected_zero2" / "index.json").read_text())
    assert index["world_size"] == 4
    assert index["families"] == {"selected_zero2": {"ep_size": 2, "by_global_expert": True}}
    assert [(d["name"], d["ranks"], d["experts"]) for d in index["instances"]] == [
        ("selected_zero2-ep0", [0, 2], {"moe.experts": [[0, 4]]}),
        ("selected_zero2-ep1", [1, 3], {"moe.experts": [[4, 8]]})]
    manifest = json.loads((saved / "ep2" / "selected_zero2" / "selected_zero2-ep1" /
                           "manifest.json").read_text())
    names = [e["name"] for e in manifest["contract"]["entries"]]
    assert names[0] == "moe.experts.4.w_in.weight"  # global, not the local moe.experts.0
    assert manifest["contract"]["entries"][0]["local_name"] == "moe.experts.0.w_in.weight"
    index4 = json.loads((saved / "ep4" / "selected_zero2" / "index.json").read_text())
    assert [(d["name"], d["ranks"], d["experts"]) for d in index4["instances"]] == [
        (f"selected_zero2-ep{k}", [k], {"moe.experts": [[2 * k, 2 * k + 2]]}) for k in range(4)]
    index1 = json.loads((saved / "ep1" / "selected_zero2" / "index.json").read_text())
    assert [(d["name"], d["ranks"]) for d in index1["instances"]] == [
        ("selected_zero2-ep0", [0, 1])]
    assert cli(["inspect", str(saved / "ep2")]) == 0
    out = capsys.readouterr().out
    assert "expert-parallel size 2, keyed by global expert" in out
    assert "instance selected_zero2-ep1: expert-parallel rank 1, ranks [1, 3]; " \
           "moe.experts experts 4..7" in out
    assert "moe.experts.7.w_in.weight" in out and "never stepped" in out


def test_restart_at_the_same_layout_continues_exactly(saved, tmp_path):
    runs = all_values(run_ranks(_phase, 4, 2, SAVED_AT, STEPS, str(saved), load="ep2",
                                save="end2", timeout=240))
    ref, opt = _reference([4] * STEPS)
    _check(runs, ref, opt, saved / "end2" / "selected_zero2", tmp_path, EXPERTS // 2)


def test_resharded_to_ep4_continues_exactly_and_the_old_layout_is_refused(saved, tmp_path):
    runs = all_values(run_ranks(_phase, 4, 4, SAVED_AT, STEPS, str(saved), load="ep4",
                                save="end4", wrong="ep2", timeout=240))
    for run in runs:  # the EP 2 folder, loaded at EP 4 without reshard: every rank refuses
        assert "expert-parallel size 2 over 4 rank(s); this run has 4 over 4" in run["refused"]
        assert "selzero reshard" in run["refused"] and "--ep-size 4" in run["refused"]
    ref, opt = _reference([4] * STEPS)
    _check(runs, ref, opt, saved / "end4" / "selected_zero2", tmp_path, EXPERTS // 4)


def test_resharded_to_ep1_on_two_ranks_continues_exactly(saved, tmp_path):
    runs = all_values(run_ranks(_phase, 2, 1, SAVED_AT, STEPS, str(saved), load="ep1",
                                save="end1", timeout=240))
    assert [r["group"] for r in runs] == [[0, 1], [0, 1]]
    ref, opt = _reference([4] * SAVED_AT + [2] * (STEPS - SAVED_AT))
    _check(runs, ref, opt, saved / "end1" / "selected_zero2", tmp_path, EXPERTS)


# ---- fused experts (expert_dim=0) beside a ModuleList, moved between layouts ----------------

LOCAL = 2  # experts per expert-parallel rank at EP 2 (4 global experts)


class FusedExperts(nn.Module):
    """transformers-style fused experts: one (experts, 3, 4) tensor; rows are global experts
    expert_offset, expert_offset + 1, ..."""

    def __init__(self, local: int, offset: int) -> None:
        super().__init__()
        self.num_experts, self.expert_offset = local, offset
        self.w = nn.Parameter(torch.randn(local, 3, 4))


class FusedNet(nn.Module):
    def __init__(self, local: int, offset: int | None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.fused = FusedExperts(local, offset or 0)
        self.experts = nn.ModuleList(nn.Linear(4, 3) for _ in range(local))
        if offset is not None:
            self.experts.expert_offset = offset
        else:
            del self.fused.expert_offset
        with torch.no_grad():  # global expert g starts from the same values at any layout
            base = torch.randn(4 * LOCAL, 3, 4, generator=g)
            lin = [torch.randn(3, 4, generator=g) for _ in range(4 * LOCAL)]
            first = offset or 0
            self.fused.w.copy_(base[first:first + local])
            for i, layer in enumerate(self.experts):
                layer.weight.copy_(lin[first + i])
                layer.bias.zero_()

    def forward(self, x: torch.Tensor, used: list[int]) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], 3)
        for i in used:
            out = out + (x @ self.fused.w[i].T) + self.experts[i](x)
        return out


def _fused_phase(rank: int, world: int, ep: int, local: int, work: str, *,
                 offsets: str = "global", load: str | None = None, save: str | None = None
                 ) -> dict:
    """``offsets``: "global" (ep_rank * local), "same" (0 on every rank: wrong), "none"."""
    import torch.distributed as dist

    groups = expert_data_parallel(ep) if ep else None  # ep 0: no expert parallelism
    ep_rank = groups.ep_rank if groups else 0
    net = FusedNet(local, {"global": ep_rank * local, "same": 0, "none": None}[offsets])
    sz = SelectedZero2(net, {"params": ["fused.*", "experts.*"], "expert_dim": 0,
                             "normalize_over": "world"},
                       torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, group=groups)
    refused = None
    if load is not None:
        load_from(Path(work) / load, [sz])
    else:
        for step in range(2):  # local expert 1 is never used on EP rank 1: never stepped
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(5, 4, generator=g)
            used = [0] if ep_rank == 1 else [0, 1][:1 + step]
            net(x, used).pow(2).mean().backward()
            sz.step()
    if save is not None:
        try:
            save_into(Path(work) / save, [sz])
        except CheckpointError as e:
            refused = str(e)
    values = {n: p.detach().clone() for n, p in net.named_parameters()}
    sz.remove_hooks()
    t = torch.zeros(1)
    dist.all_reduce(t)
    return {"values": values, "refused": refused}


def test_fused_and_listed_experts_move_between_layouts_unchanged(tmp_path):
    """Saved at EP 2 on 2 ranks; resharded to 1 rank (EP 1), 4 ranks (EP 4) and 6 ranks (EP 2,
    uneven chunks over 3): consolidated, every key holds the same bits as the original (values,
    both moments, per-expert step counts, never-stepped experts without state); the 1-rank
    folder loads into a model holding all 4 experts with the saved values."""
    all_values(run_ranks(_fused_phase, 2, 2, LOCAL, str(tmp_path), save="saved", timeout=120))
    root = tmp_path / "saved" / "selected_zero2"
    original = _consolidated(root, tmp_path / "c0")
    assert "fused.w[expert 3]/value" in original and "fused.w[expert 3]/exp_avg" not in original
    assert "experts.3.weight/value" in original and "experts.3.weight/step" not in original
    assert int(original["fused.w[expert 1]/step"]) == 1  # used at the second step only
    assert int(original["fused.w[expert 0]/step"]) == 2
    for world, ep in ((1, 1), (4, 4), (6, 2)):
        out = tmp_path / f"w{world}e{ep}"
        assert cli(["reshard", str(root), "--world-size", str(world), "--ep-size", str(ep),
                    "--out", str(out)]) == 0
        again = _consolidated(out, tmp_path / f"c{world}{ep}")
        assert sorted(again) == sorted(original)
        assert all(torch.equal(again[k], original[k]) for k in original), (world, ep)
        index = json.loads((out / "index.json").read_text())
        assert index["world_size"] == world and len(index["instances"]) == ep
        manifest = json.loads((out / f"selected_zero2-ep{ep - 1}" / "manifest.json").read_text())
        fused = next(e for e in manifest["contract"]["entries"] if e["name"] == "fused.w")
        assert fused["shape"] == [4 // ep, 3, 4] and fused["experts"] == 4 // ep
        assert fused["placement"]["first"] == 4 - 4 // ep
    (tmp_path / "one").mkdir()
    (tmp_path / "w1e1").rename(tmp_path / "one" / "selected_zero2")
    got = all_values(run_ranks(_fused_phase, 1, 1, 4, str(tmp_path), load="one", timeout=120))[0]
    for g in range(4):
        assert torch.equal(got["values"]["fused.w"][g],
                           original[f"fused.w[expert {g}]/value"].view(3, 4))
        assert torch.equal(got["values"][f"experts.{g}.weight"],
                           original[f"experts.{g}.weight/value"].view(3, 4))


def test_a_checkpoint_without_expert_parallelism_splits_over_expert_ranks(tmp_path):
    """One process holding all 4 experts (offset 0), saved; `--ep-size 2` splits it into two
    expert-parallel instances with the same bits."""
    all_values(run_ranks(_fused_phase, 1, 0, 2 * LOCAL, str(tmp_path), save="plain",
                         timeout=120))
    root = tmp_path / "plain" / "selected_zero2"
    assert json.loads((root / "index.json").read_text())["families"] == {
        "selected_zero2": {"ep_size": None, "by_global_expert": True}}
    original = _consolidated(root, tmp_path / "c")
    assert cli(["reshard", str(root), "--world-size", "2", "--ep-size", "2", "--out",
                str(tmp_path / "ep2")]) == 0
    index = json.loads((tmp_path / "ep2" / "index.json").read_text())
    assert [(d["name"], d["ranks"], d["experts"]) for d in index["instances"]] == [
        ("selected_zero2-ep0", [0], {"experts": [[0, 2]], "fused.w": [[0, 2]]}),
        ("selected_zero2-ep1", [1], {"experts": [[2, 4]], "fused.w": [[2, 4]]})]
    again = _consolidated(tmp_path / "ep2", tmp_path / "c2")
    assert sorted(again) == sorted(original)
    assert all(torch.equal(again[k], original[k]) for k in original)


def test_save_refuses_experts_declared_twice_and_reshard_refuses_local_names(tmp_path):
    """Without expert_offset both expert-parallel ranks name their experts alike: the save
    works (a layout-bound checkpoint, resumable as it is) and the index says so; reshard to
    another EP size refuses with the fix. A wrong offset (both ranks claiming experts 0..1)
    is refused at save on every rank before anything is written."""
    errors = [v["refused"] for v in all_values(run_ranks(
        _fused_phase, 2, 2, LOCAL, str(tmp_path), offsets="same", save="same", timeout=120))]
    for error in errors:
        assert re.search(r"global expert 0 of '(fused.w|experts)' is held by expert-parallel "
                         r"ranks 0 and 1", error), error
        assert "expert_offset" in error
    assert not (tmp_path / "same").exists()
    all_values(run_ranks(_fused_phase, 2, 2, LOCAL, str(tmp_path), offsets="none",
                         save="local", timeout=120))
    root = tmp_path / "local" / "selected_zero2"
    index = json.loads((root / "index.json").read_text())
    assert index["families"]["selected_zero2"]["by_global_expert"] is False
    with pytest.raises(CheckpointError, match="without global expert indices.*expert_offset"):
        from selzero_plugin.checkpoint.relayout import reshard_root
        reshard_root(root, 2, 1, tmp_path / "out")
    assert cli(["reshard", str(root), "--world-size", "4", "--out", str(tmp_path / "w4")]) == 0
    assert json.loads((tmp_path / "w4" / "index.json").read_text())["instances"][1]["ranks"] \
        == [1, 3]
    from safetensors.torch import load_file

    for k in range(2):  # each expert-parallel rank's own tensors, regrouped over 2 ranks
        name = f"selected_zero2-ep{k}"
        a = load_file(str(tools.consolidate(root / name, tmp_path / f"a{k}.safetensors")))
        b = load_file(str(tools.consolidate(tmp_path / "w4" / name, tmp_path / f"b{k}.st")))
        assert sorted(a) == sorted(b) and all(torch.equal(a[t], b[t]) for t in a)


# ---- a save or load of several instances is one operation of the job ---------------------


def _atomic_phase(rank: int, world: int, work: str) -> dict:
    """EP 2 on 2 ranks (two instances, one per rank): saves that fail on rank 1 only, at the
    shard write and at putting its folder in place; loads of a damaged folder and of two
    different checkpoints."""
    import warnings

    import torch.distributed as dist

    from selzero_plugin.checkpoint import save as save_module

    work = Path(work)
    groups = expert_data_parallel(2)
    net = FusedNet(LOCAL, groups.ep_rank * LOCAL)
    sz = SelectedZero2(net, {"params": ["fused.*", "experts.*"], "expert_dim": 0,
                             "normalize_over": "world"},
                       torch.optim.AdamW, {"lr": 0.05}, group=groups)

    def train() -> None:
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))
        net(x, [0, 1]).pow(2).mean().backward()
        sz.step()

    def values() -> list[torch.Tensor]:
        return [p.detach().clone() for p in net.parameters()]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    def attempt(fn, *args) -> str | None:
        try:
            fn(*args)
        except CheckpointError as e:
            return str(e)
        return None

    def failing(name: str) -> None:  # on rank 1 only
        original = getattr(save_module, name)

        def boom(*args, **kwargs):
            setattr(save_module, name, original)
            raise OSError(28, "No space left on device")
        if rank == 1:
            setattr(save_module, name, boom)

    out: dict = {}
    train()
    save_into(work / "ck", [sz])
    first = values()
    train()
    failing("_write_shard")
    out["write_failed"] = attempt(save_into, work / "ck", [sz])
    load_from(work / "ck", [sz])
    out["after_write_failure"] = same(values(), first)
    train()
    failing("put_in_place")  # rank 0's folder is already in place when rank 1's fails
    out["place_failed"] = attempt(save_into, work / "ck", [sz])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_from(work / "ck", [sz])
    out["after_place_failure"] = same(values(), first)
    out["previous_note"] = [str(w.message) for w in caught if "previous" in str(w.message)]
    train()  # a second save interrupted the same way keeps the save the index names
    failing("put_in_place")
    out["place_failed_again"] = attempt(save_into, work / "ck", [sz])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_from(work / "ck", [sz])
    out["after_second_place_failure"] = same(values(), first)
    train()
    save_into(work / "ck", [sz])
    second = values()
    dist.all_reduce(torch.zeros(1))  # each group's rank 0 removes its old folder after the index
    out["leftovers"] = sorted(p.name for p in (work / "ck" / "selected_zero2").iterdir())
    train()
    save_into(work / "ck2", [sz])
    if rank == 1:  # one byte of rank 1's shard flipped
        shard = work / "ck" / "selected_zero2" / "selected_zero2-ep1" / \
            "shard-00000-of-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    dist.all_reduce(torch.zeros(1))
    third = values()
    out["damaged"] = attempt(load_from, work / "ck", [sz])
    out["kept_after_damaged"] = same(values(), third)
    out["different"] = attempt(load_from, work / ("ck2" if rank else "ck"), [sz])
    out["kept_after_different"] = same(values(), third)
    out["second_differs"] = not same(second, third)
    sz.remove_hooks()
    dist.all_reduce(torch.zeros(1))
    return out


def test_a_save_or_load_of_several_instances_is_one_operation_of_the_job(tmp_path):
    """Every rank raises the same error when one group's save fails (at its shard, or at
    putting its folder in place after the other group's is in place), and the checkpoint then
    loads as the previous save on every rank (not one instance new, one old); a damaged shard
    in one group, or ranks pointed at different checkpoints, are refused on every rank with no
    rank changed."""
    got = all_values(run_ranks(_atomic_phase, 2, str(tmp_path), timeout=180))
    for rank, v in enumerate(got):
        assert "No space left on device" in v["write_failed"], v
        assert "No space left on device" in v["place_failed"], v
        assert v["after_write_failure"] and v["after_place_failure"], v
        assert v["place_failed_again"] and v["after_second_place_failure"], v
        assert v["leftovers"] == ["index.json", "selected_zero2-ep0", "selected_zero2-ep1"], v
        assert "sha256 differs" in v["damaged"] and v["kept_after_damaged"], v
        assert "index.json differs" in v["different"] and v["kept_after_different"], v
        assert v["second_differs"]
    assert got[0]["previous_note"] and not got[1]["previous_note"]  # rank 0's newer folder


def test_an_index_from_before_the_layout_was_recorded_is_completed():
    from selzero_plugin.checkpoint.host import _completed

    old = {"format": 1, "instances": [{"name": "selected_zero2-ep0", "ranks": [0, 2]},
                                      {"name": "selected_zero2-ep1", "ranks": [1, 3]},
                                      {"name": "dense", "ranks": [0, 1, 2, 3]}]}
    index = _completed(old)
    assert index["world_size"] == 4
    assert index["families"] == {
        "selected_zero2": {"ep_size": 2, "by_global_expert": False},
        "dense": {"ep_size": None, "by_global_expert": False}}
    assert [(d["family"], d["ep_rank"], d["ep_size"]) for d in index["instances"]] == [
        ("selected_zero2", 0, 2), ("selected_zero2", 1, 2), ("dense", None, None)]
