"""Reshard 2 -> 3 and 3 -> 2 ranks: resuming on the new group size equals a single-process
torch.optim reference resumed from the consolidated state (values from the consolidated file,
optimizer state from its --torch-optim-state export), within 1e-6.

The chain, three process launches in all:
  A (2 ranks) trains K steps and saves F2; F2 is resharded to F3 and consolidated to C2;
  B (3 ranks) loads F3, trains M steps (compared with the reference from C2) and saves F3b,
    a checkpoint written natively by 3 ranks; F3b is resharded to F2b and consolidated to C3;
  C (2 ranks) loads F2b and trains M steps (compared with the reference from C3).
The routing leaves expert 3 without state at the first save and expert 0 absent around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from selzero_plugin.checkpoint import tools

from . import _ckpt
from .dist_utils import all_values, run_ranks
from .parity import max_diff

pytestmark = pytest.mark.multiproc

K, M = 3, 3
_chain: dict[str, Any] = {}


def _case(folder: Path, k: int, **extra: Any) -> dict[str, Any]:
    return {"kind": "toy", "opt": "AdamW", "dtype": torch.float32, "folder": str(folder),
            "k": k, "m": M, "save_at": K, **extra}


def reference(root: Path, consolidated: str, *, world: int,
              steps: range) -> dict[str, torch.Tensor]:
    """One process, plain torch.optim.AdamW over the model, resumed from consolidated files."""
    full = root / f"{consolidated}.safetensors"
    optim = root / f"{consolidated}.pt"
    tools.consolidate(root / consolidated, full, torch_optim_state=optim)
    model = _ckpt.build("toy", seed=99)
    values = load_file(full)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[f"{name}/value"].view(p.shape))
    cls, kwargs = _ckpt.OPTIMIZERS["AdamW"]
    opt = cls(list(model.parameters()), **kwargs)  # selected_names order == parameter order
    opt.load_state_dict(torch.load(optim, weights_only=True))
    for step in steps:
        losses = [_ckpt.loss_at(model, step, r, K) for r in range(world)]
        torch.stack(losses).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _ckpt.params_of(model)


def _run_chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _chain:
        root = tmp_path_factory.mktemp("reshard")
        all_values(run_ranks(_ckpt.save_only, 2, str(root / "F2"), kind="toy", opt="AdamW", k=K,
                             timeout=240))
        tools.reshard(root / "F2", 3, root / "F3")
        b = all_values(run_ranks(_ckpt.resume, 3, [_case(root / "F3", K, save_to=str(
            root / "F3b"))], timeout=240))
        tools.reshard(root / "F3b", 2, root / "F2b")
        c = all_values(run_ranks(_ckpt.resume, 2, [_case(root / "F2b", K + M)], timeout=240))
        _chain.update(root=root, b=[r[0] for r in b], c=[r[0] for r in c])
    return _chain


def test_reshard_2_to_3_resumes_like_a_reference_from_the_consolidated_state(tmp_path_factory):
    chain = _run_chain(tmp_path_factory)
    ref = reference(chain["root"], "F2", world=3, steps=range(K, K + M))
    for r, res in enumerate(chain["b"]):
        assert max_diff(res["final"], ref) <= 1e-6, f"rank {r}"
        assert max_diff(res["final"], res["after_load"]["params"]) > 1e-3  # training moved it
    assert max_diff(chain["b"][0]["final"], chain["b"][2]["final"]) == 0.0


def test_reshard_3_to_2_resumes_like_a_reference_from_the_consolidated_state(tmp_path_factory):
    chain = _run_chain(tmp_path_factory)
    ref = reference(chain["root"], "F3b", world=2, steps=range(K + M, K + 2 * M))
    for r, res in enumerate(chain["c"]):
        assert max_diff(res["final"], ref) <= 1e-6, f"rank {r}"
    assert max_diff(chain["c"][0]["final"], chain["c"][1]["final"]) == 0.0


def test_a_resharded_load_restores_the_consolidated_values_exactly(tmp_path_factory):
    chain = _run_chain(tmp_path_factory)
    root = chain["root"]
    values = load_file(tools.consolidate(root / "F2", root / "F2-values.safetensors"))
    for r, res in enumerate(chain["b"]):
        for name, p in res["after_load"]["params"].items():
            assert torch.equal(p, values[f"{name}/value"].view(p.shape)), (r, name)


def test_consolidate_reshard_consolidate_round_trips_exactly_on_a_trained_checkpoint(
        tmp_path_factory):
    chain = _run_chain(tmp_path_factory)
    root = chain["root"]
    native = tools.consolidate(root / "F3b", root / "rt-native.safetensors").read_bytes()
    resharded = tools.consolidate(root / "F2b", root / "rt-resharded.safetensors").read_bytes()
    assert native == resharded
    back = tools.reshard(root / "F2b", 3, root / "F3b-again")
    assert _ckpt.files_of(back) == _ckpt.files_of(root / "F3b")
