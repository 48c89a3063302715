"""selzero's step path without communication, against plain torch AdamW on the same parameters.

One process, no process group (selzero's collectives are then no-ops, everything else runs):
the expert parameters of a ``bench.py`` workload get the same gradients in both arms through
the same synthetic backward (``sum(p * g)``), then
- ``plain``: ``torch.optim.AdamW(experts).step()``;
- ``ddp``: the same under DDP (a process group of one): its reducer copies each gradient into
  its bucket during the backward (measured like selzero's copy-in), its all-reduce has no peer;
- ``selzero``: ``SelectedZero2(model, experts)``: its gradient hooks copy each gradient into
  its bucket (copy-in, measured as this arm's backward time minus the plain arm's), then
  ``step()``: reduction point (control vector, presence, non-finite check, binding check), the
  segment optimizer (the same class and arguments), the cast into the gather row, copy-out into
  the parameters.
Arms alternate within each round; figures are medians over rounds, the ratios (selzero's path
over plain AdamW's step, and over DDP's path) are taken within a round. ``--fused`` runs both arms with ``fused=True`` (torch's CPU or CUDA fused AdamW),
``--device cuda`` on a GPU.

    benchmarks/step_path.py --workload c [--rounds 21] [--fused] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench  # noqa: E402


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def run(workload: str, rounds: int, steps: int, fused: bool, device_name: str,
        optimizer_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch

    from selzero_plugin import SelectedZero2
    try:
        from selzero_plugin.core import flat_step
    except ImportError:  # a version before the flat step (a before/after run): both arms alike
        flat_step = None

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    device = torch.device(device_name)
    spec = bench.WORKLOADS[workload]
    kwargs = {"lr": 1e-4, "weight_decay": 0.1, **(optimizer_kwargs or {})}
    if fused:
        kwargs["fused"] = True
    config = bench.selection(spec)

    class Synthetic(torch.nn.Module):
        """sum(p * g) over the experts: every arm's backward delivers the same gradients."""

        def __init__(self, model: Any, params: list[Any], grads: list[Any]) -> None:
            super().__init__()
            self.model, self.params, self.grads = model, params, grads

        def forward(self) -> Any:
            return sum((p * g).sum() for p, g in zip(self.params, self.grads))

    def arm(kind: str) -> tuple[Any, list[Any], Any]:
        model = bench.build_model(spec).to(device)
        params = [p for n, p in model.named_parameters() if bench.is_expert(spec, n)]
        for p in model.parameters():
            p.requires_grad_(any(p is q for q in params))
        g = torch.Generator(device="cpu").manual_seed(1)
        grads = [torch.randn(p.shape, generator=g).to(device) for p in params]
        synthetic = Synthetic(model, params, grads)
        if kind in ("selzero", "selzero_segments"):
            if flat_step is None:
                return SelectedZero2(model, {**config, "name": kind}, torch.optim.AdamW,
                                     kwargs), params, synthetic
            flat_step.ENABLED = kind == "selzero"
            try:
                sz = SelectedZero2(model, {**config, "name": kind}, torch.optim.AdamW, kwargs)
            finally:
                flat_step.ENABLED = True
            return sz, params, synthetic
        if kind == "ddp":  # DDP's reducer copies each gradient into its bucket (C++)
            synthetic = torch.nn.parallel.DistributedDataParallel(synthetic)
        return torch.optim.AdamW(params, **kwargs), params, synthetic

    import torch.distributed as dist

    if not dist.is_initialized():  # DDP needs a process group: one process (no peers)
        import tempfile

        store = dist.FileStore(tempfile.mktemp(), 1)
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl", store=store,
                                rank=0, world_size=1)
    arms = {"plain": arm("plain"), "ddp": arm("ddp"), "selzero": arm("selzero"),
            "selzero_segments": arm("selzero_segments")}
    times: dict[str, dict[str, list[float]]] = {k: {"backward": [], "step": []} for k in arms}

    def one(name: str) -> tuple[float, float]:
        opt, params, synthetic = arms[name]
        _sync(device)
        t0 = time.perf_counter()
        synthetic().backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        if not name.startswith("selzero"):
            opt.zero_grad(set_to_none=name == "plain")  # DDP keeps its bucket views
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    for name in arms:  # warm-up: optimizer state exists, buffers allocated
        for _ in range(2):
            one(name)
    ratios, ddp_ratios, flat_ratios, path = [], [], [], {k: [] for k in arms}
    for _ in range(rounds):
        round_times = {}
        for name in arms:
            b, s = zip(*(one(name) for _ in range(steps)))
            round_times[name] = (statistics.median(b), statistics.median(s))
            times[name]["backward"].append(round_times[name][0])
            times[name]["step"].append(round_times[name][1])
        path["plain"].append(round_times["plain"][1])
        # copy-in: backward time beyond the plain arm's
        for name in ("ddp", "selzero", "selzero_segments"):
            path[name].append(max(0.0, round_times[name][0] - round_times["plain"][0])
                              + round_times[name][1])
        ratios.append(path["selzero"][-1] / path["plain"][-1])
        ddp_ratios.append(path["selzero"][-1] / path["ddp"][-1])
        flat_ratios.append(path["selzero"][-1] / path["selzero_segments"][-1])
    sz = arms["selzero"][0]
    same = all(torch.equal(p, q) and torch.equal(p, r) and torch.equal(p, t) for p, q, r, t in
               zip(arms["plain"][1], arms["selzero"][1], arms["ddp"][1],
                   arms["selzero_segments"][1]))
    n = len(arms["plain"][1])
    # after the parity check: the profiled steps run on the selzero arms only
    profiles = {name: _profile(arms[name][0], lambda name=name: one(name), rounds,
                               backward_base=statistics.median(times["plain"]["backward"]))
                for name in ("selzero", "selzero_segments")}
    us = lambda xs: round(1e6 * statistics.median(xs) / n, 2)  # noqa: E731
    ms = lambda xs: round(1000 * statistics.median(xs), 2)  # noqa: E731
    return {"workload": workload, "fused": fused, "device": device_name,
            "parameters": len(arms["plain"][1]), "segments": len(sz.segments),
            "elements": sum(p.numel() for p in arms["plain"][1]),
            "plain_step_ms": ms(path["plain"]), "ddp_path_ms": ms(path["ddp"]),
            "selzero_path_ms": ms(path["selzero"]),
            "selzero_copy_in_ms": ms([a - b for a, b in zip(times["selzero"]["backward"],
                                                            times["plain"]["backward"])]),
            "selzero_step_ms": ms(times["selzero"]["step"]),
            "selzero_runs": sz.flat_step.runs_last_step if flat_step is not None else -1,
            "selzero_segments_path_ms": ms(path["selzero_segments"]),
            "selzero_segments_step_ms": ms(times["selzero_segments"]["step"]),
            "us_per_tensor": {"plain": us(path["plain"]), "ddp": us(path["ddp"]),
                              "selzero": us(path["selzero"]),
                              "selzero_segments": us(path["selzero_segments"])},
            "profile_us_per_tensor": {name: {k: round(v * 1e6 / n, 2) for k, v in p.items()}
                                      for name, p in profiles.items()},
            "ratio_flat_vs_segments": round(statistics.median(flat_ratios), 3),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "ratio_vs_ddp": round(statistics.median(ddp_ratios), 3),
            "ratio_vs_ddp_min": round(min(ddp_ratios), 3),
            "ratio_vs_ddp_max": round(max(ddp_ratios), 3),
            "parameters_equal": same}


