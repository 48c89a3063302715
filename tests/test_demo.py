"""`selzero demo` runs end to end through torch's launcher and prints its report."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.multiproc]


def _run_demo(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "selzero_plugin.cli", "demo", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_demo_prints_a_clean_report_and_exits_zero():
    proc = _run_demo("--steps", "12")
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert not proc.stderr.strip(), "the demo should print nothing on stderr:\n" + proc.stderr
    assert "terminate called" not in out
    assert "per-rank bytes of expert gradients + optimizer state" in out
    rows = re.findall(r"^\s+(\d)\s+([\d,.]+) KiB\s+([\d,.]+) KiB\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1"], out
    for _, held, ddp, ratio in rows:
        # 2 ranks: selzero holds at most half of what DDP + AdamW holds for the experts
        assert 0.0 < float(ratio) <= 0.5, out
        assert float(held.replace(",", "")) < float(ddp.replace(",", "")), out
    first, last = map(float, re.search(r"step 1: ([\d.]+)\s+step 12: ([\d.]+)", out).groups())
    assert last < first, out
    skipped = int(re.search(r"expert updates skipped .*?: (\d+) of", out).group(1))
    assert skipped > 0, out  # the demo's routing leaves some experts without tokens
    assert "bit-identical to its start" in out
    assert "replicas identical after training: yes" in out
    assert "reloaded into a fresh SelectedZero2: expert weights and AdamW state match exactly" \
        in out


def test_demo_keeps_its_checkpoint_in_out(tmp_path):
    proc = _run_demo("--steps", "3", "--out", str(tmp_path))
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    saved = sorted(p.name for p in (tmp_path / "selected_zero2").iterdir())
    assert saved == ["manifest.json", "shard-00000-of-00002.safetensors",
                     "shard-00001-of-00002.safetensors"]
    assert str(tmp_path / "selected_zero2") in proc.stdout


def test_cannot_run_demo_with_fewer_than_two_steps(capsys):
    from selzero_plugin.demo import launch

    assert launch(nproc=2, steps=1, out=None) == 2
    assert "--steps >= 2" in capsys.readouterr().err


def test_demo_under_deepspeed_prints_the_same_report():
    """`selzero demo --host deepspeed`: DeepSpeed ZeRO-2 with the "selected_zero2" entry."""
    pytest.importorskip("deepspeed")
    proc = _run_demo("--steps", "12", "--host", "deepspeed", timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert not proc.stderr.strip(), proc.stderr
    assert "everything else: DeepSpeed ZeRO-2" in out
    rows = re.findall(r"^\s+(\d)\s+([\d,.]+) KiB\s+([\d,.]+) KiB\s+([\d.]+)\s+([\d,.]+) KiB$",
                      out, re.M)
    assert [r[0] for r in rows] == ["0", "1"], out
    for _, held, ddp, ratio, ds in rows:
        assert 0.0 < float(ratio) <= 0.5 and float(ds.replace(",", "")) > 0, out
    first, last = map(float, re.search(r"step 1: ([\d.]+)\s+step 12: ([\d.]+)", out).groups())
    assert last < first, out
    assert int(re.search(r"expert updates skipped .*?: (\d+) of", out).group(1)) > 0, out
    assert "bit-identical to its start" in out
    assert "replicas identical after training: yes" in out
    assert "AdamW state match exactly" in out
    # training time apart from DeepSpeed's initialize (its one-off op build)
    assert re.search(r"training time: [\d.]+ s \(DeepSpeed's initialize before it, one-off op "
                     r"build included: [\d.]+ s\)", out), out


def test_expert_parallelism_under_another_host_names_the_real_problem(capsys):
    from selzero_plugin.demo import launch

    assert launch(nproc=4, steps=6, out=None, host="trainer", ep=2) == 2
    err = capsys.readouterr().err
    assert "runs beside plain DDP only" in err and "selzero demo --ep 2 --nproc 4" in err
    assert launch(nproc=3, steps=6, out=None, ep=2) == 2
    assert "a divisor of --nproc 3" in capsys.readouterr().err


@pytest.mark.parametrize("host,label", [("accelerate", "DDP (through Accelerate)"),
                                        ("trainer", "DDP (through the HF Trainer)")])
def test_demo_through_accelerate_and_the_trainer_prints_the_same_report(host, label):
    """`selzero demo --host accelerate|trainer`: selzero_plugin.accelerate.prepare, and the HF
    Trainer with SelectedZero2Callback; the same routing, so the same experts are skipped."""
    pytest.importorskip("accelerate")
    if host == "trainer":
        pytest.importorskip("transformers")
    proc = _run_demo("--steps", "12", "--host", host, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert not proc.stderr.strip(), proc.stderr
    assert f"everything else: {label}" in out
    rows = re.findall(r"^\s+(\d)\s+([\d,.]+) KiB\s+([\d,.]+) KiB\s+([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["0", "1"], out
    assert all(0.0 < float(r[3]) <= 0.5 for r in rows), out
    first, last = map(float, re.search(r"step 1: ([\d.]+)\s+step 12: ([\d.]+)", out).groups())
    assert last < first, out
    # the DDP demo's routing: 68 of 192 expert updates skipped over 12 steps
    assert "expert updates skipped (expert absent on every rank): 68 of 192" in out, out
    assert "bit-identical to its start" in out
    assert "replicas identical after training: yes" in out
    assert "AdamW state match exactly" in out


def test_demo_with_expert_parallelism_matches_its_one_process_reference():
    """`selzero demo --ep 2 --nproc 4`: experts per rank, per-rank memory, the global norm
    beside one process holding every expert, skipped updates of the never-routed expert."""
    proc = _run_demo("--ep", "2", "--nproc", "4", "--steps", "6", timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{proc.stderr}"
    assert not proc.stderr.strip(), proc.stderr
    rows = re.findall(r"^\s+(\d)\s+(\[[\d, ]+\])\s+([\d,.]+) KiB\s+([\d,.]+) KiB\s+([\d.]+)$",
                      out, re.M)
    assert [(r[0], r[1]) for r in rows] == [("0", "[0, 1, 2, 3]"), ("1", "[4, 5, 6, 7]"),
                                            ("2", "[0, 1, 2, 3]"), ("3", "[4, 5, 6, 7]")], out
    assert all(0.0 < float(r[4]) <= 0.5 for r in rows), out
    gap = float(re.search(r"largest relative gap ([\d.e+-]+)", out).group(1))
    assert gap < 1e-5, out
    skipped = re.search(r"per group: \[(\d+), (\d+)\]", out).groups()
    assert int(skipped[0]) == 0 and int(skipped[1]) > 0, out  # expert 7 is held by group 1
    assert launch_refuses_bad_ep()


def launch_refuses_bad_ep() -> bool:
    from selzero_plugin.demo import launch

    return launch(nproc=4, steps=3, out=None, ep=3) == 2
