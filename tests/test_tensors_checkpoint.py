"""Checkpoints under whole-tensor ownership (``partition="tensors"``): the same format (per-rank
shards + manifest, format version 2), each tensor whole in its owner's shard, the manifest
recording the partition and the plan. Save at world 2 -> ``selzero reshard --world-size 3`` ->
load at world 3 -> continue equals one uninterrupted run (one process: the first steps on the
mean of 2 ranks' losses, the rest on 3); a resume at the same world is bit-identical; a load
whose plan differs from the saving run's reads each tensor from the shard that holds it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from selzero_plugin.checkpoint import tools

from . import _ckpt
from .dist_utils import all_values, run_ranks
from .parity import max_diff

pytestmark = pytest.mark.multiproc

K, M = 3, 3
_chain: dict[str, Any] = {}


def _case(folder: Path, opt: str, kind: str = "toy", **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "opt": opt, "dtype": torch.float32, "folder": str(folder), "k": K,
            "m": M, "save_at": K, **extra}


def _reference(opt: str, phases: list[tuple[int, range]]) -> dict[str, torch.Tensor]:
    """One process, the same torch optimizers over the toy model, uninterrupted."""
    model = _ckpt.build("toy", seed=0)
    named = list(model.named_parameters())
    cls, kwargs = _ckpt.OPTIMIZERS[opt]
    if cls is torch.optim.Muon:
        one_d = [p for n, p in named if "bias" in n or "gain" in n]
        opts = [cls([p for n, p in named if not ("bias" in n or "gain" in n)], **kwargs),
                torch.optim.AdamW(one_d, lr=1e-2)]
    else:
        opts = [cls([p for _, p in named], **kwargs)]
    for world, steps in phases:
        for step in steps:
            torch.stack([_ckpt.loss_at(model, step, r, K) for r in range(world)]).mean().backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
    return _ckpt.params_of(model)


def _chain_for(root: Path) -> dict[str, Any]:
    if not _chain:
        cases = [_case(root / f"{opt}-{kind}", opt, kind)
                 for opt in ("Muon", "Adafactor") for kind in ("toy", "fused")]
        saved = all_values(run_ranks(_ckpt.save_then_continue, 2, cases, timeout=300))
        resumed = all_values(run_ranks(_ckpt.resume, 2, cases, timeout=300))
        for c in cases:
            tools.reshard(c["folder"], 3, c["folder"] + "-w3")
        at3 = all_values(run_ranks(_ckpt.resume, 3, [
            dict(c, folder=c["folder"] + "-w3", save_to=c["folder"] + "-w3b") for c in cases],
            timeout=300))
        _chain.update(root=root, cases=cases, saved=saved, resumed=resumed, at3=at3)
    return _chain


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return _chain_for(tmp_path_factory.mktemp("tensors-ckpt"))


def _index(chain: dict[str, Any], opt: str, kind: str) -> int:
    return next(i for i, c in enumerate(chain["cases"]) if c["opt"] == opt and c["kind"] == kind)


@pytest.mark.parametrize("opt", ["Muon", "Adafactor"])
@pytest.mark.parametrize("kind", ["toy", "fused"])
def test_resume_at_the_same_world_is_bit_identical(chain, opt, kind):
    i = _index(chain, opt, kind)
    for r in range(2):
        saved, resumed = chain["saved"][r][i], chain["resumed"][r][i]
        assert _ckpt.same(saved["at_save"]["params"], resumed["after_load"]["params"])
        assert _ckpt.same(saved["at_save"]["state"], resumed["after_load"]["state"])
        assert _ckpt.same(saved["final"], resumed["final"])
        assert _ckpt.same(saved["final_state"], resumed["final_state"])
        assert not _ckpt.same(resumed["before"], resumed["after_load"]["params"])


@pytest.mark.parametrize("opt", ["Muon", "Adafactor"])
def test_save_at_2_reshard_load_at_3_continues_like_one_uninterrupted_run(chain, opt):
    i = _index(chain, opt, "toy")
    ref = _reference(opt, [(2, range(K)), (3, range(K, K + M))])
    for r, ranks in enumerate(chain["at3"]):
        assert max_diff(ranks[i]["final"], ref) <= 1e-6, (r, max_diff(ranks[i]["final"], ref))
    assert _ckpt.same(chain["at3"][0][i]["final"], chain["at3"][2][i]["final"])
    # and the first phase alone is the saved state
    first = _reference(opt, [(2, range(K))])
    assert max_diff(chain["saved"][0][i]["at_save"]["params"], first) <= 1e-6


@pytest.mark.parametrize("opt", ["Muon", "Adafactor"])
@pytest.mark.parametrize("kind", ["toy", "fused"])
def test_the_manifest_records_the_partition_and_the_plan(chain, opt, kind):
    folder = Path(chain["cases"][_index(chain, opt, kind)]["folder"])
    raw = json.loads((folder / "manifest.json").read_text())
    assert raw["partition"] == "tensors" and raw["format_version"] == 2
    owners = [v["owner"] for v in raw["virtuals"]]
    assert set(owners) == {0, 1}
    classes = [g.get("class") for g in raw["optimizer"]["param_groups"]]
    assert classes[0] is None  # the main class: raw["optimizer"]["class"]
    if opt == "Muon":
        assert raw["optimizer"]["class"] == "torch.optim.Muon"
        assert classes[1] == "torch.optim.adamw.AdamW"
    # each tensor lies whole, in its own shape, in its owner's shard only
    shapes = {e["name"]: e["shape"] for e in raw["contract"]["entries"]}
    for r in range(2):
        with safe_open(str(folder / f"shard-{r:05d}-of-00002.safetensors"), "pt") as f:
            keys = set(f.keys())
            for v in raw["virtuals"]:
                key = f"{v['key']}/value"
                assert (key in keys) == (v["owner"] == r)
                if key in keys:
                    shape = shapes[v["entry"]][1:] if v["expert"] is not None \
                        else shapes[v["entry"]]
                    assert list(f.get_slice(key).get_shape()) == shape
    # a resharded manifest holds the plan for its group size, the same the engine makes
    resharded = json.loads((Path(str(folder) + "-w3") / "manifest.json").read_text())
    natively = json.loads((Path(str(folder) + "-w3b") / "manifest.json").read_text())
    assert [v["owner"] for v in resharded["virtuals"]] == \
        [v["owner"] for v in natively["virtuals"]]


@pytest.mark.parametrize("opt", ["Muon", "Adafactor"])
def test_consolidate_is_the_same_before_and_after_a_reshard(chain, opt):
    folder = Path(chain["cases"][_index(chain, opt, "fused")]["folder"])
    root = chain["root"]
    a = tools.consolidate(folder, root / f"{opt}-c2.safetensors").read_bytes()
    b = tools.consolidate(Path(str(folder) + "-w3"), root / f"{opt}-c3.safetensors").read_bytes()
    assert a == b
    values = load_file(root / f"{opt}-c2.safetensors")
    saved = chain["saved"][0][_index(chain, opt, "fused")]["at_save"]["params"]
    for name, p in saved.items():
        if name == "scale":
            continue  # frozen: not saved
        key = name if name in ("inp.weight", "inp.bias", "out.weight", "out.bias") else name
        if p.dim() == 3 or name == "experts.bias":
            for e in range(p.shape[0]):
                assert torch.equal(values[f"{name}[expert {e}]/value"], p[e])
        else:
            assert torch.equal(values[f"{key}/value"], p)
    if opt == "Adafactor":  # factored state in its own shape, per expert
        assert values["experts.down[expert 0]/row_var"].shape == (5, 1)
        assert values["experts.down[expert 0]/col_var"].shape == (1, 7)


def _load_with_rotated_plan(rank: int, world: int, folder: str) -> Any:
    """A load by a run whose plan differs from the saving run's (another selzero version's
    plan, another ns_steps): each owner moved to the next rank."""
    from selzero_plugin.core import zero2

    plan = zero2.plan_virtual_owners
    zero2.plan_virtual_owners = lambda *a: [(o + 1) % world for o in plan(*a)]
    return _ckpt.load_many(rank, world, [folder], kind="toy", opt="Muon")


def test_a_load_whose_plan_differs_reads_each_tensor_from_its_shard(tmp_path):
    folder = tmp_path / "saved"
    all_values(run_ranks(_ckpt.save_only, 3, str(folder), kind="toy", opt="Muon", k=K,
                         timeout=300))
    rotated = all_values(run_ranks(_load_with_rotated_plan, 3, str(folder), timeout=300))
    same = all_values(run_ranks(_ckpt.load_many, 3, [str(folder)], kind="toy", opt="Muon",
                                timeout=300))
    for r in range(3):
        assert rotated[r][0]["error"] is None, rotated[r][0]["error"]
        assert _ckpt.same(rotated[r][0]["params"], same[r][0]["params"])
    saved_state = {k: v for r in range(3) for k, v in same[r][0]["state"].items()}
    loaded_state = {k: v for r in range(3) for k, v in rotated[r][0]["state"].items()}
    assert _ckpt.same(saved_state, loaded_state)  # every tensor and its state, once
    for r in range(3):  # and each rank now holds what the next rank held
        assert set(rotated[(r + 1) % 3][0]["state"]) == set(same[r][0]["state"])


def test_chunks_and_tensors_checkpoints_are_not_mixed_up(tmp_path):
    tensors, chunks = tmp_path / "tensors", tmp_path / "chunks"
    all_values(run_ranks(_ckpt.save_only, 2, str(tensors), kind="toy", opt="AdamW-tensors",
                         k=1, timeout=300))
    all_values(run_ranks(_ckpt.save_only, 2, str(chunks), kind="toy", opt="AdamW", k=1,
                         timeout=300))
    a = all_values(run_ranks(_ckpt.load_many, 2, [str(chunks)], kind="toy", opt="AdamW-tensors",
                             timeout=300))
    b = all_values(run_ranks(_ckpt.load_many, 2, [str(tensors)], kind="toy", opt="AdamW",
                             timeout=300))
    for outcome in (a, b):
        for r in range(2):
            assert "partition" in outcome[r][0]["error"], outcome[r][0]["error"]


def test_inspect_shows_the_partition_and_the_balance(chain):
    folder = chain["cases"][_index(chain, "Muon", "toy")]["folder"]
    out = subprocess.run([sys.executable, "-m", "selzero_plugin.cli", "inspect", folder,
                          "--verify"], capture_output=True, text=True, check=True).stdout
    assert "partition: tensors" in out and "balance" in out and "verify: OK" in out


def test_the_torch_export_holds_what_torch_can_step_and_refuses_the_rest(chain):
    """--torch-optim-state: a one-class checkpoint whose state torch keeps the same way loads
    into torch and steps; several classes (Muon + AdamW), or per-expert state torch would keep
    otherwise for the whole fused tensor (Adafactor on 1-D experts), are refused, naming the
    consolidated file (review finding: the export was written and failed in torch)."""
    from selzero_plugin.errors import CheckpointError

    root = chain["root"]
    toy = Path(chain["cases"][_index(chain, "Adafactor", "toy")]["folder"])
    tools.consolidate(toy, root / "toy-ada.safetensors", torch_optim_state=root / "toy-ada.pt")
    state = torch.load(root / "toy-ada.pt", weights_only=True)
    model = _ckpt.build("toy", seed=0)
    params = list(model.parameters())
    opt = torch.optim.Adafactor([{"params": [params[i] for i in g["params"]]}
                                 for g in state["param_groups"]])
    opt.load_state_dict(state)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for opt_name, match in (("Muon", "several optimizer classes"),
                            ("Adafactor", "no torch state dict expresses")):
        folder = Path(chain["cases"][_index(chain, opt_name, "fused")]["folder"])
        with pytest.raises(CheckpointError, match=match):
            tools.consolidate(folder, root / f"{opt_name}-x.safetensors",
                              torch_optim_state=root / f"{opt_name}-x.pt")
        assert not (root / f"{opt_name}-x.pt").exists()


@pytest.mark.parametrize("partition", ["chunks", "tensors"])
def test_an_expert_parallel_reshard_to_one_local_expert_per_rank_loads(tmp_path, partition):
    """EP 2 on 2 ranks (2 fused experts each) -> `selzero reshard --world-size 4 --ep-size 4`
    (one local expert per rank) -> load: every expert's value arrives (review finding: the
    one-expert split was keyed without its global expert, so the load was refused)."""
    from selzero_plugin.cli import main as cli

    from . import _tensors as T

    saved = all_values(run_ranks(T.ep_phase, 2, 2, partition, str(tmp_path / "a"), load=False,
                                 timeout=300))
    assert cli(["reshard", str(tmp_path / "a" / "selected_zero2"), "--world-size", "4",
                "--ep-size", "4", "--out", str(tmp_path / "b" / "selected_zero2")]) == 0
    loaded = all_values(run_ranks(T.ep_phase, 4, 4, partition, str(tmp_path / "b"), load=True,
                                  timeout=300))
    before = {k: v for r in saved for k, v in r.items()}
    after = {k: v for r in loaded for k, v in r.items()}
    assert before.keys() == after.keys() == {f"expert {e}" for e in range(4)}
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_consolidate_is_the_same_after_a_reshard_of_an_integrations_save(tmp_path):
    """Review finding: the manifest's save_id (written by the integrations' saves) reached the
    consolidated file's metadata, so a resharded checkpoint consolidated to other bytes."""
    from selzero_plugin.cli import main as cli

    from . import _tensors as T

    all_values(run_ranks(T.save_through_host, 2, str(tmp_path / "a"), timeout=300))
    assert cli(["reshard", str(tmp_path / "a" / "selected_zero2"), "--world-size", "3",
                "--out", str(tmp_path / "b")]) == 0
    one = tools.consolidate(tmp_path / "a" / "selected_zero2" / "selected_zero2",
                            tmp_path / "a.safetensors").read_bytes()
    two = tools.consolidate(tmp_path / "b" / "selected_zero2", tmp_path / "b.safetensors")
    assert one == two.read_bytes()
