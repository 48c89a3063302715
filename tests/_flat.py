"""selzero with the flat step and with the per-segment step, in one rank process, side by side.

Both arms train the same ToyMoE (experts under selzero, DDP + the same optimizer class on the
rest) on routing that differs by rank and leaves experts without tokens, and snapshot after
every step the parameters, the optimizer's state dict, and how many tensors the optimizer's
``step()`` was given (a step pre-hook, as a user's hook would see it).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from selzero_plugin import SelectedZero2, SelZeroConfig, wrap_ddp
from selzero_plugin.core import flat_step

from .models import loss_fn, make_batch
from .parity import build_model, routes_for

OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True,
                                       "weight_decay": 0.01}),
    "SGD-plain": (torch.optim.SGD, {"lr": 5e-2}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 5e-2, "lr_decay": 0.01}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5, "centered": True}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-2, "decoupled_weight_decay": True,
                                  "weight_decay": 0.1}),
    "RAdam": (torch.optim.RAdam, {"lr": 1e-2}),
    "Adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "AdamW-fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
}


def _arm(rank: int, flat: bool, opt_name: str, steps: int, *, dtype: torch.dtype,
         num_experts: int, pattern: str, groups: str, scheduler: bool,
         reload_at: int | None, clear_at: int | None, twist: str) -> dict[str, Any]:
    flat_step.ENABLED = flat
    try:
        model = build_model(num_experts=num_experts, dtype=dtype)
        cls, kwargs = OPTIMIZERS[opt_name]
        config: dict[str, Any] = {"params": ["experts.*"], "name": f"flat{int(flat)}"}
        if groups == "lr":  # the experts' second layers in a group of their own
            config["param_groups"] = [{"params": ["experts.*.w2.*"], "lr": kwargs["lr"] / 3}]
        elif groups == "class":  # ... with an optimizer class of its own (two torch optimizers)
            config["param_groups"] = [{"params": ["experts.*.w2.*"], "lr": 5e-2,
                                       "optimizer": "torch.optim.SGD", "momentum": 0.9}]
        sz = SelectedZero2(model, SelZeroConfig(**config), cls, kwargs)
    finally:
        flat_step.ENABLED = True
    if flat and twist == "bound":  # [Note: scratch bound]: half the fp32 runs fit, the rest
        # are stepped segment by segment, in place
        sz.flat_step.scratch_numel = sum(s.numel for s in sz.slots) // 2
    selected = {id(e.param) for e in sz.entries}
    host = cls([p for p in model.parameters() if id(p) not in selected], **kwargs)
    ddp = wrap_ddp(model, sz)
    seen: list[int] = []
    sz.optimizer.register_step_pre_hook(
        lambda opt, args, kw: seen.append(sum(len(g["params"]) for g in opt.param_groups)))
    sched = torch.optim.lr_scheduler.LambdaLR(sz.optimizer, lambda s: 1.0 / (1 + s)) \
        if scheduler else None
    raised = []

    def failing_post_hook(opt: Any, args: Any, kw: Any) -> None:
        if len(seen) == 3:  # after the third update: a user's logging hook that fails
            raise RuntimeError("logging failed")

    if twist == "posthook":
        sz.optimizer.register_step_post_hook(failing_post_hook)
    snaps = []
    had: list[set[int]] = []  # after each step: the segments that hold state
    dropped: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if step == reload_at:  # a user's optimizer round trip through torch's state dict
                saved = {"state": {k: {n: v.clone() for n, v in s.items()}
                                   for k, s in sz.optimizer.state_dict()["state"].items()},
                         "param_groups": sz.optimizer.state_dict()["param_groups"]}
                for s in sz.optimizer.state.values():
                    for v in s.values():
                        v.zero_()  # what is loaded must come back, not what was left
                sz.optimizer.load_state_dict(saved)
            if step == clear_at:  # DeepSpeed's weights-only load does this
                sz.optimizer.state.clear()
            if step == 2 and twist == "replace":  # a user resets some segments' moments
                for seg in list(sz.optimizer.state)[:3]:
                    st = sz.optimizer.state[seg]
                    st[next(iter(k for k in st if k != "step"))] = \
                        torch.full_like(st[next(iter(k for k in st if k != "step"))], 0.25)
            if step == 2 and twist == "storage":  # new storage under the same tensor objects
                segs = list(sz.optimizer.state)
                st = sz.optimizer.state[segs[0]]
                key = next(k for k in st if k != "step")
                st[key].data = torch.full_like(st[key], 0.25)  # an offload helper's idiom
                st = sz.optimizer.state[segs[1]]
                st[key].set_(torch.full_like(st[key], -0.5))
                st["step"].set_(torch.full_like(st["step"], 7.0))
            if step == 2 and twist == "swap":  # two experts' state exchanged (a permutation)
                by_shape: dict[Any, list[Any]] = {}
                for seg in sz.optimizer.state:
                    by_shape.setdefault(tuple(seg.shape), []).append(seg)
                a_, b_ = next(v for v in by_shape.values() if len(v) >= 2)[:2]
                st = sz.optimizer.state
                st[a_], st[b_] = st[b_], st[a_]
            if step == 2 and twist == "swap_off":  # the same, and a slot between them whose
                segs = list(sz.optimizer.state)  # state ends the flat path in that step
                st = sz.optimizer.state
                a_ = segs[0]
                b_ = next(s_ for s_ in segs[2:] if s_.shape == a_.shape)
                st[a_], st[b_] = st[b_], st[a_]
                st[segs[1]]["step"] = st[segs[1]]["step"].to(torch.float64)
            if twist == "drop_new" and not dropped and step >= 2:  # a user deletes the state
                # the last step made (experts stepped for the first time): torch restarts it
                born = [seg for seg in sz.optimizer.state if id(seg) not in had[step - 2]]
                for seg in born:
                    del sz.optimizer.state[seg]
                dropped.extend(id(seg) for seg in born)
            if step == 2 and twist == "momentum":  # SGD's momentum turned on mid-training
                for group in sz.optimizer.param_groups:
                    group["momentum"] = 0.9
                for group in host.param_groups:
                    group["momentum"] = 0.9
            x, y = make_batch(step, rank)
            loss_fn(ddp, x.to(dtype), y.to(dtype),
                    routes_for(step, rank, 6, num_experts, pattern)).float().backward()
            host.step()
            try:
                result = sz.step()
            except RuntimeError as e:
                if "logging failed" not in str(e):
                    raise
                raised.append(step)  # as a user recovers: drop the window, go on
                sz.zero_grad()
                result = type("Failed", (), {"updated": -1})()
            host.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
            had.append({id(seg) for seg in sz.optimizer.state})
            snaps.append({
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "state": {k: {n: v.detach().clone() for n, v in s.items()}
                          for k, s in sz.optimizer.state_dict()["state"].items()},
                "updated": result.updated,
                "runs": sz.flat_step.runs_last_step if sz.flat_step is not None else -1})
    return {"snaps": snaps, "tensors_per_step": seen, "raised": raised, "segments": len(sz.segments),
            "dropped": len(dropped),
            "memory": sz.memory_report(),
            "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)
                         or "optimizer.step()" in str(w.message)]}


def flat_and_segments(rank: int, world: int, opt_name: str, steps: int = 5, *,
                      dtype: torch.dtype = torch.float32, num_experts: int = 6,
                      pattern: str = "random", groups: str = "", scheduler: bool = False,
                      reload_at: int | None = None, clear_at: int | None = None,
                      twist: str = "") -> dict[str, Any]:
    kw = dict(dtype=dtype, num_experts=num_experts, pattern=pattern, groups=groups,
              scheduler=scheduler, reload_at=reload_at, clear_at=clear_at, twist=twist)
    return {"flat": _arm(rank, True, opt_name, steps, **kw),
            "segments": _arm(rank, False, opt_name, steps, **kw)}


def scratch_memory_run(rank: int, world: int) -> dict[str, Any]:
    """[Note: scratch bound] at allocation level: many small fp32 experts (every rank's share
    several times the bound), small buckets and runs; the allocation peak of ``sz.step()``
    beside this rank's share of the subset in bytes."""
    from torch import nn

    from selzero_plugin.memtrace import track_allocations

    torch.manual_seed(0)
    model = nn.ModuleDict({"experts": nn.ModuleList(nn.Linear(48, 40) for _ in range(24))})
    least, flat_step.SCRATCH_NUMEL = flat_step.SCRATCH_NUMEL, 0  # the bucket block binds
    try:
        sz = SelectedZero2(model, SelZeroConfig(params=["experts.*"], bucket_mb=0.02,
                                                name="bound"),
                           torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})
    finally:
        flat_step.SCRATCH_NUMEL = least
    sz.flat_step.run_numel = 1024  # AdamW's temporaries are run-sized: keep them small
    g = torch.Generator().manual_seed(rank)
    peaks, runs = [], []
    for _ in range(3):
        x = torch.randn(5, 48, generator=g)
        sum(e(x).pow(2).sum() for e in model["experts"]).backward()
        with track_allocations() as trace:
            sz.step()
        peaks.append(trace.peak)
        runs.append(sz.flat_step.runs_last_step)
    share = 4 * sum(s.numel for s in sz.slots)
    return {"peaks": peaks, "share": share, "scratch_numel": sz.flat_step.scratch_numel,
            "segments": len(sz.segments), "runs": runs}
