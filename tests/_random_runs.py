"""Randomized parity scenarios: selzero + DDP on N ranks vs plain torch.optim on one process.

A scenario is drawn from a seed (``draw_scenario(seed, world)``), so a failure is replayed by its
seed alone. It fixes everything both sides need as plain data: the model (a host part, a few
selected "expert" modules with awkward parameter shapes, optionally a fused ``(E, a, b)`` expert
tensor in a module declaring ``num_experts = E``), the routing of every token on every rank in
every micro-step, the optimizer and its groups, bucket size, accumulation, clipping, lr schedule.

The routing is drawn so that, step after step, some experts get tokens on every rank, some on a
few ranks, some on none, and some ranks route no token to any expert at all.

The reference runs one process on ``mean over ranks of the loss / micro-steps`` and
``torch.nn.utils.clip_grad_norm_`` over every parameter. With ``expert_dim=0`` a fused tensor
follows per-expert semantics: each expert slice is its own FP32 tensor in the plain optimizer,
given ``grad=None`` when its mean-of-ranks gradient slice is exactly zero (so torch skips it: no
update, no decay, no step count). With ``expert_dim=None`` it is one stock parameter.

[Note: ill-conditioned first steps]
Adam's first update of an element is ``lr * g / (|g| + eps)``; where ``|g|`` is below ``eps``
(1e-8) its derivative is about ``lr / eps`` = 1e6, so FP32 rounding in ``g`` (the reference
and selzero sum the ranks' contributions in different orders, and ``g`` may come from
cancelling terms) shows up as a parameter difference of 1e-6 to 1e-4. A sweep of seeds 0-299 at
world sizes 2 and 3 (600 scenarios) hit this 5 times, all at world size 3 (seeds 20, 128, 215,
235, 285; each time an expert's first update, when it first got tokens); in each the FP32
reference was as far from an FP64 reference (``reference_run(sc, torch.float64)``) as selzero
was: rounding, not a bug. The test's seeds are fixed and well conditioned (worst
difference ~1.2e-7); on a failure it reports the FP64 comparison so the two cases are told apart.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import random
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from selzero_plugin import SelectedZero2, SelZeroConfig, clip_grad_norm_, wrap_ddp

from .parity import OPTIMIZERS

__all__ = ["Scenario", "draw_scenario", "build_model", "run_scenarios", "reference_run",
           "SHAPES", "FUSED_SHAPES", "MICRO_MODES", "OPT_NAMES", "SELECT"]

D = 7  # hidden size; each expert parameter is projected to a (D, D) matrix
SHAPES: tuple[tuple[int, ...], ...] = ((1,), (3,), (7,), (7, 15), (13, 7), (2, 3, 5))
FUSED_SHAPES: tuple[tuple[int, int, int], ...] = ((2, 7, 15), (3, 3, 5), (4, 1, 7), (3, 13, 7),
                                                   (2, 2, 3))
BUCKETS_MB = (0.0001, 0.0006, 25.0)  # ~100 bytes (a bucket per tensor), a few tensors, default
OPT_NAMES = ("AdamW", "SGD", "Adam")
MICRO_MODES = ("end_microstep", "ddp_no_sync", "sz_no_sync")
"""How a micro-step that is not the last of its window is closed: reduced and closed by
``sz.end_microstep()``; local inside the DDP model's ``no_sync()``; local inside ``sz.no_sync()``
alone (DDP then averages the host's gradients every micro-step)."""
SELECT = ["experts.*", "fused.*"]
_ALT_WEIGHT_DECAY = {"AdamW": 0.0, "SGD": 0.0, "Adam": 0.02}


@dataclass(frozen=True)
class Scenario:
    seed: int
    world: int
    experts: tuple[tuple[tuple[int, ...], ...], ...]  # shapes of each expert module's params
    frozen: str | None  # a selected parameter with requires_grad=False
    fused: tuple[int, int, int] | None  # (E, a, b)
    expert_dim: int | None
    opt: str
    instance: bool  # a host optimizer instance (mirrored) instead of class + kwargs
    override: tuple[str, tuple[tuple[str, float], ...]] | None  # (pattern, hyperparameters)
    bucket_mb: float
    micro_modes: tuple[str, ...]  # one per micro-step but the last
    clip: float | None
    schedule: bool  # lr *= (1 - 0.15 step), set on the host optimizer each step
    steps: int
    routes: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]  # [step][micro][rank] -> targets

    @property
    def accumulate(self) -> int:
        return len(self.micro_modes) + 1

    @property
    def num_targets(self) -> int:
        return len(self.experts) + (self.fused[0] if self.fused else 0)

    @property
    def name(self) -> str:
        return f"w{self.world}-s{self.seed}"

    def describe(self) -> str:
        fused = f"fused{self.fused}/dim{self.expert_dim}" if self.fused else "no-fused"
        return (f"{self.name}: {self.opt}{'(instance)' if self.instance else ''} "
                f"override={self.override} experts={list(self.experts)} frozen={self.frozen} "
                f"{fused} bucket_mb={self.bucket_mb} micro={list(self.micro_modes)}+last "
                f"clip={self.clip} schedule={self.schedule} steps={self.steps}")


