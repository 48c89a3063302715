"""Offline tools on a synthetic checkpoint: inspect / verify, reshard, consolidate, torch export,
streaming memory; the ``selzero`` subcommands through ``python -m selzero_plugin.cli``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from selzero_plugin.checkpoint import tools
from selzero_plugin.checkpoint import chunk_range, read_manifest, shard_file_name, tensor_key
from selzero_plugin.errors import CheckpointError
from selzero_plugin.core.layout import EntrySpec, plan_layout

from . import _ckpt_synth as synth

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selzero_plugin.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def _in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """``selzero ARGS`` in this process (no interpreter start: suite time), like ``_cli``."""
    from selzero_plugin.cli import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.out, out.err)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def ckpt2(tmp_path: Path) -> Path:
    return synth.write(tmp_path / "ckpt2", 2)


# ---- consolidate ---------------------------------------------------------------------------


def test_consolidate_holds_full_per_parameter_tensors_keyed_by_name(ckpt2, tmp_path):
    out = tools.consolidate(ckpt2, tmp_path / "full.safetensors")
    tensors = load_file(out)
    m = synth.manifest(2)
    expected = {}
    for v in m.virtuals:
        for what in ["value"] + (sorted(synth.ADAMW_STATE) if v.stateful else []):
            t = synth.full_tensor(v, what)
            expected[tensor_key(v.key, what)] = t if t.dim() == 0 else t.view(v.shape)
    assert tensors.keys() == expected.keys()
    for k in expected:
        assert torch.equal(tensors[k], expected[k]), k
    assert tensors["moe.w[expert 1]/exp_avg"].shape == (4, 5)
    assert "moe.w[expert 2]/exp_avg" not in tensors  # never stepped: value only


def test_consolidate_reshard_consolidate_round_trips_exactly(ckpt2, tmp_path):
    first = tools.consolidate(ckpt2, tmp_path / "c2.safetensors").read_bytes()
    for m in (1, 3, 5):  # 5 ranks: b.bias (1 element) has empty chunks on ranks 1-4
        resharded = tools.reshard(ckpt2, m, tmp_path / f"ckpt{m}")
        assert read_manifest(resharded).group_size == m
        assert sorted(p.name for p in resharded.iterdir()) == sorted(
            ["manifest.json"] + [shard_file_name(r, m) for r in range(m)])
        again = tools.consolidate(resharded, tmp_path / f"c{m}.safetensors").read_bytes()
        assert again == first, f"consolidated bytes differ after resharding to {m}"
        back = tools.reshard(resharded, 2, tmp_path / f"back{m}")
        assert _files(back) == _files(ckpt2), f"2 -> {m} -> 2 is not byte-identical"


def test_reshard_puts_every_chunk_where_the_engine_layout_expects_it(ckpt2, tmp_path):
    out = tools.reshard(ckpt2, 3, tmp_path / "ckpt3")
    m = read_manifest(out)
    layout = plan_layout([EntrySpec(35, "torch.float32"), EntrySpec(60, "torch.bfloat16", 3),
                          EntrySpec(1, "torch.float32")], 3, 1 << 20)
    for rank in range(3):
        shard = load_file(out / shard_file_name(rank, 3))
        for spec, v in zip(layout.virtuals, m.virtuals):
            start, length = chunk_range(v.numel, 3, rank)
            assert length == spec.real_chunk_numel(rank)
            assert start == spec.chunk_start(rank) - spec.flat_offset
            key = tensor_key(v.key, "value")
            if length:
                assert torch.equal(shard[key], synth.full_tensor(v, "value")[start:start + length])
            else:
                assert key not in shard


def test_cannot_reshard_a_damaged_checkpoint(ckpt2, tmp_path):
    path = ckpt2 / shard_file_name(1, 2)
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CheckpointError, match="failed verification; nothing was written"):
        tools.reshard(ckpt2, 3, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt2"]  # no output, no staging


def test_cannot_reshard_into_a_folder_that_is_not_a_checkpoint(ckpt2, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a selzero checkpoint; refusing to replace"):
        tools.reshard(ckpt2, 3, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cannot_reshard_to_zero_ranks(ckpt2, tmp_path):
    with pytest.raises(CheckpointError, match="expected a positive integer"):
        tools.reshard(ckpt2, 0, tmp_path / "out")


# ---- the torch.optim export ----------------------------------------------------------------


def test_torch_export_merges_experts_and_loads_into_torch_optim(ckpt2, tmp_path):
    full = tools.consolidate(ckpt2, tmp_path / "full.safetensors")
    with pytest.warns(UserWarning, match="moe.w"):  # experts stepped 5, 3 and never
        pt = tools.export_torch_state_dict(full, tmp_path / "optim.pt")
    sd = torch.load(pt, weights_only=True)  # plain tensors and numbers only
    # indices follow selected_names: a.weight 0, frozen 1 (no state), moe.w 2, b.bias 3
    assert sorted(sd["state"]) == [0, 2, 3]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 2], [3]]
    assert sd["param_groups"][1]["weight_decay"] == 0.0
    moe = sd["state"][2]
    assert moe["exp_avg"].shape == (3, 4, 5)
    assert torch.equal(moe["exp_avg"][1].flatten(),
                       synth.full_tensor(synth.manifest(2).virtuals[2], "exp_avg"))
    assert torch.equal(moe["exp_avg"][2], torch.zeros(4, 5))  # never stepped
    assert float(moe["step"]) == 5.0  # the most-stepped expert's count
    params = [torch.zeros(5, 7, requires_grad=True), torch.zeros(3, 4, 5, requires_grad=True),
              torch.zeros(1, requires_grad=True)]
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0}])
    opt.load_state_dict(sd)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    expected = 0.9 * synth.full_tensor(synth.manifest(2).virtuals[0], "exp_avg") + 0.1
    assert torch.allclose(opt.state[params[0]]["exp_avg"].flatten(), expected, atol=1e-6)
    assert float(opt.state[params[0]]["step"]) == 6.0


# ---- inspect / verify and the command line -------------------------------------------------


def test_inspect_verify_describes_the_checkpoint_in_human_terms(ckpt2):
    result = _cli("inspect", str(ckpt2), "--verify")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for text in ["group size 2 rank(s); 2 shard(s)", "optimizer torch.optim.adamw.AdamW",
                 "group 1: 1 parameter(s)", "weight_decay=0.0", "exp_avg (elementwise)",
                 "step (scalar)", "4 selected (3 trainable, 1 frozen), 5 virtual",
                 "aliases tied.weight", "frozen (no state, value not saved)",
                 "3 experts, steps 3..5, 1 never stepped", "step: 5",
                 "verify: OK, 2 shard(s) complete"]:
        assert text in out, f"{text!r} missing from:\n{out}"
    assert result.stderr == ""  # no progress bar when stderr is not a terminal


def test_inspect_verify_exits_nonzero_on_any_problem(ckpt2, tmp_path):
    damaged = shutil.copytree(ckpt2, tmp_path / "damaged")
    (damaged / shard_file_name(0, 2)).unlink()
    report = tools.inspect(damaged, verify_shards=True)
    assert "missing" in report.problems[0]
    incomplete = shutil.copytree(ckpt2, tmp_path / "incomplete")
    (incomplete / "manifest.json").unlink()
    result = _cli("inspect", str(incomplete))  # even without --verify
    assert result.returncode == 1 and "PROBLEM" in result.stdout and "incomplete save" in \
        result.stdout
    assert tools.run_inspect(str(damaged), verify_shards=True) == 1
    assert tools.run_inspect(str(damaged), verify_shards=False) == 0  # manifest alone is fine


def test_reshard_and_consolidate_commands(ckpt2, tmp_path):
    result = _cli("reshard", str(ckpt2), "--world-size", "3", "--out", str(tmp_path / "ckpt3"))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert read_manifest(tmp_path / "ckpt3").group_size == 3
    result = _cli("consolidate", str(tmp_path / "ckpt3"), "--out",
                  str(tmp_path / "full.safetensors"), "--torch-optim-state",
                  str(tmp_path / "optim.pt"))
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stdout
    assert set(load_file(tmp_path / "full.safetensors")) >= {"a.weight/value", "b.bias/step"}
    assert sorted(torch.load(tmp_path / "optim.pt", weights_only=True)["state"]) == [0, 2, 3]
    result = _cli("reshard", str(tmp_path / "nowhere"), "--world-size", "3", "--out",
                  str(tmp_path / "x"))
    assert result.returncode == 1 and "no checkpoint at" in result.stderr


def test_the_model_export_is_in_the_models_names_and_shapes(ckpt2, tmp_path, capsys):
    """--torch-state-dict: model.load_state_dict(sd, strict=False) takes it: canonical and tied
    names, fused experts stacked back into (E, ...), the parameter's dtype; frozen left out."""
    m = synth.manifest(2)
    for suffix in ("safetensors", "pt"):
        out = tmp_path / f"model.{suffix}"
        assert _in_process(capsys, "consolidate", str(ckpt2), "--out", str(tmp_path / "full.safetensors"),
                    "--torch-state-dict", str(out)).returncode == 0
        sd = load_file(out) if suffix == "safetensors" else torch.load(out, weights_only=True)
        assert sorted(sd) == ["a.weight", "b.bias", "moe.w", "tied.weight"]
        by_key = {v.key: v for v in m.virtuals}
        assert torch.equal(sd["a.weight"], synth.full_tensor(by_key["a.weight"], "value")
                           .view(5, 7))
        assert torch.equal(sd["tied.weight"], sd["a.weight"])
        assert sd["moe.w"].shape == (3, 4, 5)
        for e in range(3):
            assert torch.equal(sd["moe.w"][e].flatten(),  # the masters, in the weights' bf16
                               synth.full_tensor(by_key[f"moe.w[expert {e}]"], "value")
                               .to(torch.bfloat16))
        assert sd["moe.w"].dtype == torch.bfloat16 and sd["a.weight"].dtype == torch.float32
        model = torch.nn.Module()
        model.a = torch.nn.Linear(7, 5, bias=False)
        model.moe = torch.nn.Module()
        model.moe.w = torch.nn.Parameter(torch.zeros(3, 4, 5, dtype=torch.bfloat16))
        missing, unexpected = model.load_state_dict(
            {k: v for k, v in sd.items() if k in ("a.weight", "moe.w")}, strict=False)
        assert not missing and not unexpected
        assert torch.equal(model.moe.w.detach(), sd["moe.w"])


