"""A small synthetic checkpoint for the offline tools: no process group needed.

Awkward on purpose: a tied alias, a frozen parameter, a fused bf16 expert tensor split into 3
virtual parameters (one never stepped, the others with different step counts), a one-element
parameter (empty chunks on most ranks), two optimizer groups.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Iterator

import torch

from selzero_plugin.checkpoint.format import (CHUNKING, FORMAT, FORMAT_VERSION, Manifest,
                                              VirtualRecord, tensor_key, whats)
from selzero_plugin.checkpoint.tools import write_sharded
from selzero_plugin.core.optim import jsonable

__all__ = ["ENTRIES", "VIRTUALS", "STEPS", "ADAMW_STATE", "hyperparameters", "manifest",
           "full_tensor", "stream", "write"]

ENTRIES = [
    {"name": "a.weight", "aliases": ["tied.weight"], "shape": [5, 7], "dtype": "float32",
     "frozen": False, "experts": None},
    {"name": "frozen", "aliases": [], "shape": [2], "dtype": "float32", "frozen": True,
     "experts": None},
    {"name": "moe.w", "aliases": [], "shape": [3, 4, 5], "dtype": "bfloat16", "frozen": False,
     "experts": 3},
    {"name": "b.bias", "aliases": [], "shape": [1], "dtype": "float32", "frozen": False,
     "experts": None},
]
VIRTUALS = [
    {"key": "a.weight", "entry": "a.weight", "expert": None, "numel": 35, "group": 0,
     "stateful": True},
    *({"key": f"moe.w[expert {e}]", "entry": "moe.w", "expert": e, "numel": 20, "group": 0,
       "stateful": e != 2} for e in range(3)),
    {"key": "b.bias", "entry": "b.bias", "expert": None, "numel": 1, "group": 1,
     "stateful": True},
]
STEPS = {"a.weight": 5.0, "moe.w[expert 0]": 5.0, "moe.w[expert 1]": 3.0, "b.bias": 5.0}
ADAMW_STATE = {"exp_avg": {"kind": "elementwise", "dtype": "float32"},
               "exp_avg_sq": {"kind": "elementwise", "dtype": "float32"},
               "step": {"kind": "scalar", "dtype": "float32"}}


def hyperparameters(**overrides: object) -> dict:
    group = torch.optim.AdamW([torch.zeros(1)], lr=1e-2, weight_decay=0.1).param_groups[0]
    return jsonable({**{k: v for k, v in group.items() if k != "params"}, **overrides})


def manifest(world: int) -> Manifest:
    raw = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "package_version": "0.1.0",
        "name": "synthetic", "group_size": world,
        "contract": {"entries": ENTRIES, "chunking": CHUNKING},
        "virtuals": VIRTUALS,
        "optimizer": {"class": "torch.optim.adamw.AdamW", "param_groups": [
            {"hyperparameters": hyperparameters(), "state": ADAMW_STATE},
            {"hyperparameters": hyperparameters(weight_decay=0.0), "state": ADAMW_STATE}]},
        "normalization": {"reduction": "mean", "normalize_over": "group", "missing_grad": "zero",
                          "nonfinite": "error"},
        "config": {"params": ["*"]}, "shards": [],
    }
    return Manifest.from_json(raw, where="synthetic")


def full_tensor(v: VirtualRecord, what: str) -> torch.Tensor:
    """Deterministic full (flat) tensor of ``what`` for virtual parameter ``v``."""
    if what == "step":
        return torch.tensor(STEPS[v.key])
    g = torch.Generator().manual_seed(zlib.crc32(tensor_key(v.key, what).encode()))
    t = torch.randn(v.numel, generator=g)
    return t.abs() if what == "exp_avg_sq" else t


def stream(m: Manifest) -> Iterator[tuple[VirtualRecord, str, torch.Tensor]]:
    for v in m.virtuals:
        for what in whats(m, v):
            yield v, what, full_tensor(v, what)


def write(folder: Path, world: int) -> Path:
    m = manifest(world)
    write_sharded(folder, m, stream(m))
    return folder