# ---- drawing ------------------------------------------------------------------------------


def draw_scenario(seed: int, world: int) -> Scenario:
    rng = random.Random(seed)
    experts = tuple(tuple(rng.choice(SHAPES) for _ in range(rng.randint(1, 2)))
                    for _ in range(rng.randint(1, 3)))
    fused = rng.choice(FUSED_SHAPES) if rng.random() < 0.6 else None
    opt = rng.choice(OPT_NAMES)
    instance = rng.random() < 0.4
    schedule = rng.random() < 0.5
    override = None
    if rng.random() < 0.35:
        pattern = rng.choice(["experts.0.*", "fused.*" if fused else "experts.*", "*.w0"])
        hyper = {"weight_decay": _ALT_WEIGHT_DECAY[opt]}
        if instance or not schedule:  # step(lr=x) sets every selzero group's lr alike
            hyper["lr"] = OPTIMIZERS[opt][1]["lr"] * 0.5
        override = (pattern, tuple(hyper.items()))
    accumulate = rng.randint(1, 3)
    steps = rng.randint(3, 5)
    targets = len(experts) + (fused[0] if fused else 0)
    return Scenario(
        seed=seed, world=world, experts=experts,
        frozen=f"experts.{rng.randrange(len(experts))}.w0" if rng.random() < 0.15 else None,
        fused=fused, expert_dim=0 if fused and rng.random() < 0.75 else None,
        opt=opt, instance=instance, override=override, bucket_mb=rng.choice(BUCKETS_MB),
        micro_modes=tuple(rng.choice(MICRO_MODES) for _ in range(accumulate - 1)),
        clip=rng.choice([None, None, 0.05, 1.0]), schedule=schedule, steps=steps,
        routes=tuple(tuple(_draw_routes(rng, world, targets) for _ in range(accumulate))
                     for _ in range(steps)))


