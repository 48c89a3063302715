"""Whole-tensor ownership (partition="tensors") runs: selzero with Muon on the expert matrices
and AdamW on the rest of the experts (a param group with its own optimizer), DDP + AdamW on the
host, against one process running torch.optim.Muon + AdamW on the mean of the ranks' losses."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_, wrap_ddp

from .models import loss_fn, make_batch
from .parity import build_model, reference_run, routes_for

MUON = {"lr": 0.02, "weight_decay": 0.1}
ADAMW = {"lr": 1e-2, "weight_decay": 0.05}
ADAFACTOR = {"lr": 1e-2, "weight_decay": 0.01}
OWN_ADAMW = [{"params": ["*.bias", "*.gain"], "optimizer": "torch.optim.AdamW", **ADAMW}]


def _is_expert(name: str) -> bool:
    return name.startswith("experts.")


def reference_optimizers(model: nn.Module, recipe: str) -> list[torch.optim.Optimizer]:
    """One process: the same optimizers over the same parameters."""
    named = list(model.named_parameters())
    host = [p for n, p in named if not _is_expert(n)]
    if recipe == "muon":
        mats = [p for n, p in named if _is_expert(n) and p.ndim == 2]
        rest = [p for n, p in named if _is_expert(n) and p.ndim != 2]
        return [torch.optim.Muon(mats, **MUON), torch.optim.AdamW(rest + host, **ADAMW)]
    experts = [p for n, p in named if _is_expert(n)]
    return [torch.optim.Adafactor(experts, **ADAFACTOR), torch.optim.AdamW(host, **ADAMW)]


def reference(world: int, steps: int, recipe: str = "muon", *, pattern: str = "uneven",
              num_experts: int = 4, accumulate: int = 1, clip: float | None = None
              ) -> dict[str, torch.Tensor]:
    return reference_run(world, steps, None, pattern=pattern, num_experts=num_experts,
                         accumulate=accumulate, clip=clip,
                         optimizers=lambda model: reference_optimizers(model, recipe))


def selzero_config(recipe: str, **extra: Any) -> tuple[SelZeroConfig, type, dict[str, Any]]:
    if recipe == "muon":
        return (SelZeroConfig.from_dict({"params": ["experts.*"], "partition": "tensors",
                                         "param_groups": OWN_ADAMW, **extra}),
                torch.optim.Muon, dict(MUON))
    return (SelZeroConfig.from_dict({"params": ["experts.*"], "partition": "tensors", **extra}),
            torch.optim.Adafactor, dict(ADAFACTOR))


def run(rank: int, world: int, steps: int, recipe: str = "muon", *, pattern: str = "uneven",
        num_experts: int = 4, accumulate: int = 1, accumulate_mode: str = "end_microstep",
        clip: float | None = None, config: dict[str, Any] | None = None,
        trace: bool = False) -> dict[str, Any]:
    model = build_model(num_experts=num_experts)
    cfg, cls, kwargs = selzero_config(recipe, **(config or {}))
    sz = SelectedZero2(model, cfg, cls, kwargs)
    if trace:
        sz.comm.trace = []
    selected = {id(e.param) for e in sz.entries}
    host_params = [p for p in model.parameters() if id(p) not in selected]
    host_opt = torch.optim.AdamW(host_params, **ADAMW)
    ddp = wrap_ddp(model, sz)
    for step in range(steps):
        for micro in range(accumulate):
            s = step * accumulate + micro
            x, y = make_batch(s, rank)
            last = micro == accumulate - 1
            routes = routes_for(s, rank, 6, num_experts, pattern)
            if accumulate_mode == "no_sync" and not last:
                with ddp.no_sync():
                    (loss_fn(ddp, x, y, routes) / accumulate).backward()
            else:
                (loss_fn(ddp, x, y, routes) / accumulate).backward()
                if not last:
                    sz.end_microstep()
        if clip is not None:
            clip_grad_norm_(list(model.parameters()), clip, subsets=[sz])
        host_opt.step()
        sz.step()
        host_opt.zero_grad(set_to_none=True)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "owners": sz.owners, "memory": sz.memory_report(),
            "trace": sz.comm.trace, "segments": len(sz.segments),
            "stateful": [sz.virtual_name(slot.virtual) for slot, seg in zip(sz.slots, sz.segments)
                         if sz.optimizer.state.get(seg)]}


def run_many(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several runs in one launch (the machine is small): each case is ``run``'s keywords."""
    return [run(rank, world, **case) for case in cases]


