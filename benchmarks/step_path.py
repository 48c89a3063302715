"""selzero's step path without communication, against plain torch AdamW on the same parameters.

One process, no process group (selzero's collectives are then no-ops, everything else runs):
the expert parameters of a ``bench.py`` workload get the same gradients in both arms through
the same synthetic backward (``sum(p * g)``), then
- ``plain``: ``torch.optim.AdamW(experts).step()``;
- ``selzero``: ``SelectedZero2(model, experts)``: its gradient hooks copy each gradient into
  its bucket (copy-in, measured as this arm's backward time minus the plain arm's), then
  ``step()``: reduction point (control vector, presence, non-finite check, binding check), the
  segment optimizer (the same class and arguments), the cast into the gather row, copy-out into
  the parameters.
Arms alternate within each round; figures are medians over rounds, the ratio is taken within a
round. ``--fused`` runs both arms with ``fused=True`` (torch's CPU or CUDA fused AdamW),
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

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    device = torch.device(device_name)
    spec = bench.WORKLOADS[workload]
    kwargs = {"lr": 1e-4, "weight_decay": 0.1, **(optimizer_kwargs or {})}
    if fused:
        kwargs["fused"] = True
    config = {"params": bench.expert_names(spec), "bucket_mb": 25.0,
              **({"expert_dim": 0} if spec["kind"] == "qwen3" else {})}

    def arm(selzero: bool) -> tuple[Any, list[Any], Any]:
        model = bench.build_model(spec).to(device)
        params = [p for n, p in model.named_parameters() if bench.is_expert(spec, n)]
        for p in model.parameters():
            p.requires_grad_(any(p is q for q in params))
        g = torch.Generator(device="cpu").manual_seed(1)
        grads = [torch.randn(p.shape, generator=g).to(device) for p in params]
        if selzero:
            sz = SelectedZero2(model, config, torch.optim.AdamW, kwargs)
            return sz, params, grads
        return torch.optim.AdamW(params, **kwargs), params, grads

    arms = {"plain": arm(False), "selzero": arm(True)}
    times: dict[str, dict[str, list[float]]] = {k: {"backward": [], "step": []} for k in arms}

    def one(name: str) -> tuple[float, float]:
        opt, params, grads = arms[name]
        _sync(device)
        t0 = time.perf_counter()
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        opt.step()
        if name == "plain":
            opt.zero_grad()
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    for name in arms:  # warm-up: optimizer state exists, buffers allocated
        for _ in range(2):
            one(name)
    ratios, path = [], {k: [] for k in arms}
    for _ in range(rounds):
        round_times = {}
        for name in arms:
            b, s = zip(*(one(name) for _ in range(steps)))
            round_times[name] = (statistics.median(b), statistics.median(s))
            times[name]["backward"].append(round_times[name][0])
            times[name]["step"].append(round_times[name][1])
        copy_in = max(0.0, round_times["selzero"][0] - round_times["plain"][0])
        sz_path = copy_in + round_times["selzero"][1]
        path["plain"].append(round_times["plain"][1])
        path["selzero"].append(sz_path)
        ratios.append(sz_path / round_times["plain"][1])
    sz = arms["selzero"][0]
    same = all(torch.equal(p, q) for p, q in zip(arms["plain"][1], arms["selzero"][1]))
    ms = lambda xs: round(1000 * statistics.median(xs), 2)  # noqa: E731
    return {"workload": workload, "fused": fused, "device": device_name,
            "parameters": len(arms["plain"][1]), "segments": len(sz.segments),
            "elements": sum(p.numel() for p in arms["plain"][1]),
            "plain_step_ms": ms(path["plain"]), "selzero_path_ms": ms(path["selzero"]),
            "selzero_copy_in_ms": ms([a - b for a, b in zip(times["selzero"]["backward"],
                                                            times["plain"]["backward"])]),
            "selzero_step_ms": ms(times["selzero"]["step"]),
            "ratio": round(statistics.median(ratios), 3),
            "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
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