# (phase, object of the instance, method): wall time inside each, nested ones subtracted
PHASES = (("hooks: presence", "window", "_record_presence"),
          ("hooks: copy into bucket", "collectives", "fill"),
          ("hooks: the rest", "window", "_on_grad"),
          ("reduction point", "window", "reduce"),
          ("optimizer", "flat_step", "step"),
          ("gather: cast into row", "storage", "pack_row"),
          ("gather: copy-out", "collectives", "_unpack"),
          ("gather: the rest", "collectives", "all_gather_updated"),
          ("bindings record", "bindings", "record"))
NESTED = {"hooks: the rest": ("hooks: presence", "hooks: copy into bucket"),
          "gather: the rest": ("gather: cast into row", "gather: copy-out")}


def _profile(sz: Any, one: Any, rounds: int, backward_base: float) -> dict[str, float]:
    """Seconds per step in each phase of selzero's path (median over ``rounds`` steps), by
    wrapping the instance's methods with wall clocks (a few hundred ns per call; the timed
    rounds above run unwrapped). ``backward: autograd`` is the backward beyond plain torch's
    that no hook accounts for (hook dispatch, unit hooks)."""
    owners = {"window": sz.window, "collectives": sz.collectives,
              "flat_step": getattr(sz, "flat_step", None) or sz.segment_optimizer.optimizer,
              "storage": sz.storage, "bindings": sz.window.bindings}
    spent = {phase: 0.0 for phase, _, _ in PHASES}

    def wrap(phase: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t0
        return timed

    for phase, owner, method in PHASES:
        setattr(owners[owner], method, wrap(phase, getattr(owners[owner], method)))
    per_step: dict[str, list[float]] = {phase: [] for phase in spent}
    per_step["backward: autograd"] = []
    try:
        for _ in range(rounds):
            for phase in spent:
                spent[phase] = 0.0
            backward, _step = one()
            for outer, inner in NESTED.items():
                spent[outer] -= sum(spent[i] for i in inner)
            for phase, value in spent.items():
                per_step[phase].append(value)
            hooks = sum(v for k, v in spent.items() if k.startswith("hooks"))
            per_step["backward: autograd"].append(max(0.0, backward - backward_base - hooks))
    finally:
        for _phase, owner, method in PHASES:
            delattr(owners[owner], method)
    return {phase: statistics.median(v) for phase, v in per_step.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="c", choices=sorted(bench.WORKLOADS))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    result = run(args.workload, args.rounds, args.steps, args.fused, args.device)
    result["command"] = "benchmarks/step_path.py " + " ".join(sys.argv[1:])
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
