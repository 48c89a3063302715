"""Reliability 8 under the integrations: the HF Trainer with the callback beside DDP, and beside
DeepSpeed ZeRO-2 through ``TrainingArguments(deepspeed=...)`` (tests/_trainer_runs.py variants
``sz0`` and ``ds-sz0``: tiny Qwen3-MoE, fused experts with ``expert_dim=0``, accumulation 2,
clipping, saves every 2 steps, a resume from ``checkpoint-4``), launched as two torchrun "nodes"
of one process each (``--nnodes 2 --node-rank {0,1}``: global rank 1 is local rank 0) and as one
node of two. Confusing the local rank with the global or group rank anywhere (data, routing,
shard names, which rank writes what) shows as a difference: the weights, the resumed weights,
the logged losses and norms, each rank's routing and every selzero shard file are identical.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ._launch import free_port, start, wait_all

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.e2e, pytest.mark.multiproc, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "_trainer_runs.py"
VARIANTS = ["sz0", "ds-sz0"]
ENV = {"ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_nodes_trainer")
    two, one = tmp / "two", tmp / "one"
    two.mkdir()
    one.mkdir()
    port = free_port()
    launches = [start(tmp, f"node{k}", RUNS, nnodes=2, node_rank=k, nproc=1, port=port,
                      args=[str(two), "qwen3", *VARIANTS], env=ENV) for k in range(2)]
    wait_all(launches, 600)
    wait_all([start(tmp, "one", RUNS, nnodes=1, node_rank=0, nproc=2, port=free_port(),
                    args=[str(one), "qwen3", *VARIANTS], env=ENV)], 600)
    return two, one


def _logged(history: list[dict]) -> list[dict]:
    """The log history without wall-clock figures (runtime, samples per second)."""
    return [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}
            for entry in history]


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_nodes_train_exactly_as_one(outs, variant):
    two, one = outs
    for suffix in (".safetensors", ".resumed.safetensors"):
        assert _bytes(two / f"{variant}{suffix}") == _bytes(one / f"{variant}{suffix}"), suffix
    a = json.loads((two / f"{variant}.json").read_text())
    b = json.loads((one / f"{variant}.json").read_text())
    assert _logged(a["full"]) == _logged(b["full"]) and len(_logged(a["full"])) >= 6
    assert _logged(a["resumed"]) == _logged(b["resumed"])
    for rank in range(2):  # routing is per global rank, and differs between them
        assert (two / f"{variant}.routing{rank}.json").read_text() == \
            (one / f"{variant}.routing{rank}.json").read_text()
    assert (two / f"{variant}.routing0.json").read_text() != \
        (two / f"{variant}.routing1.json").read_text()


@pytest.mark.parametrize("variant", VARIANTS)
def test_selzero_shards_are_named_by_group_rank_and_identical(outs, variant):
    two, one = outs
    work = [Path(json.loads((o / f"{variant}.json").read_text())["work"]) for o in (two, one)]

    def shards(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.suffix == ".safetensors" and "selected_zero2" in p.parts}

    a, b = shards(work[0]), shards(work[1])
    assert a and a.keys() == b.keys(), (sorted(a), sorted(b))
    names = {os.path.basename(k) for k in a}
    assert names == {"shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"}
    for key in a:
        assert a[key] == b[key], key