def _two_levels_down(ckpt: Path, parent: Path, name: str) -> Path:
    return Path(shutil.copytree(ckpt, parent / "run" / name))


def test_a_parent_folder_holding_one_checkpoint_stands_for_it(ckpt2, tmp_path, capsys):
    """`selzero demo --out DIR`, a Trainer output folder, a DeepSpeed save folder: the tools
    find the one checkpoint below instead of calling the folder an incomplete save."""
    parent = tmp_path / "out"
    inner = _two_levels_down(ckpt2, parent, "selected_zero2")
    result = _in_process(capsys, "inspect", str(parent))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"the checkpoint in {parent} is {inner}" in result.stderr
    assert "group size 2 rank(s)" in result.stdout
    assert _in_process(capsys, "reshard", str(parent), "--world-size", "3", "--out",
                str(tmp_path / "r3")).returncode == 0
    assert read_manifest(tmp_path / "r3").group_size == 3
    assert _in_process(capsys, "consolidate", str(parent), "--out", str(tmp_path / "f.safetensors")
                ).returncode == 0
    _two_levels_down(ckpt2, parent, "second")
    result = _in_process(capsys, "inspect", str(parent))
    assert result.returncode == 1 and "holds 2 checkpoints; name the one you mean" in \
        result.stderr and str(inner) in result.stderr


