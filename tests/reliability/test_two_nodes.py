"""More than one machine, simulated: two torchrun launches ``--nnodes 2 --node-rank {0,1}
--nproc-per-node 2`` with a static rendezvous on 127.0.0.1 (world 4), against one node of 4.

The program (``_two_nodes_train.py``) is an expert-parallel MoE at EP 2: the expert-parallel
groups are the "nodes" ({0, 1}, {2, 3}), selzero's ``experts`` instances run over the
expert-data-parallel groups {0, 2} and {1, 3} *across* the nodes (group rank = rank // 2), a
``head`` instance over the world (group rank = global rank), the rest under a host done by hand.
So on the two "nodes" global rank, local rank and group rank differ (global 1: local 1, group
rank 0 of experts-ep1; global 2: local 0, group rank 1 of experts-ep0, group rank 2 of head;
global 3: local 1, group rank 1, group rank 3), and any confusion between them shows:

(a)/(b) the two-node run equals the one-node run bit for bit (losses, norms, parameters), every
    rank's instances are the groups of its GLOBAL rank, shard files are named by group rank and
    group size and hold, byte for byte, what the one-node run's hold, and each holds exactly the
    chunk its group rank owns; the error text of a contract mismatch names group ranks;
(c) the checkpoint the two nodes saved at step 3 loads on one node of 4 and continuing equals
    the uninterrupted two-node run bit for bit;
(d) resharded by ``selzero reshard --world-size 2 --ep-size 1``, it loads on 2 processes (each
    taking the tokens of two of the 4 data ranks) and continuing equals the uninterrupted
    two-node run within 1e-6 (not bitwise: sums run in another order over other groups).

Launches: the two "nodes" together, then one node of 4 (train from scratch and save, then load
the two nodes' checkpoint and continue) beside one node of 2 (load the resharded one): four
torchrun processes, two at a time.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from selzero_plugin.cli import main as cli

from ._launch import free_port, start, wait_all

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().with_name("_two_nodes_train.py")
SAVE_AT, TOTAL, WORLD, LAUNCH_TIMEOUT = 3, 5, 4, 180
EXPERTS, LOCAL = 8, 4  # global experts; experts per expert-parallel rank at EP 2
MEMBERS = ("w_in.weight", "w_in.bias", "w_out.weight", "w_out.bias")
DEAD = EXPERTS - 1  # never routed: no optimizer state


def _start(tmp: Path, tag: str, *, nnodes: int, node_rank: int, nproc: int, port: int,
           args: list[str]) -> tuple[subprocess.Popen, Path]:
    return start(tmp, tag, SCRIPT, nnodes=nnodes, node_rank=node_rank, nproc=nproc, port=port,
                 args=args)


def _wait_all(launches: list[tuple[subprocess.Popen, Path]]) -> None:
    wait_all(launches, LAUNCH_TIMEOUT)


def _results(folder: Path, world: int) -> list[dict[str, Any]]:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("two_nodes")
    common = ["--save-at", str(SAVE_AT), "--total", str(TOTAL)]
    # (a) two "nodes" of 2 processes, one rendezvous on 127.0.0.1
    port = free_port()
    nodes = [_start(tmp, f"node{k}", nnodes=2, node_rank=k, nproc=2, port=port,
                    args=["--out", str(tmp / "out2n"), "--train", str(tmp / "ck2n"),
                          "--ep", "2", *common]) for k in range(2)]
    _wait_all(nodes)
    # (d) the offline tool: every instance of the index for 2 ranks at EP 1
    assert cli(["reshard", str(tmp / "ck2n"), "--world-size", "2", "--ep-size", "1",
                "--out", str(tmp / "ck2r")]) == 0
    # the host's own part is replicated: the host's to convert, here a copy
    (tmp / "ck2r" / "dense.pt").write_bytes((tmp / "ck2n" / "dense.pt").read_bytes())
    # (b) + (c) one node of 4: from scratch, then from the two nodes' checkpoint;
    # (d) beside it, one node of 2 from the resharded checkpoint
    one = _start(tmp, "one4", nnodes=1, node_rank=0, nproc=4, port=free_port(),
                 args=["--out", str(tmp / "out1n"), "--train", str(tmp / "ck1n"),
                       "--load", str(tmp / "ck2n"), "--ep", "2", *common])
    two = _start(tmp, "one2", nnodes=1, node_rank=0, nproc=2, port=free_port(),
                 args=["--out", str(tmp / "out2r"), "--load", str(tmp / "ck2r"), "--ep", "1",
                       *common])
    _wait_all([one, two])
    return {"tmp": tmp, "nodes": _results(tmp / "out2n", WORLD),
            "one": _results(tmp / "out1n", WORLD), "two": _results(tmp / "out2r", 2),
            "logs": [(tmp / f"{t}.log").read_text() for t in ("node0", "node1", "one4", "one2")]}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _expert_names(ep_rank: int) -> list[str]:
    return [f"moe.experts.{g}.{m}" for g in range(ep_rank * LOCAL, (ep_rank + 1) * LOCAL)
            for m in MEMBERS]


def _instances() -> dict[str, tuple[list[int], list[str]]]:
    """name -> (global ranks of its group, its selected parameters under their global names)."""
    return {f"experts-ep{k}": ([k, k + 2], _expert_names(k)) for k in range(2)} | \
        {"head": ([0, 1, 2, 3], ["out.weight", "out.bias"])}


def _chunk(flat: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    c = math.ceil(flat.numel() / size)
    return flat[rank * c:min((rank + 1) * c, flat.numel())]


# ---- (a) / (b) ----------------------------------------------------------------------------


def test_each_process_is_placed_by_its_global_rank(runs):
    """torchrun's numbering differs between the launches; selzero's groups follow the global
    rank only: experts-ep{r % 2} over {r % 2, r % 2 + 2} at group rank r // 2, head over the
    world at group rank r. The printed banner shows the launches really were two nodes."""
    for r in range(WORLD):
        node, one = runs["nodes"][r], runs["one"][r]
        assert node["env"]["RANK"] == one["env"]["RANK"] == str(r)
        assert node["env"]["LOCAL_RANK"] == str(r % 2) and node["env"]["GROUP_RANK"] == str(r // 2)
        assert node["env"]["LOCAL_WORLD_SIZE"] == "2" and node["env"]["WORLD_SIZE"] == "4"
        assert one["env"]["LOCAL_RANK"] == str(r) and one["env"]["GROUP_RANK"] == "0"
        for run in (node["train"], one["train"], one["load"]):
            e, h = run["experts"], run["head"]
            assert (e["name"], e["rank"], e["size"], e["ranks"]) == \
                (f"experts-ep{r % 2}", r // 2, 2, [r % 2, r % 2 + 2]), (r, e)
            assert e["expert_parallel"] == (r % 2, 2)
            assert (h["name"], h["rank"], h["size"], h["ranks"]) == ("head", r, 4, [0, 1, 2, 3])
            assert e["selected"] == [f"moe.experts.{i}.{m}" for i in range(LOCAL)
                                     for m in MEMBERS]
            assert h["selected"] == ["out.weight", "out.bias"]
        assert sorted(k for k in node["train"]["final"] if ".experts." in k) == \
            sorted(_expert_names(r % 2))
    assert "[global rank 3/4] local rank 1, node 1" in runs["logs"][1]
    assert "[global rank 1/4] local rank 1, node 0" in runs["logs"][0]


def test_two_nodes_train_bit_identically_to_one_node_of_four(runs):
    for r in range(WORLD):
        node, one = runs["nodes"][r]["train"], runs["one"][r]["train"]
        assert _same(node["initial"], one["initial"]), r
        assert node["losses"] == one["losses"], (r, node["losses"], one["losses"])
        assert node["norms"] == one["norms"], r
        assert node["skipped"] == one["skipped"], r
        assert _same(node["at_save"], one["at_save"]), r
        assert _same(node["final"], one["final"]), r
        assert not _same(node["initial"], node["final"])  # it trained
    # routing differs by global rank: every rank has its own losses, replicas one norm
    losses = [runs["nodes"][r]["train"]["losses"] for r in range(WORLD)]
    assert len({tuple(v) for v in losses}) == WORLD
    assert len({tuple(runs["nodes"][r]["train"]["norms"]) for r in range(WORLD)}) == 1
    assert [sum(runs["nodes"][r]["train"]["skipped"]) > 0 for r in range(WORLD)] == \
        [False, True, False, True]  # expert 7 (held by ep rank 1) is never routed


def test_shard_files_are_named_by_group_rank_and_group_size(runs):
    tmp = runs["tmp"]
    expected = ["dense.pt"]
    for top in ("selected_zero2", "plain"):
        for name, (ranks, _) in _instances().items():
            expected.append(f"{top}/{name}/manifest.json")
            expected += [f"{top}/{name}/shard-{g:05d}-of-{len(ranks):05d}.safetensors"
                         for g in range(len(ranks))]
    expected.append("selected_zero2/index.json")
    for r in range(WORLD):  # what each rank saw after the save, on either "node"
        assert runs["nodes"][r]["train"]["listing"] == sorted(expected), r
        assert runs["one"][r]["train"]["listing"] == sorted(expected), r
    index = json.loads((tmp / "ck2n" / "selected_zero2" / "index.json").read_text())
    assert index["world_size"] == 4
    assert {d["name"]: d["ranks"] for d in index["instances"]} == \
        {n: ranks for n, (ranks, _) in _instances().items()}
    for top in ("selected_zero2", "plain"):
        for name, (ranks, _) in _instances().items():
            m = json.loads((tmp / "ck2n" / top / name / "manifest.json").read_text())
            assert m["group_size"] == len(ranks)
            assert [(s["rank"], s["file"]) for s in m["shards"]] == [
                (g, f"shard-{g:05d}-of-{len(ranks):05d}.safetensors") for g in range(len(ranks))]


def test_shards_equal_the_one_node_run_byte_for_byte(runs):
    tmp = runs["tmp"]
    for top in ("selected_zero2", "plain"):
        for name, (ranks, _) in _instances().items():
            for g in range(len(ranks)):
                f = f"{top}/{name}/shard-{g:05d}-of-{len(ranks):05d}.safetensors"
                assert (tmp / "ck2n" / f).read_bytes() == (tmp / "ck1n" / f).read_bytes(), f
                if top == "plain":  # sz.save_checkpoint wrote what save_into wrote
                    assert (tmp / "ck2n" / f).read_bytes() == \
                        (tmp / "ck2n" / f.replace("plain/", "selected_zero2/")).read_bytes(), f
            a, b = (json.loads((tmp / ck / top / name / "manifest.json").read_text())
                    for ck in ("ck2n", "ck1n"))
            a.pop("save_id", None), b.pop("save_id", None)  # random per save
            assert a == b, (top, name)
    a, b = (json.loads((tmp / ck / "selected_zero2" / "index.json").read_text())
            for ck in ("ck2n", "ck1n"))
    assert a.pop("save_id") != b.pop("save_id") and a == b
    assert (tmp / "ck2n" / "dense.pt").stat().st_size > 0


def test_each_shard_holds_the_chunk_its_group_rank_owns(runs):
    """Shard g of an instance: for each of its parameters with a non-empty chunk g, that chunk
    (flat, ceil(numel / N) per rank, padding not saved) of the values at the save, and Adam's
    state of that size, unless the parameter was never stepped."""
    tmp, at_save = runs["tmp"], runs["nodes"]
    for name, (ranks, params) in _instances().items():
        values = at_save[ranks[0]]["train"]["at_save"]
        for g, owner in enumerate(ranks):
            assert _same({k: values[k] for k in params},
                         {k: at_save[owner]["train"]["at_save"][k] for k in params})
            shard = load_file(str(tmp / "ck2n" / "selected_zero2" / name /
                                  f"shard-{g:05d}-of-{len(ranks):05d}.safetensors"))
            want: dict[str, torch.Tensor] = {}
            for p in params:
                chunk = _chunk(values[p].reshape(-1), g, len(ranks))
                if chunk.numel() == 0:
                    continue
                want[f"{p}/value"] = chunk
                if not p.startswith(f"moe.experts.{DEAD}."):
                    for moment in ("exp_avg", "exp_avg_sq"):
                        got = shard.get(f"{p}/{moment}")
                        assert got is not None and got.shape == chunk.shape, (name, g, p)
                        want[f"{p}/{moment}"] = got
                    step = shard.get(f"{p}/step")
                    assert step is not None and int(step) == SAVE_AT, (name, g, p)
                    want[f"{p}/step"] = step
            assert sorted(shard) == sorted(want), (name, g)
            for k, v in want.items():
                assert torch.equal(shard[k].view(-1), v.reshape(-1)), (name, g, k)
    # the head's bias (3 elements over 4 ranks) has nothing on group rank 3
    last = load_file(str(tmp / "ck2n" / "selected_zero2" / "head" /
                         "shard-00003-of-00004.safetensors"))
    assert "out.bias/value" not in last and "out.weight/value" in last


def test_messages_name_the_group_rank_and_group_size(runs):
    """A contract mismatch on global rank 2 (group rank 1 of {0, 2}, local rank 0 on its node):
    both ranks of that group are told in group ranks; anything selzero prints or logs with a
    ``[rank a/b]`` prefix uses a group rank of this process and that group's size."""
    for launch in ("nodes", "one"):
        for r, res in enumerate(runs[launch]):
            probe = res["train"]["probe"]
            if r % 2:
                assert probe == [], (launch, r)
                continue
            assert len(probe) == 1 and probe[0].startswith(f"[rank {r // 2}/2] SelectedZero2 "
                                                           "contract: group rank 1 differs "
                                                           "from group rank 0 in"), probe
            assert "(1 rank(s) differ: [1])" in probe[0]
    for launch in ("nodes", "one", "two"):
        for r, res in enumerate(runs[launch]):
            allowed = {(run["experts"]["rank"], run["experts"]["size"])
                       for run in (res.get("train"), res.get("load")) if run} | \
                {(run["head"]["rank"], run["head"]["size"])
                 for run in (res.get("train"), res.get("load")) if run}
            texts = res["warnings"] + res["logs"] + res.get("train", {}).get("probe", [])
            for a, b in re.findall(r"\[rank (\d+)/(\d+)\]", "\n".join(texts)):
                assert (int(a), int(b)) in allowed, (launch, r, a, b, texts)


