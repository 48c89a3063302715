"""Fused expert tensors: tiny transformers Qwen3-MoE and Mixtral models, selzero runs, references.

transformers 5 stores each MoE layer's experts as one tensor stacked on dim 0
(``mlp.experts.gate_up_proj`` of shape (E, 2I, H), ``mlp.experts.down_proj`` (E, H, I)); an expert
that gets no token gets exactly-zero rows. Every rank builds the model with the same seed and feeds
its own token ids, so the routing differs across ranks.

Each rank trains two models side by side in one spawn (spawning costs seconds): one with
``expert_dim=0`` (each expert its own virtual parameter) and one with ``expert_dim=None`` (the
fused tensor is one parameter). The references run in one process on the mean of the ranks'
gradients (each rank's loss backpropagated separately, summed in FP32, divided by N):
- ``split=True``: per-expert semantics. Every expert slice of a fused tensor is its own FP32
  tensor in a plain torch optimizer, given ``grad=None`` when its mean-of-ranks gradient slice is
  exactly zero, so torch skips it (no update, no decay, no step count);
- ``split=False``: stock PyTorch. The fused tensor is one parameter whose unrouted rows get a zero
  gradient, not a missing one, so they decay and their moments decay too.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp

from ._shard import shard_snapshot

__all__ = ["KINDS", "SELECT", "OPT_KWARGS", "build_hf_model", "token_ids", "is_selected",
           "fused_selzero", "fused_reference"]

KINDS = ("qwen3_moe", "mixtral")
SELECT = ["*.experts.*"]
OPT_KWARGS: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
_TOKENS = {"qwen3_moe": 3, "mixtral": 2}  # few tokens per rank: many experts get none


def build_hf_model(kind: str, seed: int = 0) -> nn.Module:
    """A 2-layer model from a tiny config; the same seed gives the same weights on every rank."""
    import transformers

    common = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=32)
    if kind == "qwen3_moe":
        # grouped_mm (transformers' default experts path) needs 16-byte strides: I % 4 == 0
        config = transformers.Qwen3MoeConfig(
            **common, intermediate_size=8, moe_intermediate_size=4, num_experts=8,
            num_experts_per_tok=1, decoder_sparse_step=1, mlp_only_layers=[],
            tie_word_embeddings=False)
        cls = transformers.Qwen3MoeForCausalLM
    elif kind == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=8, num_local_experts=6,
                                            num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    else:
        raise ValueError(f"unknown kind {kind!r}")
    torch.manual_seed(seed)
    return cls(config)


def token_ids(kind: str, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10007 * step + 101 * rank + 1)
    return torch.randint(0, 32, (1, _TOKENS[kind]), generator=g)


def is_selected(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in SELECT)


def _fused(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if is_selected(n)}


def _expert_rows_nonzero(grad: torch.Tensor) -> torch.Tensor:
    return grad.detach().reshape(grad.shape[0], -1).ne(0).any(dim=1)


def fused_selzero(rank: int, world: int, kind: str, steps: int) -> dict[str, list[dict[str, Any]]]:
    """Train an ``expert_dim=0`` and an ``expert_dim=None`` model; snapshots after every step.

    Each snapshot also records which experts this rank's gradient reached (a tensor hook sees the
    gradient before selzero's post-accumulate hook takes it), so the test can tell which experts
    were absent on every rank from selzero's own run.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    runs = []
    for expert_dim in (0, None):
        model = build_hf_model(kind)
        config = SelZeroConfig(params=SELECT, expert_dim=expert_dim,
                               name=f"experts_dim{expert_dim}")
        sz = SelectedZero2(model, config, torch.optim.AdamW, dict(OPT_KWARGS))
        host_opt = torch.optim.AdamW([p for n, p in model.named_parameters()
                                      if not is_selected(n)], **OPT_KWARGS)
        seen: dict[str, torch.Tensor] = {}
        for name, p in _fused(model).items():
            p.register_hook(lambda g, name=name: seen.__setitem__(name, _expert_rows_nonzero(g)))
        runs.append((str(expert_dim), model, sz, wrap_ddp(model, sz), host_opt, seen))
        out[str(expert_dim)] = []
    for step in range(steps):
        ids = token_ids(kind, step, rank)
        for key, model, sz, ddp, host_opt, seen in runs:
            seen.clear()
            ddp(input_ids=ids, labels=ids).loss.backward()
            grads_left = [n for n, p in _fused(model).items() if p.grad is not None]
            host_opt.step()
            result = sz.step()
            host_opt.zero_grad(set_to_none=True)
            out[key].append({
                "params": {n: p.detach().clone() for n, p in _fused(model).items()},
                "routed": {n: seen.get(n, torch.zeros(p.shape[0], dtype=torch.bool)).clone()
                           for n, p in _fused(model).items()},
                "grads_left": grads_left, "shard": shard_snapshot(sz), "result": result})
    return out


def fused_reference(kind: str, world: int, steps: int, *, split: bool) -> list[dict[str, Any]]:
    """One process on the mean of the ranks' gradients; a snapshot per step (see module doc)."""
    model = build_hf_model(kind)
    fused = _fused(model)
    host_opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in fused],
                                 **OPT_KWARGS)
    if split:
        experts = {(n, e): p.detach()[e].clone().requires_grad_()
                   for n, p in fused.items() for e in range(p.shape[0])}
        expert_opt = torch.optim.AdamW(list(experts.values()), **OPT_KWARGS)
    else:
        experts = {(n, None): p for n, p in fused.items()}
        expert_opt = torch.optim.AdamW(list(fused.values()), **OPT_KWARGS)
    snaps = []
    for step in range(steps):
        sums = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        routed = {n: torch.zeros(world, p.shape[0], dtype=torch.bool) for n, p in fused.items()}
        for r in range(world):
            model.zero_grad(set_to_none=True)
            ids = token_ids(kind, step, r)
            model(input_ids=ids, labels=ids).loss.backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    sums[n] += p.grad
                    if n in routed:
                        routed[n][r] = _expert_rows_nonzero(p.grad)
        for n, p in model.named_parameters():
            p.grad = sums[n] / world
        if split:
            for (n, e), copy in experts.items():
                g = fused[n].grad[e]
                copy.grad = g.clone() if bool(g.ne(0).any()) else None
        host_opt.step()
        expert_opt.step()
        model.zero_grad(set_to_none=True)
        if split:
            with torch.no_grad():
                for (n, e), copy in experts.items():
                    fused[n][e].copy_(copy)
        snaps.append({
            "params": {n: p.detach().clone() for n, p in fused.items()},
            "routed": routed,
            "state": {key: {k: v.detach().clone() for k, v in expert_opt.state[t].items()}
                      for key, t in experts.items() if t in expert_opt.state}})
    return snaps
