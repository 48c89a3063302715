"""``selzero plan``: the per-rank bytes selzero will hold for a selection, before any run.

[Note: memory plan]
The prediction uses the engine's own arithmetic on the model's shapes (a model on the meta
device will do: no weights): ``resolve_selection`` and ``plan_layout`` give every rank's real
chunks, and the optimizer's state is found by stepping a throwaway parameter
(``probe_state_shaped``: of each (virtual) parameter's shape, flat under ``chunks``). Per rank
r, over the slots (virtual parameters with a non-empty chunk on r):

- gradient shard: 4 bytes x the real chunk elements (FP32, no padding);
- masters: 4 bytes x the real chunk elements of bf16 / fp16 parameters;
- optimizer state: per slot, each elementwise state tensor's element size x the chunk's
  elements, plus each scalar state tensor's element size (AdamW: ``exp_avg``, ``exp_avg_sq``
  and a 0-dim ``step``), once the slot has been stepped.

Under whole-tensor ownership (``partition="tensors"``) a rank's slots are the whole (virtual)
parameters the engine's plan gives it (``plan_virtual_owners``), and each stepped one holds
every state tensor one step of its group's optimizer makes for its shape (``probe_state_shaped``:
Adafactor's factored statistics are a row and a column).

This is what ``SelectedZero2.memory_report()`` measures from the live storages once every
(virtual) parameter has been stepped; the tests and ``benchmarks/`` check that they are equal
to the byte. Beside it: the same subset under DDP (full gradients in the parameter dtype and
torch's state on every rank) and under ZeRO-2 of the whole model (DeepSpeed: FP32 gradient
partition, FP32 master partition for low-precision parameters, FP32 Adam state, each 1/N of
the model).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint.format import ELEMENTWISE, SCALAR, probe_state_shaped
from .config import SelZeroConfig
from .core.layout import EntrySpec, plan_layout
from .core.optim import ELEMENTWISE as ELEMENTWISE_OPTIMIZERS
from .core.optim import check_admitted, override_class, plan_groups, resolve_optimizer_class
from .core.ownership import balance
from .core.zero2 import plan_virtual_owners, probe_groups, virtual_costs
from .core.selection import resolve_selection
from .errors import ConfigError, SelectionError

__all__ = ["RankPlan", "MemoryPlan", "plan_memory", "rank_plans", "state_specs", "ddp_bytes",
           "ddp_label", "load_model", "run_plan"]


@dataclass(frozen=True)
class RankPlan:
    """Predicted bytes of one rank, the fields of ``MemoryReport``."""

    rank: int
    grad_shard: int
    optimizer_state: int
    master: int

    @property
    def total(self) -> int:
        return self.grad_shard + self.optimizer_state + self.master


@dataclass(frozen=True)
class MemoryPlan:
    world_size: int
    selected: int  # tensors
    virtual: int  # virtual parameters
    elements: int  # trainable selected elements
    model_elements: int  # trainable elements of the whole model
    ranks: list[RankPlan]
    ddp_subset: int  # per rank: the subset's gradients + state, unsharded
    zero2_model: int  # per rank: ZeRO-2 over the whole model (grad + master + Adam partitions)
    ideal_total: int  # the subset's sharded bytes divided evenly (sum over ranks / N)
    partition: str = "chunks"
    balance: float = 1.0  # whole-tensor ownership: max / mean optimizer cost per rank
    weights: int = 0  # per rank: every parameter's weights (replicated under DDP and selzero)
    dense_ddp: int = 0  # per rank: the host's (other) trainable parameters under DDP
    ddp_label: str = "DDP"  # what ddp_subset counts (mixed precision for bf16/fp16 weights)


def plan_memory(model: nn.Module, config: SelZeroConfig | dict[str, Any], world_size: int,
                optimizer: Any = torch.optim.AdamW,
                optimizer_kwargs: dict[str, Any] | None = None) -> MemoryPlan:
    """[Note: memory plan] for ``model`` (any device, meta included) over ``world_size`` ranks."""
    if isinstance(config, dict):
        config = SelZeroConfig.from_dict(config)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r}: expected a positive integer.")
    entries = resolve_selection(model, params=list(config.params), modules=list(config.modules),
                                expert_dim=config.expert_dim)
    trainable = [e for e in entries if not e.frozen]
    if not trainable:
        raise SelectionError(f"params={list(config.params)} modules={list(config.modules)} select "
                             "no trainable parameter of the model; check the names with "
                             "model.named_parameters().")
    if isinstance(optimizer, torch.optim.Optimizer):  # an instance: its class and defaults
        optimizer, optimizer_kwargs = type(optimizer), dict(optimizer.defaults)
    cls = resolve_optimizer_class(optimizer)
    kwargs = dict(optimizer_kwargs or {})
    for c in [cls] + [override_class(g) for g in config.param_groups if "optimizer" in g]:
        check_admitted(c, partition=config.partition,  # as the engine refuses
                       extra_elementwise=list(config.extra_elementwise_optimizers),
                       extra_matrix=list(config.extra_matrix_optimizers))
    # each entry's state follows its optimizer group (config.param_groups), as in the engine
    groups = plan_groups(trainable, kwargs, list(config.param_groups), cls)
    owners = None
    if config.partition == "tensors":
        probe_groups(trainable, groups, cls, kwargs)
        owners = plan_virtual_owners(trainable, groups, cls, world_size)
    layout = plan_layout([EntrySpec(e.param.numel(), str(e.param.dtype), e.num_experts or 1,
                                    e.num_experts is not None) for e in trainable],
                         world_size, int(config.bucket_mb * 2 ** 20), owners=owners)
    specs = _state_specs(trainable, groups, cls, kwargs, owned=owners is not None)
    ranks = rank_plans(layout, trainable, specs)
    elements = sum(e.param.numel() for e in trainable)
    ddp = sum(ddp_bytes(e, specs[t]) for t, e in enumerate(trainable))
    figure = 1.0
    if owners is not None:
        figure = balance(virtual_costs(trainable, groups, cls), owners, world_size)
    model_params = [p for p in model.parameters() if p.requires_grad]
    model_elements = sum(p.numel() for p in model_params)
    zero2 = sum(-(-p.numel() // world_size) * (4 + 8 + (4 if p.dtype != torch.float32 else 0))
                for p in model_params)
    selected = {id(e.param) for e in entries}
    dense = [p for p in model_params if id(p) not in selected]
    return MemoryPlan(world_size, len(entries), len(layout.virtuals), elements, model_elements,
                      ranks, ddp, zero2, -(-sum(r.total for r in ranks) // world_size),
                      config.partition, figure,
                      weights=sum(p.numel() * p.element_size() for p in model.parameters()),
                      dense_ddp=_dense_ddp_bytes(dense, cls, kwargs),
                      ddp_label=ddp_label(trainable))


def _dense_ddp_bytes(params: list[nn.Parameter], cls: type, kwargs: dict[str, Any]) -> int:
    """The host's parameters under DDP, alike: FP32 gradient, state (the subset's class when it
    is elementwise, else AdamW, the usual host), an FP32 master for bf16/fp16 weights."""
    host, host_kwargs = (cls, kwargs) if cls in ELEMENTWISE_OPTIMIZERS else \
        (torch.optim.AdamW, {})
    specs = probe_state_shaped(host, {}, host_kwargs, torch.device("cpu"), (1,)) if params \
        else {}
    return sum(4 * p.numel() + (4 * p.numel() if p.dtype != torch.float32 else 0)
               + _slot_state_bytes(specs, p.numel()) for p in params)


# ---- the command --------------------------------------------------------------------------


def load_model(spec: str, *, dtype: torch.dtype | None = None) -> nn.Module:
    """``module:factory`` (called with no arguments) or a transformers config JSON, built on
    the meta device (no weights)."""
    path = Path(spec)
    if spec.endswith(".json") and path.is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        raw = json.loads(path.read_text())
        config = AutoConfig.for_model(**raw) if "model_type" in raw else None
        if config is None:
            raise ConfigError(f"{spec}: a transformers config needs \"model_type\" (e.g. "
                              "\"qwen3_moe\").")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    else:
        module_name, _, attr = spec.partition(":")
        if os.getcwd() not in sys.path:  # a console script does not put it there
            sys.path.insert(0, os.getcwd())
        if not module_name or not attr:
            raise ConfigError(f"model {spec!r}: expected `package.module:factory` or a "
                              "transformers config .json file.")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"model {spec!r}: cannot import it ({type(e).__name__}: {e}).") \
                from None
        required = _required_arguments(factory)
        if required:
            raise ConfigError(
                f"model {spec!r}: {attr}() needs argument(s) {required}, and selzero plan calls "
                f"it with none. Write a factory that takes none (`def plan_model(): return "
                f"{attr}(...)` in a module of yours) and pass `my_module:plan_model`; for a "
                "transformers model, pass its config as a .json file instead (with "
                "\"model_type\").")
        with torch.device("meta"):
            model = factory()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model {spec!r}: the factory returned {type(model).__name__}, "
                              "expected a torch.nn.Module.")
    if dtype is not None:
        model = model.to(dtype)
    return model


def _required_arguments(factory: Any) -> list[str]:
    """The arguments a call with none would miss (a class: its ``__init__``'s)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        return []
    return [n for n, p in sig.parameters.items() if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


_OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "adam": (torch.optim.Adam, {}),
               "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
               "muon": (torch.optim.Muon, {}), "adafactor": (torch.optim.Adafactor, {})}


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def run_plan(model: str, *, params: list[str], world_size: int, dtype: str | None = None,
             optimizer: str = "adamw", expert_dim: int | None = None,
             modules: list[str] | None = None, bucket_mb: float = 25.0,
             partition: str = "chunks") -> int:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype is not None and dtype not in dtypes or optimizer not in _OPTIMIZERS:
        raise ConfigError(f"--dtype {dtype!r} / --optimizer {optimizer!r}: expected one of "
                          f"{sorted(dtypes)} / {sorted(_OPTIMIZERS)}.")
    net = load_model(model, dtype=None if dtype is None else dtypes[dtype])
    built = sorted({str(p.dtype).replace("torch.", "") for p in net.parameters()})
    dtype = "/".join(built) + ("" if dtype is not None else " (as built; --dtype to cast)")
    cls, kwargs = _OPTIMIZERS[optimizer]
    config = SelZeroConfig(params=params, modules=modules or [], expert_dim=expert_dim,
                           bucket_mb=bucket_mb, partition=partition)
    if cls is torch.optim.Muon:  # Muon on the matrices, AdamW on the rest (the usual pairing)
        vectors = _non_matrices(net, config)
        if vectors:
            config = SelZeroConfig.from_dict({**config.to_dict(), "param_groups": [
                {"params": vectors, "optimizer": "torch.optim.AdamW"}]})
    plan = plan_memory(net, config, world_size, cls, kwargs)
    pairing = " (AdamW for the tensors that are not matrices)" \
        if cls is torch.optim.Muon and config.param_groups else ""
    print(f"selzero plan: {model}, {dtype}, {cls.__name__}{pairing}, {world_size} rank(s), "
          f"partition={partition}")
    print(f"  selected: {plan.selected} tensor(s), {plan.virtual} virtual parameter(s), "
          f"{plan.elements:,} elements ({plan.elements / max(plan.model_elements, 1):.1%} of the "
          f"model's {plan.model_elements:,} trainable)")
    print(f"  {'rank':>6} {'grad shard':>14} {'optimizer state':>16} {'masters':>14} "
          f"{'total':>14}")
    shown = plan.ranks if world_size <= 8 else plan.ranks[:4] + plan.ranks[-2:]
    for r in shown:
        print(f"  {r.rank:>6} {_mib(r.grad_shard):>14} {_mib(r.optimizer_state):>16} "
              f"{_mib(r.master):>14} {_mib(r.total):>14}")
    if plan.partition == "tensors":
        print(f"  whole tensors per rank: optimizer-work balance (max/mean) {plan.balance:.3f}")
    top = max(r.total for r in plan.ranks)
    print(f"  per rank, the subset: selzero {_mib(top)} (largest rank; even split "
          f"{_mib(plan.ideal_total)}) vs {plan.ddp_label} {_mib(plan.ddp_subset)} "
          f"({plan.ddp_subset / max(top, 1):.2f}x selzero)")
    host = plan.dense_ddp
    mine = plan.weights + host + top
    theirs = plan.weights + host + plan.ddp_subset
    print(f"  per rank, in all: weights {_mib(plan.weights)} (every rank) + the host's other "
          f"{plan.model_elements - plan.elements:,} trainable elements under DDP {_mib(host)} + "
          f"selzero {_mib(top)} = {_mib(mine)}; {plan.ddp_label} over the whole model "
          f"{_mib(theirs)} ({mine / max(theirs, 1):.2f}x)")
    print(f"  per rank, ZeRO-2 over the whole model (DeepSpeed: FP32 grads, masters, Adam): "
          f"{_mib(plan.zero2_model)} besides the weights")
    return 0


def _state_specs(trainable: list[Any], groups: list[Any], cls: type, kwargs: dict[str, Any],
                 *, owned: bool) -> list[dict[str, Any]]:
    """Each trainable entry's optimizer state for one of its (virtual) parameters: its
    group's class stepped once on a parameter of its shape (flat under ``chunks``, where the
    state is elementwise), found once per group and shape."""
    out: list[dict[str, Any]] = [{} for _ in trainable]
    probes: dict[tuple[int, tuple[int, ...]], dict[str, Any]] = {}
    for g, group in enumerate(groups):
        c = group.cls or cls
        for t in group.members:
            shape = trainable[t].virtual_shape
            shape = shape if owned else (math.prod(shape),)
            if (g, shape) not in probes:
                probes[g, shape] = probe_state_shaped(c, group.hyper, kwargs if c is cls else {},
                                                      torch.device("cpu"), shape)
            out[t] = probes[g, shape]
    return out


def _slot_state_bytes(specs: dict[str, Any], numel: int) -> int:
    """A slot's state: elementwise tensors over its elements, the others whole."""
    return sum(s.dtype.itemsize * (numel if s.kind == ELEMENTWISE else math.prod(s.shape or ()))
               for s in specs.values())


def rank_plans(layout: Any, trainable: list[Any], specs: list[dict[str, Any]]) -> list[RankPlan]:
    """Every rank's bytes over its slots (the engine's layout, or one planned alike).

    O(virtual parameters + N): chunked virtual parameters of one entry have one size, so rank
    r holds ``chunk_numel`` of each up to the last full chunk, the remainder on one rank and
    nothing after it ([Note: layout]); each distinct (entry, size) is added to those ranks once,
    not rank by rank over every virtual parameter (which was O(N x virtual parameters): 22 s for
    12,288 experts at N=256)."""
    n = layout.world_size
    grad, state, low = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)  # difference arrays

    def add(first: int, stop: int, t: int, numel: int, copies: int) -> None:
        if numel <= 0 or first >= stop:
            return
        cost = (4 * numel * copies, _slot_state_bytes(specs[t], numel) * copies,
                4 * numel * copies * (trainable[t].param.dtype != torch.float32))
        for diff, value in zip((grad, state, low), cost):
            diff[first] += value
            diff[stop] -= value

    chunked: dict[tuple[int, int, int], int] = {}
    for v in layout.virtuals:
        if v.owner is not None:
            add(v.owner, v.owner + 1, v.entry, v.numel, 1)
        else:
            key = (v.entry, v.numel, v.chunk_numel)
            chunked[key] = chunked.get(key, 0) + 1
    for (t, numel, chunk), copies in chunked.items():
        full = min(n, numel // chunk) if chunk > 0 else 0
        add(0, full, t, chunk, copies)
        if full < n:
            add(full, full + 1, t, numel - full * chunk, copies)
    ranks, totals = [], [0, 0, 0]
    for r in range(n):
        totals = [a + d[r] for a, d in zip(totals, (grad, state, low))]
        ranks.append(RankPlan(r, totals[0], totals[1], totals[2]))
    return ranks


def state_specs(sz: Any) -> list[dict[str, Any]]:
    """A built instance's optimizer state per trainable entry (its own groups and classes)."""
    return _state_specs(sz.trainable, sz._plans, sz._opt_cls, sz._defaults,
                        owned=sz.owners is not None)


def ddp_bytes(entry: Any, specs: dict[str, Any]) -> int:
    """The tensor under DDP on one rank, like for like with what selzero holds, the same
    whatever the partition (review finding: it changed with it): its FP32 gradient, the state
    of each of its (virtual) parameters as the optimizer keeps it (FP32: it steps the masters),
    a scalar state once per tensor, and for a bf16/fp16 parameter an FP32 master (mixed-
    precision DDP: FP32 gradients, masters and state; review finding: it counted a bf16
    gradient and bf16 state, a baseline smaller than selzero's own per-rank bytes)."""
    numel = entry.param.numel()
    per_virtual = numel // (entry.num_experts or 1)
    state = sum((per_virtual if s.kind == ELEMENTWISE else math.prod(s.shape or ()))
                * s.dtype.itemsize for s in specs.values() if s.kind != SCALAR)
    master = 4 * numel if entry.param.dtype != torch.float32 else 0
    return 4 * numel + master + (entry.num_experts or 1) * state \
        + sum(s.dtype.itemsize for s in specs.values() if s.kind == SCALAR)


def ddp_label(trainable: list[Any]) -> str:
    low = sorted({str(e.param.dtype).replace("torch.", "") for e in trainable
                  if e.param.dtype != torch.float32})
    return f"mixed-precision DDP ({'/'.join(low)} weights; FP32 grads, masters, state)" if low \
        else "DDP (FP32 grads and state)"


def _non_matrices(model: nn.Module, config: SelZeroConfig) -> list[str]:
    """Names of the selected tensors whose (virtual) shape is not 2-D."""
    entries = resolve_selection(model, params=list(config.params), modules=list(config.modules),
                                expert_dim=config.expert_dim)
    return [e.name for e in entries if not e.frozen and len(e.virtual_shape) != 2]