def initial_state(num_experts: int = 4) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(num_experts=num_experts)
            .state_dict().items()}


# ---- fused experts (transformers Qwen3-MoE, expert_dim=0) under Muon --------------------------


def fused_run(rank: int, world: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Muon on every expert matrix (each expert of a fused (E, a, b) tensor its own (a, b)
    matrix), DDP + AdamW on the rest; the fused tensors after every step."""
    from ._fused import build_hf_model, is_selected, token_ids

    model = build_hf_model("qwen3_moe")
    cfg = SelZeroConfig(params=["*.experts.*"], expert_dim=0, partition="tensors")
    sz = SelectedZero2(model, cfg, torch.optim.Muon, dict(MUON))
    host = torch.optim.AdamW([p for n, p in model.named_parameters() if not is_selected(n)],
                             **ADAMW)
    ddp = wrap_ddp(model, sz)
    snaps = []
    for step in range(steps):
        ids = token_ids("qwen3_moe", step, rank)
        ddp(input_ids=ids, labels=ids).loss.backward()
        sz.reduce_gradients()
        update = sz.window.decision.update
        grads = {sz.virtual_name(slot.virtual): g.clone()  # the reduced gradients it owns
                 for slot, g in zip(sz.slots, sz.storage.grad_views) if update[slot.virtual]}
        host.step()
        sz.step()
        host.zero_grad(set_to_none=True)
        snaps.append({"params": {n: p.detach().clone() for n, p in model.named_parameters()
                                 if is_selected(n)}, "grads": grads})
    return snaps


def fused_reference(world: int, steps: int, replay: list[dict[str, Any]] | None = None
                    ) -> list[dict[str, Any]]:
    """One process on the mean of the ranks' gradients (each rank's loss backpropagated
    separately, summed in FP32, divided by N); every expert slice its own Muon parameter with
    ``grad=None`` when its gradient rows are exactly zero (absent on every rank).

    ``replay`` (selzero's snapshots, every rank's merged): Muon steps on the gradients selzero
    reduced instead of on its own mean, and each step records its own mean gradient beside."""
    from ._fused import build_hf_model, is_selected, token_ids

    model = build_hf_model("qwen3_moe")
    fused = {n: p for n, p in model.named_parameters() if is_selected(n)}
    host = torch.optim.AdamW([p for n, p in model.named_parameters() if n not in fused], **ADAMW)
    experts = {(n, e): p.detach()[e].clone().requires_grad_()
               for n, p in fused.items() for e in range(p.shape[0])}
    muon = torch.optim.Muon(list(experts.values()), **MUON)
    snaps = []
    for step in range(steps):
        sums = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in range(world):
            model.zero_grad(set_to_none=True)
            ids = token_ids("qwen3_moe", step, r)
            model(input_ids=ids, labels=ids).loss.backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    sums[n] += p.grad
        for n, p in model.named_parameters():
            p.grad = sums[n] / world
        means = {}
        for (n, e), copy in experts.items():
            g = fused[n].grad[e]
            means[f"{n}[expert {e}]"] = g.clone()
            if replay is not None:
                copy.grad = replay[step]["grads"].get(f"{n}[expert {e}]")
            else:
                copy.grad = g.clone() if bool(g.ne(0).any()) else None
        host.step()
        muon.step()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for (n, e), copy in experts.items():
                fused[n][e].copy_(copy)
        snaps.append({"params": {n: p.detach().clone() for n, p in fused.items()},
                      "means": means})
    return snaps


# ---- the memory model: 64 experts x 3 matrices of three shapes -------------------------

SHAPES = ((32, 16), (16, 48), (24, 24))


class ThreeMatrixExperts(nn.Module):
    def __init__(self, experts: int = 64) -> None:
        super().__init__()
        self.experts = nn.ModuleList(
            nn.ParameterDict({f"w{i}": nn.Parameter(torch.randn(*s) * 0.1)
                              for i, s in enumerate(SHAPES)}) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(())
        for e in self.experts:  # every expert on every rank: all get state in one step
            a = x[:, :16] @ e["w0"].t()          # (t, 32)
            b = x[:, :16] @ e["w1"]              # (t, 48)
            c = x[:, :24] @ e["w2"]              # (t, 24)
            out = out + a.pow(2).mean() + b.pow(2).mean() + c.pow(2).mean()
        return out


def _memory_recipe(recipe: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    return {"muon": (torch.optim.Muon, MUON), "adamw": (torch.optim.AdamW, ADAMW),
            "adafactor": (torch.optim.Adafactor, ADAFACTOR)}[recipe]


def one_process_state_bytes(recipe: str) -> int:
    """The optimizer state one process running the same optimizer over all 192 matrices keeps
    after one step (bytes of its live storages): what the ranks' shares must add up to."""
    torch.manual_seed(0)
    model = ThreeMatrixExperts()
    cls, kwargs = _memory_recipe(recipe)
    optimizer = cls(model.parameters(), **kwargs)
    model(torch.randn(8, 48)).backward()
    optimizer.step()
    return sum(v.untyped_storage().nbytes() for st in optimizer.state.values()
               for v in st.values() if isinstance(v, torch.Tensor))