def _draw_routes(rng: random.Random, world: int, targets: int) -> tuple[tuple[int, ...], ...]:
    """One micro-step: some targets banned on every rank; a rank may route to no expert at all."""
    banned = set(rng.sample(range(targets), rng.randint(0, targets // 2)))
    allowed = [t for t in range(targets) if t not in banned]
    out = []
    for _ in range(world):
        tokens = rng.randint(3, 6)
        if not allowed or rng.random() < 0.25:
            out.append((-1,) * tokens)
            continue
        pool = rng.sample(allowed, rng.randint(1, len(allowed))) + [-1]
        out.append(tuple(rng.choice(pool) for _ in range(tokens)))
    return tuple(out)


# ---- the model ----------------------------------------------------------------------------


def _projection(numel: int) -> torch.Tensor:
    return torch.randn(numel, D * D) / math.sqrt(numel)


class _Expert(nn.Module):
    """Parameters of any shape, each mapped to a (D, D) matrix by a fixed random projection."""

    def __init__(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"w{i}", nn.Parameter(0.5 * torch.randn(shape)))
            self.register_buffer(f"proj{i}", _projection(math.prod(shape)))
        self.count = len(shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = sum(torch.tanh(getattr(self, f"w{i}").reshape(-1)) @ getattr(self, f"proj{i}")
                for i in range(self.count))
        return torch.tanh(x @ a.view(D, D))


class _FusedExperts(nn.Module):
    """E experts stacked on dim 0 (transformers 5 style): an unrouted expert's rows get zeros."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.num_experts = shape[0]
        self.weight = nn.Parameter(0.5 * torch.randn(shape))
        self.register_buffer("proj", _projection(shape[1] * shape[2]))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.weight[e].reshape(-1)) @ self.proj
        return torch.tanh(x @ a.view(D, D))


class RandomMoE(nn.Module):
    """Host: inp, router, out. Route target t < len(experts) is experts[t], then fused experts."""

    def __init__(self, sc: Scenario) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.router = nn.Linear(D, sc.num_targets)
        self.experts = nn.ModuleList(_Expert(shapes) for shapes in sc.experts)
        self.fused = _FusedExperts(sc.fused) if sc.fused else None
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        gates = torch.softmax(self.router(h), dim=-1)
        y = torch.zeros_like(h)
        for t in range(gates.shape[1]):
            idx = (routes == t).nonzero().flatten()
            if idx.numel():
                y = y.index_add(0, idx, self._target(t, h[idx]) * gates[idx, t:t + 1])
        # the aux term keeps the router in the graph on ranks whose tokens reach no expert
        return self.out(h + y) + 0.01 * gates.pow(2).sum(-1, keepdim=True)

    def _target(self, t: int, x: torch.Tensor) -> torch.Tensor:
        if t < len(self.experts):
            return self.experts[t](x)
        return self.fused.expert(t - len(self.experts), x)


def build_model(sc: Scenario, dtype: torch.dtype = torch.float32) -> RandomMoE:
    torch.manual_seed(sc.seed)
    model = RandomMoE(sc).to(dtype)
    if sc.frozen:
        model.get_parameter(sc.frozen).requires_grad_(False)
    return model


def _loss(model: nn.Module, sc: Scenario, step: int, micro: int, rank: int,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    routes = torch.tensor(sc.routes[step][micro][rank])
    g = torch.Generator().manual_seed(((sc.seed * 7 + step) * 5 + micro) * 11 + rank)
    x, y = torch.randn(routes.numel(), D, generator=g), torch.randn(routes.numel(), 3, generator=g)
    return (model(x.to(dtype), routes) - y.to(dtype)).pow(2).mean()


def _is_selected(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in SELECT)


def _lr_factor(sc: Scenario, step: int) -> float:
    return 1.0 - 0.15 * step if sc.schedule else 1.0


def _groups(named: list[tuple[str, nn.Parameter]], sc: Scenario) -> list[dict[str, Any]]:
    """Torch param groups: the override's group holds the selected names it matches."""
    if sc.override is None:
        return [{"params": [p for _, p in named]}]
    pattern, hyper = sc.override[0], dict(sc.override[1])
    hit = [_is_selected(n) and fnmatch.fnmatchcase(n, pattern) for n, _ in named]
    return [{"params": [p for (_, p), h in zip(named, hit) if not h]},
            {"params": [p for (_, p), h in zip(named, hit) if h], **hyper}]


def _set_lr(optimizer: torch.optim.Optimizer, base: list[float], factor: float) -> None:
    for group, lr in zip(optimizer.param_groups, base):
        group["lr"] = lr * factor


# ---- selzero side -------------------------------------------------------------------------


def _micro_context(ddp: Any, sz: SelectedZero2, mode: str) -> Any:
    if mode == "ddp_no_sync":
        return ddp.no_sync()
    return sz.no_sync() if mode == "sz_no_sync" else contextlib.nullcontext()


def _build(sc: Scenario, model: nn.Module) -> tuple[SelectedZero2, torch.optim.Optimizer]:
    cls, kwargs = OPTIMIZERS[sc.opt]
    overrides = [] if sc.override is None or sc.instance else [
        {"params": [sc.override[0]], **dict(sc.override[1])}]
    config = SelZeroConfig(params=SELECT, expert_dim=sc.expert_dim, bucket_mb=sc.bucket_mb,
                           param_groups=overrides, timeout_s=60.0, name=f"random_{sc.seed}")
    if sc.instance:
        host = cls(_groups(list(model.named_parameters()), sc), **kwargs)
        return SelectedZero2(model, config, host), host
    sz = SelectedZero2(model, config, cls, dict(kwargs))
    host = cls([p for n, p in model.named_parameters() if not _is_selected(n)], **kwargs)
    return sz, host


def selzero_scenario(rank: int, sc: Scenario) -> dict[str, Any]:
    """Train one scenario on this rank; the final state and StepResult.updated of every step."""
    model = build_model(sc)
    sz, host = _build(sc, model)
    ddp = wrap_ddp(model, sz)
    base = [g["lr"] for g in host.param_groups]
    updated = []
    try:
        for step in range(sc.steps):
            factor = _lr_factor(sc, step)
            _set_lr(host, base, factor)
            for micro in range(sc.accumulate):
                mode = sc.micro_modes[micro] if micro < len(sc.micro_modes) else "last"
                with _micro_context(ddp, sz, mode):
                    (_loss(ddp, sc, step, micro, rank) / sc.accumulate).backward()
                if mode == "end_microstep":
                    sz.end_microstep()
            if sc.clip is not None:
                clip_grad_norm_(model.parameters(), sc.clip, subsets=[sz])
            host.step()
            lr = base[0] * factor if sc.schedule and not sc.instance else None
            updated.append(sz.step(lr=lr).updated)
            host.zero_grad(set_to_none=True)
    finally:
        sz.remove_hooks()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "updated": updated}


def run_scenarios(rank: int, world: int, scenarios: list[Scenario]) -> list[dict[str, Any]]:
    """Every scenario in one set of processes; a failing one is reported, the next ones run."""
    out = []
    for sc in scenarios:
        assert sc.world == world
        try:
            out.append({"error": None, **selzero_scenario(rank, sc)})
        except Exception:  # noqa: BLE001 - reported per scenario to the test
            out.append({"error": traceback.format_exc()})
        flag = torch.zeros(1)
        dist.all_reduce(flag)  # line the ranks up before the next scenario
    return out


# ---- the single-process reference ---------------------------------------------------------


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run single-threaded: same kernels, same rounding
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_run(sc: Scenario, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Final state, number of (virtual) selected parameters updated per step, clipped steps.

    ``dtype=torch.float64`` gives the exact answer that both FP32 runs approximate: it tells
    rounding from a bug when they differ (see [Note: ill-conditioned first steps]).
    """
    with _one_thread():
        return _reference(sc, dtype)


def _reference(sc: Scenario, dtype: torch.dtype) -> dict[str, Any]:
    model = build_model(sc, dtype)
    split = sc.fused is not None and sc.expert_dim == 0
    named = [(n, p) for n, p in model.named_parameters() if not (split and n == "fused.weight")]
    copies = [model.fused.weight.detach()[e].clone().requires_grad_()
              for e in range(sc.fused[0])] if split else []
    # the copies take the fused tensor's place (and its group) among the optimizer's params
    named += [("fused.weight", c) for c in copies]
    cls, kwargs = OPTIMIZERS[sc.opt]
    optimizer = cls(_groups(named, sc), **kwargs)
    base = [g["lr"] for g in optimizer.param_groups]
    updated, clipped = [], []
    for step in range(sc.steps):
        _set_lr(optimizer, base, _lr_factor(sc, step))
        for micro in range(sc.accumulate):
            losses = [_loss(model, sc, step, micro, r, dtype) for r in range(sc.world)]
            (torch.stack(losses).mean() / sc.accumulate).backward()
        if sc.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), sc.clip)
            clipped.append(float(norm) > sc.clip)
        if split:
            grad = model.fused.weight.grad
            for e, c in enumerate(copies):
                c.grad = grad[e].clone() if grad is not None and bool(grad[e].ne(0).any()) else None
            model.fused.weight.grad = None
        updated.append(sum(1 for n, p in named if _is_selected(n) and p.grad is not None))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if split:
            with torch.no_grad():
                for e, c in enumerate(copies):
                    model.fused.weight[e].copy_(c)
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "updated": updated, "clipped": clipped}