def test_reshard_onto_an_existing_folder_needs_force(ckpt2, tmp_path, capsys):
    out = tmp_path / "ckpt3"
    assert _in_process(capsys, "reshard", str(ckpt2), "--world-size", "3", "--out", str(out)).returncode == 0
    before = _files(out)
    result = _in_process(capsys, "reshard", str(ckpt2), "--world-size", "4", "--out", str(out))
    assert result.returncode == 1 and "pass --force to replace it" in result.stderr
    assert _files(out) == before
    result = _in_process(capsys, "reshard", str(ckpt2), "--world-size", "4", "--out", str(out), "--force")
    assert result.returncode == 0, result.stderr
    assert read_manifest(out).group_size == 4
    result = _in_process(capsys, "reshard", str(ckpt2), "--world-size", "3", "--out", str(ckpt2), "--force")
    assert result.returncode == 1 and "overlaps the checkpoint being read" in result.stderr
    assert read_manifest(ckpt2).group_size == 2


def test_progress_bar_only_on_a_terminal(monkeypatch):
    class Terminal:
        def isatty(self) -> bool:
            return True

        def write(self, s: str) -> int:
            return len(s)

        def flush(self) -> None:
            pass

    items = [1, 2]
    assert tools._progress(items, total=2, desc="x", unit="y") is items
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = tools._progress(items, total=2, desc="x", unit="y")
    assert type(bar).__name__ == "tqdm" and list(bar) == items