# ---- (c) / (d) ----------------------------------------------------------------------------


def test_the_two_nodes_checkpoint_continues_on_one_node_of_four_bit_identically(runs):
    for r in range(WORLD):
        node, loaded = runs["nodes"][r]["train"], runs["one"][r]["load"]
        assert _same(loaded["after_load"], node["at_save"]), r
        assert loaded["losses"] == node["losses"][SAVE_AT:], r
        assert loaded["norms"] == node["norms"][SAVE_AT:], r
        assert _same(loaded["final"], node["final"]), r


def test_resharded_to_two_processes_continues_like_the_two_nodes(runs):
    """``selzero reshard --world-size 2 --ep-size 1``: one experts instance (every expert)
    over both ranks and the head over both; loading restores the saved values exactly and
    the continuation equals the uninterrupted world-4 run within 1e-6."""
    tmp, nodes, two = runs["tmp"], runs["nodes"], runs["two"]
    index = json.loads((tmp / "ck2r" / "selected_zero2" / "index.json").read_text())
    assert index["world_size"] == 2
    assert {d["name"]: d["ranks"] for d in index["instances"]} == \
        {"experts-ep0": [0, 1], "head": [0, 1]}
    for name in ("experts-ep0", "head"):
        files = sorted(p.name for p in (tmp / "ck2r" / "selected_zero2" / name).iterdir())
        assert files == ["manifest.json", "shard-00000-of-00002.safetensors",
                         "shard-00001-of-00002.safetensors"], (name, files)
    whole_at_save = {**nodes[0]["train"]["at_save"], **nodes[1]["train"]["at_save"]}
    whole_final = {**nodes[0]["train"]["final"], **nodes[1]["train"]["final"]}
    assert len([k for k in whole_final if ".experts." in k]) == EXPERTS * len(MEMBERS)
    for q, res in enumerate(two):
        e, h = res["load"]["experts"], res["load"]["head"]
        assert (e["name"], e["rank"], e["size"], e["ranks"]) == ("experts-ep0", q, 2, [0, 1])
        assert (h["name"], h["rank"], h["size"], h["ranks"]) == ("head", q, 2, [0, 1])
        assert res["env"]["LOCAL_RANK"] == str(q) and res["world"] == 2
        assert _same(res["load"]["after_load"], whole_at_save), q
        final = res["load"]["final"]
        assert sorted(final) == sorted(whole_final)
        worst = max(float((final[k] - whole_final[k]).abs().max()) for k in final)
        assert worst <= 1e-6, (q, worst)
        # process q took data ranks 2q and 2q + 1: its loss is the mean of theirs
        for i, loss in enumerate(res["load"]["losses"]):
            mean = (nodes[2 * q]["train"]["losses"][SAVE_AT + i] +
                    nodes[2 * q + 1]["train"]["losses"][SAVE_AT + i]) / 2
            assert loss == pytest.approx(mean, rel=1e-6, abs=1e-6), (q, i)
        assert res["load"]["norms"] == pytest.approx(nodes[0]["train"]["norms"][SAVE_AT:],
                                                     rel=1e-5)
