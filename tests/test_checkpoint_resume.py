"""Resume parity: train k steps, save, load in fresh processes, train m more == never stopping.

Bit-exact (torch.equal) in fp32 and for bf16 parameters with FP32 masters; 2 and 3 ranks;
AdamW and SGD with momentum; per-expert modules and fused experts split with expert_dim=0.
The routing (tests/_ckpt.py ``routes``) leaves expert 0 without tokens in the last step before
the save and the first after it, and gives expert 3 its first tokens only after the resume, so
the save holds an expert with state but no recent gradient and an expert with no state at all.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from . import _ckpt
from .dist_utils import all_values, run_ranks

pytestmark = pytest.mark.multiproc

K, M = 3, 3
CASES: dict[int, list[dict[str, Any]]] = {
    2: [{"name": "toy-AdamW-fp32", "kind": "toy", "opt": "AdamW", "dtype": torch.float32},
        {"name": "toy-AdamW-bf16", "kind": "toy", "opt": "AdamW", "dtype": torch.bfloat16},
        {"name": "fused-SGD-bf16", "kind": "fused", "opt": "SGD", "dtype": torch.bfloat16}],
    3: [{"name": "toy-SGD-fp32", "kind": "toy", "opt": "SGD", "dtype": torch.float32},
        {"name": "fused-AdamW-fp32", "kind": "fused", "opt": "AdamW", "dtype": torch.float32}],
}
_results: dict[int, Any] = {}


def _run(world: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both phases for every case of ``world``, once per session (two process launches)."""
    if world not in _results:
        root = tmp_path_factory.mktemp(f"resume{world}")
        cases = [{**c, "folder": str(root / c["name"]), "k": K, "m": M} for c in CASES[world]]
        uninterrupted = all_values(run_ranks(_ckpt.save_then_continue, world, cases, timeout=240))
        resumed = all_values(run_ranks(_ckpt.resume, world, cases, timeout=240))
        _results[world] = {c["name"]: ([u[i] for u in uninterrupted], [r[i] for r in resumed])
                           for i, c in enumerate(cases)}
    return _results[world]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


CASE_IDS = [(w, c["name"]) for w, cs in CASES.items() for c in cs]


@pytest.mark.parametrize("world,name", CASE_IDS, ids=[f"{w}ranks-{n}" for w, n in CASE_IDS])
def test_resume_equals_uninterrupted_training_bit_exact(world, name, tmp_path_factory):
    uninterrupted, resumed = _run(world, tmp_path_factory)[name]
    for r in range(world):
        assert _equal(uninterrupted[r]["final"], resumed[r]["final"]) == [], f"rank {r}"
        assert _equal(uninterrupted[r]["final_state"], resumed[r]["final_state"]) == [], f"rank {r}"


@pytest.mark.parametrize("world,name", CASE_IDS, ids=[f"{w}ranks-{n}" for w, n in CASE_IDS])
def test_load_restores_parameters_and_state_of_the_save_on_every_rank(world, name,
                                                                       tmp_path_factory):
    uninterrupted, resumed = _run(world, tmp_path_factory)[name]
    for r in range(world):
        at_save, loaded = uninterrupted[r]["at_save"], resumed[r]["after_load"]
        assert _equal(at_save["params"], loaded["params"]) == [], f"rank {r}"
        assert _equal(at_save["state"], loaded["state"]) == [], f"rank {r}"
        # the load really changed something: the fresh process started from other weights
        moved = _equal(resumed[r]["before"], loaded["params"])
        assert len(moved) >= len(loaded["params"]) - 1, f"rank {r}: only {moved} changed"
        assert resumed[r]["warnings"] == []


def test_the_save_window_really_has_an_absent_and_a_never_stepped_expert(tmp_path_factory):
    """Guard for the routing above: at the save, expert 3 has no state and expert 0 has some."""
    uninterrupted, _ = _run(3, tmp_path_factory)["fused-AdamW-fp32"]
    state = {k for r in range(3) for k in uninterrupted[r]["at_save"]["state"]}
    assert "experts.gate_up[expert 0]/exp_avg" in state
    assert "experts.gate_up[expert 3]/value" in state
    assert "experts.gate_up[expert 3]/exp_avg" not in state
    final = {k for r in range(3) for k in uninterrupted[r]["final_state"]}
    assert "experts.gate_up[expert 3]/exp_avg" in final
