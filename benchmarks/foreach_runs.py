"""torch's multi-tensor (``foreach``) optimizers beside the single-tensor ones over the flat step's
runs, on the CPU: time per step, and whether the results are bitwise equal.

The flat step ([Note: flat step] in selzero_plugin/core/flat_step.py) hands torch's optimizer a
few dozen runs of about ``RUN_NUMEL`` elements each. On the CPU torch's default is the
single-tensor path (``foreach=None`` -> False); a multi-tensor update would save Python per
run. One process, one thread; ``--runs`` tensors of ``--shape``; per class the median step over
``--steps`` steps after one warm-up, the ratio foreach / single, and ``torch.equal`` of every
parameter after the steps (the same gradients in both arms).

    benchmarks/foreach_runs.py [--runs 74] [--shape 16,8192] [--steps 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

CLASSES: list[tuple[str, dict[str, Any]]] = [
    ("AdamW", {"weight_decay": 0.1}), ("Adam", {}), ("SGD", {"momentum": 0.9}),
    ("NAdam", {}), ("RAdam", {}), ("Adamax", {}), ("Adagrad", {}), ("RMSprop", {})]


def arm(cls: type, kwargs: dict[str, Any], foreach: bool, runs: int, shape: tuple[int, ...],
        steps: int) -> tuple[list[torch.Tensor], float]:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g).requires_grad_() for _ in range(runs)]
    opt = cls(params, lr=1e-3, foreach=foreach, **kwargs)
    times = []
    for _ in range(steps + 1):
        for p in params:
            p.grad = torch.randn(shape, generator=g)
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return params, statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=74)
    parser.add_argument("--shape", default="16,8192")
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = tuple(int(x) for x in args.shape.split(","))
    rows = []
    for name, kwargs in CLASSES:
        cls = getattr(torch.optim, name)
        single, t_single = arm(cls, kwargs, False, args.runs, shape, args.steps)
        multi, t_multi = arm(cls, kwargs, True, args.runs, shape, args.steps)
        rows.append({"optimizer": name, "kwargs": kwargs, "single_ms": round(1000 * t_single, 2),
                     "foreach_ms": round(1000 * t_multi, 2),
                     "ratio": round(t_multi / t_single, 2),
                     "bitwise": all(torch.equal(a, b) for a, b in zip(single, multi))})
        print(json.dumps(rows[-1]), flush=True)
    print("command: benchmarks/foreach_runs.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
