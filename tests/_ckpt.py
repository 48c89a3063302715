"""Checkpoint tests: models, routing with experts absent around the save, rank functions."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig
from selzero_plugin.checkpoint import atomic

from .models import D, ToyMoE, make_batch

__all__ = ["OPTIMIZERS", "E", "FusedExperts", "FusedMoE", "build", "config", "routes", "loss_at",
           "train", "make", "params_of", "state_of", "save_then_continue", "resume", "save_only",
           "load_many", "crash_while_saving", "attempt_loads", "same", "files_of",
           "run_ranks_with_crash"]

OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    "AdamW-other-lr": (torch.optim.AdamW, {"lr": 0.5, "weight_decay": 0.0}),
    # whole-tensor ownership (partition="tensors"); 1-D tensors go to a group of their own
    "Muon": (torch.optim.Muon, {"lr": 0.02, "weight_decay": 0.1}),
    "Muon-ns2": (torch.optim.Muon, {"lr": 0.02, "weight_decay": 0.1, "ns_steps": 2}),
    "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2, "weight_decay": 0.01}),
    "AdamW-tensors": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
}
TENSORS: dict[str, dict[str, Any]] = {
    "Muon": {"partition": "tensors", "param_groups": [
        {"params": ["*bias*", "*gain*"], "optimizer": "torch.optim.AdamW", "lr": 1e-2}]},
    "Muon-ns2": {"partition": "tensors", "param_groups": [
        {"params": ["*bias*", "*gain*"], "optimizer": "torch.optim.AdamW", "lr": 1e-2}]},
    "Adafactor": {"partition": "tensors"},
    "AdamW-tensors": {"partition": "tensors"},
}
E = 4  # experts in every test model


class FusedExperts(nn.Module):
    """transformers-5 style: experts stacked on dim 0; declares num_experts for expert_dim=0."""

    def __init__(self, num_experts: int = E, d: int = D, h: int = 5) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up = nn.Parameter(torch.randn(num_experts, d, h) * 0.3)  # 35 per expert
        self.down = nn.Parameter(torch.randn(num_experts, h, d) * 0.3)
        self.bias = nn.Parameter(torch.randn(num_experts, d) * 0.1)

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(h)
        for e in range(self.num_experts):
            idx = (routes == e).nonzero().flatten()
            if idx.numel():
                out = torch.tanh(h[idx] @ self.gate_up[e]) @ self.down[e] + self.bias[e]
                y = y.index_add(0, idx, out)
        return y


class FusedMoE(nn.Module):
    """Fused experts, a tied alias (``alias_name``.weight == inp.weight) and a frozen scale."""

    def __init__(self, h: int = 5, alias_name: str = "tied") -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.experts = FusedExperts(E, D, h)
        self.out = nn.Linear(D, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3), requires_grad=False)
        setattr(self, alias_name, self.inp)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.experts(h, routes)) * self.scale


def build(kind: str, *, seed: int, dtype: torch.dtype = torch.float32,
          **kwargs: Any) -> nn.Module:
    torch.manual_seed(seed)
    model = ToyMoE(E) if kind == "toy" else FusedMoE(**kwargs)
    return model.to(dtype)


def config(kind: str, **overrides: Any) -> SelZeroConfig:
    base: dict[str, Any] = {"params": ["*"], "timeout_s": 60.0}
    if kind == "fused":
        base["expert_dim"] = 0
    return SelZeroConfig.from_dict({**base, **overrides})


def routes(step: int, rank: int, *, save_at: int, tokens: int = 6) -> torch.Tensor:
    """Expert E-1 first gets tokens at step save_at + 1 (no state at the save); expert 0 gets
    none at steps save_at - 1 and save_at (absent in the window around the save)."""
    allowed = list(range(E))
    if step <= save_at:
        allowed.remove(E - 1)
    if save_at - 1 <= step <= save_at:
        allowed.remove(0)
    g = torch.Generator().manual_seed(7919 * step + 31 * rank)
    return torch.tensor(allowed)[torch.randint(len(allowed), (tokens,), generator=g)]


def loss_at(model: nn.Module, step: int, rank: int, save_at: int) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    x, y = make_batch(step, rank)
    return (model(x.to(dtype), routes(step, rank, save_at=save_at)) - y.to(dtype)).float() \
        .pow(2).mean()


def train(model: nn.Module, sz: SelectedZero2, rank: int, steps: range, save_at: int) -> None:
    for step in steps:
        loss_at(model, step, rank, save_at).backward()
        sz.step()


def make(kind: str, opt: str, *, seed: int, dtype: torch.dtype = torch.float32,
         model_kwargs: dict[str, Any] | None = None,
         config_overrides: dict[str, Any] | None = None) -> tuple[nn.Module, SelectedZero2]:
    model = build(kind, seed=seed, dtype=dtype, **(model_kwargs or {}))
    cls, kwargs = OPTIMIZERS[opt]
    overrides = {**TENSORS.get(opt, {}), **(config_overrides or {})}
    return model, SelectedZero2(model, config(kind, **overrides), cls, dict(kwargs))


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def state_of(sz: SelectedZero2) -> dict[str, Any]:
    """This rank's optimizer state and segment values, keyed by virtual parameter."""
    out: dict[str, Any] = {}
    for slot, seg in zip(sz.slots, sz.segments):
        name = sz.virtual_name(slot.virtual)
        out[f"{name}/value"] = seg.detach().clone()
        for k, v in sz.optimizer.state.get(seg, {}).items():
            out[f"{name}/{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else v
    return out


# ---- rank functions (run by tests.dist_utils.run_ranks; each takes a list of cases so one
# process launch serves several tests: the machine is small and shared) ----------------------


def save_then_continue(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: train k steps, save, train m more (the uninterrupted run; saving must not
    perturb it). A case: folder, kind, opt, dtype, k, m."""
    out = []
    for c in cases:
        model, sz = make(c["kind"], c["opt"], seed=0, dtype=c["dtype"])
        train(model, sz, rank, range(c["k"]), c["k"])
        at_save = {"params": params_of(model), "state": state_of(sz)}
        sz.save_checkpoint(c["folder"])
        train(model, sz, rank, range(c["k"], c["k"] + c["m"]), c["k"])
        out.append({"at_save": at_save, "final": params_of(model), "final_state": state_of(sz)})
        sz.remove_hooks()
    return out


def resume(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, in a fresh process with other initial weights: load, train steps k..k+m-1,
    then save to ``save_to`` when given."""
    out = []
    for c in cases:
        model, sz = make(c["kind"], c["opt"], seed=123, dtype=c["dtype"])
        before = params_of(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sz.load_checkpoint(c["folder"])
        after_load = {"params": params_of(model), "state": state_of(sz)}
        train(model, sz, rank, range(c["k"], c["k"] + c["m"]), c.get("save_at", c["k"]))
        if c.get("save_to"):
            sz.save_checkpoint(c["save_to"])
        out.append({"before": before, "after_load": after_load, "final": params_of(model),
                    "final_state": state_of(sz), "warnings": [str(w.message) for w in caught]})
        sz.remove_hooks()
    return out


def save_only(rank: int, world: int, folder: str, *, kind: str, opt: str, k: int,
              dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    model, sz = make(kind, opt, seed=0, dtype=dtype)
    train(model, sz, rank, range(k), k)
    sz.save_checkpoint(folder)
    return {"params": params_of(model), "state": state_of(sz)}


def load_many(rank: int, world: int, folders: list[str], *, kind: str, opt: str,
              then_save: str | None = None) -> list[dict[str, Any]]:
    """Load each folder into a fresh instance; report values, state, warnings or the error.
    Then, if asked, train 2 steps and save into ``then_save``."""
    out = []
    for folder in folders:
        model, sz = make(kind, opt, seed=123)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                sz.load_checkpoint(folder)
                error = None
            except Exception as e:  # noqa: BLE001 - reported to the test
                error = f"{type(e).__name__}: {e}"
        out.append({"params": params_of(model), "state": state_of(sz), "error": error,
                    "warnings": [str(w.message) for w in caught]})
        sz.remove_hooks()
    if then_save is not None:
        model, sz = make(kind, opt, seed=0)
        train(model, sz, rank, range(2), 2)
        sz.save_checkpoint(then_save)
        sz.remove_hooks()
    return out


def crash_while_saving(rank: int, world: int, folder: str, *, kind: str, opt: str, k: int,
                       point: str, crash_rank: int) -> None:
    """Train k steps (a state newer than the checkpoint's), save over ``folder``, and let
    ``crash_rank`` die at ``point`` (see selzero_plugin.checkpoint.atomic.CRASH_POINTS)."""
    model, sz = make(kind, opt, seed=0, config_overrides={"timeout_s": 20.0})
    train(model, sz, rank, range(k), k)

    def hook(at: str) -> None:
        if at == point and rank == crash_rank:
            os._exit(17)

    atomic.set_crash_hook(hook)
    sz.save_checkpoint(folder)


def attempt_loads(rank: int, world: int, scenarios: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each scenario: build (maybe differently), train a step, try to load, report the
    error and whether parameters and optimizer state stayed bit-identical."""
    results = []
    for sc in scenarios:
        model, sz = make(sc.get("kind", "fused"), sc.get("opt", "AdamW"), seed=5,
                         dtype=sc.get("dtype", torch.float32),
                         model_kwargs=sc.get("model_kwargs"),
                         config_overrides=sc.get("config_overrides"))
        train(model, sz, rank, range(1), 1)
        params, state = params_of(model), state_of(sz)
        error_type = message = None
        try:
            sz.load_checkpoint(sc["folder"])
        except Exception as e:  # noqa: BLE001 - reported to the test
            error_type, message = type(e).__name__, str(e)
        untouched = same(params, params_of(model)) and same(state, state_of(sz))
        results.append({"name": sc["name"], "error_type": error_type, "message": message,
                        "untouched": untouched,
                        "params": params_of(model) if error_type is None else None})
        sz.remove_hooks()
    return results


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def files_of(folder: str | Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def run_ranks_with_crash(fn: Any, world: int, *args: Any, timeout: float = 90.0,
                         **kwargs: Any) -> list[int | None]:
    """Like run_ranks, for runs where a rank dies on purpose: waits for every process to end
    (killing stragglers after ``timeout``) and returns their exit codes."""
    import tempfile

    from .dist_utils import _child, _context

    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, init_file, queue, args, {}, kwargs),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            try:  # drain outcomes, so no child blocks on a full pipe at exit
                queue.get(timeout=0.2)
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [p.exitcode for p in procs]
