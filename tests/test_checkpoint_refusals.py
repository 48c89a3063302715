"""Every refusal of load_checkpoint: a clear CheckpointError on every rank, state untouched.

One 2-rank save (fused experts, a tied alias, a frozen parameter, AdamW) is copied and damaged
in one way per test; one launch of 2 ranks then tries every load (each rank trains one step first,
so its parameters and optimizer state differ from the checkpoint's and "untouched" means
something), and one launch of 3 ranks tries the group-size mismatch.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from . import _ckpt
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc


def _remove_manifest(f: Path) -> None:
    (f / "manifest.json").unlink()


def _unreadable_manifest(f: Path) -> None:
    (f / "manifest.json").write_text('{"format": "selzero-checkpoint", "format_vers')


def _remove_rank1_shard(f: Path) -> None:
    (f / "shard-00001-of-00002.safetensors").unlink()


def _flip_byte(f: Path) -> None:
    path = f / "shard-00000-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data: only the checksum can see it
    path.write_bytes(bytes(data))


def _truncate_rank1_shard(f: Path) -> None:
    path = f / "shard-00001-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-40])


def _future_format(f: Path) -> None:
    raw = json.loads((f / "manifest.json").read_text())
    raw["format_version"] = 99
    (f / "manifest.json").write_text(json.dumps(raw))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "missing_manifest": _remove_manifest,
    "unreadable_manifest": _unreadable_manifest,
    "missing_shard": _remove_rank1_shard,
    "flipped_byte": _flip_byte,
    "truncated": _truncate_rank1_shard,
    "unknown_format": _future_format,
}
# Scenarios whose checkpoint is intact but whose run differs from the saving one.
RUN_DIFFERS: dict[str, dict[str, Any]] = {
    "parameter_set": {"config_overrides": {"params": ["inp.*", "tied.*", "experts.*", "scale"]}},
    "shapes": {"model_kwargs": {"h": 6}},
    "dtypes": {"dtype": torch.bfloat16},
    "aliases": {"model_kwargs": {"alias_name": "other"}},
    "expert_split": {"config_overrides": {"expert_dim": None}},
    "optimizer_class": {"opt": "SGD"},
    "optimizer_state_keys": {"opt": "AdamW-amsgrad"},
    # not a refusal: runtime settings may change between save and load
    "runtime_settings": {"opt": "AdamW-other-lr",
                         "config_overrides": {"bucket_mb": 0.0005, "reduction": "sum",
                                              "timeout_s": 30.0}},
}
_results: dict[str, Any] = {}


def _attempts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _results:
        root = tmp_path_factory.mktemp("refusals")
        good = root / "good"
        saved = all_values(run_ranks(_ckpt.save_only, 2, str(good), kind="fused", opt="AdamW",
                                     k=2, timeout=240))
        scenarios = []
        for name, damage in DAMAGE.items():
            shutil.copytree(good, root / name)
            damage(root / name)
            scenarios.append({"name": name, "folder": str(root / name)})
        scenarios += [{"name": name, "folder": str(good), **sc} for name, sc in RUN_DIFFERS.items()]
        per_rank = all_values(run_ranks(_ckpt.attempt_loads, 2, scenarios, timeout=300))
        _results.update({sc["name"]: [per_rank[r][i] for r in range(2)]
                         for i, sc in enumerate(scenarios)})
        _results["group_size"] = [
            r[0] for r in all_values(run_ranks(_ckpt.attempt_loads, 3, [
                {"name": "group_size", "folder": str(good)}], timeout=240))]
        _results["_saved"] = saved
        _results["_good"] = good
    return _results


def _refused(name: str, tmp_path_factory: pytest.TempPathFactory, *, expect: list[str]) -> str:
    """Every rank raised the same CheckpointError naming ``expect``, and kept its state."""
    results = _attempts(tmp_path_factory)[name]
    for r, res in enumerate(results):
        assert res["error_type"] == "CheckpointError", (r, res)
        assert res["untouched"], f"rank {r}: state changed by a refused load"
    bodies = {res["message"].split("] ", 1)[1] for res in results}
    assert len(bodies) == 1, f"ranks raised different errors: {bodies}"
    body = bodies.pop()
    for word in expect:
        assert word in body, f"{word!r} not in {body!r}"
    return body


def test_cannot_load_without_a_manifest(tmp_path_factory):
    _refused("missing_manifest", tmp_path_factory, expect=["no manifest.json", "incomplete save"])


def test_cannot_load_an_unreadable_manifest(tmp_path_factory):
    _refused("unreadable_manifest", tmp_path_factory, expect=["unreadable", "manifest.json"])


def test_cannot_load_with_a_missing_shard(tmp_path_factory):
    body = _refused("missing_shard", tmp_path_factory,
                    expect=["shard-00001-of-00002.safetensors", "missing"])
    assert "group rank 1" in body  # found by rank 1 only; rank 0 raises it too


def test_cannot_load_a_shard_with_a_flipped_byte(tmp_path_factory):
    _refused("flipped_byte", tmp_path_factory,
             expect=["shard-00000-of-00002.safetensors", "sha256", "corrupt"])


def test_cannot_load_a_truncated_shard(tmp_path_factory):
    _refused("truncated", tmp_path_factory, expect=["shard-00001-of-00002.safetensors",
                                                    "truncated"])


def test_cannot_load_an_unknown_format_version(tmp_path_factory):
    _refused("unknown_format", tmp_path_factory, expect=["format version 99", "reads versions 1, 2"])


def test_cannot_load_on_a_different_group_size(tmp_path_factory):
    results = _attempts(tmp_path_factory)["group_size"]
    assert len(results) == 3
    for r, res in enumerate(results):
        assert res["error_type"] == "CheckpointError" and res["untouched"], (r, res)
        assert "group of 2 rank(s); this group has 3" in res["message"]
        assert "selzero reshard" in res["message"] and "--world-size 3" in res["message"]


def test_cannot_load_a_different_parameter_set(tmp_path_factory):
    _refused("parameter_set", tmp_path_factory,
             expect=["selected parameters differ", "'out.weight'"])


def test_cannot_load_different_shapes(tmp_path_factory):
    _refused("shapes", tmp_path_factory, expect=["'experts.gate_up'", "shape [4, 7, 5]",
                                                 "[4, 7, 6]"])


def test_cannot_load_different_dtypes(tmp_path_factory):
    _refused("dtypes", tmp_path_factory, expect=["dtype \"float32\"", "\"bfloat16\""])


def test_cannot_load_different_aliases(tmp_path_factory):
    _refused("aliases", tmp_path_factory, expect=["'inp.weight'", "aliases", "tied.weight",
                                                  "other.weight"])


def test_cannot_load_a_different_expert_split(tmp_path_factory):
    _refused("expert_split", tmp_path_factory, expect=["experts 4", "this run has null"])


def test_cannot_load_with_a_different_optimizer_class(tmp_path_factory):
    _refused("optimizer_class", tmp_path_factory,
             expect=["torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"])


def test_cannot_load_with_different_optimizer_state_keys(tmp_path_factory):
    _refused("optimizer_state_keys", tmp_path_factory,
             expect=["max_exp_avg_sq", "amsgrad"])


def test_runtime_settings_may_change_between_save_and_load(tmp_path_factory):
    """lr, weight decay, bucket_mb (so other buckets), reduction and timeout_s differ: the load
    succeeds and restores the saved parameters exactly."""
    results = _attempts(tmp_path_factory)
    saved = results["_saved"]
    for r, res in enumerate(results["runtime_settings"]):
        assert res["error_type"] is None, res["message"]
        assert _ckpt.same(res["params"], saved[r]["params"]), f"rank {r}"