# ---- streaming ------------------------------------------------------------------------------


def test_reshard_and_consolidate_hold_one_full_tensor_and_one_chunk_at_a_time(tmp_path,
                                                                             monkeypatch):
    """A counting wrapper around every tensor read from a shard and every full tensor
    assembled: the bytes alive at once never exceed the largest tensor plus one chunk."""
    folder = synth.write(tmp_path / "src", 3)
    alive = {"now": 0, "peak": 0}

    def track(t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        alive["now"] += n
        alive["peak"] = max(alive["peak"], alive["now"])
        weakref.finalize(t, lambda: alive.__setitem__("now", alive["now"] - n))
        return t

    real_read, real_iter = tools.LazyShard.read, tools.iter_full_state
    monkeypatch.setattr(tools.LazyShard, "read", lambda self, k: track(real_read(self, k)))
    def tracked_iter(f: Path, m):  # holds no reference across its own yields
        for item in real_iter(f, m):
            track(item[2])
            yield item
            del item

    monkeypatch.setattr(tools, "iter_full_state", tracked_iter)
    tools.reshard(folder, 2, tmp_path / "out")
    tools.consolidate(folder, tmp_path / "full.safetensors")
    m = read_manifest(folder)
    largest = max(v.numel for v in m.virtuals) * 4
    state = sum(t.numel() * t.element_size()
                for t in load_file(tmp_path / "full.safetensors").values())
    assert 0 < alive["peak"] <= largest + -(-largest // 3)
    assert state >= 4 * (largest + -(-largest // 3))  # holding everything would fail the bound


@pytest.mark.multiproc
def test_peak_rss_of_reshard_and_consolidate_stays_near_one_parameter(tmp_path):
    """The benchmark script on 8 parameters of 1M elements (AdamW: ~92 MiB of state), each
    command in a fresh process under /usr/bin/time -v: the peak RSS above the bare imports stays
    within one parameter's state plus 32 MiB of constant overhead, far below the total."""
    if not Path("/usr/bin/time").exists():
        pytest.skip("needs /usr/bin/time")
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_memory.py"), "--params", "8",
         "--numel", "1000000", "--world", "2", "--reshard-to", "3", "--dir",
         str(tmp_path / "bench"), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout)
    bound_kb = (r["largest_param_state_bytes"] + (32 << 20)) // 1024
    assert r["state_bytes"] // 1024 > 2 * bound_kb
    for op in ("reshard", "consolidate"):
        assert r[f"{op}_rss_kb"] - r["baseline_rss_kb"] <= bound_kb, (op, r)


def _root_checkpoint(folder: Path) -> Path:
    """A host checkpoint holding a selzero folder (index.json), saved by one process."""
    from selzero_plugin import SelectedZero2
    from selzero_plugin.checkpoint import host

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    sz = SelectedZero2(model, {"params": ["0.*"]}, torch.optim.AdamW, {"lr": 1e-3})
    model(torch.randn(3, 4)).sum().backward()
    sz.step()
    host.save_into(folder, [sz])
    sz.remove_hooks()
    return folder


def test_a_forced_reshard_that_fails_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """Review finding: --force moved the old folder aside, and a failure before the new one was
    in place (a full disk) lost it and escaped as a traceback."""
    from selzero_plugin.checkpoint.relayout import find_root

    source = _root_checkpoint(tmp_path / "checkpoint-1")
    out = tmp_path / "new"
    assert tools.run_reshard(str(source), world_size=2, out=str(out)) == 0
    before = _files(out / "selected_zero2" / "selected_zero2")
    real = Path.rename

    def full_disk(self, target):
        if ".staging-" in self.name and Path(target) == out / "selected_zero2":
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", full_disk)
    assert tools.run_reshard(str(source), world_size=3, out=str(out), force=True) == 1
    monkeypatch.setattr(Path, "rename", real)
    assert _files(out / "selected_zero2" / "selected_zero2") == before  # still the old one
    assert find_root(out) is not None and not (out / "selected_zero2.previous").exists()
    assert tools.run_reshard(str(source), world_size=3, out=str(out), force=True) == 0
    assert read_manifest(out / "selected_zero2" / "selected_zero2").group_size == 3


def test_consolidate_takes_a_host_checkpoint_holding_one_instance(tmp_path):
    """Review finding: consolidate called a Trainer checkpoint-N, its selected_zero2 folder and
    the output folder above them all "an incomplete save"."""
    source = _root_checkpoint(tmp_path / "out" / "checkpoint-1")
    for folder in (source, source / "selected_zero2", tmp_path / "out"):
        out = tmp_path / f"{folder.name}.safetensors"
        assert tools.run_consolidate(str(folder), out=str(out), torch_state_dict=str(
            tmp_path / f"{folder.name}-model.safetensors")) == 0, folder
        assert "0.weight/value" in load_file(out)
        assert sorted(load_file(tmp_path / f"{folder.name}-model.safetensors")) == \
            ["0.bias", "0.weight"]


def test_consolidate_refuses_several_instances_and_expert_parallel_exports(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from selzero_plugin import SelectedZero2
    from selzero_plugin.checkpoint import host

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    a = SelectedZero2(model, {"params": ["0.*"], "name": "a"}, torch.optim.AdamW, {"lr": 1e-3})
    b = SelectedZero2(model, {"params": ["1.*"], "name": "b"}, torch.optim.SGD, {"lr": 1e-3})
    model(torch.randn(3, 4)).sum().backward()
    a.step(), b.step()
    host.save_into(tmp_path / "two", [a, b])
    a.remove_hooks(), b.remove_hooks()
    assert tools.run_consolidate(str(tmp_path / "two"), out=str(tmp_path / "x.safetensors"),
                                 torch_state_dict=None) == 1
    err = capsys.readouterr().err
    assert "holds 2 selzero instances (['a', 'b'])" in err and "Consolidate each" in err
    # one of several expert-parallel instances: its fused tensors are not the model's
    full = tools.consolidate(tmp_path / "two" / "selected_zero2" / "a", tmp_path / "a.safetensors")
    with safe_open(str(full), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    raw = json.loads(meta["selzero"])
    raw["expert_parallel"] = {"ep_rank": 0, "ep_size": 2}
    save_file(tensors, str(full), metadata={**meta, "selzero": json.dumps(raw)})
    with pytest.raises(CheckpointError, match="one of 2 expert-parallel instances"):
        tools.export_model_state(full, tmp_path / "m.safetensors")


def test_several_checkpoints_below_a_folder_are_listed_newest_last(tmp_path):
    from selzero_plugin.checkpoint.locate import locate

    for name in ("checkpoint-9", "checkpoint-10", "checkpoint-10.replaced-ab12"):
        (tmp_path / name / "selected_zero2").mkdir(parents=True)
        (tmp_path / name / "selected_zero2" / "index.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds 2 checkpoints.*checkpoint-10` \(the last\)"):
        locate(tmp_path, tool="inspect")
    (tmp_path / "latest").write_text("checkpoint-9")  # DeepSpeed's newest tag
    with pytest.raises(CheckpointError, match=r"checkpoint-9` \(the `latest` tag\)"):
        locate(tmp_path, tool="inspect")


def test_an_export_that_cannot_be_written_is_a_one_line_error(ckpt2, tmp_path, capsys):
    """Review finding: --torch-state-dict onto a folder raised torch.save's RuntimeError."""
    (tmp_path / "adir").mkdir()
    for flag in ("torch_state_dict", "torch_optim_state"):
        code = tools.run_consolidate(str(ckpt2), out=str(tmp_path / "ok.safetensors"),
                                     **{"torch_state_dict": None, flag: str(tmp_path / "adir")})
        assert code == 1, flag
        assert "selzero consolidate: error:" in capsys.readouterr().err


def test_an_interrupted_replacement_names_the_previous_checkpoint(tmp_path, capsys):
    source = _root_checkpoint(tmp_path / "checkpoint-1")
    (source / "selected_zero2").rename(source / "selected_zero2.previous")
    assert tools.run_inspect(str(source), verify_shards=False) == 1
    err = capsys.readouterr().err
    assert "selected_zero2.previous does" in err and "Rename it to selected_zero2" in err
