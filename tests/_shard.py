"""Gather selzero's per-rank shards (FP32 values, optimizer state) into full per-parameter tensors.

Each rank returns ``shard_snapshot(sz)`` (plain, picklable data); the test process calls
``assemble`` on the list of every rank's snapshot and gets, for every selected trainable (virtual)
parameter, its full FP32 value (the master for bf16/fp16 parameters) and its full optimizer state,
keyed by ``(canonical name, expert index or None)``. ``assemble`` checks on the way that the
chunks tile the parameter exactly (no gap, no overlap, no padding) and that the ranks agree on the
scalar state (the step count) and on which parameters have state at all.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Key", "shard_snapshot", "assemble", "bf16_ulp", "within_one_bf16_ulp"]

Key = tuple[str, "int | None"]


def shard_snapshot(sz: Any) -> list[dict[str, Any]]:
    """This rank's segments: where each chunk sits in its virtual parameter, value, state."""
    out = []
    for slot, seg in zip(sz.slots, sz.segments):
        spec = sz.layout.virtuals[slot.virtual]
        state = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                 for k, v in sz.optimizer.state.get(seg, {}).items()}
        out.append({"key": (sz.trainable[spec.entry].name, spec.expert),
                    "start": spec.chunk_start(sz.rank) - spec.flat_offset,
                    "total": spec.numel, "value": seg.detach().clone(), "state": state})
    return out


def _is_scalar(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) or value.dim() == 0


def assemble(per_rank: list[list[dict[str, Any]]]) -> dict[Key, dict[str, Any]]:
    """Full FP32 value and state per virtual parameter, from every rank's ``shard_snapshot``."""
    pieces: dict[Key, list[tuple[int, int, dict[str, Any]]]] = {}
    for rank, snap in enumerate(per_rank):
        for item in snap:
            pieces.setdefault(item["key"], []).append((item["start"], rank, item))
    full: dict[Key, dict[str, Any]] = {}
    for key, chunks in pieces.items():
        chunks.sort(key=lambda c: c[0])
        total = chunks[0][2]["total"]
        at = 0
        for start, rank, item in chunks:
            assert start == at, f"{key}: chunk of rank {rank} starts at {start}, expected {at}"
            at += item["value"].numel()
        assert at == total, f"{key}: chunks cover {at} of {total} elements"
        state_keys = {tuple(sorted(item["state"])) for _, _, item in chunks}
        assert len(state_keys) == 1, f"{key}: ranks disagree on which state exists: {state_keys}"
        state: dict[str, Any] = {}
        for k in next(iter(state_keys)):
            values = [item["state"][k] for _, _, item in chunks]
            if _is_scalar(values[0]):
                assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(values[0]))
                           for v in values), f"{key}: ranks disagree on {k}: {values}"
                state[k] = values[0]
            else:
                state[k] = torch.cat([v.reshape(-1) for v in values])
        full[key] = {"value": torch.cat([item["value"].reshape(-1) for _, _, item in chunks]),
                     "state": state}
    return full


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |x| (8 significant bits); the subnormal spacing near 0."""
    _, exponent = torch.frexp(x.float().abs())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 8).clamp_min(2.0 ** -133)


def within_one_bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: a and b (bf16 values) are equal or adjacent bfloat16 numbers."""
    a32, b32 = a.float(), b.float()
    larger = torch.maximum(a32.abs(), b32.abs())
    return (a32 - b32).abs() <= bf16_ulp(larger)
