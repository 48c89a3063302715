"""Memory runs: selzero's per-rank footprint and the lifetime of full-size gradients.

``MemModel`` mixes what the footprint depends on, with sizes that divide by neither 2 nor 3
(except where a (1,) tensor makes ranks >= 1 hold an empty chunk): fp32 and bf16 parameters, (1,)
parameters, fused (E, 5, 7) expert tensors split with ``expert_dim=0``, a frozen selected
parameter, a tied alias (``alias`` is ``dense`` under a second name) and an unselected host layer.
Its loss reaches every parameter, so every (virtual) parameter has optimizer state after one step.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from selzero_plugin import SelectedZero2, SelZeroConfig

from .models import loss_fn, make_batch
from .parity import build_model, routes_for

__all__ = ["MEM_SELECT", "MemModel", "memory_run", "gradient_lifetime_run", "sync_broadcast_run"]

MEM_SELECT = ["tiny", "frozen", "scale", "dense.*", "alias.*", "low.*", "moe.*"]


class FusedExperts(nn.Module):
    """E experts stacked on dim 0; declaring ``num_experts`` opts in to ``expert_dim=0``."""

    def __init__(self, num_experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.randn(num_experts, 5, 7).to(dtype))


class MemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tiny = nn.Parameter(torch.randn(1))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.bfloat16))
        self.dense = nn.Linear(7, 13)
        self.low = nn.Linear(5, 7).to(torch.bfloat16)
        self.moe = nn.Module()
        self.moe.experts = FusedExperts(3, torch.float32)
        self.moe.hexperts = FusedExperts(3, torch.bfloat16)
        self.host = nn.Linear(4, 4)
        self.alias = self.dense

    def loss(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step)
        total = torch.zeros(())
        for p in self.parameters():
            if p.requires_grad:
                coef = torch.randn(p.shape, generator=g) + 2.0  # never zero: every row present
                total = total + (p.float() * coef).sum() + 0.5 * p.float().pow(2).sum()
        return total


def _report(sz: SelectedZero2) -> dict[str, int]:
    r = sz.memory_report()
    return {"grad_shard": r.grad_shard, "optimizer_state": r.optimizer_state,
            "master": r.master, "total": r.total, "ideal_total": r.ideal_total}


def memory_run(rank: int, world: int) -> dict[str, Any]:
    """Reports before the first step and after steps 1 and 2, for AdamW and SGD with momentum."""
    out: dict[str, Any] = {}
    for opt_name, cls, kwargs in (("AdamW", torch.optim.AdamW, {"lr": 1e-3}),
                                  ("SGD", torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})):
        model = MemModel()
        sz = SelectedZero2(model, SelZeroConfig(params=MEM_SELECT, expert_dim=0,
                                                name=f"mem_{opt_name}"), cls, kwargs)
        reports = [_report(sz)]
        for step in range(2):
            model.loss(step).backward()
            result = sz.step()
            assert result.skipped_absent == 0, result
            reports.append(_report(sz))
        out[opt_name] = {"reports": reports, "state_parameter_count": sz.state_parameter_count,
                         "selected_names": list(sz.selected_names),
                         "trainable_names": list(sz.trainable_names)}
    return out


def gradient_lifetime_run(rank: int, world: int) -> dict[str, Any]:
    """Track every full-size gradient of a selected parameter and every bucket buffer by weakref.

    The weak references are to the *storages* (``StorageWeakRef``, a C++ weak pointer): a Python
    ``weakref.ref`` to a tensor dies with its Python wrapper even while the storage lives on, so it
    would not see a leak.

    Tiny buckets (one per parameter) so several reductions happen. ``alive_in_backward`` is
    measured from a hook on the first layer's weight, whose gradient is the last one backward
    produces: by then every expert's full gradient must already be gone.
    """
    model = build_model(num_experts=3)
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=1e-4),
                       torch.optim.AdamW, {"lr": 1e-3})
    grads: list[StorageWeakRef] = []
    for e in sz.trainable:
        e.param.register_hook(lambda g: grads.append(StorageWeakRef(g.untyped_storage())))
    # the storages themselves: their memory must be gone after the reduction point (a storage
    # object may outlive its memory: the communicator keeps finished works, whose storages were
    # freed in place by resize_(0), [Note: work objects at exit])
    buffers: list[tuple[torch.UntypedStorage, int]] = []
    reduce_scatter = sz.comm.reduce_scatter_rows

    def tracking_reduce_scatter(buffer: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        storage = buffer.untyped_storage()
        buffers.append((storage, storage.data_ptr()))
        return reduce_scatter(buffer, *args, **kwargs)

    sz.comm.reduce_scatter_rows = tracking_reduce_scatter
    in_backward: list[int] = []

    def count_alive(_grad: torch.Tensor) -> None:
        gc.collect()
        in_backward.append(sum(not r.expired() for r in grads))

    model.inp.weight.register_hook(count_alive)
    out: dict[str, Any] = {"buckets": len(sz.layout.buckets), "steps": []}
    for step in range(2):
        grads.clear()
        buffers.clear()
        in_backward.clear()
        x, y = make_batch(step, rank)
        loss_fn(model, x, y, routes_for(step, rank, 6, 3, "same")).backward()
        gc.collect()
        record = {"grads_seen": len(grads), "alive_in_backward": list(in_backward),
                  "alive_after_backward": sum(not r.expired() for r in grads),
                  "grad_not_none": [e.name for e in sz.trainable if e.param.grad is not None]}
        sz.reduce_gradients()
        gc.collect()
        record["buffers_reduced"] = len(buffers)
        # on the CPU two pooled blocks are reused for every bucket ([Note: buffer pool]); any
        # other bucket buffer must be gone
        pooled = sz.collectives.pool.kept
        record["buffers_alive_after_reduction"] = sum(storage.nbytes() > 0 and ptr not in pooled
                                                      for storage, ptr in buffers)
        record["from_pool"] = sum(ptr in pooled for _, ptr in buffers)
        record["bucket_buffers_held"] = [i for i, b in enumerate(sz.collectives.buffers)
                                         if b is not None]
        sz.step()
        model.zero_grad(set_to_none=True)
        out["steps"].append(record)
    return out


class _BigExperts(nn.Module):
    """Four 1 MiB experts, each larger than the 0.5 MiB bucket (one-tensor broadcasts)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.experts = nn.ModuleList([nn.Linear(512, 512, bias=False) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).repeat(1, 64)
        for expert in self.experts:
            h = expert(h)
        return h


def sync_broadcast_run(rank: int, world: int) -> dict[str, Any]:
    """``sync_from_params(values, broadcast=True)`` (what the DeepSpeed door calls at every
    ``initialize``) must not leave a broadcast's buffer alive after it returns."""
    from selzero_plugin.memtrace import track_allocations

    torch.manual_seed(0)
    model = _BigExperts()
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=0.5),
                       torch.optim.SGD, {"lr": 0.1})
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("experts")}
    values = {n: v + rank for n, v in before.items()}
    with track_allocations() as trace:
        sz.sync_from_params(values, broadcast=True)
        gc.collect()
    equal = all(torch.equal(model.get_parameter(n), before[n]) for n in values)  # rank 0's
    return {"alive": [b for b in trace.alive_blocks() if b >= 2 ** 18], "net": trace.net,
            "rank0_values": equal}
