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
    from selzero_plugin.core import flat_step

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    device = torch.device(device_name)
    spec = bench.WORKLOADS[workload]
    kwargs = {"lr": 1e-4, "weight_decay": 0.1, **(optimizer_kwargs or {})}
    if fused:
        kwargs["fused"] = True
    config = {"params": bench.expert_names(spec), "bucket_mb": 25.0,
              **({"expert_dim": 0} if spec["kind"] == "qwen3" else {})}

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
        for name in ("ddp", "selzero", "selzero_segments"):  # copy-in: backward time beyond the plain arm's
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
            "selzero_runs": sz.flat_step.runs_last_step,
            "selzero_segments_path_ms": ms(path["selzero_segments"]),
            "selzero_segments_step_ms": ms(times["selzero_segments"]["step"]),
            "us_per_tensor": {"plain": us(path["plain"]), "ddp": us(path["ddp"]),
                              "selzero": us(path["selzero"]),
                              "selzero_segments": us(path["selzero_segments"])},
            "ratio_flat_vs_segments": round(statistics.median(flat_ratios), 3),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
            "ratio_vs_ddp": round(statistics.median(ddp_ratios), 3),
            "ratio_vs_ddp_min": round(min(ddp_ratios), 3),
            "ratio_vs_ddp_max": round(max(ddp_ratios), 3),
            "parameters_equal": same}


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