def memory_run(rank: int, world: int, recipe: str, lopsided: bool = False) -> dict[str, Any]:
    """One step on the 192-matrix model; the optimizer state measured from the live tensors
    (memory_report) and at allocation level (the net bytes the first step allocated).
    ``lopsided`` (the mutation): a plan that gives rank 0 half of the tensors."""
    from selzero_plugin.core import zero2
    from selzero_plugin.core.ownership import balance, optimizer_cost
    from selzero_plugin.memtrace import track_allocations

    if lopsided:
        zero2.plan_virtual_owners = lambda trainable, plans, cls, n: [  # type: ignore[assignment]
            0 if i % 2 else i % n for i in range(64 * len(SHAPES))]

    torch.manual_seed(0)
    model = ThreeMatrixExperts()
    cls, kwargs = _memory_recipe(recipe)
    sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], partition="tensors"), cls,
                       dict(kwargs))
    x = torch.randn(8, 48, generator=torch.Generator().manual_seed(rank))
    model(x).backward()
    with track_allocations() as trace:
        sz.step()
    report = sz.memory_report()
    name = f"{cls.__module__}.{cls.__qualname__}"
    costs = [optimizer_cost(name, kwargs, s) for _ in range(64) for s in SHAPES]
    return {"state": report.optimizer_state, "step_net": trace.net,
            "balance": balance(costs, sz.owners, world), "owners": sz.owners,
            "elements": sum(s.numel() for s in sz.segments)}


# ---- expert parallelism down to one local fused expert per rank --------------------------------

TOTAL_EXPERTS = 4


class _EPFused(nn.Module):
    def __init__(self, local: int, offset: int) -> None:
        super().__init__()
        self.num_experts, self.expert_offset = local, offset
        base = torch.randn(TOTAL_EXPERTS, 3, 4, generator=torch.Generator().manual_seed(5))
        self.w = nn.Parameter(base[offset:offset + local].clone())


class EPNet(nn.Module):
    def __init__(self, local: int, offset: int) -> None:
        super().__init__()
        self.fused = _EPFused(local, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(x @ w.T for w in self.fused.w)


def ep_phase(rank: int, world: int, ep: int, partition: str, folder: str, *,
             load: bool) -> dict[str, torch.Tensor]:
    """Train 2 steps and save, or load; the fused tensor's global experts this rank holds."""
    from selzero_plugin.checkpoint.host import load_from, save_into
    from selzero_plugin.groups import expert_data_parallel

    groups = expert_data_parallel(ep)
    local = TOTAL_EXPERTS // ep
    net = EPNet(local, groups.ep_rank * local)
    cls, kwargs = (torch.optim.Adafactor, {"lr": 1e-2}) if partition == "tensors" else \
        (torch.optim.AdamW, {"lr": 1e-2})
    sz = SelectedZero2(net, {"params": ["fused.*"], "expert_dim": 0, "partition": partition,
                             "normalize_over": "world"}, cls, kwargs, group=groups)
    if load:
        load_from(folder, [sz])
    else:
        for step in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            net(x).pow(2).mean().backward()
            sz.step()
        save_into(folder, [sz])
    values = {f"expert {groups.ep_rank * local + i}": net.fused.w[i].detach().clone()
              for i in range(local)}
    sz.remove_hooks()
    return values


def save_through_host(rank: int, world: int, folder: str) -> None:
    """A save as the integrations make it (an index.json and a save_id in the manifest)."""
    from selzero_plugin.checkpoint.host import save_into

    from . import _ckpt

    model, sz = _ckpt.make("toy", "Muon", seed=0)
    _ckpt.train(model, sz, rank, range(2), 2)
    save_into(folder, [sz])
    sz.remove_hooks()
